"""Crash-dump files, the history the scheduler keeps for them, and the pieces around them:
written atomically and private, read back in any schema, secrets masked, inputs as the request
log level allows, the history bounded, the fault switch parsed strictly."""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from app.actors.failure_report import exception_report, failure_kind, parse_report, send_report
from app.actors.faults import FaultPlan, InjectedFault, around
from app.engine.request import Request, Status
from app.ipc.channel import PeerDiedError
from app.ipc.messages import Finish, FinishReason, SamplingParams
from app.observability.crash_dump import (
    DumpReason,
    dump_header,
    mask_secrets,
    read_crash_dump,
    versions,
    write_crash_dump,
)
from app.observability.request_history import INPUT_CUT, RequestHistory, request_record
from app.server_args import parse_server_args

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-unit-4c1d9e"


def _request(rid: str, prompt: int = 5, output: int = 3) -> Request:
    req = Request(rid, list(range(100, 100 + prompt)), SamplingParams(max_new_tokens=7, temperature=0.5), 1,
                  arrival_time=1000.0, priority=2)
    req.output_ids = list(range(output))
    return req


def test_a_dump_is_written_atomically_private_and_strict_json(tmp_path):
    dump = dump_header(writer="supervisor", reason=DumpReason.ACTOR_DIED, message="m", actor="tokenizer")
    dump["figures"] = {"nan": math.nan, "inf": math.inf, "ok": 1.5}
    path = write_crash_dump(tmp_path / "dumps", dump, "crash_dump_x.json")

    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["crash_dump_x.json"]  # no temporary left
    loaded = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert loaded["figures"] == {"nan": None, "inf": None, "ok": 1.5}
    assert read_crash_dump(path)["schema_version"] == 2 and loaded["actor"] == "tokenizer"


def test_reading_accepts_schema_1_and_refuses_what_is_not_a_dump(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format_version": 1, "time": 5.0, "reason": "app::tokenizer was killed by signal SIGKILL",
                               "details": {"actor": "tokenizer", "returncode": -9, "stderr_tail": "x"},
                               "pending_requests": [{"rid": "a", "text": "hi"}], "server_args": {}, "pid": 7}))
    upgraded = read_crash_dump(old)
    assert (upgraded["schema_version"], upgraded["actor"], upgraded["failure"]["returncode"]) == (1, "tokenizer", -9)
    assert upgraded["reason"] == {"kind": "actor_died", "message": "app::tokenizer was killed by signal SIGKILL"}

    for name, text, why in [("a.json", '{"a": 1}', "no format"), ("b.json", "[1]", "not a JSON object"),
                            ("c.log", "Fatal Python error", "not JSON"),
                            ("d.json", '{"format": "app-crash-dump", "schema_version": 99}', "newer")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=why):
            read_crash_dump(tmp_path / name)


def test_settings_are_masked_keys_never_appear():
    args = parse_server_args(["--otlp-traces-endpoint", f"http://collector:{KEY}@localhost:4318/v1/traces"],
                             environ={"APP_API_KEY": KEY, "APP_ADMIN_API_KEY": KEY + "-admin"})
    masked = mask_secrets({**args.to_dict(), "nested": {"password": "hunter2", "auth_token": "t0k"}})
    text = json.dumps(masked)

    assert KEY not in text and "hunter2" not in text and "t0k" not in text
    assert masked["api_key"] == masked["admin_api_key"] == "<set>"
    assert masked["otlp_traces_endpoint"] == "http://collector:<set>@localhost:4318/v1/traces"
    assert masked["max_total_tokens"] is None and masked["shutdown_timeout"] == 5.0  # not secrets: kept


def test_versions_name_python_the_package_and_torch():
    found = versions({"device": "cpu"})
    assert found["python"] == sys.version.split()[0] and found["device"] == "cpu"
    assert found["app"] and found["torch"]


def test_a_request_record_shows_inputs_as_the_log_level_allows():
    req = _request("r1", prompt=INPUT_CUT + 10)
    req.status = Status.FINISHED
    req.finish = Finish(FinishReason.ABORT, message="gone", status_code=499)
    level0, level1, level2, level3 = (request_record(req, level, first_token_time=3.0) for level in range(4))

    assert level0["prompt_tokens"] == INPUT_CUT + 10 and level0["output_tokens"] == 3 and level0["priority"] == 2
    assert level0["finish"] == {"reason": "abort", "matched": None, "message": "gone", "status_code": 499}
    assert "sampling" not in level0 and "input_ids" not in level0
    assert level1["sampling"] == {"max_new_tokens": 7, "temperature": 0.5} and "input_ids" not in level1
    assert len(level2["input_ids"]) == INPUT_CUT and level2["input_cut"] is True
    assert level3["input_ids"] == req.prompt_ids and level3["input_cut"] is False


def test_the_history_keeps_five_minutes_and_is_bounded_by_count_and_tokens():
    history = RequestHistory(seconds=300.0, max_requests=3, max_tokens=10_000)
    for i in range(5):
        req = _request(f"r{i}")
        history.first_token(req, 100.0 + i)
        history.finished(req, 101.0 + i)
    assert [r["rid"] for r in history.recent(110.0, 0)] == ["r2", "r3", "r4"]  # the count bound
    assert history.recent(110.0, 0)[0]["first_token_time"] == 102.0 and not history.first_tokens
    assert [r["rid"] for r in history.recent(403.5, 0)] == ["r3", "r4"]  # older than 300 s are not shown

    history.finished(_request("late"), 500.0)  # trims by age as it goes
    assert [req.rid for _, _, req in history.finished_requests] == ["late"]

    by_tokens = RequestHistory(max_tokens=20)
    for i in range(4):
        by_tokens.finished(_request(f"t{i}", prompt=5, output=3), 10.0 + i)  # 8 tokens each
    assert [req.rid for _, _, req in by_tokens.finished_requests] == ["t2", "t3"] and by_tokens.tokens_held == 16


def test_the_fault_switch_fires_once_at_its_occurrence_and_refuses_a_typo():
    plan = FaultPlan.from_env("scheduler_TP0", {"APP_FAULT": "scheduler:step:raise:3"})
    step = around(plan, "step", lambda: "stepped")
    assert [step(), step()] == ["stepped", "stepped"]
    with pytest.raises(InjectedFault, match="step #3"):
        step()
    assert step() == "stepped"  # once only
    assert FaultPlan.from_env("tokenizer", {"APP_FAULT": "scheduler:step:raise"}) is None
    function = lambda: 1  # noqa: E731
    assert around(None, "step", function) is function  # no plan: nothing wrapped
    with pytest.raises(ValueError, match="APP_FAULT"):
        FaultPlan.from_env("scheduler", {"APP_FAULT": "scheduler:step:explode"})


def test_failure_reports_travel_as_one_line_and_say_cause_or_consequence(tmp_path):
    try:
        raise ExceptionGroup("nursery", [ValueError("the step broke"), PeerDiedError("channel x: peer died")])
    except ExceptionGroup as raised:
        group = raised
        report = exception_report(group)
    assert (report["type"], report["message"]) == ("ValueError", "the step broke")
    assert "ValueError: the step broke" in report["traceback"]
    assert failure_kind(group) == "exception"
    assert failure_kind(ExceptionGroup("n", [PeerDiedError("a"), trio.BrokenResourceError("b")])) == "peer_gone"
    assert failure_kind(trio.Cancelled._create()) == "cancelled"

    stream = tmp_path / "stderr"
    with stream.open("w") as file:
        send_report(report, file)
    [line] = stream.read_text().splitlines()
    assert parse_report(line)["traceback"] == report["traceback"]
    assert parse_report("an ordinary log line") is None and parse_report("APP_FAILURE_REPORT {broken") is None


def test_postmortem_refuses_a_non_dump_with_exit_2_and_reads_schema_1(tmp_path):
    (tmp_path / "notes.json").write_text('{"hello": "world"}')
    refused = subprocess.run([sys.executable, str(ROOT / "tools/postmortem.py"), str(tmp_path / "notes.json")],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "not a crash dump" in refused.stderr and refused.stdout == ""

    old = tmp_path / "crash_dump_old.json"
    old.write_text(json.dumps({"format_version": 1, "time": 5.0, "reason": "app::detokenizer was killed by signal SIGKILL",
                               "details": {"actor": "detokenizer", "returncode": -9, "stderr_tail": "last words"},
                               "pending_requests": [{"rid": "p1", "text": "hi", "started": 4.0}], "server_args": {}}))
    human = subprocess.run([sys.executable, str(ROOT / "tools/postmortem.py"), str(old)],
                           capture_output=True, text=True, timeout=60)
    assert human.returncode == 0, human.stderr
    assert "Root cause: app::detokenizer" in human.stdout and "last words" in human.stdout
    as_json = subprocess.run([sys.executable, str(ROOT / "tools/postmortem.py"), "--json", str(old)],
                             capture_output=True, text=True, timeout=60)
    [summary] = json.loads(as_json.stdout)
    assert (summary["schema_version"], summary["actor"], summary["pending_requests"]) == (1, "detokenizer", 1)
