"""The engine's attention backends and kernel and scheduling switches as command-line flags, for
the tools that build an Engine (bench_offline.py, profile_decode.py): each is declared here once,
with its help, and reported back resolved. Every switch defaults to None, which lets the engine
choose (see EngineConfig); the server's own flags are in app/server_args.py."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from app.engine.config import (
    ATTENTION_BACKENDS,
    DEFAULT_GEMV_ROWS,
    DEFAULT_PDL_MODE,
    GEMV_PDL_MODES,
    MLP_EARLY_TRIGGER_MAX_HIDDEN,
    PLAIN_MLP_PDL_MODE,
    BlockLaunch,
    FusedMlpKnobs,
    GemvBlockKnobs,
    GemvPdlRoles,
    GemvRowRoles,
    GemvRowsKnobs,
    RowLaunch,
)

# (flag, help): the EngineConfig field is the flag with "_" for "-".
SWITCHES: tuple[tuple[str, str], ...] = (
    ("fused-kernels", "our triton kernels for RMSNorm (+residual), rotary and SiLU-and-mul (default: on with CUDA)"),
    ("triton-gemv", "our decode-shaped linear kernel for batch-1 decode (default: on with CUDA)"),
    ("fused-decode", "batch-1 decode steps through the fused decode kernels: RMSNorm and SiLU-and-mul inside the "
                     "gemv, the KV store inside rotary (default: on with CUDA)"),
    ("gemv-pdl", "launch the batch-1 gemv kernels as programmatic dependents (default: on with CUDA 9.0+)"),
    ("fused-qkv-rotary", "the batch-1 qkv gemv also rotates q, k and stores K/V (default: with --fused-decode)"),
    ("fused-silu-out", "the batch-1 gate_up gemv stores silu(gate) * up; down is a plain gemv (default: with "
                       "--fused-decode)"),
    ("fused-greedy", "greedy steps record in one kernel; batch 1 folds the argmax into the lm_head gemv "
                     "(default: on with CUDA)"),
    ("fused-kv-alloc", "a step's KV slots come off the allocator's free list in one triton kernel (default: on with "
                       "CUDA)"),
    ("graph-inputs-advance", "a steady decode step moves its graph's positions and lengths on, on the device, "
                             "instead of copying them from the host (default: on with CUDA graphs)"),
    ("fused-mlp", "the batch-1 MLP (norm, gate_up, SiLU, down) in one persistent kernel, down's output summed with "
                  "float32 atomics (default: with --fused-decode)"),
    ("fused-split-reduce", "the triton decode attention merges its splits in stage 1 (default: off)"),
    ("overlap-schedule", "queue decode step N+1 before reading step N's tokens (default: on with CUDA)"),
    ("copy-stream", "copy each step's sampled tokens to the host on a side stream (CUDA; default: on with CUDA for "
                    "decode steps of at most 48 rows; --copy-stream: every step)"),
)
FIELDS = tuple(flag.replace("-", "_") for flag, _ in SWITCHES)
KNOBS = (  # integer options (None: their defaults): the prefill graphs', the triton decode attention's (two
    # --[no-] switches besides)
    ("prefill-graph-max-tokens", "prefills of one sequence of up to this many new tokens replay CUDA graphs; 0: off "
                                 "(CUDA graphs and the triton prefill backend; default: 512 where they can run)"),
    ("triton-attention-num-kv-splits", "the triton decode attention's most KV splits a sequence (default: 16)"),
    ("triton-decode-min-split-len", "tokens a split of the triton decode attention at least (default: 64)"),
    ("triton-decode-block-n", "keys a step of the triton decode attention's loop (default: 64, 128 at mid batches "
                              "on CUDA)"),
    ("triton-decode-num-warps", "warps a program of the triton decode attention (default: 4 with 128-key blocks, "
                                "else 2 at one split a sequence, else 4)"),
    ("triton-decode-num-stages", "pipelining depth of the triton decode attention's key loop (default: triton's)"),
)
KNOB_FIELDS = tuple(flag.replace("-", "_") for flag, _ in KNOBS) + ("triton_decode_early_v",
                                                                      "triton_decode_prefetch_slots",
                                                                      "triton_decode_step_slots",
                                                                      "triton_decode_stage2_pdl")
BACKEND_FIELDS = ("attention_backend", "decode_attention_backend")


def add_engine_switches(parser: argparse.ArgumentParser) -> None:
    """``--attention-backend``, ``--decode-attention-backend`` and ``--[no-]<switch>`` for each of SWITCHES."""
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    parser.add_argument("--decode-attention-backend", default=None, choices=ATTENTION_BACKENDS,
                        help="decode steps' backend when it differs from --attention-backend (default: the same)")
    for flag, help_text in SWITCHES:
        parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None, help=help_text)
    parser.add_argument("--gemv-pdl-mode", default=None, type=_checked(GemvPdlRoles.parse),
                        help=f"with --gemv-pdl: how each gemv overlaps its neighbours: one of {', '.join(GEMV_PDL_MODES)} "
                             f"or role=mode pairs (roles {', '.join(GemvPdlRoles._fields)}; default: auto, {DEFAULT_PDL_MODE} "
                             f"with --fused-mlp up to hidden size {MLP_EARLY_TRIGGER_MAX_HIDDEN}, else {PLAIN_MLP_PDL_MODE})")
    parser.add_argument("--gemv-rows", default=None, type=_checked(GemvRowRoles.parse),
                        help="the batch-1 gemv kernels that run persistent: off, all or roles separated by commas "
                             f"({', '.join(GemvRowRoles._fields)}; default: {DEFAULT_GEMV_ROWS} with --triton-gemv up to "
                             "hidden size 4096)")
    parser.add_argument("--fused-mlp-config", default=None, type=_checked(FusedMlpKnobs.parse),
                        help="the batch-1 MLP kernel's launch where it differs from its tuned one: name=value pairs "
                             f"({', '.join(FusedMlpKnobs._fields)}; default: none)")
    parser.add_argument("--gemv-rows-config", default=None, type=_checked(GemvRowsKnobs.parse),
                        help="the persistent gemvs' launches where they differ from their tiling: role:name=value,... "
                             f"separated by ';' (names {', '.join(RowLaunch._fields)}; default: none)")
    parser.add_argument("--gemv-config", default=None, type=_checked(GemvBlockKnobs.parse),
                        help="the row-block gemvs' launches where they differ from their default tiling: "
                             f"role:name=value,... separated by ';' (names {', '.join(BlockLaunch._fields)}; default: none)")
    for flag, help_text in KNOBS:
        parser.add_argument(f"--{flag}", type=int, default=None, help=help_text)
    parser.add_argument("--triton-decode-early-v", action=argparse.BooleanOptionalAction, default=None,
                        help="the triton decode attention loads each V block beside its K block (default: after the softmax)")
    parser.add_argument("--triton-decode-prefetch-slots", action=argparse.BooleanOptionalAction, default=None,
                        help="each key block of the triton decode attention loads the next block's slots (default: on CUDA)")
    parser.add_argument("--triton-decode-step-slots", action=argparse.BooleanOptionalAction, default=None,
                        help="the first layer's triton decode attention records the splits' KV slots, the later "
                             "layers read them (decode steps of up to 8 sequences; default: on CUDA)")
    parser.add_argument("--triton-decode-stage2-pdl", action=argparse.BooleanOptionalAction, default=None,
                        help="the triton decode attention's stage 2 launches as a programmatic dependent of stage 1 "
                             "(default: on CUDA of compute capability 9.0 or newer)")


def _checked(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type that keeps the spelling and reports ``parse``'s ValueError as a usage error."""
    def check(value: str) -> str:
        try:
            parse(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value
    return check


def engine_switches(options: argparse.Namespace) -> dict[str, bool | int | str | None]:
    """The parsed backends and switches as Engine keyword arguments (the PDL mode, the persistent
    roles and the decode-attention knobs only when given)."""
    switches = {field: getattr(options, field) for field in BACKEND_FIELDS + FIELDS}
    if options.gemv_pdl_mode is not None:
        switches["gemv_pdl_mode"] = options.gemv_pdl_mode
    if options.gemv_rows is not None:
        switches["gemv_rows"] = options.gemv_rows
    if options.fused_mlp_config is not None:
        switches["fused_mlp_config"] = options.fused_mlp_config
    if options.gemv_rows_config is not None:
        switches["gemv_rows_config"] = options.gemv_rows_config
    if options.gemv_config is not None:
        switches["gemv_config"] = options.gemv_config
    for field in KNOB_FIELDS:
        if getattr(options, field) is not None:
            switches[field] = getattr(options, field)
    return switches


def resolved_switches(built: Any) -> dict[str, bool | int | str]:
    """What the engine made of them (its BuiltEngine), for a tool's JSON line."""
    resolved: dict[str, Any] = {field: getattr(built, field) for field in BACKEND_FIELDS + FIELDS + (
        "gemv_pdl_mode", "gemv_rows", "gemv_rows_config", "gemv_config", "fused_mlp_config", "decode_tiling")}
    resolved["prefill_graph_max_tokens"] = max(built.prefill_graph_tokens, default=0)
    return resolved
