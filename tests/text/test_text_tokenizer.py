"""The light tokenizer: exact UTF-8 round trips, the same ids and text as transformers, no torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from app.text import Tokenizer
from app.text import builtin_tokenizer as builtin

TRICKY_TEXTS = [
    "",
    " ",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\nand\n\n\nblank lines\n",
    "emoji 😀👍🏽 family 👩‍👩‍👧 flag 🇫🇷 keycap 1️⃣",
    "中文字符 日本語のテキスト 한국어",
    "combining: e\u0301 a\u0308\u0304 Z\u0351\u0362",
    "RTL: مرحبا بالعالم שלום",
    "zero width\u200b\u200d joiner, BOM \ufeff, NUL \x00, DEL \x7f",
    "numbers 1234567890 3.14159 -42 1e-9",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "\U0010ffff\U000e0001 private use \ue000",
    "a" * 500,
    " " * 50 + "x",
]

# Any Unicode string Python can encode as UTF-8 (no lone surrogates).
utf8_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)


def _without_special_tokens(text: str) -> bool:
    return not any(token in text for token in builtin.SPECIAL_TOKENS)


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_tricky_text_round_trips_exactly(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_bos=False)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < tokenizer.vocab_size for i in ids)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=utf8_text)
def test_any_utf8_round_trips_exactly(tokenizer: Tokenizer, text: str) -> None:
    assume(_without_special_tokens(text))
    assert tokenizer.decode(tokenizer.encode(text, add_bos=False)) == text
    with_bos = tokenizer.encode(text)
    assert with_bos[0] == tokenizer.bos_token_id
    assert tokenizer.decode(with_bos, skip_special_tokens=True) == text


def test_special_ids_and_vocabulary(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == builtin.VOCAB_SIZE
    assert tokenizer.bos_token_id == tokenizer.token_to_id(builtin.BOS_TOKEN) == builtin.special_token_id(builtin.BOS_TOKEN)
    # eos_token first, then generation_config's list (which repeats it) adds <|eot_id|>.
    assert tokenizer.eos_token_ids == (tokenizer.token_to_id(builtin.EOS_TOKEN), tokenizer.token_to_id(builtin.EOT_TOKEN))
    assert tokenizer.pad_token_id == tokenizer.token_to_id(builtin.PAD_TOKEN)
    assert tokenizer.id_to_token(tokenizer.bos_token_id) == builtin.BOS_TOKEN
    # The specials are the last ids, after the 256 byte symbols and the merges.
    assert sorted(tokenizer.token_to_id(t) for t in builtin.SPECIAL_TOKENS) == list(
        range(builtin.VOCAB_SIZE - len(builtin.SPECIAL_TOKENS), builtin.VOCAB_SIZE)
    )


def test_add_bos_modes(tokenizer: Tokenizer) -> None:
    plain = tokenizer.encode("hi there", add_bos=False)
    assert tokenizer.encode("hi there") == [tokenizer.bos_token_id, *plain]
    assert tokenizer.encode("hi there", add_bos=True) == [tokenizer.bos_token_id, *plain]
    assert tokenizer.encode_batch(["hi there", ""], add_bos=False) == [plain, []]
    assert tokenizer.encode_batch(["hi there"]) == [[tokenizer.bos_token_id, *plain]]
    # Special-token text in the input becomes the special token (as with transformers).
    assert tokenizer.encode("<|eot_id|>", add_bos=False) == [tokenizer.token_to_id(builtin.EOT_TOKEN)]


def test_the_bpe_learned_real_merges(tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog, and the server answers every request."
    assert len(tokenizer.encode(text, add_bos=False)) < len(text.encode()) / 2


def test_add_bos_true_without_a_bos_token_is_an_error(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_dir, tmp_path / "no-bos"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["bos_token"] = None
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "special_tokens_map.json").unlink()
    no_bos = Tokenizer.from_dir(model_dir)
    assert no_bos.bos_token_id is None
    with pytest.raises(ValueError, match="no bos_token"):
        no_bos.encode("x", add_bos=True)


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_malformed_tokenizer_config_names_the_file(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_dir, tmp_path / "bad"))
    (model_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_dir(model_dir)
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|no such token|>"}))
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_dir(model_dir)


# ---------------------------------------------------------------- the same as transformers


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_same_ids_and_text_as_transformers(tokenizer: Tokenizer, hf_tokenizer, text: str) -> None:
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert tokenizer.encode(text, add_bos=False) == hf_tokenizer.encode(text, add_special_tokens=False)
    ids = tokenizer.encode(text + "<|eot_id|>")
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=utf8_text)
def test_same_ids_as_transformers_for_any_text(tokenizer: Tokenizer, hf_tokenizer, text: str) -> None:
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)


def test_same_special_tokens_as_transformers(tokenizer: Tokenizer, hf_tokenizer) -> None:
    assert tokenizer.vocab_size == len(hf_tokenizer)
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id
    assert tokenizer.eos_token_ids[0] == hf_tokenizer.eos_token_id
    assert tokenizer.pad_token_id == hf_tokenizer.pad_token_id
    assert dict(tokenizer.special_tokens) == hf_tokenizer.special_tokens_map


def test_every_architecture_tokenizes_as_transformers(arch_dir: Path) -> None:
    """transformers loads a qwen2 checkpoint's tokenizer with its own Qwen2Tokenizer class."""
    from transformers import AutoTokenizer

    ours, theirs = Tokenizer.from_dir(arch_dir), AutoTokenizer.from_pretrained(arch_dir)
    assert ours.vocab_size == len(theirs)
    for text in TRICKY_TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids)


@pytest.mark.parametrize("flags", [{}, {"add_bos_token": True}, {"add_bos_token": False, "add_eos_token": True}])
@pytest.mark.parametrize("post_processor", ["kept", "removed"])
def test_tokenizer_json_post_processor_decides_what_is_added_like_transformers(
    tiny_dir: Path, tmp_path: Path, flags: dict, post_processor: str
) -> None:
    """transformers 5 ignores add_bos_token/add_eos_token for a plain tokenizer.json tokenizer."""
    from transformers import AutoTokenizer

    model_dir = Path(shutil.copytree(tiny_dir, tmp_path / "flags"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, **flags}))
    if post_processor == "removed":
        data = json.loads((model_dir / "tokenizer.json").read_text())
        (model_dir / "tokenizer.json").write_text(json.dumps({**data, "post_processor": None}))
    ours, theirs = Tokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(model_dir)
    ids = ours.encode("hello")
    assert ids == theirs.encode("hello")
    assert (ids[0] == ours.bos_token_id) == (post_processor == "kept")


# ---------------------------------------------------------------- light import


def test_light_modules_import_without_torch_or_transformers(tiny_dir: Path) -> None:
    """The tokenizer and detokenizer actors import only this; loading and using it stays light."""
    code = """
import json, sys, time
start = time.perf_counter()
import app.text.tokenizer, app.text.chat_template, app.text.incremental_detokenize
import_s = time.perf_counter() - start
from app.text import IncrementalDetokenizer, Tokenizer
tok = Tokenizer.from_dir(sys.argv[1])
ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]), add_bos=False)
detok = IncrementalDetokenizer(tok)
text = "".join(detok.push([i]) for i in ids) + detok.flush()
assert text == tok.decode(ids, skip_special_tokens=True)
heavy = sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)
# Peak RSS of this process image (getrusage's maxrss would include the parent's, across exec).
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
rss_mb = int(status["VmHWM"].split()[0]) / 1024
print(json.dumps({"heavy": heavy, "import_s": import_s, "total_s": time.perf_counter() - start, "rss_mb": rss_mb}))
"""
    result = subprocess.run([sys.executable, "-c", code, str(tiny_dir)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["heavy"] == [], f"light modules pulled in {report['heavy']}"
    # Generous bounds (importing torch alone takes over a second and 300 MB); see the report.
    assert report["total_s"] < 1.5, report
    assert report["rss_mb"] < 150, report
