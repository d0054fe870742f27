"""The engine's configuration: its command-line flags, declared once here (app/flags.py derives
the server's and the tools' parsers from these fields), checked once at start, never changed.

The kernels that run are not flags of their own: ``--kernel-options`` overrides the kernel plan
(app/engine/kernel_plan.py), which the builder resolves from the device and the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.kernel_plan import KernelOptions
from app.flags import flag
from app.ipc.messages import MAX_INT32, MAX_TIMEOUT_S

DEFAULT_MAX_RUNNING_REQUESTS = 256  # without --max-running-requests (lower when the KV pool holds fewer tokens)

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
SCHEDULE_POLICIES = ("fcfs", "lpm")  # first come first served; longest prefix match (scheduling/waiting.py)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What the engine needs to know; every field but ``model_path`` is the flag of its name.

    ``None`` means "derive it": from the model (context length), from memory (pool size), or
    from the pool (running requests). :func:`EngineConfig.validate` raises ValueError naming the
    flag for anything out of range.
    """

    model_path: str
    dtype: str = flag("auto", "weights and KV cache (auto: the checkpoint's on a GPU, float32 on a CPU, where half "
                              "precision is slow)", choices=DTYPES)
    device: str = flag("auto", "auto: cuda when available", choices=DEVICES)
    context_length: int | None = flag(None, "longest prompt + output (default: the model's)")
    max_total_tokens: int | None = flag(None, "KV cache size in tokens (default: on a GPU what "
                                              "--mem-fraction-static leaves, on a CPU 32768)")
    mem_fraction_static: float = flag(0.85, "on a GPU: share of its memory for the weights, KV cache, activations "
                                            "and CUDA graphs (the KV cache gets what a profiling run of the largest "
                                            "prefill leaves)")
    page_size: int = flag(1, "KV slots per page: allocation and prefix caching in whole pages")
    max_running_requests: int | None = flag(None, "requests decoding at once (default: 256, or the KV pool if "
                                                  "smaller)")
    max_prefill_tokens: int = flag(16384, "prompt tokens admitted per prefill step")
    chunked_prefill_size: int | None = flag(None, "prompt tokens per step when a prompt is split (default: 2048 on "
                                                  "a CPU, 8192 on a GPU; -1: never split)")
    disable_radix_cache: bool = flag(False, "no prefix reuse between requests")
    max_queued_requests: int | None = flag(None, "requests waiting in the scheduler's queue at most: one more is "
                                                 "refused at once with 503 and Retry-After (default: unbounded)")
    allow_auto_truncate: bool = flag(False, "serve a request whose prompt + max_tokens exceeds the context by cutting "
                                            "its output at the context (finish reason length) instead of refusing it "
                                            "with 400")
    enable_priority_scheduling: bool = flag(False, "order the waiting queue by each request's integer priority, "
                                                   "then arrival; a full queue lets a more important arrival evict "
                                                   "the least important queued request (503); without it a request "
                                                   "that gives a priority is refused (400)")
    schedule_low_priority_values_first: bool = flag(False, "with --enable-priority-scheduling: smaller priority "
                                                           "values are more important (default: larger values)")
    default_priority_value: int = flag(0, "the priority of a request that gives none (with "
                                          "--enable-priority-scheduling)")
    priority_scheduling_preemption_threshold: int = flag(10, "with --enable-priority-scheduling: a waiting request "
                                                             "preempts (retracts) a running one only when their "
                                                             "priorities differ by more than this")
    attention_backend: str = flag(
        "auto", "auto: on CUDA triton at head size <= 64 with grouped-query heads (its prefill packs them), else "
                "flashinfer in bf16/fp16 with head size 64/128/256, else triton; torch off CUDA",
        choices=ATTENTION_BACKENDS)
    decode_attention_backend: str | None = flag(
        None, "the backend of decode steps and their CUDA graphs, when it should differ from --attention-backend "
              "(which then serves prefill only) (default: the same as --attention-backend, except triton on CUDA "
              "when that is auto: its decode kernels are the fastest at small batches)", choices=ATTENTION_BACKENDS)
    schedule_policy: str = flag("fcfs", "the order waiting requests are admitted in (after priority): fcfs, arrival; "
                                        "lpm, the longest prefix already in the prefix cache first (fcfs when over "
                                        "128 wait)", choices=SCHEDULE_POLICIES)
    schedule_conservativeness: float = flag(
        1.0, "scales the share of running requests' remaining output kept free when admitting new ones (it starts "
             "at 0.4 x this, falls to 0.1 x this over 600 steps, and starts again after a retraction): higher admits "
             "fewer and retracts less")
    waiting_timeout: float | None = flag(None, "seconds a request may wait in the queue before its prefill starts; "
                                               "past it the request is aborted with 503 (default: no limit; a "
                                               "request's own waiting_timeout may be shorter)", metavar="SECONDS")
    request_timeout: float | None = flag(None, "seconds from a request's arrival to its end; past it the request is "
                                               "aborted with 503, also mid-stream (default: no limit; a request's own "
                                               "timeout may be shorter)", metavar="SECONDS")
    enable_kv_swap: bool = flag(False, "when decode runs out of KV (or a request is preempted), copy the victim's "
                                       "KV to a host-memory pool and back when it resumes instead of recomputing its "
                                       "prompt and output; a victim that does not fit the host pool is recomputed")
    host_kv_pool_tokens: int | None = flag(None, "with --enable-kv-swap: tokens of KV the host pool holds (pinned "
                                                 "memory on CUDA, taken as victims are swapped out) (default: the "
                                                 "device KV cache's size, --max-total-tokens)")
    stream_interval: int = flag(1, "tokens per streamed chunk (the first token is sent at once)")
    cuda_graph_max_bs: int | None = flag(None, "largest decode batch replayed from a CUDA graph (default: "
                                               "--max-running-requests, at most 256)")
    disable_cuda_graph: bool = flag(False, "run every decode step eagerly (graphs are used on CUDA with the triton "
                                           "and flashinfer backends)")
    disable_overlap_schedule: bool = flag(False, "read each decode step's tokens before queueing the next (the "
                                                 "overlap is on by default with CUDA)")
    kernel_options: str = flag(
        "", "override the kernel plan: key=value,... (may be repeated; a value's own list joins its items with "
            "'+'); keys and values in docs/performance.md, 'Kernel options'; the plan in use is in /server_info",
        metavar="KEY=VALUE,...", repeat=True)

    @property
    def options(self) -> KernelOptions:
        """``kernel_options`` parsed (ValueError listing the valid keys or values)."""
        return KernelOptions.parse(self.kernel_options)

    def validate(self) -> None:
        def fail(flag: str, why: str, value: object) -> None:
            raise ValueError(f"--{flag.replace('_', '-')} {why}, got {value!r}")

        if self.dtype not in DTYPES:
            fail("dtype", f"must be one of {', '.join(DTYPES)}", self.dtype)
        if self.device not in DEVICES:
            fail("device", f"must be one of {', '.join(DEVICES)}", self.device)
        if self.attention_backend not in ATTENTION_BACKENDS:
            fail("attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)}", self.attention_backend)
        if self.decode_attention_backend is not None and self.decode_attention_backend not in ATTENTION_BACKENDS:
            fail("decode_attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)}",
                 self.decode_attention_backend)
        if self.context_length is not None and self.context_length < 2:
            fail("context_length", "must be at least 2", self.context_length)
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            fail("max_total_tokens", "must be at least 2", self.max_total_tokens)
        if not 0.0 < self.mem_fraction_static < 1.0:
            fail("mem_fraction_static", "must be in (0, 1)", self.mem_fraction_static)
        if not 1 <= self.page_size <= 256:
            fail("page_size", "must be in [1, 256]", self.page_size)
        if self.max_running_requests is not None and self.max_running_requests < 1:
            fail("max_running_requests", "must be at least 1", self.max_running_requests)
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            fail("max_queued_requests", "must be at least 1", self.max_queued_requests)
        if self.priority_scheduling_preemption_threshold < 0:
            fail("priority_scheduling_preemption_threshold", "must be at least 0",
                 self.priority_scheduling_preemption_threshold)
        if not -MAX_INT32 - 1 <= self.default_priority_value <= MAX_INT32:
            fail("default_priority_value", f"must be in [{-MAX_INT32 - 1}, {MAX_INT32}]", self.default_priority_value)
        if self.max_prefill_tokens < 1:
            fail("max_prefill_tokens", "must be at least 1", self.max_prefill_tokens)
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            fail("chunked_prefill_size", "must be -1 (disabled) or at least 1", self.chunked_prefill_size)
        for name in ("waiting_timeout", "request_timeout"):
            seconds = getattr(self, name)
            if seconds is not None and not 0.0 < seconds <= MAX_TIMEOUT_S:
                fail(name, f"must be in (0, {MAX_TIMEOUT_S:g}] seconds", seconds)
        if self.host_kv_pool_tokens is not None and self.host_kv_pool_tokens < 1:
            fail("host_kv_pool_tokens", "must be at least 1", self.host_kv_pool_tokens)
        if self.stream_interval < 1:
            fail("stream_interval", "must be at least 1", self.stream_interval)
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            fail("cuda_graph_max_bs", "must be at least 1 (--disable-cuda-graph turns graphs off)", self.cuda_graph_max_bs)
        if self.schedule_policy not in SCHEDULE_POLICIES:
            fail("schedule_policy", f"must be one of {', '.join(SCHEDULE_POLICIES)}", self.schedule_policy)
        if not 0.0 <= self.schedule_conservativeness <= 10.0:
            fail("schedule_conservativeness", "must be in [0, 10]", self.schedule_conservativeness)
        self.options  # noqa: B018 - parsing is the check
