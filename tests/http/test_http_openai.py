"""The OpenAI routes through the official openai client, streamed and not.

The client is synchronous, so it runs in a worker thread while the server runs on the test's
trio loop. The echo backend answers a prompt with the prompt itself, one character a token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import openai
import pytest
import trio

T = TypeVar("T")


async def in_thread(call: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(call)


@pytest.fixture
def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=10)


async def test_completion_stops_at_max_tokens(sdk, backend):
    result = await in_thread(lambda: sdk.completions.create(model="echo", prompt="hello world", max_tokens=5))

    assert result.id.startswith("cmpl-") and result.object == "text_completion" and result.model == "echo"
    assert result.created > 0
    assert [(c.text, c.finish_reason) for c in result.choices] == [("hello", "length")]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (11, 5, 16)
    assert result.usage.prompt_tokens_details.cached_tokens == 2
    assert backend.requests[-1].sampling.max_new_tokens == 5


async def test_completion_default_max_tokens_is_16(sdk, backend):
    result = await in_thread(lambda: sdk.completions.create(model="echo", prompt="abcdefghijklmnopqrstuvwxyz"))

    assert result.choices[0].text == "abcdefghijklmnop"
    assert backend.requests[-1].sampling.max_new_tokens == 16


async def test_completion_stop_string_is_trimmed_and_reported(sdk):
    result = await in_thread(lambda: sdk.completions.create(model="echo", prompt="one, two", stop=[",", "x"]))

    choice = result.choices[0]
    assert (choice.text, choice.finish_reason) == ("one", "stop")
    assert choice.model_extra["matched_stop"] == ","
    assert result.usage.completion_tokens == 4  # the stop string's token was generated, not shown


async def test_completion_from_token_ids_passes_sampling_fields(sdk, backend):
    result = await in_thread(
        lambda: sdk.completions.create(
            model="echo", prompt=[104, 105], max_tokens=8, temperature=0.0, top_p=0.5, seed=7,
            presence_penalty=0.5, frequency_penalty=-0.5,
            extra_body={"top_k": 3, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1, "ignore_eos": True},
        )
    )

    assert (result.choices[0].text, result.choices[0].finish_reason) == ("hi", "stop")
    sampling = backend.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.seed, sampling.top_k, sampling.min_p) == (0.0, 0.5, 7, 3, 0.1)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (sampling.min_new_tokens, sampling.ignore_eos) == (1, True)


async def test_streamed_completion_equals_the_whole_one(sdk):
    whole = await in_thread(lambda: sdk.completions.create(model="echo", prompt="stream me", max_tokens=6))

    def stream() -> list[Any]:
        return list(sdk.completions.create(
            model="echo", prompt="stream me", max_tokens=6, stream=True, stream_options={"include_usage": True}
        ))

    chunks = await in_thread(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text == "stream"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 2
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")


async def test_completion_logprobs(sdk):
    result = await in_thread(lambda: sdk.completions.create(model="echo", prompt="ab", logprobs=2))

    logprobs = result.choices[0].logprobs
    assert logprobs.tokens == ["token_id:97", "token_id:98"]
    assert logprobs.token_logprobs == [-0.5, -0.5]
    assert logprobs.top_logprobs == [{"token_id:97": -0.5, "token_id:98": -1.5}, {"token_id:98": -0.5, "token_id:99": -1.5}]
    assert logprobs.text_offset == [0, len("token_id:97")]


async def test_chat_completion(sdk, backend):
    messages = [
        {"role": "system", "content": "be "},
        {"role": "user", "content": [{"type": "text", "text": "brief"}, {"type": "text", "text": "!"}]},
    ]
    result = await in_thread(lambda: sdk.chat.completions.create(model="echo", messages=messages))

    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    choice = result.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "be brief\n!", "stop")
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (10, 10)
    assert result.usage.prompt_tokens_details.cached_tokens == 2
    request = backend.requests[-1]
    assert [(m.role, m.content) for m in request.messages] == [("system", "be "), ("user", "brief\n!")]
    assert request.sampling.max_new_tokens == backend.model.context_length  # no limit given: up to the context


async def test_chat_max_completion_tokens_wins_over_max_tokens(sdk, backend):
    result = await in_thread(
        lambda: sdk.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "abcdef"}], max_tokens=5, max_completion_tokens=2
        )
    )

    assert (result.choices[0].message.content, result.choices[0].finish_reason) == ("ab", "length")


async def test_streamed_chat_sends_role_then_content_then_finish_then_usage(sdk):
    def stream() -> list[Any]:
        return list(sdk.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hey you"}], stop=" ", stream=True,
            stream_options={"include_usage": True},
        ))

    chunks = await in_thread(stream)
    first, *middle, last_choice, usage = chunks
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    assert "".join(c.choices[0].delta.content for c in middle) == "hey"
    assert all(c.choices[0].delta.role is None and c.choices[0].finish_reason is None for c in middle)
    assert last_choice.choices[0].finish_reason == "stop"
    assert last_choice.choices[0].model_extra["matched_stop"] == " "
    assert usage.choices == [] and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (7, 4)
    assert all(c.object == "chat.completion.chunk" for c in chunks)


async def test_chat_logprobs(sdk):
    result = await in_thread(
        lambda: sdk.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "A"}], logprobs=True, top_logprobs=2
        )
    )

    [token] = result.choices[0].logprobs.content
    assert (token.token, token.logprob, token.bytes) == ("token_id:65", -0.5, list(b"token_id:65"))
    assert [(t.token, t.logprob) for t in token.top_logprobs] == [("token_id:65", -0.5), ("token_id:66", -1.5)]


async def test_models_lists_the_served_model(sdk):
    models = await in_thread(lambda: sdk.models.list())

    assert [(m.id, m.object, m.owned_by) for m in models.data] == [("echo", "model", "app")]
    assert models.data[0].model_extra["max_model_len"] == 256


async def test_validation_errors_reach_the_sdk_with_the_field(sdk):
    with pytest.raises(openai.BadRequestError) as caught:
        await in_thread(lambda: sdk.completions.create(model="echo", prompt="x", temperature=-1))

    assert caught.value.status_code == 400
    assert caught.value.param == "temperature" and caught.value.body["code"] == 400
    assert caught.value.type == "BadRequestError"
    assert caught.value.message.endswith("temperature must be a float >= 0.0")


async def test_unknown_model_is_404_model_not_found(sdk):
    with pytest.raises(openai.NotFoundError) as caught:
        await in_thread(lambda: sdk.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}]))

    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    assert "gpt-4" in caught.value.message


async def test_error_event_mid_stream_raises_in_the_sdk(sdk, backend):
    backend.fail_after = 2

    def stream() -> list[str]:
        texts = []
        for chunk in sdk.completions.create(model="echo", prompt="abcdef", stream=True):
            texts.append(chunk.choices[0].text)
        return texts

    with pytest.raises(openai.APIError) as caught:
        await in_thread(stream)
    assert "the scheduler died" in caught.value.message


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def usage_figures(chunk: Any) -> tuple[int, int, int]:
    return (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens)


async def test_continuous_usage_stats_put_the_usage_so_far_in_every_completion_chunk(sdk):
    def stream() -> list[Any]:
        return list(sdk.completions.create(
            model="echo", prompt="hello world", max_tokens=5, stream=True, stream_options=CONTINUOUS,
        ))

    *chunks, final = await in_thread(stream)
    assert [c.choices[0].text for c in chunks] == ["h", "e", "l", "l", "o"]
    assert [usage_figures(c) for c in chunks] == [(11, k, 11 + k) for k in range(1, 6)]
    assert all(c.usage.prompt_tokens_details.cached_tokens == 2 for c in chunks)
    assert final.choices == [] and usage_figures(final) == (11, 5, 16)  # the usage chunk as without the option


async def test_continuous_usage_stats_in_chat_count_from_the_role_chunk_to_a_textless_finish(sdk):
    def stream() -> list[Any]:
        return list(sdk.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hey you"}], stop=" ", stream=True,
            stream_options=CONTINUOUS,
        ))

    role, *content, finish, final = await in_thread(stream)
    assert role.choices[0].delta.role == "assistant" and usage_figures(role) == (7, 0, 7)  # before any token
    assert [(c.choices[0].delta.content, usage_figures(c)) for c in content] == [
        ("h", (7, 1, 8)), ("e", (7, 2, 9)), ("y", (7, 3, 10))
    ]
    # The stop string's token was generated but not shown: a chunk without text still counts it.
    assert finish.choices[0].finish_reason == "stop" and finish.choices[0].delta.content is None
    assert usage_figures(finish) == (7, 4, 11)
    assert final.choices == [] and usage_figures(final) == (7, 4, 11)


async def test_continuous_usage_stats_needs_include_usage(client):
    body = {"prompt": "abc", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    response = await client.post("/v1/completions", json=body)

    payloads = [e[len("data: "):] for e in response.text.split("\n\n") if e]
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == "[DONE]" and [c["choices"][0]["text"] for c in chunks] == ["a", "b", "c"]
    assert all("usage" not in c for c in chunks)  # as vLLM: only with include_usage too


async def test_continuous_usage_stats_must_be_a_boolean(client):
    body = {"prompt": "abc", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "on"}}
    response = await client.post("/v1/completions", json=body)

    assert response.status_code == 400
    assert response.json()["param"] == "stream_options.continuous_usage_stats"
    assert "Expected `bool`" in response.json()["message"]
