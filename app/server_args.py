"""Command-line arguments of ``python -m app serve``: parsed once, validated, frozen.

The server's own flags are declared here, the engine's in app/engine/config.py (EngineConfig);
both parsers come from those declarations (app/flags.py). Flag names and defaults follow
SGLang's where it has the same flag, since its users know them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from app.actors.watchdog import DEFAULT_WATCHDOG_TIMEOUT_S
from app.engine.config import EngineConfig
from app.flags import HelpWithDefaults, add_flags, flag, flag_values
from app.http.asgi import BODY_READ_TIMEOUT_S
from app.http.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, ApiKeys, Secret
from app.http.server import MAX_CONNECTIONS
from app.observability.logs import LEVELS
from app.observability.settings import ObservabilitySettings


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    """The server's flags, and the engine's (``engine``, whose ``model_path`` is resolved later:
    :meth:`engine_config`)."""

    model_path: str | None = flag(None, "Hugging Face checkpoint directory (default: the embedded tiny model, whose "
                                        "output is gibberish)")
    served_model_name: str | None = flag(None, "the model id clients use (default: the directory name)")
    host: str = flag("127.0.0.1", "address HTTP listens on")
    port: int = flag(30000, "HTTP port (0: any free port, logged as `serving url=...`)")
    api_key: Secret | None = flag(None, "require 'Authorization: Bearer <key>' on every route but /health and "
                                        f"/metrics (prefer ${API_KEY_ENV}: a flag shows in ps)")
    admin_api_key: Secret | None = flag(None, "require this key on the control routes (/abort_request, /flush_cache, "
                                              "the details of /server_info); without it they take --api-key "
                                              f"(prefer ${ADMIN_API_KEY_ENV})")
    http_read_timeout: float = flag(BODY_READ_TIMEOUT_S, "seconds a client has to send a request's body once its "
                                                         "headers are in; then 408 and the connection is closed")
    max_connections: int = flag(MAX_CONNECTIONS, "open HTTP connections at most; one more is answered 503 and closed "
                                                 "at once (the process's file limit is raised to fit)")
    log_level: str = flag("info", "lowest level logged, by every actor", choices=LEVELS)
    log_json: bool = flag(False, "one JSON object per log line")
    crash_dump_folder: str | None = flag(None, "write crash dumps here when the server fails (mode 0600, secrets masked; "
                                               "docs/crash-dumps.md), and each process's native tracebacks")
    startup_timeout: float = flag(300.0, "seconds for each actor to report ready")
    shutdown_timeout: float = flag(5.0, "seconds the requests in flight have to finish on SIGTERM (new ones get "
                                        "503; then those left get an error), and as long again for the actors to "
                                        "stop, before SIGKILL (docs/faults.md)")
    watchdog_timeout: float = flag(DEFAULT_WATCHDOG_TIMEOUT_S, "seconds an actor may have work and make no progress "
                                   "(a hung step, a stopped process) before the server treats it as crashed: "
                                   "crash dump, every client answered, exit 1 (docs/faults.md)")
    scheduler_threads: int | None = flag(None, "torch threads in the scheduler (default: the cores available, less "
                                               "one for the other actors)")
    ingress_workers: int | None = flag(None, "HTTP fronts sharing the port, each with its own tokenizer and "
                                             "detokenizer (SGLang's --tokenizer-worker-num, vLLM's --api-server-count; "
                                             "default: 1 below 8 cores, then one per 4 cores, at most 4)")
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model_path=""))
    observability: ObservabilitySettings = field(default_factory=ObservabilitySettings)

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
        if not self.watchdog_timeout > 0:
            raise ValueError(f"--watchdog-timeout must be positive, got {self.watchdog_timeout}")
        if not self.http_read_timeout > 0:
            raise ValueError(f"--http-read-timeout must be positive, got {self.http_read_timeout}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if self.scheduler_threads is not None and self.scheduler_threads < 1:
            raise ValueError(f"--scheduler-threads must be at least 1, got {self.scheduler_threads}")
        if self.ingress_workers is not None and not 1 <= self.ingress_workers <= 64:
            raise ValueError(f"--ingress-workers must be in [1, 64], got {self.ingress_workers}")
        if self.model_path is not None and not os.path.isdir(self.model_path):
            raise ValueError(f"--model-path {self.model_path!r} is not a directory")
        self.engine.validate()
        self.observability.validate()

    def engine_config(self, model_path: str) -> EngineConfig:
        """The engine's flags for the checkpoint at ``model_path`` (the embedded model's when
        --model-path is not given)."""
        return replace(self.engine, model_path=model_path)

    @property
    def context_length(self) -> int | None:
        """--context-length (None: the model's), which the HTTP side's model card shows too."""
        return self.engine.context_length

    @property
    def keys(self) -> ApiKeys:
        return ApiKeys(self.api_key, self.admin_api_key)

    def to_dict(self) -> dict[str, Any]:
        """Every flag's value, for /server_info and crash dumps: a key shows only whether it is set."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("engine", "observability")}
        values.update((name, value) for name, value in asdict(self.engine).items() if name != "model_path")
        values.update(asdict(self.observability))
        for name in ("api_key", "admin_api_key"):
            values[name] = None if values[name] is None else "<set>"
        return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app serve",
        description="Serve a model over HTTP (OpenAI-compatible and native routes).",
        formatter_class=HelpWithDefaults,
    )
    add_flags(parser.add_argument_group("server"), ServerArgs)
    add_flags(parser.add_argument_group("engine"), EngineConfig)
    add_flags(parser.add_argument_group("observability"), ObservabilitySettings)
    return parser


def _key(flag_value: str | None, env_name: str, flag: str, environ: Mapping[str, str]) -> Secret | None:
    """The key from its flag, else from its environment variable (an empty one: unset)."""
    value = flag_value if flag_value is not None else environ.get(env_name) or None
    return None if value is None else Secret(value, name=f"{flag} (or ${env_name})")


def parse_server_args(argv: list[str], environ: Mapping[str, str] | None = None) -> ServerArgs:
    """Parse and validate; argparse exits with code 2 on a malformed flag, ValueError otherwise.
    The keys come from their flags or from ``environ`` (default: this process's environment)."""
    environ = os.environ if environ is None else environ
    namespace = _parser().parse_args(argv)
    values = flag_values(namespace, ServerArgs)
    values["api_key"] = _key(values["api_key"], API_KEY_ENV, "--api-key", environ)
    values["admin_api_key"] = _key(values["admin_api_key"], ADMIN_API_KEY_ENV, "--admin-api-key", environ)
    engine = EngineConfig(model_path=values["model_path"] or "", **flag_values(namespace, EngineConfig))
    observability = ObservabilitySettings(**flag_values(namespace, ObservabilitySettings))
    args = ServerArgs(**values, engine=engine, observability=observability)
    args.validate()
    return args
