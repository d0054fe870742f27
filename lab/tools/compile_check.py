"""Our triton kernels compiled for a GPU on a machine without one: does each tiling build, and what does it cost in registers, spills and shared memory.

    python lab/tools/compile_check.py [--arch 90] [--only SUBSTRING ...] [--sass] [--order N] [--json PATH]

Why: a session has 30 minutes of device time. A tiling that does not build for the H200 (sm_90),
or one that spills registers or caps the programs an SM by its registers, should not cost a
device call to find out. Triton compiles to a cubin without a GPU when given the target (its
wheel ships ptxas and cuobjdump); cuobjdump reads each kernel's resources off the cubin.

Each case names a kernel and the arguments a launch passes it, as the launch code does
(triton_gemv._launch, _launch_rows, triton_decode.decode_attention), and is specialised the way
triton's JIT specialises a real launch: pointers 16-byte aligned, integers divisible by 16 marked
so (those the kernel lists in ``do_not_specialize`` left alone), an integer equal to 1 a constant.
The CPU machine's triton may be newer than the device's (3.9 here, 3.6 there): a build here is a
strong hint, not a proof; resources may differ by a few registers.

Printed per case: registers a thread, stack and local bytes (spills), shared memory, the
programs an SM that registers, shared memory and threads allow (65,536 registers, 228 KiB and
2,048 threads a multiprocessor at compute capability 9.0) and, with ``--sass``, the
global load and store instructions by width (LDG.E.128 is a 16-byte load; U16 a 2-byte one);
with ``--order N`` the first N loads, stores, waits and barriers in program order, where a
chain of round trips shows (a load whose address needs another load's result).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for app

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

REGISTERS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048
SMEM_PER_SM = 228 * 1024  # compute capability 9.0
SMEM_PER_PROGRAM = 1024  # ... of which each resident program also takes this much (the system's share)
INT_POINTERS = {"pos_ptr": "*i64", "loc_ptr": "*i64", "keys_ptr": "*i64", "ids_ptr": "*i64", "req_to_token_ptr": "*i32",
                "req_idx_ptr": "*i64", "seq_lens_ptr": "*i64", "num_splits_ptr": "*i32", "counter_ptr": "*i32",
                "stack_ptr": "*i64", "slots_out_ptr": "*i64", "page_free_ptr": "*i1", "per_seq_ptr": "*i64",
                "slots_ptr": "*i64", "out_cache_loc_ptr": "*i64", "table_ptr": "*i32", "step_slots_ptr": "*i32",
                "probe_ptr": "*i64"}
FLOAT32_POINTERS = {"part_ptr", "sq_ptr", "cos_ptr", "sin_ptr", "mid_o_ptr", "mid_lse_ptr", "out_acc_ptr", "zero_ptr"}
FLOAT_SCALARS = {"eps", "qk_scale"}


class Case(NamedTuple):
    """One launch to compile: the kernel, its integer arguments' values (others default to 0),
    its constexprs, and the launch's warps and stages."""

    name: str
    kernel: Any  # a triton JITFunction
    ints: dict[str, int]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3


def _gemv_constexprs(**changes: Any) -> dict[str, Any]:
    """The row-block gemv's constexprs for a one-row bf16 launch (triton_gemv._launch), changed."""
    base = dict(HAS_BIAS=False, SPLIT=False, BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024, USE_DOT=False, EVEN=True,
                DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", NUM_STAGES=1, PROLOGUE=0, HAS_RESIDUAL=False, EMBED=False,
                PDL_WAIT=True, PDL_PRELOAD=0, PDL_TRIGGER_LATE=False, ROTARY=False, HALF=1, NUM_Q_HEADS=0,
                SILU_OUT=False, ARGMAX=False, SLOTS=64, PROBE=False)
    return {**base, **changes}


def _rows_constexprs(**changes: Any) -> dict[str, Any]:
    """The persistent gemv's constexprs (triton_gemv._launch_rows) at K = 2048, changed."""
    base = dict(K=2048, BLOCK_K=2048, BLOCK_N=2, EVEN=True, NUM_STAGES=3, HAS_BIAS=False, PROLOGUE=2,
                HAS_RESIDUAL=True, EMBED=False, ROTARY=False, HALF=1, NUM_Q_HEADS=0, SILU_OUT=False, ARGMAX=False,
                SLOTS=64, TRIGGER=0)
    return {**base, **changes}


def _mlp_constexprs(**changes: Any) -> dict[str, Any]:
    """The fused MLP kernel's constexprs (triton_fused_mlp) for the 1B (K = 2048), as the default
    config launches it from a layer after the first, changed."""
    base = dict(K=2048, BLOCK_K=2048, BLOCK_N=4, NUM_STAGES=4, HAS_RESIDUAL=True, HAS_ZERO=True, TRIGGER=True,
                TRIGGER_AT_START=False, EARLY_TILE=False, PDL_WAIT=False, PROBE=False)
    return {**base, **changes}


def _stage1_constexprs(**changes: Any) -> dict[str, Any]:
    """Decode attention stage 1 for the 1B's heads (32 q, 8 kv, head_dim 64), bf16, changed."""
    base = dict(GROUP=4, HEAD_DIM=64, BLOCK_H=16, BLOCK_D=64, BLOCK_N=64, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32",
                EARLY_V=False, PREFETCH_SLOTS=True, DIRECT=False, REDUCE=False, MAX_SPLITS=16, SPLITS_FROM_LEN=True,
                TRIGGER=False, STEP_SLOTS=0, BLOCK_S=16, MERGE_H=4)
    return {**base, **changes}


def cases() -> list[Case]:
    """The 1B's batch-1 decode kernels as the defaults launch them, and the variants in question."""
    from app.kernels.triton_decode import _decode_stage1_kernel, _decode_stage2_kernel
    from app.kernels.triton_fused_mlp import _fused_mlp_kernel
    from app.kernels.triton_gemv import _gemv_kernel
    from app.kernels.triton_gemv_rows import gemv_rows_kernel
    from app.kernels.triton_graph_inputs import _load_graph_inputs_kernel
    from app.kernels.triton_kv_alloc import POP_BLOCK, _pop_pages_kernel

    qkv = dict(M=1, N=3072, K=2048, stride_xm=2048, k_per_split=2048, stride_cos=32, stride_cache_slot=512,
               stride_cache_head=64, rotary_programs=640)
    plain = dict(M=1, N=2048, K=2048, stride_xm=2048, k_per_split=2048)
    rows = dict(N=16384, stride_cos=0, stride_cache_slot=0, stride_cache_head=0, rotary_programs=0)
    attention = dict(min_split_len=64, stride_qb=2048, stride_qh=64, stride_cs=512, stride_ch=64, stride_rt=4096,
                     stride_mob=16384, stride_moh=1024, stride_mos=64, stride_mlb=512, stride_mlh=16, stride_ob=2048,
                     stride_oh=64, stride_cb=8)
    norm = dict(PROLOGUE=2, HAS_RESIDUAL=True)
    return [
        Case("gemv qkv (norm, rotary, pdl wait)", _gemv_kernel, qkv,
             _gemv_constexprs(BLOCK_N=4, ROTARY=True, HALF=32, NUM_Q_HEADS=32, **norm)),
        Case("gemv qkv layer 0 (embedding row)", _gemv_kernel, qkv,
             _gemv_constexprs(BLOCK_N=4, ROTARY=True, HALF=32, NUM_Q_HEADS=32, PROLOGUE=2, EMBED=True)),
        Case("gemv o (pdl preload)", _gemv_kernel, plain, _gemv_constexprs(PDL_PRELOAD=1)),
        Case("gemv down (pdl late, K 8192)", _gemv_kernel, dict(plain, K=8192, k_per_split=8192, stride_xm=8192),
             _gemv_constexprs(PDL_PRELOAD=1, PDL_TRIGGER_LATE=True)),
        Case("rows gate_up (norm, silu out)", gemv_rows_kernel, rows, _rows_constexprs(SILU_OUT=True)),
        Case("persistent gate_up, its dependents let in at its start", gemv_rows_kernel, rows,
             _rows_constexprs(SILU_OUT=True, TRIGGER=1)),
        *(Case(f"fused MLP, {block_n} rows a tile, {warps} warps, {stages} stages{', early tile' if early else ''}",
               _fused_mlp_kernel, dict(intermediate=8192),
               _mlp_constexprs(BLOCK_N=block_n, NUM_STAGES=stages, EARLY_TILE=early), num_warps=warps)
          for block_n, warps, stages, early in ((4, 8, 3, False), (4, 8, 3, True), (2, 4, 3, False), (8, 8, 3, False),
                                                (4, 8, 4, False), (4, 4, 3, False), (8, 8, 2, False))),
        Case("fused MLP, qkv let in at its start", _fused_mlp_kernel, dict(intermediate=8192),
             _mlp_constexprs(TRIGGER_AT_START=True), num_warps=8),
        Case("rows lm_head (norm, argmax)", gemv_rows_kernel, dict(rows, N=128256), _rows_constexprs(ARGMAX=True)),
        *(Case(f"rows lm_head (norm, argmax), {block_n} rows, 8 warps, {stages} stages (one an SM)", gemv_rows_kernel,
               dict(rows, N=128256), _rows_constexprs(ARGMAX=True, BLOCK_N=block_n, NUM_STAGES=stages), num_warps=8,
               num_stages=stages) for block_n, stages in ((2, 4), (4, 4), (4, 5))),
        Case("attention stage 1, 16 splits (batch 1)", _decode_stage1_kernel, attention, _stage1_constexprs(TRIGGER=False)),
        Case("attention stage 1, 16 splits, early V", _decode_stage1_kernel, attention, _stage1_constexprs(EARLY_V=True)),
        *(Case(f"attention stage 1, 16 splits, step slots {mode}", _decode_stage1_kernel,
               {**attention, "stride_ssb": 16 * 512, "split_cap": 512},
               _stage1_constexprs(TRIGGER=False, STEP_SLOTS=value))
          for mode, value in (("recorded", 1), ("read", 2))),
        Case("attention stage 1, 16 splits merged in stage 1", _decode_stage1_kernel, attention,
             _stage1_constexprs(REDUCE=True, TRIGGER=True)),
        Case("attention stage 1, one split, 2 warps", _decode_stage1_kernel, attention,
             _stage1_constexprs(DIRECT=True, MAX_SPLITS=1, TRIGGER=True), num_warps=2),
        Case("attention stage 1, one split, 4 warps", _decode_stage1_kernel, attention,
             _stage1_constexprs(DIRECT=True, MAX_SPLITS=1, TRIGGER=True)),
        Case("attention stage 1, one split, 128 keys", _decode_stage1_kernel, attention,
             _stage1_constexprs(DIRECT=True, MAX_SPLITS=1, TRIGGER=True, BLOCK_N=128)),
        Case("attention stage 1, one split, 128 keys, slots not prefetched", _decode_stage1_kernel, attention,
             _stage1_constexprs(DIRECT=True, MAX_SPLITS=1, TRIGGER=True, BLOCK_N=128, PREFETCH_SLOTS=False)),
        Case("attention stage 1, one split, 256 keys, 8 warps", _decode_stage1_kernel, attention,
             _stage1_constexprs(DIRECT=True, MAX_SPLITS=1, TRIGGER=True, BLOCK_N=256), num_warps=8),
        *(Case(f"graph inputs, ids on the device{', advancing' if advance else ''}", _load_graph_inputs_kernel,
               dict(width=8, table_stride=4096, b=1, bs=1),
               dict(HAS_IDS=True, ADVANCE=advance, ROW_IDS=0, ROW_POOL=1, ROW_POS=2, ROW_LENS=3, DUMMY=0, BLOCK=8),
               num_warps=4) for advance in (False, True)),
        Case("kv alloc pop, pages of 1", _pop_pages_kernel, dict(top=100, n=1),
             dict(PAGE=1, PAGE_P2=1, BLOCK=POP_BLOCK)),
        Case("kv alloc pop, pages of 16", _pop_pages_kernel, dict(top=100, n=1),
             dict(PAGE=16, PAGE_P2=16, BLOCK=POP_BLOCK)),
        *(Case(f"attention stage 2, 16 splits{', a dependent of stage 1' if wait else ''}", _decode_stage2_kernel,
               attention, dict(MAX_SPLITS=16, HEAD_DIM=64, BLOCK_S=16, BLOCK_D=64, SPLITS_FROM_LEN=True, TRIGGER=True,
                               PDL_WAIT=wait)) for wait in (False, True)),
    ]


def _signature(case: Case) -> tuple[dict[str, str], dict[tuple[int, ...], Any], dict[tuple[int, ...], list]]:
    """The kernel's signature, constants and attributes, specialised as triton's JIT would."""
    signature: dict[str, str] = {}
    constants: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list] = {}
    missing = [p.name for p in case.kernel.params if p.is_constexpr and p.name not in case.constexprs]
    if missing:
        raise ValueError(f"{case.name}: constexprs not given: {', '.join(missing)}")
    for index, param in enumerate(case.kernel.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            constants[(index,)] = case.constexprs[name]
        elif name.endswith("_ptr"):
            signature[name] = INT_POINTERS.get(name, "*fp32" if name in FLOAT32_POINTERS else "*bf16")
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in FLOAT_SCALARS:
            signature[name] = "fp32"
        else:
            value = case.ints.get(name, 0)
            if param.do_not_specialize:
                signature[name] = "i32"
            elif value == 1:
                signature[name] = "constexpr"
                constants[(index,)] = 1
            else:
                signature[name] = "i32"
                if value % 16 == 0:
                    attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


def _cuda_tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resources(cubin: bytes, sass: bool = False) -> dict[str, Any]:
    """REG, STACK and LOCAL of the cubin's kernel (cuobjdump), and with ``sass`` its global and
    shared-memory load/store instructions by kind."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([_cuda_tool("cuobjdump"), "--dump-resource-usage", file.name], capture_output=True,
                               text=True, check=True).stdout
        found = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage.split("Function", 1)[-1]))
        result: dict[str, Any] = {key.lower(): int(value) for key, value in found.items()}
        if sass:
            listing = subprocess.run([_cuda_tool("cuobjdump"), "-sass", file.name], capture_output=True, text=True,
                                     check=True).stdout
            kinds = re.findall(r"\b((?:LDG|STG|LDGSTS|LDS|STS)\.[A-Z0-9_.]+)", listing)
            result["memory_ops"] = dict(collections.Counter(kinds))
            result["order"] = program_order(listing)
    return result


# What decides a kernel's chain of memory round trips, in program order: global loads and stores,
# asynchronous copies and their waits, block barriers, and PDL's wait (ACQBULK) and trigger (PREEXIT).
ORDERED = re.compile(r"\b(LDG|STG|LDGSTS|DEPBAR|BAR|ACQBULK|PREEXIT|ATOMG|RED)\b")


def program_order(listing: str) -> list[str]:
    """``"offset OP operands"`` for each ORDERED instruction of a cuobjdump SASS listing, in order:
    a warp issues in order and stalls at a register's first use, so a load issued after a wait
    on another load's result costs a second round trip (lab/notes/gpu_notes.md, variants 58-60)."""
    order = []
    for line in listing.splitlines():
        match = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if match and ORDERED.search(match.group(2)):
            order.append(f"{match.group(1)} {' '.join(match.group(2).split())}")
    return order


def compile_case(case: Case, arch: int, sass: bool = False) -> dict[str, Any]:
    """Compile ``case`` for sm_``arch``; its resources and the programs an SM its registers allow,
    or the compiler's error."""
    signature, constants, attrs = _signature(case)
    source = ASTSource(fn=case.kernel, signature=signature, constexprs=constants, attrs=attrs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": case.num_warps, "num_stages": case.num_stages})
    except Exception as exc:  # the compiler's message is the result
        return {"name": case.name, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"}
    found = resources(compiled.asm["cubin"], sass)
    found["shared"] = compiled.metadata.shared  # triton's (dynamic) shared memory; the cubin's static part is a stub
    threads = 32 * case.num_warps
    by_registers = REGISTERS_PER_SM // max(1, found.get("reg", 1) * threads)
    # Each resident program also takes SMEM_PER_PROGRAM (1 KB) of the SM's shared memory.
    by_shared = SMEM_PER_SM // (found["shared"] + SMEM_PER_PROGRAM) if found["shared"] else MAX_THREADS_PER_SM
    return {"name": case.name, "num_warps": case.num_warps, **found,
            "programs_per_sm": min(by_registers, by_shared, MAX_THREADS_PER_SM // threads)}


def main(argv: list[str] | None = None, selected: Callable[[], list[Case]] = cases) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability as one number (H200: 90)")
    parser.add_argument("--only", nargs="*", default=None, help="cases whose name contains any of these")
    parser.add_argument("--sass", action="store_true", help="also count the global load/store instructions by kind")
    parser.add_argument("--order", type=int, default=0, metavar="N",
                        help="also list the first N memory, barrier and PDL instructions in program order")
    parser.add_argument("--json", default=None)
    options = parser.parse_args(argv)
    chosen = [c for c in selected() if not options.only or any(part in c.name for part in options.only)]
    results = []
    for case in chosen:
        result = compile_case(case, options.arch, options.sass or options.order > 0)
        results.append(result)
        if "error" in result:
            print(f"{case.name:48s} FAILED {result['error']}", flush=True)
            continue
        print(f"{case.name:48s} w{case.num_warps:<2} regs {result['reg']:3d}  stack {result['stack']:4d}  "
              f"local {result['local']:4d}  shared {result['shared']:6d}  {result['programs_per_sm']:2d} an SM", flush=True)
        if options.sass:
            print("    " + ", ".join(f"{kind} {count}" for kind, count in sorted(result["memory_ops"].items())))
        if options.order:
            print("\n".join(f"      {op}" for op in result["order"][:options.order]))
    if options.json:
        Path(options.json).write_text(json.dumps({"arch": options.arch, "triton": triton.__version__,
                                                  "cases": results}, indent=1))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
