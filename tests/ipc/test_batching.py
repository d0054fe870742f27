"""Batches cut to fit a channel's frames: estimates are upper bounds, order is kept."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from app.ipc.batching import batches_under, text_output_size, token_output_size
from app.ipc.messages import (
    Finish,
    FinishReason,
    StepOutput,
    TextBatch,
    TextOutput,
    TokenLogprobs,
    TokenOutput,
    Usage,
    pack_tokens,
)

token_outputs = st.builds(
    TokenOutput,
    rid=st.text(max_size=40),
    token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=500).map(pack_tokens),
    finish=st.none() | st.just(Finish(FinishReason.ABORT, message="x" * 30, status_code=503)),
    usage=st.none() | st.just(Usage(10**6, 10**6, 10**6)),
    logprobs=st.none() | st.just(TokenLogprobs(b"\0" * 40, b"\0" * 80, b"\0" * 80, 2)),
)
text_outputs = st.builds(
    TextOutput,
    rid=st.text(max_size=40),
    text=st.text(max_size=300),
    token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=300).map(pack_tokens),
    finish=st.none() | st.just(Finish(FinishReason.STOP, matched="\u00e9" * 10)),
)


@settings(max_examples=100, deadline=None)
@given(output=token_outputs)
def test_token_output_estimate_is_an_upper_bound(output):
    assert len(msgspec.msgpack.encode(output)) <= token_output_size(output)


@settings(max_examples=100, deadline=None)
@given(output=text_outputs)
def test_text_output_estimate_is_an_upper_bound(output):
    assert len(msgspec.msgpack.encode(output)) <= text_output_size(output)


@settings(max_examples=50, deadline=None)
@given(outputs=st.lists(text_outputs, max_size=40), limit=st.integers(300, 5000))
def test_batches_keep_order_and_fit(outputs, limit):
    batches = list(batches_under(outputs, text_output_size, limit))
    assert [o for batch in batches for o in batch] == outputs
    for batch in batches:
        assert len(batch) == 1 or sum(text_output_size(o) for o in batch) <= limit
        if sum(text_output_size(o) for o in batch) <= limit:
            assert len(msgspec.msgpack.encode(TextBatch(tuple(batch)))) <= limit + 16


def test_a_step_of_long_answers_is_cut_into_several_messages():
    outputs = [TokenOutput(f"r{i}", pack_tokens(range(30_000))) for i in range(100)]  # 12 MB in all
    limit = 4 * 1024 * 1024
    batches = list(batches_under(outputs, token_output_size, limit))
    assert len(batches) == 3
    assert all(len(msgspec.msgpack.encode(StepOutput(tuple(b)))) <= limit for b in batches)
