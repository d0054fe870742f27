"""vLLM's ``stream_options.continuous_usage_stats`` through real processes and the openai SDK.

The embedded model has random weights: many of its tokens decode to no text yet (a piece of a
multi-byte character), so these streams show that such tokens still get a chunk each, with the
usage so far, and that the chunks count every token the request was asked for.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import openai
import pytest

MODEL = "tiny-llama-v1"
N_TOKENS = 32
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


class Piece(NamedTuple):
    """One chunk with a choice, the same for both APIs."""

    index: int
    text: str
    completion_tokens: int | None  # None: the chunk had no usage figures


@pytest.fixture(scope="module")
def client(shared_server):
    return openai.OpenAI(base_url=f"{shared_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def stream(client: openai.OpenAI, api: str, options: dict[str, bool], n: int = 1) -> tuple[list[Piece], Any]:
    """The chunks with choices (chat: past each choice's role chunk), and the final usage."""
    common = {"model": MODEL, "max_tokens": N_TOKENS, "n": n, "temperature": 1.0, "seed": 5, "stream": True,
              "stream_options": options, "extra_body": {"ignore_eos": True}}
    if api == "chat":
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "Tell a story"}],
                                                     **common))
    else:
        chunks = list(client.completions.create(prompt="Once upon a time", **common))
    *with_choices, final = chunks
    assert final.choices == [] and final.usage is not None  # include_usage's last chunk, as ever
    pieces = []
    for chunk in with_choices:
        [choice] = chunk.choices
        assert options.get("continuous_usage_stats") or chunk.usage is None
        if chunk.usage is not None:
            assert chunk.usage.prompt_tokens == final.usage.prompt_tokens
            assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        tokens = chunk.usage.completion_tokens if chunk.usage is not None else None
        if api == "chat" and choice.delta.role is not None:  # before any token of this choice
            assert choice.delta.content == ""
            assert tokens is None or tokens == (pieces[-1].completion_tokens if pieces else 0)
            continue
        if api == "chat" and options.get("continuous_usage_stats") and choice.finish_reason is None:
            assert choice.delta.content is not None  # "" for tokens without text yet, as vLLM sends them
        text = choice.text if api == "completions" else choice.delta.content or ""
        pieces.append(Piece(choice.index, text, tokens))
    return pieces, final.usage


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_every_token_gets_a_chunk_with_the_usage_so_far(client, api):
    pieces, usage = stream(client, api, CONTINUOUS)

    counts = [p.completion_tokens for p in pieces]
    assert counts == list(range(1, N_TOKENS + 1))  # one token per output, each with its chunk
    rises = [b - a for a, b in zip([0, *counts], counts)]
    assert sum(rises) == N_TOKENS == usage.completion_tokens == counts[-1]
    assert usage.total_tokens == usage.prompt_tokens + N_TOKENS
    # Tokens that decode to no text yet are sent too: that is what the option is for.
    assert any(p.text == "" for p in pieces)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_without_the_option_the_stream_is_unchanged(client, api):
    counted, _ = stream(client, api, CONTINUOUS)
    plain, usage = stream(client, api, {"include_usage": True})

    assert all(p.completion_tokens is None for p in plain)  # ``usage: null`` but in the last chunk
    assert "".join(p.text for p in plain) == "".join(p.text for p in counted)  # the same seeded text
    # Only the chunks without text are left out (but the last, which carries the finish).
    assert [p.text for p in plain[:-1]] == [p.text for p in counted[:-1] if p.text]
    assert len(plain) < len(counted) and usage.completion_tokens == N_TOKENS


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_two_choices_sum_their_tokens_in_every_chunk(client, api):
    pieces, usage = stream(client, api, CONTINUOUS, n=2)

    counts = [p.completion_tokens for p in pieces]
    assert counts == list(range(1, 2 * N_TOKENS + 1))  # both choices, summed, one token a chunk
    per_choice = {0: 0, 1: 0}
    for before, piece in zip([0, *counts], pieces):
        per_choice[piece.index] += piece.completion_tokens - before
    assert per_choice == {0: N_TOKENS, 1: N_TOKENS}  # max_tokens with ignore_eos: exact, per choice
    assert usage.completion_tokens == 2 * N_TOKENS == counts[-1]
    assert usage.total_tokens == usage.prompt_tokens + 2 * N_TOKENS
