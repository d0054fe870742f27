"""Preemption on a real server whose KV pool is too small for its batch: by recompute (the
default) and by swap to host memory (--enable-kv-swap), every request's greedy text equals the
text it gets alone (unpreempted), /server_info counts the retractions (and the swaps), and the
pool and the host pool end empty.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server import ServerProcess, wait_until

MODEL = "tiny-llama-v1"
PROMPTS = [f"Request number {i} asks for a long answer about" + " and more" * i for i in range(6)]
MAX_TOKENS = 60  # six at once need far more than the pool's 192 tokens; one alone fits


@pytest.fixture(scope="module", params=["recompute", "swap"])
def server(request, cache_dir):
    # a host pool that holds every victim at once: none falls back to recompute
    swap = ("--enable-kv-swap", "--host-kv-pool-tokens", "4096") if request.param == "swap" else ()
    process = ServerProcess("--max-total-tokens", "192", "--chunked-prefill-size", "64", *swap, cache_dir=cache_dir)
    try:
        process.wait_serving()
        yield request.param, process.url
    finally:
        process.stop()


def complete(url: str, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return choice["text"]


def scheduler_info(url: str) -> dict:
    return httpx.get(f"{url}/server_info").json()["scheduler"]


def test_preempted_requests_answer_as_they_would_alone(server):
    mode, url = server
    alone = [complete(url, p) for p in PROMPTS]
    assert scheduler_info(url)["retractions"] == 0
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: complete(url, p), PROMPTS))
    assert together == alone
    assert wait_until(lambda: scheduler_info(url)["kv_pool"]["used"] == 0, timeout=30)
    info = scheduler_info(url)
    assert info["retractions"] > 0 and info["kv_pool"]["locked"] == 0
    swap = info["kv_swap"]
    if mode == "recompute":
        assert swap is None
    else:
        assert swap["capacity_tokens"] == 4096 and swap["used_tokens"] == swap["requests"] == 0
        assert swap["swapped_out"] > 0 and swap["swapped_in"] == swap["swapped_out"] == info["retractions"]
        assert swap["fallbacks"] == 0
