"""Assemble an engine from its configuration: device, dtype, model, KV memory, scheduler.

The scheduler actor and the offline Engine both call :func:`build_scheduler`, so the server
and offline generation run exactly the same pieces.

On a GPU the KV pool takes what is left of ``--mem-fraction-static`` of the device after the
weights, one profiled forward of the largest prefill step, and a reserve for CUDA graphs,
sampling and the request table (arithmetic in memory_budget.py)::

    load weights ─▶ profiling forward on a tiny temporary pool ─▶ free it ─▶ read free memory
                    (EXTEND of the largest step; DECODE of the      │
                     largest graph batch; builds the JIT kernels)   ▼
                                          size the pool ─▶ allocate it ─▶ capture CUDA graphs

Too little memory at any of these points is a ValueError naming the flags to change, raised at
start, never an out-of-memory crash later.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from app.engine.attention import AttentionBackend
from app.engine.config import DEFAULT_MAX_RUNNING_REQUESTS, EngineConfig
from app.engine.cuda_graph import DEFAULT_CUDA_GRAPH_MAX_BS, capture_batch_sizes
from app.engine.forward_batch import ForwardMode
from app.engine.kv_pool import KVPool, ReqToTokenPool, SlotAllocator, kv_bytes_per_token
from app.engine.memory import KVMemory
from app.engine.kernel_plan import (
    GRAPH_BACKENDS,
    AttentionBackends,
    KernelPlan,
    resolve_device,
    resolve_dtype,
    resolve_kernel_plan,
)
from app.engine.memory_budget import (
    INDEX_BYTES_PER_TOKEN,
    check_step_headroom,
    gib,
    kv_pool_tokens,
    reserve_bytes,
    weights_do_not_fit,
)
from app.engine.model_config import ModelConfig
from app.engine.model_runner import ModelRunner
from app.engine.models import CausalLM, build_model
from app.engine.radix_cache import RadixCache
from app.engine.prefill_graph import prefill_graph_tokens
from app.engine.scheduling import Scheduler, SchedulerLimits
from app.engine.weights import load_weights
from app.engine.attention.torch_backend import TorchAttentionBackend
from app.text.tokenizer import Tokenizer

CPU_DEFAULT_MAX_TOTAL_TOKENS = 32768
CPU_DEFAULT_CHUNKED_PREFILL = 2048
GPU_DEFAULT_CHUNKED_PREFILL = 8192


class MemoryFigures(NamedTuple):
    """Device memory (GiB) of the built engine: the model's parameters and buffers; the profiled
    growth of the largest prefill step (0 off CUDA: not profiled); the KV pool's K/V buffers;
    what capturing the CUDA graphs took from the device (measured; 0 without graphs)."""

    weights_gib: float = 0.0
    activation_peak_gib: float = 0.0
    kv_pool_gib: float = 0.0
    cuda_graph_gib: float = 0.0


@dataclass(frozen=True, kw_only=True)
class BuiltEngine:
    """What :func:`build_scheduler` made, with the values it derived."""

    scheduler: Scheduler
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    plan: KernelPlan  # the kernels that run (resolved --kernel-options and backends)
    context_len: int
    max_total_tokens: int
    max_running_requests: int
    chunked_prefill_size: int | None
    cuda_graph_batch_sizes: tuple[int, ...] = ()  # decode batch sizes captured (empty: no graphs)
    prefill_graph_tokens: tuple[int, ...] = ()  # prefill (one-sequence EXTEND) token counts captured
    cuda_graph_capture_s: float = 0.0
    decode_tiling: str = ""  # the decode attention's split cap, split length and key block (triton); "" on others
    memory: MemoryFigures = MemoryFigures()


def make_attention_backend(name: str, pool: KVPool, table: ReqToTokenPool, model_config: ModelConfig,
                           plan: KernelPlan | None = None) -> AttentionBackend:
    """The backend ``name`` over ``pool`` and ``table``; a triton one launches its decode steps as
    ``plan`` says (None: its defaults, as the profiling forward and a prefill-only backend run)."""
    # Imported here: triton decides at import whether its kernels are compiled or interpreted,
    # and CPU-only runs (the torch backend) should not import triton or flashinfer at all.
    if name == "triton":
        from app.engine.attention.triton_backend import TritonAttentionBackend

        launch = {} if plan is None else dict(reduce_in_stage1=plan.fused_split_reduce,
                                              trigger_dependents=plan.attention_triggers_o,
                                              **plan.triton_decode.backend_kwargs())
        return TritonAttentionBackend(pool, table, num_heads=model_config.num_heads, **launch)
    if name == "flashinfer":
        from app.engine.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(pool, table, num_heads=model_config.num_heads)
    return TorchAttentionBackend(pool, table)


def make_runner(model: CausalLM, model_config: ModelConfig, pool: KVPool, table: ReqToTokenPool, device: torch.device,
                backends: AttentionBackends, plan: KernelPlan | None = None) -> ModelRunner:
    """The model runner over ``pool`` and ``table`` with the prefill and decode backends named
    (one object when they are the same); the decode one and the sampler run as ``plan`` says
    (None: the backends' defaults and the plain sampler, as the profiling forward runs)."""
    decode = make_attention_backend(backends.decode, pool, table, model_config, plan)
    prefill = decode if backends.prefill == backends.decode else make_attention_backend(
        backends.prefill, pool, table, model_config)
    return ModelRunner(model, prefill, table, device, decode_backend=decode,
                       fused_greedy=plan is not None and plan.fused_greedy)


def cuda_graph_batch_sizes(config: EngineConfig, device: torch.device, attention_backend: str, max_running: int) -> tuple[int, ...]:
    """Decode batch sizes to capture: none with --disable-cuda-graph, off CUDA, or for a backend
    without graph support (torch: it runs eagerly; the plan's ``cuda_graphs`` is the same test);
    else up to --cuda-graph-max-bs, which defaults to (and is capped by) the running-request
    limit, at most 256 by default."""
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


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _device_memory(device: torch.device) -> str:
    free, total = torch.cuda.mem_get_info(device)
    return f"{gib(free):.2f} GiB free of {gib(total):.2f} GiB"


def load_model_on_device(model_config: ModelConfig, model_dir: Path, dtype: torch.dtype, device: torch.device,
                         plan: KernelPlan) -> CausalLM:
    """Build the model with ``plan``'s kernels and load its weights. On CUDA, weights that cannot
    fit (their size, from the model built on the meta device, exceeds the free memory) or that
    run out of memory while loading are a ValueError with the figures and what to try."""
    if device.type != "cuda":
        model = build_model(model_config, dtype=dtype, device=device, plan=plan)
        load_weights(model, model_dir)
        return model
    weights = model_bytes(build_model(model_config, dtype=dtype, device="meta"))
    free, total = torch.cuda.mem_get_info(device)
    dtype_name = str(dtype).removeprefix("torch.")
    if weights > free:
        raise ValueError(weights_do_not_fit(weights, total, free, dtype_name))
    try:
        model = build_model(model_config, dtype=dtype, device=device, plan=plan)
        load_weights(model, model_dir)
    except torch.cuda.OutOfMemoryError as exc:
        raise ValueError(weights_do_not_fit(weights, total, free, dtype_name)) from exc
    return model


def largest_prefill_step(max_prefill_tokens: int, chunk: int | None, context_len: int, max_running: int) -> list[int]:
    """Extend lengths of the largest EXTEND step the scheduler can issue, as sequences.

    Its tokens: one chunk (``min(chunk, max_prefill_tokens)``) with chunked prefill; without,
    ``max_prefill_tokens``, or a whole prompt of up to ``context_len`` tokens when it is the
    step's first. They go in as few sequences as positions allow (each at most ``context_len``):
    activations grow with the tokens, not the sequences, and one long sequence is the largest
    case for an attention backend's per-sequence work. More sequences only add rows of logits
    ([B, vocab]), which the sampling reserve (SAMPLING_TEMPORARIES rows per running request)
    covers.
    """
    tokens = min(chunk, max_prefill_tokens) if chunk is not None else max(max_prefill_tokens, context_len)
    tokens = min(tokens, max_running * context_len)
    full, rest = divmod(tokens, context_len)
    return [context_len] * full + ([rest] if rest else [])


class StepProfile(NamedTuple):
    """Device memory (bytes) of the profiling forwards."""

    activation_peak: int  # growth of the largest EXTEND step, with the attention backend's workspace
    decode_peak: int  # growth of one eager DECODE step of the largest graph batch (0: no graphs)
    graph_state: int  # what the backend's init_cuda_graph_state allocated (0: no graphs)


def profile_step_memory(
    model: CausalLM,
    model_config: ModelConfig,
    backends: AttentionBackends,
    dtype: torch.dtype,
    device: torch.device,
    *,
    extend_lens: list[int],
    context_len: int,
    decode_bs: int = 0,
) -> StepProfile:
    """Run the largest prefill step (``extend_lens``, from empty prefixes), and with ``decode_bs``
    a decode step of that many sequences, on the real attention backend over a temporary pool
    just large enough; measure the growth of ``torch.cuda.max_memory_allocated`` of each. This
    also builds the JIT kernels of both paths before the server reports ready. Everything it
    allocates is freed when it returns (call ``torch.cuda.empty_cache`` to give it back)."""
    num_tokens = sum(extend_lens)
    pool = KVPool.for_model(model_config, num_slots=max(num_tokens, decode_bs) + 1, dtype=dtype, device=device)
    table = ReqToTokenPool(max(len(extend_lens), decode_bs), context_len, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    runner = make_runner(model, model_config, pool, table, device, backends)
    slots = torch.arange(1, num_tokens + 1, dtype=torch.int64, device=device)  # slot 0: the dummy
    rows = list(range(len(extend_lens)))
    runner.forward_eager(ForwardMode.EXTEND, rows, [0] * len(rows), extend_lens, [0] * num_tokens, slots)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - base
    decode_peak = graph_state = 0
    if decode_bs:
        before = torch.cuda.memory_allocated(device)
        runner.decode_backend.init_cuda_graph_state(decode_bs)  # type: ignore[attr-defined]
        graph_state = torch.cuda.memory_allocated(device) - before
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        rows = list(range(decode_bs))
        slots = torch.arange(1, decode_bs + 1, dtype=torch.int64, device=device)
        runner.forward_eager(ForwardMode.DECODE, rows, [0] * decode_bs, [1] * decode_bs, [0] * decode_bs, slots)
        torch.cuda.synchronize(device)
        decode_peak = torch.cuda.max_memory_allocated(device) - base
    return StepProfile(activation_peak, decode_peak, graph_state)


@dataclass(frozen=True)
class PoolSizing:
    """The KV pool's size on CUDA and the figures it came from (bytes)."""

    max_total_tokens: int
    weights: int
    activation_peak: int
    sampling_reserve: int
    prefill_tokens: int


def size_kv_pool_on_cuda(
    config: EngineConfig,
    model: CausalLM,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    backends: AttentionBackends,
    *,
    context_len: int,
    chunk: int | None,
    max_running: int,
) -> PoolSizing:
    """Profile, then size the pool (memory_budget.kv_pool_tokens) or check --max-total-tokens.
    ``max_running`` is an upper bound of the running-request limit (it may still shrink to the
    pool's size): the request table, the sampling workspace and the graphs are reserved for it."""
    weights = model_bytes(model)
    extend_lens = largest_prefill_step(config.max_prefill_tokens, chunk, context_len, max_running)
    graph_sizes = cuda_graph_batch_sizes(config, device, backends.decode, max_running)
    decode_bs = max(graph_sizes, default=0)
    prefill_tokens = sum(extend_lens)
    try:
        profile = profile_step_memory(
            model, model_config, backends, dtype, device,
            extend_lens=extend_lens, context_len=context_len, decode_bs=decode_bs,
        )
    except torch.cuda.OutOfMemoryError as exc:
        gc.collect()
        torch.cuda.empty_cache()
        raise ValueError(
            f"a profiling forward of the largest prefill step ({prefill_tokens} tokens) ran out of device memory "
            f"after loading the weights ({gib(weights):.2f} GiB; {_device_memory(device)}): lower "
            "--chunked-prefill-size or --max-prefill-tokens (without chunked prefill: --context-length), "
            "or use a device with more memory"
        ) from exc
    gc.collect()
    torch.cuda.empty_cache()  # the temporary pool and activations go back to the device
    free, total = torch.cuda.mem_get_info(device)
    reserve = reserve_bytes(
        vocab_size=model_config.vocab_size, max_running=max_running, context_len=context_len,
        graph_sizes=len(graph_sizes), graph_max_bs=decode_bs, graph_step_peak=profile.decode_peak,
        graph_state=profile.graph_state,
    )
    per_token = kv_bytes_per_token(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, dtype)
    tokens = kv_pool_tokens(
        total=total, used=total - free, activation_peak=profile.activation_peak, reserve=reserve.total,
        bytes_per_token=per_token + INDEX_BYTES_PER_TOKEN, mem_fraction_static=config.mem_fraction_static,
        context_len=context_len, page_size=config.page_size, max_total_tokens=config.max_total_tokens,
        weights=weights,
    )
    return PoolSizing(tokens, weights, profile.activation_peak, reserve.sampling, prefill_tokens)


def build_scheduler(config: EngineConfig, tokenizer: Tokenizer | None = None) -> BuiltEngine:
    """Load the model and build the scheduler over it. Raises ValueError naming the flag or
    file at fault (also when device memory is short: see the module docstring),
    FileNotFoundError for a missing checkpoint file."""
    from app.engine.attention.flashinfer_backend import flashinfer_available  # imports flashinfer only if asked

    config.validate()
    model_dir = Path(config.model_path)
    model_config = ModelConfig.from_pretrained(model_dir)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, model_config, device)
    plan = resolve_kernel_plan(
        config.options, device=device, model_config=model_config,
        attention_backend=config.attention_backend, decode_attention_backend=config.decode_attention_backend,
        disable_cuda_graph=config.disable_cuda_graph, disable_overlap_schedule=config.disable_overlap_schedule,
        flashinfer_ok=lambda: flashinfer_available(device, dtype, model_config.head_dim),
    )
    backends = plan.attention
    context_len = config.context_length or model_config.max_context_len
    if context_len > model_config.max_context_len:
        raise ValueError(
            f"--context-length {context_len} exceeds the model's {model_config.max_context_len} "
            f"(max_position_embeddings in {model_dir / 'config.json'})"
        )
    if config.chunked_prefill_size == -1:
        chunk: int | None = None
    else:
        chunk = config.chunked_prefill_size or (GPU_DEFAULT_CHUNKED_PREFILL if device.type == "cuda" else CPU_DEFAULT_CHUNKED_PREFILL)
    model = load_model_on_device(model_config, model_dir, dtype, device, plan)
    sizing: PoolSizing | None = None
    if device.type == "cuda":
        sizing = size_kv_pool_on_cuda(
            config, model, model_config, dtype, device, backends, context_len=context_len, chunk=chunk,
            max_running=config.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
        )
        max_total_tokens = sizing.max_total_tokens
    else:
        max_total_tokens = config.max_total_tokens or CPU_DEFAULT_MAX_TOTAL_TOKENS
    max_running = config.max_running_requests or min(DEFAULT_MAX_RUNNING_REQUESTS, max_total_tokens)

    max_total_tokens -= max_total_tokens % config.page_size  # whole pages only
    if max_total_tokens < 2 * config.page_size:
        raise ValueError(f"--max-total-tokens must hold at least two pages of --page-size {config.page_size}")
    per_token = kv_bytes_per_token(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, dtype)
    try:
        allocator = SlotAllocator(max_total_tokens, page_size=config.page_size, device=device, fused_pop=plan.fused_kv_alloc)
        pool = KVPool.for_model(model_config, num_slots=allocator.num_slots, dtype=dtype, device=device)
        table = ReqToTokenPool(max_running, context_len, device=device)
    except torch.cuda.OutOfMemoryError as exc:
        raise ValueError(
            f"allocating the KV cache ({max_total_tokens} tokens, "
            f"{gib((max_total_tokens + config.page_size) * per_token):.2f} GiB) and the request table ran out of "
            f"device memory ({_device_memory(device)} after the failure): lower --mem-fraction-static or "
            "--max-total-tokens"
        ) from exc
    cache = RadixCache(allocator.free, page_size=config.page_size, disabled=config.disable_radix_cache, device=device)
    memory = KVMemory(allocator, pool, table, cache)
    runner = make_runner(model, model_config, pool, table, device, backends, plan)
    graph_sizes = cuda_graph_batch_sizes(config, device, backends.decode, max_running)
    prefill_counts = prefill_graph_tokens(plan.prefill_graph_max_tokens) if graph_sizes else ()
    capture_started = time.monotonic()
    graph_bytes = 0
    if graph_sizes:
        free_before, _ = torch.cuda.mem_get_info(device)
        try:
            # warm-up before the server reports ready
            runner.capture_cuda_graphs(graph_sizes, advance_inputs=plan.graph_inputs_advance)
            if prefill_counts:
                runner.capture_prefill_graphs(prefill_counts)
        except torch.cuda.OutOfMemoryError as exc:
            raise ValueError(
                f"capturing CUDA graphs of decode batches up to {max(graph_sizes)}"
                f"{f' and prefills up to {max(prefill_counts)} tokens' if prefill_counts else ''} ran out of device memory "
                f"({_device_memory(device)} after the failure; the KV cache holds {max_total_tokens} tokens): "
                "lower --cuda-graph-max-bs, --mem-fraction-static or --max-total-tokens, or --disable-cuda-graph"
            ) from exc
        torch.cuda.empty_cache()  # the warm-up runs' blocks: only the graphs' own pool stays
        graph_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])
    capture_s = time.monotonic() - capture_started
    if sizing is not None:
        check_step_headroom(
            free=torch.cuda.mem_get_info(device)[0], activation_peak=sizing.activation_peak,
            sampling=sizing.sampling_reserve, prefill_tokens=sizing.prefill_tokens,
        )
    eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else checkpoint_eos_ids(model_dir)
    limits = SchedulerLimits(context_len, config.max_prefill_tokens, chunk, config.stream_interval,
                             allow_auto_truncate=config.allow_auto_truncate,
                             schedule_conservativeness=config.schedule_conservativeness,
                             schedule_policy=config.schedule_policy,
                             max_queued_requests=config.max_queued_requests,
                             priority_scheduling=config.enable_priority_scheduling,
                             low_priority_values_first=config.schedule_low_priority_values_first,
                             preemption_threshold=config.priority_scheduling_preemption_threshold,
                             host_kv_pool_tokens=(config.host_kv_pool_tokens or max_total_tokens)
                             if config.enable_kv_swap else 0)
    scheduler = Scheduler(
        runner, memory, limits, vocab_size=model_config.vocab_size, eos_token_ids=eos_token_ids,
        overlap=plan.overlap_schedule, copy_stream=plan.copy_stream,
        waiting_timeout=config.waiting_timeout, request_timeout=config.request_timeout,
    )
    return BuiltEngine(
        scheduler=scheduler, model_config=model_config, device=device, dtype=dtype, plan=plan, context_len=context_len,
        max_total_tokens=max_total_tokens, max_running_requests=max_running, chunked_prefill_size=chunk,
        cuda_graph_batch_sizes=graph_sizes, prefill_graph_tokens=prefill_counts,
        cuda_graph_capture_s=round(capture_s, 2), decode_tiling=runner.decode_backend.decode_tiling(),
        memory=MemoryFigures(
            weights_gib=round(gib(model_bytes(model)), 3),
            activation_peak_gib=round(gib(sizing.activation_peak), 3) if sizing is not None else 0.0,
            kv_pool_gib=round(gib(allocator.num_slots * per_token), 3),
            cuda_graph_gib=round(gib(graph_bytes), 3),
        ),
    )
