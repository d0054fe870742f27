"""A checkpoint of the embedded tiny model, and its tokenizer loaded both ways (ours and transformers')."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.engine.make_checkpoint import PRESETS, TINY_LLAMA, make_checkpoint
from app.text import Tokenizer


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("text") / "tiny-llama", TINY_LLAMA)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_dir: Path):  # -> transformers.PreTrainedTokenizerBase
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def arch_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One checkpoint per architecture: transformers picks a different tokenizer class for each."""
    return make_checkpoint(tmp_path_factory.mktemp("arch") / request.param, PRESETS[request.param])
