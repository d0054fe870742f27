"""Streaming detokenization: the deltas add up to the full decode, never split a character, stay O(1)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.text import IncrementalDetokenizer, Tokenizer
from app.text import builtin_tokenizer as builtin

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def chunked(draw: st.DrawFn, ids: st.SearchStrategy[list[int]]) -> list[list[int]]:
    """A list of ids cut into random consecutive batches (empty batches included)."""
    values = draw(ids)
    cuts = sorted(draw(st.lists(st.integers(0, len(values)), max_size=len(values) + 2)))
    bounds = [0, *cuts, len(values)]
    return [values[a:b] for a, b in zip(bounds, bounds[1:])]


def _stream(detok: IncrementalDetokenizer, batches: Sequence[Sequence[int]]) -> tuple[list[str], str]:
    deltas = [detok.push(batch) for batch in batches]
    return deltas, detok.flush()


any_ids = st.lists(st.integers(0, builtin.VOCAB_SIZE - 1), max_size=60)
# Byte tokens only: the ids most likely to leave a character unfinished.
byte_ids = st.lists(st.integers(0, 255), max_size=60)


@FAST
@given(batches=chunked(any_ids), skip=st.booleans())
def test_deltas_add_up_to_the_full_decode(tokenizer: Tokenizer, batches: list[list[int]], skip: bool) -> None:
    deltas, tail = _stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip), batches)
    all_ids = [i for batch in batches for i in batch]
    assert "".join(deltas) + tail == tokenizer.decode(all_ids, skip_special_tokens=skip)


@FAST
@given(batches=chunked(byte_ids))
def test_deltas_add_up_for_raw_bytes(tokenizer: Tokenizer, batches: list[list[int]]) -> None:
    deltas, tail = _stream(IncrementalDetokenizer(tokenizer), batches)
    assert "".join(deltas) + tail == tokenizer.decode([i for batch in batches for i in batch])


@FAST
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80), data=st.data())
def test_valid_text_streams_without_replacement_characters(tokenizer: Tokenizer, text: str, data: st.DataObject) -> None:
    """Characters split over tokens are held back until complete: no delta shows U+FFFD."""
    ids = tokenizer.encode(text, add_bos=False)
    batches = data.draw(chunked(st.just(ids)))
    detok = IncrementalDetokenizer(tokenizer)
    deltas, tail = _stream(detok, batches)
    assert all("\ufffd" not in delta for delta in deltas if "\ufffd" not in text)
    assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=True)
    if not any(token in text for token in builtin.SPECIAL_TOKENS):
        assert "".join(deltas) + tail == text
    if not tokenizer.decode(ids, skip_special_tokens=True).endswith("\ufffd"):
        # A literal U+FFFD at the very end looks like an unfinished character: flush emits it.
        assert tail == ""
    assert detok.pending_tokens == 0


def test_a_literal_replacement_character_at_the_end_is_held_then_flushed_once(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok \ufffd", add_bos=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == "ok " and detok.pending_tokens > 0
    assert detok.flush() == "\ufffd" and detok.pending_tokens == 0
    assert detok.push(tokenizer.encode("!", add_bos=False)) == "!"


def test_an_emoji_split_over_byte_tokens_appears_once_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 😀", add_bos=False)
    assert len(tokenizer.encode("😀", add_bos=False)) > 1  # the built-in vocabulary splits it
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == "ok 😀"
    assert deltas[-1].endswith("😀") and all("\ufffd" not in d for d in deltas)
    assert detok.flush() == ""


def test_a_batch_emits_its_complete_part_and_holds_the_partial_character(tokenizer: Tokenizer) -> None:
    emoji = tokenizer.encode("😀", add_bos=False)
    head = tokenizer.encode("hello", add_bos=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(head + emoji[:1]) == "hello"
    assert detok.pending_tokens == 1
    assert detok.push(emoji[1:]) == "😀"


def test_flush_returns_bytes_that_never_completed(tokenizer: Tokenizer) -> None:
    emoji = tokenizer.encode("😀", add_bos=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(tokenizer.encode("a", add_bos=False) + emoji[:1]) == "a"
    assert detok.flush() == tokenizer.decode(emoji[:1]) == "\ufffd"
    assert detok.flush() == ""


def test_special_tokens_are_skipped_or_kept(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hi<|eot_id|>", add_bos=True)
    skip, keep = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(skip.push([i]) for i in ids) + skip.flush() == "hi"
    assert "".join(keep.push([i]) for i in ids) + keep.flush() == "<|begin_of_text|>hi<|eot_id|>"


def test_context_ids_give_spacing_without_being_emitted(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Say hello", add_bos=False)
    output = tokenizer.encode(" world 😀!", add_bos=False)
    detok = IncrementalDetokenizer(tokenizer, context_ids=prompt[-5:])
    assert "".join(detok.push([i]) for i in output) + detok.flush() == " world 😀!"


class CountingDecoder:
    """Wraps a tokenizer and counts how many token ids it is asked to decode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        self.decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", ["The quick brown fox jumps over the lazy dog. " * 60, "你好，世界！😀 " * 150])
def test_work_per_token_is_bounded(tokenizer: Tokenizer, text: str) -> None:
    """A long stream decodes a bounded window per token: linear work, not quadratic."""
    ids = tokenizer.encode(text, add_bos=False)
    counter = CountingDecoder(tokenizer)
    detok = IncrementalDetokenizer(counter)
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == text
    assert len(ids) > 500
    assert counter.decoded < 12 * len(ids)  # re-decoding everything would be ~len(ids)**2 / 2
