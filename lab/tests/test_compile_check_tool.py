"""lab/tools/compile_check.py on this machine, which has no GPU: our kernels compile for the H200's
sm_90 through triton's own ptxas, and the tool reports each one's registers, spills, shared memory
and programs an SM from the cubin; a tiling the compiler refuses is reported, not raised.

In a fresh process without TRITON_INTERPRET: under the interpreter (the kernel tests' setting) a
kernel is not a JITFunction and nothing compiles."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Found, not imported: triton imported here, before tests/kernels/conftest.py sets TRITON_INTERPRET,
# would decorate triton.language's own helpers as compiled, and every interpreted kernel after
# this module would fail ("Cannot call @triton.jit'd outside of the scope of a kernel").
_TRITON = importlib.util.find_spec("triton")
if _TRITON is None or _TRITON.origin is None or not (
        Path(_TRITON.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
    pytest.skip("no triton wheel with cuobjdump to read a cubin's resources", allow_module_level=True)


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-c", code] if code else [sys.executable, str(ROOT / "lab" / "tools" / "compile_check.py"), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_kernels_compile_for_sm90_with_their_resources(tmp_path: Path) -> None:
    out = tmp_path / "resources.json"
    proc = _run("--only", "rows gate_up", "stage 2", "embedding row", "--sass", "--order", "5", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["arch"] == 90
    by_name = {case["name"]: case for case in report["cases"]}
    assert set(by_name) == {"rows gate_up (norm, silu out)", "attention stage 2, 16 splits",
                            "attention stage 2, 16 splits, a dependent of stage 1", "gemv qkv layer 0 (embedding row)"}
    for case in by_name.values():
        assert "error" not in case and 16 <= case["reg"] <= 255 and case["stack"] == 0 and case["local"] == 0
        threads = 32 * case["num_warps"]
        assert 1 <= case["programs_per_sm"] <= 2048 // threads
        assert case["programs_per_sm"] <= 65536 // (case["reg"] * threads)
        # 16-byte weight loads: the specialisation marks the pointers aligned, as a real launch does.
        assert any(kind.endswith(".128") for kind in case["memory_ops"]), case["memory_ops"]
    rows = by_name["rows gate_up (norm, silu out)"]
    assert rows["shared"] > 0 and any(kind.startswith("LDGSTS") for kind in rows["memory_ops"])  # the pipelined tiles
    assert "rows gate_up (norm, silu out)" in proc.stdout and "an SM" in proc.stdout


def _loads_before_first_barrier(order: list[str]) -> list[str]:
    ops = [line.split(maxsplit=1)[1] for line in order]
    barrier = next(i for i, op in enumerate(ops) if op.startswith("BAR"))
    return [op for op in ops[:barrier] if "LDG" in op]


def test_the_program_order_holds_the_round_trips_removed(tmp_path: Path) -> None:
    """--order lists the loads, barriers and PDL instructions in program order: what variants 58-60
    (lab/notes/gpu_notes.md) changed. The persistent gemv issues x, the residual and the norm weight
    (two 16-byte loads each a thread) before its reduction's barrier; the qkv gemv loads the token's
    position and slot right after its PDL wait, before its weights; decode attention stage 2
    issues all its loads (length, lse, partials) before any barrier, and as stage 1's dependent
    only after its PDL wait. Stage 1 (variant 83) reading the slots layer 0 recorded loads no
    request index before its K/V: its slots' loads go out beside the length's, unpredicated."""
    out = tmp_path / "order.json"
    proc = _run("--only", "rows gate_up (norm", "gemv qkv (norm", "stage 2", "stage 1, 16 splits (batch",
                "step slots read", "--order", "10", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    cases = {case["name"]: case["order"] for case in json.loads(out.read_text())["cases"]}
    rows = _loads_before_first_barrier(cases["rows gate_up (norm, silu out)"])
    assert sum(".128" in op for op in rows) == 6, rows
    qkv = [line.split(maxsplit=1)[1] for line in cases["gemv qkv (norm, rotary, pdl wait)"]]
    after_wait = [op for op in qkv[qkv.index("ACQBULK") + 1:] if "LDG" in op]
    assert [op.split()[0] for op in after_wait[:2]] == ["LDG.E.64", "LDG.E.64"], qkv  # position and slot
    stage2 = _loads_before_first_barrier(cases["attention stage 2, 16 splits"])
    assert len(stage2) == sum("LDG" in line for line in cases["attention stage 2, 16 splits"]) >= 5, stage2
    assert not any(op.startswith("@") for op in stage2)  # none waits on a predicate from the length
    dependent = [line.split(maxsplit=1)[1] for line in cases["attention stage 2, 16 splits, a dependent of stage 1"]]
    assert dependent[0] == "ACQBULK" and "LDG" in dependent[2], dependent  # the wait, the trigger, then the loads

    def before_kv(name: str) -> list[str]:
        ops = [line.split(maxsplit=1)[1] for line in cases[name]]
        return ops[:next(i for i, op in enumerate(ops) if op.startswith("LDGSTS"))]
    table = before_kv("attention stage 1, 16 splits (batch 1)")
    recorded = before_kv("attention stage 1, 16 splits, step slots read")
    assert sum(op.startswith("LDG.E.64") for op in table) == 1, table  # the request's index, then its row's slots
    assert not any(op.startswith("LDG.E.64") for op in recorded), recorded
    assert sum(op.startswith("LDG.E ") for op in recorded) >= 5, recorded  # the length and the slots, unpredicated


def test_a_tiling_the_compiler_refuses_is_reported() -> None:
    code = (
        "import sys; sys.path.insert(0, 'lab/tools')\n"
        "from compile_check import Case, compile_case, _stage1_constexprs\n"
        "from app.kernels.triton_decode import _decode_stage1_kernel\n"
        "bad = Case('stage 1, 8-key blocks', _decode_stage1_kernel, {}, _stage1_constexprs(BLOCK_N=8))\n"
        "print(compile_case(bad, 90))\n"
        "try:\n"
        "    compile_case(Case('no constexprs', _decode_stage1_kernel, {}, {}), 90)\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
    )
    proc = _run(code=code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'name': 'stage 1, 8-key blocks', 'error':" in proc.stdout
    assert "refused: no constexprs: constexprs not given: GROUP, HEAD_DIM" in proc.stdout
