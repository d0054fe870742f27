"""OpenAI's ``n`` through real processes and the openai SDK: seeded choices that differ, are
reproducible, and add up in ``usage``."""

from __future__ import annotations

import openai
import pytest

MODEL = "tiny-llama-v1"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(shared_server):
    return openai.OpenAI(base_url=f"{shared_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _create(client: openai.OpenAI, **extra):
    return client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=MAX_TOKENS, n=3, temperature=1.0, seed=1234,
        extra_body={"ignore_eos": True}, **extra,
    )


def test_seeded_choices_differ_repeat_and_add_up(client):
    first, second = _create(client), _create(client)
    single = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1)

    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3  # seeds 1234, 1235, 1236: three different samples
    assert [c.text for c in second.choices] == texts  # and the same three again
    assert all(c.finish_reason == "length" for c in first.choices)
    usage = first.usage
    assert usage.prompt_tokens == single.usage.prompt_tokens  # the prompt is counted once
    assert usage.completion_tokens == 3 * MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streamed_choices_equal_the_whole_ones(client):
    whole = _create(client)
    chunks = list(_create(client, stream=True, stream_options={"include_usage": True}))

    texts = ["", "", ""]
    finishes = []
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes.append(choice.index)
    assert texts == [c.text for c in whole.choices]
    assert sorted(finishes) == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * MAX_TOKENS


def test_native_generate_with_n_returns_every_choice(shared_server):
    import json as _json

    import httpx

    url = shared_server.url
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "n": 3,
                                                            "sampling_seed": 11, "ignore_eos": True}}
    whole = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    assert [choice["index"] for choice in whole] == [0, 1, 2]
    assert all(len(choice["output_ids"]) == 8 for choice in whole)
    assert len({tuple(choice["output_ids"]) for choice in whole}) > 1  # seed + i: different choices
    again = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    assert [c["output_ids"] for c in again] == [c["output_ids"] for c in whole]  # and reproducible
    finals: dict[int, dict] = {}
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = _json.loads(line[6:])
                finals[event["index"]] = event
    assert [finals[i]["output_ids"] for i in range(3)] == [c["output_ids"] for c in whole]
    assert all(finals[i]["meta_info"]["finish_reason"]["type"] == "length" for i in range(3))
