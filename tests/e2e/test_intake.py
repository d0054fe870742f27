"""A burst of requests through a real server: every one answered, with exact usage."""

from __future__ import annotations

import json
import random

import httpx
import trio

BURST = 128  # more than hypercorn's default listen backlog (100)


async def burst(url: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, dict]]:
    """Every prompt at once, each on its own new connection; odd ones streamed. (status, usage)."""
    answers: list[tuple[int, dict]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one(i: int) -> None:
            body = {"model": "tiny-llama-v1", "prompt": prompts[i], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0}
            if i % 2:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                response = await client.post("/v1/completions", json=body)
                chunks = [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: {")]
                assert response.text.endswith("data: [DONE]\n\n"), response.text[-200:]
                finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
                assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
                answers.append((response.status_code, chunks[-1]["usage"]))
            else:
                response = await client.post("/v1/completions", json=body)
                answers.append((response.status_code, response.json()["usage"]))

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    return answers


def test_a_burst_of_token_id_prompts_is_all_answered_with_exact_usage(start_server):
    server = start_server("--max-total-tokens", "16384")
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 1024) for _ in range(rng.randrange(256, 513))] for _ in range(BURST)]
    for max_tokens in (0, 2):  # 0: finished by the scheduler at once; 2: prefill and a decode step
        answers = trio.run(burst, server.url, prompts, max_tokens)
        assert len(answers) == BURST
        assert all(status == 200 for status, _ in answers), [a for a in answers if a[0] != 200][:3]
        assert sorted(usage["prompt_tokens"] for _, usage in answers) == sorted(len(p) for p in prompts)
        assert {usage["completion_tokens"] for _, usage in answers} == {max_tokens}
    info = httpx.get(f"{server.url}/server_info", timeout=30).json()
    assert info["requests_in_flight"] == 0 and info["scheduler"]["running_requests"] == 0
    assert "Traceback" not in server.log()
