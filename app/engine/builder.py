"""Assemble an engine from its configuration: device, dtype, model, KV memory, scheduler.

The scheduler actor and the offline Engine both call :func:`build_scheduler`, so the server
and offline generation run exactly the same pieces.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app.engine.attention import AttentionBackend
from app.engine.config import EngineConfig
from app.engine.cuda_graph import DEFAULT_CUDA_GRAPH_MAX_BS, capture_batch_sizes
from app.engine.kv_pool import KVPool, ReqToTokenPool, SlotAllocator, kv_bytes_per_token
from app.engine.memory import KVMemory
from app.engine.model_config import ModelConfig
from app.engine.model_runner import ModelRunner
from app.engine.models import build_model
from app.engine.radix_cache import RadixCache
from app.engine.scheduler import Scheduler, SchedulerLimits
from app.engine.weights import load_weights
from app.kernels.torch_attention import TorchAttentionBackend
from app.text.tokenizer import Tokenizer

CPU_DEFAULT_MAX_TOTAL_TOKENS = 32768
CPU_DEFAULT_CHUNKED_PREFILL = 2048
GPU_DEFAULT_CHUNKED_PREFILL = 8192
DEFAULT_MAX_RUNNING_REQUESTS = 256


@dataclass(frozen=True)
class BuiltEngine:
    """What :func:`build_scheduler` made, with the values it derived."""

    scheduler: Scheduler
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    context_len: int
    max_total_tokens: int
    max_running_requests: int
    chunked_prefill_size: int | None
    attention_backend: str
    cuda_graph_batch_sizes: tuple[int, ...] = ()  # decode batch sizes captured (empty: no graphs)
    cuda_graph_capture_s: float = 0.0
    fused_kernels: bool = False  # the model runs our triton norm/rotary/SiLU kernels


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


def _kv_capacity(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Tokens of KV: the flag, or on a GPU what --mem-fraction-static leaves after the weights."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    if device.type != "cuda":
        return CPU_DEFAULT_MAX_TOTAL_TOKENS
    free, total = torch.cuda.mem_get_info(device)
    budget = total * config.mem_fraction_static - (total - free)
    per_token = kv_bytes_per_token(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, dtype)
    tokens = int(budget // per_token)
    if tokens < 2:
        raise ValueError(
            f"--mem-fraction-static {config.mem_fraction_static} leaves no room for the KV cache "
            f"after the model's weights ({(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB in use)"
        )
    return tokens


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """``auto``: flashinfer on a CUDA device when it imports and the dtype is half precision,
    else triton on CUDA, else torch. ``triton`` off CUDA only runs under triton's interpreter
    (TRITON_INTERPRET=1: slow, for debugging)."""
    from app.kernels.flashinfer_attention import flashinfer_available

    if name == "auto":
        if device.type != "cuda":
            return "torch"
        return "flashinfer" if flashinfer_available(device, dtype, head_dim) else "triton"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"--attention-backend triton needs a CUDA device (--device is {device.type}); "
            "set TRITON_INTERPRET=1 to run its kernels interpreted on the CPU"
        )
    if name == "flashinfer" and not flashinfer_available(device, dtype, head_dim):
        raise ValueError(
            f"--attention-backend flashinfer needs CUDA, bf16 or fp16 (--dtype), head_dim 64, 128 or 256, "
            f"and flashinfer installed (the 'gpu' extra); here: device {device.type}, "
            f"dtype {str(dtype).removeprefix('torch.')}, head_dim {head_dim}"
        )
    return name


def check_fused_kernels(enabled: bool, device: torch.device) -> None:
    """``--fused-kernels`` runs triton kernels: on CUDA, or on a CPU only under triton's
    interpreter (TRITON_INTERPRET=1: slow, for debugging). Raises ValueError naming the flag."""
    if enabled and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"--fused-kernels needs a CUDA device (--device is {device.type}); "
            "set TRITON_INTERPRET=1 to run its kernels interpreted on the CPU"
        )


def make_attention_backend(name: str, pool: KVPool, table: ReqToTokenPool, model_config: ModelConfig) -> AttentionBackend:
    # Imported here: triton decides at import whether its kernels are compiled or interpreted,
    # and CPU-only runs (the torch backend) should not import triton or flashinfer at all.
    if name == "triton":
        from app.kernels.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend(pool, table)
    if name == "flashinfer":
        from app.kernels.flashinfer_attention import FlashInferAttentionBackend

        return FlashInferAttentionBackend(pool, table, num_heads=model_config.num_heads)
    return TorchAttentionBackend(pool, table)


GRAPH_BACKENDS = ("triton",)  # backends whose decode metadata can live in static buffers


def cuda_graph_batch_sizes(config: EngineConfig, device: torch.device, attention_backend: str, max_running: int) -> tuple[int, ...]:
    """Decode batch sizes to capture: none with --disable-cuda-graph, off CUDA, or for a backend
    without graph support (torch, flashinfer: they run eagerly); else up to --cuda-graph-max-bs,
    which defaults to (and is capped by) the running-request limit, at most 256 by default."""
    if config.disable_cuda_graph or device.type != "cuda" or attention_backend not in GRAPH_BACKENDS:
        return ()
    return capture_batch_sizes(min(config.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, max_running))


def checkpoint_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json (for checkpoints without a tokenizer)."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                return tuple(value) if isinstance(value, list) else (int(value),)
    return ()


def build_scheduler(config: EngineConfig, tokenizer: Tokenizer | None = None) -> BuiltEngine:
    """Load the model and build the scheduler over it. Raises ValueError naming the flag or
    file at fault, FileNotFoundError for a missing checkpoint file."""
    config.validate()
    model_dir = Path(config.model_path)
    model_config = ModelConfig.from_pretrained(model_dir)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, model_config, device)
    attention_backend = resolve_attention_backend(config.attention_backend, device, dtype, model_config.head_dim)
    check_fused_kernels(config.fused_kernels, device)
    context_len = config.context_length or model_config.max_context_len
    if context_len > model_config.max_context_len:
        raise ValueError(
            f"--context-length {context_len} exceeds the model's {model_config.max_context_len} "
            f"(max_position_embeddings in {model_dir / 'config.json'})"
        )
    model = build_model(model_config, dtype=dtype, device=device, fused_kernels=config.fused_kernels)
    load_weights(model, model_dir)
    max_total_tokens = _kv_capacity(config, model_config, dtype, device)
    max_running = config.max_running_requests or min(DEFAULT_MAX_RUNNING_REQUESTS, max_total_tokens)
    if config.chunked_prefill_size == -1:
        chunk: int | None = None
    else:
        chunk = config.chunked_prefill_size or (GPU_DEFAULT_CHUNKED_PREFILL if device.type == "cuda" else CPU_DEFAULT_CHUNKED_PREFILL)

    max_total_tokens -= max_total_tokens % config.page_size  # whole pages only
    if max_total_tokens < 2 * config.page_size:
        raise ValueError(f"--max-total-tokens must hold at least two pages of --page-size {config.page_size}")
    allocator = SlotAllocator(max_total_tokens, page_size=config.page_size, device=device)
    pool = KVPool.for_model(model_config, num_slots=allocator.num_slots, dtype=dtype, device=device)
    table = ReqToTokenPool(max_running, context_len, device=device)
    cache = RadixCache(allocator.free, page_size=config.page_size, disabled=config.disable_radix_cache, device=device)
    memory = KVMemory(allocator, pool, table, cache)
    runner = ModelRunner(model, make_attention_backend(attention_backend, pool, table, model_config), table, device)
    graph_sizes = cuda_graph_batch_sizes(config, device, attention_backend, max_running)
    capture_started = time.monotonic()
    if graph_sizes:
        runner.capture_cuda_graphs(graph_sizes)  # warm-up before the server reports ready
    capture_s = time.monotonic() - capture_started
    eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else checkpoint_eos_ids(model_dir)
    limits = SchedulerLimits(context_len, config.max_prefill_tokens, chunk, config.new_token_ratio, config.stream_interval)
    scheduler = Scheduler(
        runner, memory, limits, vocab_size=model_config.vocab_size, eos_token_ids=eos_token_ids
    )
    return BuiltEngine(
        scheduler, model_config, device, dtype, context_len, max_total_tokens, max_running, chunk, attention_backend,
        graph_sizes, round(capture_s, 2), config.fused_kernels,
    )
