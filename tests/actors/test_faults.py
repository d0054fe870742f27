"""The test-only fault switch: every actor's point, every action, each firing once at its
occurrence; exits, segfaults and hangs in real child processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.actors.faults import FAULT_EXIT_CODE, FaultPlan, InjectedFault, around

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("actor", "value", "point"), [
    ("tokenizer", "tokenizer:request:raise:2", "request"),
    ("scheduler_TP0", "scheduler:step:raise:2", "step"),
    ("detokenizer", "detokenizer:output:raise:2", "output"),
])
def test_each_actor_has_its_point_and_the_fault_fires_once_at_its_occurrence(actor, value, point):
    plan = FaultPlan.from_env(actor, {"APP_FAULT": value})
    calls = []
    faulty = around(plan, point, lambda x: calls.append(x) or x)
    assert faulty(1) == 1
    with pytest.raises(InjectedFault, match=f"{point} #2"):
        faulty(2)
    assert faulty(3) == 3 and calls == [1, 3]
    others = [name for name in ("tokenizer", "scheduler_TP0", "detokenizer") if name != actor]
    assert all(FaultPlan.from_env(other, {"APP_FAULT": value}) is None for other in others)


@pytest.mark.parametrize("value", ["tokenizer:step:raise", "scheduler:step:explode", "detokenizer:output:hang:x",
                                   "scheduler:step", "ingress:request:raise"])
def test_a_malformed_switch_is_refused_naming_the_forms(value):
    with pytest.raises(ValueError, match="tokenizer:request|scheduler:step|detokenizer:output"):
        FaultPlan.from_env("scheduler_TP0", {"APP_FAULT": value})


def test_an_oom_fault_raises_the_out_of_memory_error_of_a_gpu():
    import torch

    plan = FaultPlan.from_env("scheduler_TP0", {"APP_FAULT": "scheduler:step:oom"})
    with pytest.raises(torch.cuda.OutOfMemoryError, match="CUDA out of memory. Injected fault: step #1"):
        around(plan, "step", lambda: None)()


def _child(action: str) -> subprocess.Popen[bytes]:
    code = ("from app.actors.faults import FaultPlan; "
            f"FaultPlan.from_env('tokenizer', {{'APP_FAULT': 'tokenizer:request:{action}'}}).reach('request')")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE)


def test_exit_segfault_and_hang_do_what_they_say_in_a_real_process():
    exits, segfaults, hangs = _child("exit"), _child("segfault"), _child("hang")
    try:
        assert exits.wait(timeout=30) == FAULT_EXIT_CODE
        assert segfaults.wait(timeout=30) == -11  # a real SIGSEGV (the e2e matrix reads its native traceback)
        time.sleep(0.5)
        assert hangs.poll() is None
    finally:
        for child in (exits, segfaults, hangs):
            child.kill()
            child.wait()
            child.stderr.close()
