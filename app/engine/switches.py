"""What each engine option resolves to on this device: the device and dtype, the attention
backends of prefill and decode steps, and every kernel and scheduling switch whose default
(None) depends on the device, the model or another switch.

Each ``resolve_*`` takes the option as given and returns what runs, or raises ValueError naming
the flag (and the one it needs) when the combination cannot run here. :mod:`app.engine.builder`
calls them in order; the tests call them directly for the rules.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from app.engine.config import (
    DEFAULT_GEMV_ROWS,
    DEFAULT_PDL_MODE,
    MLP_EARLY_TRIGGER_MAX_HIDDEN,
    PLAIN_MLP_PDL_MODE,
    EngineConfig,
    GemvPdlRoles,
    GemvRowRoles,
)
from app.engine.model_config import ModelConfig
from app.kernels.prefill_tiling import packs_query_groups


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's dtype on a GPU; float32 on a CPU (half precision is slow there)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    return getattr(torch, model_config.dtype)


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int, *,
                              group: int = 1, flag: str = "--attention-backend") -> str:
    """``auto``: on a CUDA device triton where its prefill packs query groups (head_dim <= 64 with
    ``group`` query heads a KV head >= 2: app/kernels/prefill_tiling.py), else flashinfer when it
    imports and the dtype is half precision, else triton; torch off CUDA. ``triton`` off CUDA
    only runs under triton's interpreter (TRITON_INTERPRET=1: slow, for debugging). Errors name
    ``flag``."""
    from app.engine.attention.flashinfer_backend import flashinfer_available

    if name == "auto":
        if device.type != "cuda":
            return "torch"
        if packs_query_groups(head_dim, group, device.type):
            return "triton"
        return "flashinfer" if flashinfer_available(device, dtype, head_dim) else "triton"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{flag} triton needs a CUDA device (--device is {device.type}); "
            "set TRITON_INTERPRET=1 to run its kernels interpreted on the CPU"
        )
    if name == "flashinfer" and not flashinfer_available(device, dtype, head_dim):
        raise ValueError(
            f"{flag} flashinfer needs CUDA, bf16 or fp16 (--dtype), head_dim 64, 128 or 256, "
            f"and flashinfer installed (the 'gpu' extra); here: device {device.type}, "
            f"dtype {str(dtype).removeprefix('torch.')}, head_dim {head_dim}"
        )
    return name


def resolve_fused_kernels(enabled: bool | None, device: torch.device, *, flag: str = "--fused-kernels") -> bool:
    """``--fused-kernels`` (and ``--triton-gemv``): None (the default) is on with a CUDA device
    and off otherwise. Explicitly on, our triton kernels need CUDA, or on a CPU triton's
    interpreter (TRITON_INTERPRET=1: slow, for debugging). Raises ValueError naming the flag."""
    if enabled is None:
        return device.type == "cuda"
    if enabled and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{flag} needs a CUDA device (--device is {device.type}); "
            "set TRITON_INTERPRET=1 to run its kernels interpreted on the CPU"
        )
    return enabled


def resolve_fused_decode(enabled: bool | None, *, fused_kernels: bool, triton_gemv: bool) -> bool:
    """``--fused-decode``: None (the default) follows the resolved ``--fused-kernels`` and
    ``--triton-gemv`` (so on with CUDA): it builds on both (the rotary tables; the gemv kernel it
    extends). Measured on the H200 (Llama-3.2-1B shape, batch 1, 128 -> 1024, triton backend):
    888 -> 942 tok/s (docs/benchmarks.md). Explicitly on without them raises ValueError naming
    the flags."""
    if enabled is None:
        return fused_kernels and triton_gemv
    if not enabled:
        return False
    if not (fused_kernels and triton_gemv):
        raise ValueError(
            "--fused-decode needs --fused-kernels and --triton-gemv on (both default to on with CUDA); got "
            f"--{'' if fused_kernels else 'no-'}fused-kernels --{'' if triton_gemv else 'no-'}triton-gemv"
        )
    return True


def resolve_auto_pdl_mode(*, fused_mlp: bool, hidden_size: int) -> str:
    """What ``--gemv-pdl-mode auto`` stands for: DEFAULT_PDL_MODE, where the MLP kernel lets the
    next layer's qkv launch at its start, with ``--fused-mlp`` up to MLP_EARLY_TRIGGER_MAX_HIDDEN
    (the 1B +1.0 % at batch 1 on the H200, the 8B -0.3 %: docs/gpu_notes.md, variant 97); else
    PLAIN_MLP_PDL_MODE (the next kernel let in after the MLP's loop)."""
    if fused_mlp and hidden_size <= MLP_EARLY_TRIGGER_MAX_HIDDEN:
        return DEFAULT_PDL_MODE
    return PLAIN_MLP_PDL_MODE


def resolve_gemv_pdl(enabled: bool | None, device: torch.device, *, triton_gemv: bool) -> bool:
    """``--gemv-pdl``: None (the default) is on where it can be: ``--triton-gemv`` (the kernels it
    launches) on a CUDA device of compute capability 9.0 or newer (programmatic dependent launch
    came with Hopper). On the H200, with ``--fused-silu-out`` and the per-role modes of
    DEFAULT_PDL_MODE, batch 1 ran 1,097 tok/s against 1,027 without (docs/gpu_notes.md,
    variant 35; before --fused-silu-out it lost). Asked for where it cannot be, a ValueError
    naming the flag."""
    if enabled is False:
        return False
    lacking = _pdl_unsupported(device)
    possible = triton_gemv and lacking is None
    if enabled is None or possible:
        return possible
    if not triton_gemv:
        raise ValueError("--gemv-pdl needs --triton-gemv on (the default with CUDA); got --no-triton-gemv")
    raise ValueError(f"--gemv-pdl {lacking}")


def _pdl_unsupported(device: torch.device) -> str | None:
    """None where programmatic dependent launch works (CUDA, compute capability 9.0+: Hopper and
    newer), else why not, worded to follow a flag's name."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is not None and capability >= (9, 0):
        return None
    where = "a CPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
    return f"needs a CUDA device of compute capability 9.0 or newer; here: {where}"


def resolve_fused_qkv_rotary(enabled: bool | None, *, fused_decode: bool) -> bool:
    """``--fused-qkv-rotary``: None (the default) follows ``--fused-decode``: on the H200 it made
    batch 1 faster (950 -> 985 tok/s; docs/gpu_notes.md, variant 23). On, it extends
    ``--fused-decode``'s qkv kernel, so it needs that; the model applies it where it fits (the
    triton backend, no q/k norm, pairs per program: see rotary_store_fits). Raises ValueError
    naming the flags."""
    return _follows_fused_decode(enabled, fused_decode, "--fused-qkv-rotary")


# The default --gemv-rows applies to models whose hidden size is at most this: the shapes it
# was measured at, the 1B's 2,048 and the 8B's 4,096 (batch 1 on the H200, 11-30, alternated
# twice: 248.9 / 248.8 tok/s against 246.3 / 246.4, +1.0 %, the persistent lm_head; gate_up is
# inside the fused MLP kernel there). Wider models are not measured.
GEMV_ROWS_DEFAULT_MAX_HIDDEN = 4096


def resolve_gemv_rows(spec: str | None, *, triton_gemv: bool, hidden_size: int = 0) -> GemvRowRoles:
    """``--gemv-rows``: the roles whose one-row gemv runs persistent. None (the default):
    DEFAULT_GEMV_ROWS with ``--triton-gemv`` for a hidden size up to GEMV_ROWS_DEFAULT_MAX_HIDDEN,
    else none (on the H200 the 1B's batch-1 step took 0.851-0.863 ms with gate_up and lm_head
    persistent against 0.889-0.892 with the defaults before, alternated three times:
    docs/gpu_notes.md, variant 52). Naming any role without ``--triton-gemv`` is a ValueError."""
    if spec is None:
        measured = hidden_size <= GEMV_ROWS_DEFAULT_MAX_HIDDEN
        spec = DEFAULT_GEMV_ROWS if triton_gemv and measured else "off"
    rows = GemvRowRoles.parse(spec)
    if any(rows) and not triton_gemv:
        raise ValueError(f"--gemv-rows {spec} needs --triton-gemv (the persistent kernel is one of its launches)")
    return rows


def resolve_fused_silu_out(enabled: bool | None, *, fused_decode: bool) -> bool:
    """``--fused-silu-out``: None (the default) follows ``--fused-decode``: the down projection's
    programs no longer each recompute silu(gate) * up of the whole row (~8M exponentials a step
    for the 1B's 1,024 programs). On, it extends ``--fused-decode``'s gate_up kernel, so it needs
    that. Raises ValueError naming the flags."""
    return _follows_fused_decode(enabled, fused_decode, "--fused-silu-out")


def resolve_fused_mlp(enabled: bool | None, *, fused_decode: bool) -> bool:
    """``--fused-mlp``: None (the default) follows ``--fused-decode``, whose one-token path it
    extends. Batch 1 on the H200: +1.5 to +4.2 % for the 1B, +2.5 % for the 8B; the steps of
    more rows read down's weight stored transposed (torch's matmul over the view) and lose
    nothing: 16 sequences +1.0 / +1.3 %, 256 +0.7 to +1.8 % (docs/gpu_notes.md, variant 70).
    Its float32 atomics make a batch-1 step's results differ from run to run in the last bits
    (as split-K and atomic kernels do in other servers); ``--no-fused-mlp`` keeps them
    bit-stable. On explicitly, it needs ``--fused-decode``. Raises ValueError naming the flags."""
    return _follows_fused_decode(enabled, fused_decode, "--fused-mlp")


def _follows_fused_decode(enabled: bool | None, fused_decode: bool, flag: str) -> bool:
    if enabled is None:
        return fused_decode
    if not enabled:
        return False
    if not fused_decode:
        raise ValueError(f"{flag} needs --fused-decode on (the default with CUDA); got --no-fused-decode "
                         "(or --no-fused-kernels / --no-triton-gemv, which it needs)")
    return True


def resolve_fused_greedy(enabled: bool | None, device: torch.device) -> bool:
    """``--fused-greedy``: None (the default) is on with CUDA: on the H200 it made batch 1 faster
    (950 -> 976 tok/s; docs/gpu_notes.md, variant 25), and off elsewhere. On, its kernels are
    triton's: CUDA, or TRITON_INTERPRET=1 on a CPU. Raises ValueError naming the flag."""
    if enabled is None:
        return device.type == "cuda"
    return enabled and resolve_fused_kernels(True, device, flag="--fused-greedy")


def resolve_fused_split_reduce(enabled: bool | None, decode_backend: str) -> bool:
    """``--fused-split-reduce``: None (the default) is off until a GPU run has measured it
    (tools/gpu_check.sh bench1, the "split-reduce" row). On, it changes the triton backend's
    decode attention, so it needs that backend. Raises ValueError naming the flags."""
    if not enabled:
        return False
    if decode_backend != "triton":
        raise ValueError(f"--fused-split-reduce changes the triton decode attention; decode steps run on "
                         f"{decode_backend} (resolved --attention-backend / --decode-attention-backend)")
    return True


def resolve_overlap_schedule(enabled: bool | None, device: torch.device) -> bool:
    """``--overlap-schedule``: None (the default) is on with CUDA, where it hides the host's
    share of each decode step (H200, Llama-3.2-1B shape: batch 1 558 -> 657 tok/s, 256 requests
    32.3k -> 35.2k; docs/benchmarks.md), and off elsewhere: on a CPU the "device" is the host,
    so there is nothing to hide and each token would only arrive one step later."""
    return device.type == "cuda" if enabled is None else enabled


# The default --copy-stream applies to steps of at most this many sampled rows (decode batches
# of at most this many requests). On the H200 the side stream gained ~1.4 % at batch 1 (1,212
# against 1,196 tok/s) and ~0.9 % at 16 (12,409 / 12,375 against 12,248 / 12,310), and lost
# ~0.8 % at 256 requests in three separate calls (see resolve_copy_stream), and +0.6 % at 48
# (30,342 / 30,384 against 30,239 / 30,120, 11-30, ninth session); 49-255 are not measured: the
# cut sits at the largest batch measured to gain.
COPY_STREAM_MAX_BATCH = 48
# Explicit --copy-stream: every step's tokens go out on the side stream, whatever its rows.
COPY_STREAM_EVERY_BATCH = 1 << 30


def resolve_copy_stream(enabled: bool | None, device: torch.device) -> int:
    """``--copy-stream``: the most rows a step may sample for its tokens to go to the host on the
    side stream; 0 is off (a CPU, or ``--no-copy-stream``). None (the default) is
    COPY_STREAM_MAX_BATCH with CUDA: the batch-1 trace of the H200 (11-30) showed the next
    step's first kernel starting after the token copy-out, itself ~4 µs after the step's last
    kernel, and a side stream takes the copy off the step's path (0.872-0.878 ms a step against
    0.878-0.882 in three alternations, and 0.871 against 0.882-0.891 in another call: variant 51;
    1,212 against 1,196 tok/s, +1.4 %), but at 256 requests it lost ~0.8 % in three separate
    calls (out tok/s 39.41k against 39.81k with ``--no-copy-stream`` over the fourth session of
    11-30's calls 4 and 5; 38.95k against 39.24k in the fifth's call 3: five pairs of seven lost).
    At 16 sequences it gained 0.9 % (the fifth's call 4), at 48 0.6 % (the ninth's). True is every step
    (COPY_STREAM_EVERY_BATCH). Asked for off CUDA, a ValueError naming the flag (a CPU has no
    streams)."""
    if enabled and device.type != "cuda":
        raise ValueError(f"--copy-stream needs a CUDA device; here: {device.type}")
    if enabled is None:
        return COPY_STREAM_MAX_BATCH if device.type == "cuda" else 0
    return COPY_STREAM_EVERY_BATCH if enabled else 0


class AttentionBackends(NamedTuple):
    """The resolved backend names: ``prefill`` serves EXTEND steps, ``decode`` DECODE steps and graphs."""

    prefill: str
    decode: str


def resolve_attention_backends(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                               head_dim: int, group: int = 1) -> AttentionBackends:
    """``--attention-backend`` and ``--decode-attention-backend`` resolved. The decode backend
    None is the prefill's, except that after ``auto`` on CUDA decode steps run on triton: on the
    H200 flashinfer's prefill with our decode kernels ran batch 1 at 959 tok/s where all
    flashinfer ran 769 and all triton 950 (docs/gpu_notes.md, variant 29)."""
    prefill = resolve_attention_backend(config.attention_backend, device, dtype, head_dim, group=group)
    if config.decode_attention_backend is None:
        auto_on_cuda = config.attention_backend == "auto" and device.type == "cuda"
        return AttentionBackends(prefill, "triton" if auto_on_cuda else prefill)
    decode = resolve_attention_backend(config.decode_attention_backend, device, dtype, head_dim,
                                       flag="--decode-attention-backend")
    return AttentionBackends(prefill, decode)


class TritonDecodeKnobs(NamedTuple):
    """The triton decode attention's split rule and stage-1 launch (``--triton-attention-num-kv-splits``,
    ``--triton-decode-min-split-len``, ``--triton-decode-block-n``, ``--triton-decode-num-warps``,
    ``--triton-decode-num-stages``, ``--[no-]triton-decode-early-v``,
    ``--[no-]triton-decode-prefetch-slots``, ``--[no-]triton-decode-step-slots``,
    ``--[no-]triton-decode-stage2-pdl``; None: the backend's default)."""

    max_kv_splits: int | None = None
    min_split_len: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    early_v: bool | None = None
    prefetch_slots: bool | None = None
    step_slots: bool | None = None
    stage2_pdl: bool | None = None

    def backend_kwargs(self) -> dict[str, int | bool]:
        """TritonAttentionBackend's keyword arguments for the knobs that are set."""
        named = {"max_kv_splits": self.max_kv_splits, "min_split_len": self.min_split_len,
                 "decode_block_n": self.block_n, "decode_warps": self.num_warps, "decode_num_stages": self.num_stages,
                 "decode_early_v": self.early_v, "decode_prefetch_slots": self.prefetch_slots,
                 "decode_step_slots": self.step_slots, "decode_stage2_pdl": self.stage2_pdl}
        return {key: value for key, value in named.items() if value is not None}


def resolve_triton_decode_knobs(config: EngineConfig, decode_backend: str) -> TritonDecodeKnobs:
    """The knobs as given; any of them set needs triton for decode steps (ValueError naming the flags)."""
    knobs = TritonDecodeKnobs(config.triton_attention_num_kv_splits, config.triton_decode_min_split_len,
                              config.triton_decode_block_n, config.triton_decode_num_warps,
                              config.triton_decode_num_stages, config.triton_decode_early_v,
                              config.triton_decode_prefetch_slots, config.triton_decode_step_slots,
                              config.triton_decode_stage2_pdl)
    if knobs != TritonDecodeKnobs() and decode_backend != "triton":
        raise ValueError("--triton-attention-num-kv-splits and the --triton-decode-* knobs change the triton decode "
                         f"attention; decode steps run on {decode_backend} (resolved --attention-backend / "
                         "--decode-attention-backend)")
    return knobs


def attention_triggers_o(gemv_pdl_mode: str) -> bool:
    """Whether the triton decode attention should let the o projection start as it begins: when
    the o gemv launches as a programmatic dependent that preloads weight tiles ("preload" or
    "late" in the resolved ``--gemv-pdl-mode``; "" when PDL is off), which it then loads while
    the attention runs. With "wait" nothing could be loaded early. o=preload (the default)
    against o=wait: o 67.6 -> 47.7 us a step (docs/gpu_notes.md, variant 53)."""
    return bool(gemv_pdl_mode) and GemvPdlRoles.parse(gemv_pdl_mode).o in ("preload", "late")
