"""Command-line arguments of ``python -m app serve``: parsed once, validated, frozen.

Flag names and defaults follow SGLang's where it has the same flag, since its users know them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from app.engine.config import ATTENTION_BACKENDS, DEVICES, DTYPES, EngineConfig
from app.observability.logs import LEVELS


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    model_path: str | None = None  # None: the embedded tiny model
    served_model_name: str | None = None  # default: the model directory's name
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
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
    stream_interval: int = 1
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    fused_kernels: bool = False

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
        if self.scheduler_threads is not None and self.scheduler_threads < 1:
            raise ValueError(f"--scheduler-threads must be at least 1, got {self.scheduler_threads}")
        if self.model_path is not None and not os.path.isdir(self.model_path):
            raise ValueError(f"--model-path {self.model_path!r} is not a directory")
        self.engine_config(self.model_path or ".").validate()

    def engine_config(self, model_path: str) -> EngineConfig:
        names = {f.name for f in fields(EngineConfig)} - {"model_path"}
        return EngineConfig(model_path=model_path, **{k: v for k, v in asdict(self).items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        """For /server_info and crash dumps; the API key is never shown."""
        values = asdict(self)
        if values["api_key"] is not None:
            values["api_key"] = "<set>"
        return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app serve", description="Serve a model over HTTP.")
    d = ServerArgs()
    add = parser.add_argument
    add("--model-path", default=d.model_path, help="Hugging Face checkpoint directory (default: the embedded tiny model, whose output is gibberish)")
    add("--served-model-name", default=d.served_model_name, help="the model id clients use (default: the directory name)")
    add("--host", default=d.host)
    add("--port", type=int, default=d.port)
    add("--api-key", default=d.api_key, help="require 'Authorization: Bearer <key>' on every API route")
    add("--log-level", default=d.log_level, choices=LEVELS)
    add("--log-json", action="store_true", help="one JSON object per log line")
    add("--crash-dump-folder", default=d.crash_dump_folder, help="write a crash dump here when the server fails")
    add("--startup-timeout", type=float, default=d.startup_timeout)
    add("--shutdown-timeout", type=float, default=d.shutdown_timeout)
    add("--scheduler-threads", type=int, default=d.scheduler_threads, help="torch threads in the scheduler (default: the cores available, less one for the other actors)")
    add("--dtype", default=d.dtype, choices=DTYPES)
    add("--device", default=d.device, choices=DEVICES)
    add("--context-length", type=int, default=d.context_length)
    add("--max-total-tokens", type=int, default=d.max_total_tokens, help="KV cache size in tokens")
    add("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    add("--page-size", type=int, default=d.page_size)
    add("--max-running-requests", type=int, default=d.max_running_requests)
    add("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    add("--chunked-prefill-size", type=int, default=d.chunked_prefill_size, help="-1 disables chunked prefill")
    add("--disable-radix-cache", action="store_true")
    add("--attention-backend", default=d.attention_backend, choices=ATTENTION_BACKENDS)
    add("--stream-interval", type=int, default=d.stream_interval, help="tokens per streamed chunk (the first token is sent at once)")
    add("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs, help="largest decode batch replayed from a CUDA graph (default: --max-running-requests, at most 256)")
    add("--disable-cuda-graph", action="store_true", help="run every decode step eagerly (graphs are used on CUDA with the triton backend)")
    add("--fused-kernels", action="store_true", help="use our triton kernels for RMSNorm (+residual), rotary and SiLU-and-mul (CUDA; under TRITON_INTERPRET=1 on a CPU for debugging)")
    return parser


def parse_server_args(argv: list[str]) -> ServerArgs:
    """Parse and validate; argparse exits with code 2 on a malformed flag, ValueError otherwise."""
    namespace = _parser().parse_args(argv)
    args = ServerArgs(**vars(namespace))
    args.validate()
    return args
