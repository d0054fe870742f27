"""Command-line arguments of ``python -m app serve``: parsed once, validated, frozen.

Flag names and defaults follow SGLang's where it has the same flag, since its users know them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, fields
from collections.abc import Mapping
from typing import Any

from app.engine.config import (
    ATTENTION_BACKENDS,
    DEFAULT_PDL_MODE,
    DEVICES,
    DTYPES,
    MLP_EARLY_TRIGGER_MAX_HIDDEN,
    PLAIN_MLP_PDL_MODE,
    EngineConfig,
)
from app.http.asgi import BODY_READ_TIMEOUT_S
from app.http.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, ApiKeys, Secret
from app.http.server import MAX_CONNECTIONS
from app.observability.logs import LEVELS


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    model_path: str | None = None  # None: the embedded tiny model
    served_model_name: str | None = None  # default: the model directory's name
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Secret | None = None  # --api-key or $APP_API_KEY (auth.py has who may call what)
    admin_api_key: Secret | None = None  # --admin-api-key or $APP_ADMIN_API_KEY
    http_read_timeout: float = BODY_READ_TIMEOUT_S  # seconds for a request's body, once its headers are in
    max_connections: int = MAX_CONNECTIONS  # open HTTP connections; more are refused at once with 503
    log_level: str = "info"
    log_json: bool = False
    crash_dump_folder: str | None = None
    startup_timeout: float = 300.0  # seconds for every actor to report ready
    shutdown_timeout: float = 5.0  # seconds for an actor to stop after SIGTERM, before SIGKILL
    scheduler_threads: int | None = None  # torch threads in the scheduler; default: our cores less one
    # Engine flags (see EngineConfig).
    dtype: str = "auto"
    device: str = "auto"
    context_length: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    page_size: int = 1
    max_running_requests: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None
    disable_radix_cache: bool = False
    attention_backend: str = "auto"
    decode_attention_backend: str | None = None  # None: --attention-backend's (triton after auto on CUDA)
    stream_interval: int = 1
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    prefill_graph_max_tokens: int | None = None  # None: EngineConfig's DEFAULT_PREFILL_GRAPH_MAX_TOKENS where they run
    fused_kernels: bool | None = None  # None: on with a CUDA device
    triton_gemv: bool | None = None  # None: on with a CUDA device
    fused_decode: bool | None = None  # None: on when --fused-kernels and --triton-gemv are (see EngineConfig)
    gemv_pdl: bool | None = None  # None: on where it can be (see EngineConfig)
    gemv_pdl_mode: str = "auto"
    fused_qkv_rotary: bool | None = None  # None: follows --fused-decode (see EngineConfig)
    fused_silu_out: bool | None = None  # None: follows --fused-decode (see EngineConfig)
    fused_mlp: bool | None = None  # None: follows --fused-decode (see EngineConfig)
    fused_mlp_config: str = ""  # "": the kernel's tuned launch (see EngineConfig)
    gemv_rows: str | None = None  # None: DEFAULT_GEMV_ROWS with --triton-gemv (see EngineConfig)
    gemv_rows_config: str = ""  # "": rows_config's tilings (see EngineConfig)
    gemv_config: str = ""  # "": default_config's tilings (see EngineConfig)
    fused_greedy: bool | None = None  # None: on with CUDA (see EngineConfig)
    fused_kv_alloc: bool | None = None  # None: on with CUDA (see EngineConfig)
    graph_inputs_advance: bool | None = None  # None: on with the fused graph inputs (see EngineConfig)
    fused_split_reduce: bool | None = None  # None: off (see EngineConfig)
    overlap_schedule: bool | None = None  # None: on with CUDA (see EngineConfig)
    copy_stream: bool | None = None  # None: on with CUDA for steps of at most 48 rows (see EngineConfig)
    triton_attention_num_kv_splits: int | None = None  # None: 16 (see EngineConfig)
    triton_decode_min_split_len: int | None = None  # None: 64
    triton_decode_block_n: int | None = None  # None: 64 (32 above head_dim 128), 128 at mid batches
    triton_decode_num_warps: int | None = None  # None: 2 at one split a sequence of 64 keys a step, else 4
    triton_decode_num_stages: int | None = None  # None: triton's default
    triton_decode_early_v: bool | None = None  # None: V loaded after the softmax
    triton_decode_prefetch_slots: bool | None = None  # None: on CUDA, off elsewhere
    triton_decode_step_slots: bool | None = None  # None: on CUDA, off elsewhere
    triton_decode_stage2_pdl: bool | None = None  # None: on CUDA of compute capability 9.0+, off elsewhere

    def validate(self) -> None:
        """Raise ValueError naming the flag for anything out of range."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.log_level not in LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {self.log_level!r}")
        if self.startup_timeout <= 0:
            raise ValueError(f"--startup-timeout must be positive, got {self.startup_timeout}")
        if self.shutdown_timeout <= 0:
            raise ValueError(f"--shutdown-timeout must be positive, got {self.shutdown_timeout}")
        if not self.http_read_timeout > 0:
            raise ValueError(f"--http-read-timeout must be positive, got {self.http_read_timeout}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if self.scheduler_threads is not None and self.scheduler_threads < 1:
            raise ValueError(f"--scheduler-threads must be at least 1, got {self.scheduler_threads}")
        if self.model_path is not None and not os.path.isdir(self.model_path):
            raise ValueError(f"--model-path {self.model_path!r} is not a directory")
        self.engine_config(self.model_path or ".").validate()

    def engine_config(self, model_path: str) -> EngineConfig:
        names = {f.name for f in fields(EngineConfig)} - {"model_path"}
        return EngineConfig(model_path=model_path, **{k: v for k, v in asdict(self).items() if k in names})

    @property
    def keys(self) -> ApiKeys:
        return ApiKeys(self.api_key, self.admin_api_key)

    def to_dict(self) -> dict[str, Any]:
        """For /server_info and crash dumps: a key shows only whether it is set."""
        values = asdict(self)
        for name in ("api_key", "admin_api_key"):
            values[name] = None if values[name] is None else "<set>"
        return values


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Show a flag's default, unless it is None or False (its help then says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False):
            return action.help or ""
        return super()._get_help_string(action) or ""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app serve",
        description="Serve a model over HTTP (OpenAI-compatible and native routes).",
        formatter_class=_HelpWithDefaults,
    )
    d = ServerArgs()
    add = parser.add_argument
    add("--model-path", default=d.model_path, help="Hugging Face checkpoint directory (default: the embedded tiny model, whose output is gibberish)")
    add("--served-model-name", default=d.served_model_name, help="the model id clients use (default: the directory name)")
    add("--host", default=d.host, help="address HTTP listens on")
    add("--port", type=int, default=d.port, help="HTTP port (0: any free port, logged as `serving url=...`)")
    add("--api-key", default=None, help=f"require 'Authorization: Bearer <key>' on every route but /health and /metrics (prefer ${API_KEY_ENV}: a flag shows in ps)")
    add("--admin-api-key", default=None, help=f"require this key on the control routes (/abort_request, /flush_cache, the details of /server_info); without it they take --api-key (prefer ${ADMIN_API_KEY_ENV})")
    add("--http-read-timeout", type=float, default=d.http_read_timeout, help="seconds a client has to send a request's body once its headers are in; then 408 and the connection is closed")
    add("--max-connections", type=int, default=d.max_connections, help="open HTTP connections at most; one more is answered 503 and closed at once (the process's file limit is raised to fit)")
    add("--log-level", default=d.log_level, choices=LEVELS, help="lowest level logged, by every actor")
    add("--log-json", action="store_true", help="one JSON object per log line")
    add("--crash-dump-folder", default=d.crash_dump_folder, help="write a crash dump here when the server fails")
    add("--startup-timeout", type=float, default=d.startup_timeout, help="seconds for each actor to report ready")
    add("--shutdown-timeout", type=float, default=d.shutdown_timeout, help="seconds for open requests and actors to finish on shutdown, before SIGKILL")
    add("--scheduler-threads", type=int, default=d.scheduler_threads, help="torch threads in the scheduler (default: the cores available, less one for the other actors)")
    add("--dtype", default=d.dtype, choices=DTYPES, help="weights and KV cache (auto: float32 on a CPU, the checkpoint's on a GPU)")
    add("--device", default=d.device, choices=DEVICES, help="auto: cuda when available")
    add("--context-length", type=int, default=d.context_length, help="longest prompt + output (default: the model's)")
    add("--max-total-tokens", type=int, default=d.max_total_tokens, help="KV cache size in tokens")
    add("--mem-fraction-static", type=float, default=d.mem_fraction_static, help="on a GPU: share of its memory for the weights, KV cache, activations and CUDA graphs (the KV cache gets what a profiling run of the largest prefill leaves)")
    add("--page-size", type=int, default=d.page_size, help="KV slots per page: allocation and prefix caching in whole pages")
    add("--max-running-requests", type=int, default=d.max_running_requests, help="requests decoding at once (default: 256, or the KV pool if smaller)")
    add("--max-prefill-tokens", type=int, default=d.max_prefill_tokens, help="prompt tokens admitted per prefill step")
    add("--chunked-prefill-size", type=int, default=d.chunked_prefill_size, help="prompt tokens per step when a prompt is split (default: 2048 on a CPU, 8192 on a GPU; -1: never split)")
    add("--disable-radix-cache", action="store_true", help="no prefix reuse between requests")
    add("--attention-backend", default=d.attention_backend, choices=ATTENTION_BACKENDS, help="auto: on CUDA triton at head size <= 64 with grouped-query heads (its prefill packs them), else flashinfer in bf16/fp16 with head size 64/128/256, else triton; torch off CUDA")
    add("--decode-attention-backend", default=d.decode_attention_backend, choices=ATTENTION_BACKENDS, help="the backend of decode steps and their CUDA graphs, when it should differ from --attention-backend (which then serves prefill only); auto resolves as for --attention-backend (default: the same as --attention-backend, except triton on CUDA when that is auto)")
    add("--stream-interval", type=int, default=d.stream_interval, help="tokens per streamed chunk (the first token is sent at once)")
    add("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs, help="largest decode batch replayed from a CUDA graph (default: --max-running-requests, at most 256)")
    add("--prefill-graph-max-tokens", type=int, default=d.prefill_graph_max_tokens, help="prefills of one sequence of up to this many new tokens replay CUDA graphs captured at 16, 32, 64, ... tokens (a short prompt's prefill is otherwise bound by the host launching its kernels); needs CUDA graphs and the triton prefill backend; 0: off (default: 512 where they can run, else off)")
    add("--disable-cuda-graph", action="store_true", help="run every decode step eagerly (graphs are used on CUDA with the triton and flashinfer backends)")
    add("--fused-kernels", action=argparse.BooleanOptionalAction, default=d.fused_kernels, help="our triton kernels for RMSNorm (+residual), rotary and SiLU-and-mul (default: on with a CUDA device, off otherwise; on a CPU only under TRITON_INTERPRET=1, for debugging)")
    add("--triton-gemv", action=argparse.BooleanOptionalAction, default=d.triton_gemv, help="our decode-shaped triton kernel for the linear layers of batch-1 decode steps instead of cuBLAS (default: on with a CUDA device)")
    add("--fused-decode", action=argparse.BooleanOptionalAction, default=d.fused_decode, help="batch-1 decode steps in fewer kernels: RMSNorm inside the next linear layer, SiLU-and-mul inside down_proj, the KV store inside rotary (triton backend); needs --fused-kernels and --triton-gemv (default: on when both are, so with CUDA)")
    add("--fused-qkv-rotary", action=argparse.BooleanOptionalAction, default=d.fused_qkv_rotary, help="with --fused-decode on the triton backend, the qkv gemv of a batch-1 step also rotates q and k and stores K and V, one kernel fewer per layer (not with a q/k norm; default: on with --fused-decode)")
    add("--fused-kv-alloc", action=argparse.BooleanOptionalAction, default=d.fused_kv_alloc, help="a step's KV slots come off the allocator's free list (popped, marked taken, expanded from pages) in one triton kernel instead of two or three of torch's (needs CUDA or TRITON_INTERPRET=1; docs/gpu_notes.md variant 66; default: on with CUDA)")
    add("--graph-inputs-advance", action=argparse.BooleanOptionalAction, default=d.graph_inputs_advance, help="a decode step of the same requests as the last, each one token further, moves its CUDA graph's positions and lengths on by one on the device instead of copying them from the host (docs/gpu_notes.md variant 68; default: on with CUDA graphs)")
    add("--fused-greedy", action=argparse.BooleanOptionalAction, default=d.fused_greedy, help="greedy decode steps in fewer kernels: the sampler records an all-greedy step in one triton kernel, and a batch-1 step's output projection (with --fused-decode) folds its argmax into a few keys instead of a pass over the vocabulary (needs CUDA or TRITON_INTERPRET=1; default: on with CUDA)")
    add("--fused-split-reduce", action=argparse.BooleanOptionalAction, default=d.fused_split_reduce, help="the triton backend's decode attention merges its KV splits in its own last program instead of a second kernel: one kernel per layer (needs triton for decode steps: --attention-backend or --decode-attention-backend; default: off: slower on the H200 so far)")
    add("--gemv-pdl", action=argparse.BooleanOptionalAction, default=d.gemv_pdl, help="launch the batch-1 gemv kernels as programmatic dependents: each starts while the kernel before it finishes (CUDA compute capability 9.0+; needs --triton-gemv; default: on where it can be)")
    add("--gemv-pdl-mode", default=d.gemv_pdl_mode, help=f"with --gemv-pdl: preload (each gemv loads its first weight tile, then waits for the kernel before it, then lets the next one start), wait (no tile before the wait), late (the next kernel only after its K loop) or wait-late (neither), for every gemv of a batch-1 step, or per gemv as role=mode pairs, (roles not named: off), or auto: the tuned modes of the MLP path in use, {DEFAULT_PDL_MODE} with --fused-mlp up to hidden size {MLP_EARLY_TRIGGER_MAX_HIDDEN}, else {PLAIN_MLP_PDL_MODE}")
    add("--fused-mlp", action=argparse.BooleanOptionalAction, default=d.fused_mlp, help="a batch-1 step runs each MLP (its norm, gate_up, SiLU and down) as one persistent kernel that sums down's output with float32 atomics, over down's weight stored transposed (no more memory; results equal the two-kernel path within float32 rounding, not bit for bit, and differ from run to run in the last bits; H200 batch 1 +1.5 to +4.2 %% for the 1B, +2.5 %% for the 8B, docs/gpu_notes.md variant 70; --no-fused-mlp keeps batch-1 results bit-stable; default: on with --fused-decode)")
    add("--fused-mlp-config", default=d.fused_mlp_config, help="the batch-1 MLP kernel's launch where it should differ from its tuned one, as name=value pairs separated by commas: block_n (weight rows a tile, half gate and half up), num_warps, num_stages, programs_per_sm, programs, early_tile (0 or 1: each program loads its first tile before its prologue); for A/B runs (docs/gpu_notes.md, lead 1); default: none")
    add("--fused-silu-out", action=argparse.BooleanOptionalAction, default=d.fused_silu_out, help="with --fused-decode, the gate_up gemv of a batch-1 step stores silu(gate) * up, so the down projection is a plain gemv (default: on with --fused-decode)")
    add("--gemv-rows", default=d.gemv_rows, help="the batch-1 gemv kernels that run persistent (a few programs an SM, each computing its input once and walking row tiles): off, all, or roles separated by commas (qkv, o, gate_up, down, lm_head); these launch without PDL; needs --triton-gemv; default: gate_up,lm_head with --triton-gemv for hidden sizes up to 4096, where measured)")
    add("--gemv-rows-config", default=d.gemv_rows_config, help="the persistent gemv kernels' launches where they should differ from their tiling, by role: role:name=value,... separated by ';' (roles qkv, o, gate_up, down, lm_head, each running persistent; names block_n, num_warps, num_stages, programs_per_sm), e.g. lm_head:programs_per_sm=1,num_warps=8,num_stages=4; for A/B runs (docs/gpu_notes.md, lead 1); default: none")
    add("--gemv-config", default=d.gemv_config, help="the row-block gemv kernels' launches (the batch-1 roles that do not run persistent) where they should differ from their default tiling, by role: role:name=value,... separated by ';' (roles qkv, o, gate_up, down, lm_head; names block_n, block_k, num_warps, num_stages), e.g. qkv:num_stages=2; for A/B runs (docs/gpu_notes.md, lead 1); default: none")
    add("--overlap-schedule", action=argparse.BooleanOptionalAction, default=d.overlap_schedule, help="queue decode step N+1 before reading step N's tokens, so the host schedules while the GPU runs (default: on with CUDA, off on a CPU)")
    add("--disable-overlap-schedule", dest="overlap_schedule", action="store_false", help="the same as --no-overlap-schedule (SGLang's spelling)")
    add("--copy-stream", action=argparse.BooleanOptionalAction, default=d.copy_stream, help="copy each step's sampled tokens to the host on a side stream, so that the next step's kernels do not queue behind the copy engine (needs CUDA; default: on with CUDA for decode steps of at most 48 rows, and prefill steps that sample at most 48 (faster at 1 to 48 sequences, slower at 256 on the H200); --copy-stream: every step)")
    add("--triton-attention-num-kv-splits", type=int, default=d.triton_attention_num_kv_splits, help="the triton decode attention's most KV splits a sequence (1: one kernel a layer, no merging stage; needs triton for decode steps; default: 16, fewer where the batch fills the GPU)")
    add("--triton-decode-min-split-len", type=int, default=d.triton_decode_min_split_len, help="the triton decode attention's tokens a split at least (a sequence gets one split per this many tokens of context, up to the split cap; default: 64)")
    add("--triton-decode-block-n", type=int, default=d.triton_decode_block_n, help="keys a step of the triton decode attention's loop at every batch size (a power of two from 16 to 256; default: 64, 32 above head_dim 128; on CUDA up to head_dim 64, 128 where each sequence gets at most two splits and the batch's (sequence, kv head) pairs are at most four an SM)")
    add("--triton-decode-num-warps", type=int, default=d.triton_decode_num_warps, help="warps a program of the triton decode attention at every batch size (1, 2, 4, 8 or 16; default: 2 where each sequence gets one split walked 64 keys a step, else 4)")
    add("--triton-decode-num-stages", type=int, default=d.triton_decode_num_stages, help="software-pipelining depth of the triton decode attention's key loop (1-8; default: triton's)")
    add("--triton-decode-early-v", action=argparse.BooleanOptionalAction, default=d.triton_decode_early_v, help="the triton decode attention loads each V block beside its K block (more bytes in flight, more registers; default: after the softmax)")
    add("--triton-decode-prefetch-slots", action=argparse.BooleanOptionalAction, default=d.triton_decode_prefetch_slots, help="each key block of the triton decode attention loads the next block's KV slots, so that a block's K/V loads need not wait for its slots' (docs/gpu_notes.md variant 63: +21 %% at 4,096 keys; default: on CUDA, off elsewhere)")
    add("--triton-decode-step-slots", action=argparse.BooleanOptionalAction, default=d.triton_decode_step_slots, help="decode steps of up to 8 sequences: the first layer's triton decode attention records each split's KV slots, the later layers read them there, one memory round trip fewer before their K/V loads (docs/gpu_notes.md variant 83: +0.6 to +1.5 %% at batch 1; default: on CUDA, off elsewhere)")
    add("--triton-decode-stage2-pdl", action=argparse.BooleanOptionalAction, default=d.triton_decode_stage2_pdl, help="the triton decode attention's stage 2 launches as a programmatic dependent of stage 1 (CUDA, compute capability 9.0 or newer; docs/gpu_notes.md variant 84; default: on where it can be)")
    return parser


def _key(flag_value: str | None, env_name: str, flag: str, environ: Mapping[str, str]) -> Secret | None:
    """The key from its flag, else from its environment variable (an empty one: unset)."""
    value = flag_value if flag_value is not None else environ.get(env_name) or None
    return None if value is None else Secret(value, name=f"{flag} (or ${env_name})")


def parse_server_args(argv: list[str], environ: Mapping[str, str] | None = None) -> ServerArgs:
    """Parse and validate; argparse exits with code 2 on a malformed flag, ValueError otherwise.
    The keys come from their flags or from ``environ`` (default: this process's environment)."""
    environ = os.environ if environ is None else environ
    values = vars(_parser().parse_args(argv))
    values["api_key"] = _key(values["api_key"], API_KEY_ENV, "--api-key", environ)
    values["admin_api_key"] = _key(values["admin_api_key"], ADMIN_API_KEY_ENV, "--admin-api-key", environ)
    args = ServerArgs(**values)
    args.validate()
    return args
