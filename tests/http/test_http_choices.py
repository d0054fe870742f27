"""OpenAI's ``n``: several choices of one prompt, fanned out as requests of their own and merged.

The echo backend gives every choice the same text, so the tests cut some choices short
(``max_tokens_of``) to tell them apart, and make one choice fail (``failing_rid``).
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio

from app.http.backend import RequestError
from app.http.outputs import merge_usage
from app.http.request_stream import fan_out_prompts
from app.ipc.messages import GenerateRequest, SamplingParams, Usage


def sse_chunks(raw: str) -> list[dict[str, Any]]:
    """The JSON events of a stream, which must end with `data: [DONE]`."""
    payloads = [event[len("data: "):] for event in raw.split("\n\n") if event]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


@pytest.fixture
def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=10)


async def test_completion_choices_are_sorted_with_usage_summed(sdk, backend):
    backend.delay_s = 0.001  # the choices' outputs interleave
    backend.max_tokens_of = {"req-0": 2, "req-2": 4}

    def create() -> Any:
        return sdk.completions.create(
            model="echo", prompt="abcdef", max_tokens=6, n=3, seed=40, extra_headers={"x-request-id": "req"}
        )

    result = await trio.to_thread.run_sync(create)

    assert [(c.index, c.text, c.finish_reason) for c in result.choices] == [
        (0, "ab", "length"), (1, "abcdef", "length"), (2, "abcd", "length"),
    ]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (6, 12, 18)
    assert result.usage.prompt_tokens_details.cached_tokens == 2
    assert result.id == "cmpl-req"
    assert sorted((r.rid, r.sampling.seed) for r in backend.requests) == [("req-0", 40), ("req-1", 41), ("req-2", 42)]


async def test_chat_choices_without_a_seed_draw_their_own_streams(client, backend):
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2}
    response = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": "chat"})

    reply = response.json()
    assert [(c["index"], c["message"]["content"]) for c in reply["choices"]] == [(0, "hi"), (1, "hi")]
    assert (reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"]) == (2, 4)
    assert sorted((r.rid, r.sampling.seed) for r in backend.requests) == [("chat-0", None), ("chat-1", None)]
    assert response.headers["x-request-id"] == "chat"


async def test_one_choice_keeps_the_request_id(client, backend):
    await client.post("/v1/completions", json={"prompt": "ab", "n": 1, "seed": 3}, headers={"x-request-id": "solo"})

    assert [(r.rid, r.sampling.seed) for r in backend.requests] == [("solo", 3)]


async def test_streamed_completion_choices_carry_their_index(client, backend):
    backend.delay_s = 0.001
    backend.max_tokens_of = {"s-1": 2}
    body = {"prompt": "abcd", "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/completions", json=body, headers={"x-request-id": "s"})

    *chunks, usage = sse_chunks(response.text)
    assert all(len(c["choices"]) == 1 for c in chunks)
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for chunk in chunks:
        by_index[chunk["choices"][0]["index"]].append(chunk["choices"][0])
    assert "".join(c["text"] for c in by_index[0]) == "abcd"
    assert "".join(c["text"] for c in by_index[1]) == "ab"
    for index, reason in [(0, "stop"), (1, "length")]:  # each choice ends with a finish chunk of its own
        choices = by_index[index]
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + [reason]
    assert usage["choices"] == []
    assert (usage["usage"]["prompt_tokens"], usage["usage"]["completion_tokens"]) == (4, 6)
    assert all(c["usage"] is None for c in chunks)


async def test_continuous_usage_sums_the_choices_tokens_so_far(client, backend):
    backend.delay_s = 0.001  # the choices' outputs interleave
    backend.max_tokens_of = {"u-1": 2}
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "abcd", "n": 2, "stream": True, "stream_options": options}
    response = await client.post("/v1/completions", json=body, headers={"x-request-id": "u"})

    *chunks, final = sse_chunks(response.text)
    assert len(chunks) == 4 + 2  # one chunk per output, each one token here
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5, 6]  # both choices, summed
    assert all(c["usage"]["prompt_tokens"] == 4 and c["usage"]["total_tokens"] == 4 + k
               for k, c in enumerate(chunks, 1))
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6


async def test_streamed_chat_choices_through_the_sdk(sdk, backend):
    backend.delay_s = 0.001
    backend.max_tokens_of = {"c-0": 1}

    def stream() -> list[Any]:
        return list(sdk.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "xyz"}], n=3, stream=True,
            stream_options={"include_usage": True}, extra_headers={"x-request-id": "c"},
        ))

    *chunks, usage = await trio.to_thread.run_sync(stream)

    contents: dict[int, str] = {0: "", 1: "", 2: ""}
    roles, finishes = [], []
    for chunk in chunks:
        [choice] = chunk.choices
        if choice.delta.role:
            roles.append(choice.index)
        contents[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes.append(choice.index)
    assert sorted(roles) == sorted(finishes) == [0, 1, 2]  # once each
    assert contents == {0: "x", 1: "xyz", 2: "xyz"}
    assert usage.choices == [] and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (3, 7)


async def test_a_rejected_choice_fails_the_request_and_aborts_the_others(client, backend):
    backend.delay_s = 0.05
    backend.failing_rid = "r-1"
    backend.reject = RequestError("queue full", 503)
    response = await client.post("/v1/completions", json={"prompt": "abcdef", "n": 3}, headers={"x-request-id": "r"})

    assert response.status_code == 503 and response.json()["message"] == "queue full"
    with trio.fail_after(2):
        await backend.closed_early["r-0"].wait()
        await backend.closed_early["r-2"].wait()


async def test_a_choice_failing_mid_stream_ends_the_stream_and_aborts_the_others(client, backend):
    backend.delay_s = 0.01
    backend.failing_rid = "f-0"
    backend.fail_after = 1
    body = {"messages": [{"role": "user", "content": "a long answer"}], "n": 2, "stream": True}
    response = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": "f"})

    chunks = sse_chunks(response.text)
    assert chunks[-1] == {"error": {"message": "the scheduler died", "type": "InternalServerError", "code": 500}}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    with trio.fail_after(2):
        await backend.closed_early["f-1"].wait()


async def test_a_choice_failing_fails_a_whole_answer(client, backend):
    backend.failing_rid = "w-1"
    backend.fail_after = 1
    response = await client.post("/v1/completions", json={"prompt": "abc", "n": 2}, headers={"x-request-id": "w"})

    assert response.status_code == 500 and response.json()["message"] == "the scheduler died"


async def test_a_client_leaving_aborts_every_choice(client, backend):
    backend.delay_s = 0.05
    body = {"prompt": "a long prompt that takes a while", "n": 3, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body, headers={"x-request-id": "gone"}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break

    with trio.fail_after(2):
        for i in range(3):
            await backend.closed_early[f"gone-{i}"].wait()


async def test_a_client_leaving_a_whole_answer_aborts_every_choice(client, backend):
    backend.delay_s = 30
    async with trio.open_nursery() as nursery:
        post = partial(client.post, "/v1/completions", json={"prompt": "abc", "n": 2}, headers={"x-request-id": "w"})
        nursery.start_soon(post)
        with trio.fail_after(2):
            await backend.started.setdefault("w-1", trio.Event()).wait()
        nursery.cancel_scope.cancel()

    with trio.fail_after(2):
        await backend.closed_early["w-0"].wait()
        await backend.closed_early["w-1"].wait()


async def test_choices_run_concurrently(client, backend):
    backend.delay_s = 0.2
    with trio.fail_after(0.5 * 3):  # one after another would take 3 x 3 x 0.2 s
        response = await client.post("/v1/completions", json={"prompt": "abc", "n": 3})

    assert [c["text"] for c in response.json()["choices"]] == ["abc"] * 3


def test_fan_out_seeds_wrap_below_the_limit():
    request = GenerateRequest("x", SamplingParams(seed=2**63 - 1), text="t")

    assert [(r.rid, r.sampling.seed) for r in fan_out_prompts([request], 3)] == [
        ("x-0", 2**63 - 1), ("x-1", 0), ("x-2", 1)]
    assert fan_out_prompts([request], 1) == [request]


def test_merged_usage_counts_the_prompt_once():
    usage = merge_usage([Usage(10, 3, 4), Usage(10, 5, 0), Usage(10, 1, 10)])

    assert usage == Usage(prompt_tokens=10, completion_tokens=9, cached_tokens=0)


def test_merged_usage_counts_each_prompt_once_and_skips_choices_not_reported():
    usages = [Usage(10, 3, 4), Usage(10, 5, 6), Usage(7, 1, 2), None, None, None]

    assert merge_usage(usages, per_prompt=2) == Usage(prompt_tokens=17, completion_tokens=9, cached_tokens=6)
    assert merge_usage([None, None]) == Usage(0, 0, 0)


def test_fan_out_prompts_numbers_choices_prompt_after_prompt():
    requests = [GenerateRequest("r", SamplingParams(seed=5), text=t) for t in ("a", "b")]
    choices = fan_out_prompts(requests, 2)

    assert [(c.rid, c.text, c.sampling.seed) for c in choices] == [
        ("r-0", "a", 5), ("r-1", "a", 6), ("r-2", "b", 5), ("r-3", "b", 6)]
    assert [c.rid for c in fan_out_prompts(requests, 1)] == ["r-0", "r-1"]
    assert fan_out_prompts(requests[:1], 1) == requests[:1]


async def test_batched_prompts_answer_choice_p_times_n_plus_i_with_each_prompt_counted_once(sdk, backend):
    backend.max_tokens_of = {"req-1": 2}

    def create() -> Any:
        return sdk.completions.create(model="echo", prompt=["abc", "defgh"], max_tokens=6, n=2,
                                      extra_headers={"x-request-id": "req"})

    result = await trio.to_thread.run_sync(create)

    assert [(c.index, c.text) for c in result.choices] == [(0, "abc"), (1, "ab"), (2, "defgh"), (3, "defgh")]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3 + 5, 3 + 2 + 5 + 5)
    assert sorted(r.rid for r in backend.requests) == ["req-0", "req-1", "req-2", "req-3"]


async def test_streamed_batched_prompts_carry_their_choice_index_and_usage(client, backend):
    body = {"prompt": ["ab", "cde"], "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/completions", json=body)

    chunks = sse_chunks(response.text)
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "ab", 1: "cde"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_n_over_the_limit_is_refused(client: httpx.AsyncClient, backend, path):
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "n": 17}
    response = await client.post(path, json=body)

    assert response.status_code == 400 and response.json()["param"] == "n"
    assert backend.requests == []
