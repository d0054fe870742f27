"""The inference core: models, paged KV cache, radix prefix cache, continuous batching, sampling.

``from app.engine import Engine`` gives the offline API. This package's own import pulls in
nothing heavy (``Engine`` loads on first use), so light actors (tokenizer, detokenizer) can
import ``app.engine.<light module>`` without loading torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineConfig", "GenerationResult"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "GenerationResult"):
        from app.engine import engine

        return getattr(engine, name)
    if name == "EngineConfig":
        from app.engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'app.engine' has no attribute {name!r}")
