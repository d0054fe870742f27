"""Serving through real processes and real clients: the openai SDK and httpx over a socket."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from server import wait_until

MODEL = "tiny-llama-v1"


@pytest.fixture(scope="module")
def url(shared_server):
    return shared_server.url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_health_and_models(url):
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_metrics_are_off_without_enable_metrics(url):
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 404
    assert "--enable-metrics" in response.json()["message"]


def test_completion_streamed_and_not_give_the_same_text(client):
    args = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    streamed = list(client.completions.create(stream=True, **args))
    text = "".join(chunk.choices[0].text for chunk in streamed)
    assert text == whole.choices[0].text
    assert whole.usage.completion_tokens == 12
    assert whole.choices[0].finish_reason == "length" == streamed[-1].choices[0].finish_reason


def test_chat_completion_uses_the_chat_template(client, url):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                           max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == 6
    # The prompt is the rendered template: more tokens than the bare text.
    bare = httpx.post(f"{url}/generate", json={"text": "Hi there", "sampling_params": {"max_new_tokens": 1}}).json()
    assert reply.usage.prompt_tokens > bare["meta_info"]["prompt_tokens"]


def test_stop_strings_cut_the_text_streamed_and_not(client):
    base = dict(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    free = client.completions.create(**base).choices[0].text
    stop = free[8:11]
    cut = free.index(stop)
    whole = client.completions.create(stop=[stop], **base)
    assert whole.choices[0].text == free[:cut]
    assert whole.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=[stop], stream=True, **base))
    assert "".join(c.choices[0].text for c in streamed) == free[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_prompt_longer_than_the_context_is_a_400_naming_both_counts(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="word " * 400, max_tokens=4)
    message = info.value.body["message"]
    assert "longer than the model's context length (256 tokens)" in message
    assert "The input (" in message


def test_invalid_parameters_are_a_400_and_the_server_keeps_serving(client, url):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-3)
    assert info.value.body["param"] == "temperature"
    response = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["object"] == "error"
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_native_generate_with_input_ids_and_stop_token(url):
    first = httpx.post(f"{url}/generate", json={"input_ids": [5, 6, 7, 8],
                                                "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}).json()
    stop = first["output_ids"][2]
    second = httpx.post(f"{url}/generate", json={"input_ids": [5, 6, 7, 8],
                                                 "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop]}}).json()
    assert second["output_ids"] == first["output_ids"][: first["output_ids"].index(stop) + 1]
    assert second["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert second["meta_info"]["cached_tokens"] == 3  # the prompt but its last token, from the first run


def test_logit_bias_bans_and_forces_tokens_through_both_apis(client, url):
    """OpenAI's logit_bias through the SDK and SGLang's through /generate: -100 bans the greedy
    pick, +100 forces a token (sampled or greedy), and a batch-mate without a bias is unchanged."""
    ids = [11, 12, 13, 14]
    native = dict(max_new_tokens=6, temperature=0, ignore_eos=True)
    free = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": native}).json()["output_ids"]
    banned = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": native | {
        "logit_bias": {str(free[0]): -100}}}).json()["output_ids"]
    assert banned[0] != free[0]
    forced = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0.9, seed=3,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    forced_native = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0.9, "ignore_eos": True, "logit_bias": {"42": 100}}}).json()
    assert forced_native["output_ids"] == [42] * 5
    assert forced.usage.completion_tokens == 5 and forced.choices[0].text == forced_native["text"]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           temperature=0, logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3 and reply.choices[0].message.content
    again = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": native}).json()["output_ids"]
    assert again == free


def test_batched_prompts_answer_as_one_prompt_each(client):
    """A list of prompts in /v1/completions (strings and token ids): choice p * n + i is prompt
    p's choice i, equal to what that prompt alone gets (greedy), streamed or not; the usage counts
    each prompt once."""
    prompts = ["The capital of France is", "Once upon a time", "One two three"]
    args = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **args) for p in prompts]
    batched = client.completions.create(prompt=prompts, n=2, **args)
    assert [c.index for c in batched.choices] == list(range(6))
    assert [c.text for c in batched.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batched.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batched.usage.completion_tokens == 6 * 6
    texts = ["", "", ""]
    for chunk in client.completions.create(prompt=prompts, stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [a.choices[0].text for a in alone]
    ids = client.completions.create(prompt=[[11, 12, 13], [14, 15]], **args)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5


def test_a_client_disconnect_aborts_the_request_and_nothing_stays_used(url):
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{url}/generate", json={"text": "abc", "stream": True,
                                                          "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # got one chunk: hang up

    def idle() -> bool:
        info = httpx.get(f"{url}/server_info").json()["scheduler"]
        return info.get("running_requests") == 0 and info.get("kv_pool", {}).get("used") == 0

    assert wait_until(idle, timeout=10, interval=0.2), httpx.get(f"{url}/server_info").json()


def test_after_requests_finish_nothing_is_used_and_a_flush_frees_everything(client, url):
    client.completions.create(model=MODEL, prompt="fill the cache", max_tokens=8)

    def pool():
        return httpx.get(f"{url}/server_info").json()["scheduler"]["kv_pool"]

    assert wait_until(lambda: pool()["used"] == 0 and pool()["evictable"] > 0, timeout=10, interval=0.2), pool()
    assert httpx.post(f"{url}/flush_cache").status_code == 200
    assert wait_until(lambda: pool()["free"] == pool()["total"], timeout=10, interval=0.2), pool()


def test_openapi_document_lists_the_routes(url):
    document = httpx.get(f"{url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/generate", "/health"} <= set(document["paths"])
    json.dumps(document)


def test_an_idle_server_burns_almost_no_cpu(shared_server):
    """Every actor sleeps when there is nothing to do: under 2% of a core each, over 4 s (a
    longer window than the issue's 2 s, so that a one-off 40 ms of clean-up after the previous
    test, four clock ticks, cannot decide the result)."""
    import time
    from pathlib import Path

    def cpu_seconds(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    pids = {"ingress": shared_server.popen.pid, **shared_server.actor_pids()}
    assert len(pids) == 4
    time.sleep(1.0)  # let the previous test's work drain
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(4.0)
    used = {name: (cpu_seconds(pid) - before[name]) / 4.0 for name, pid in pids.items()}
    assert all(share < 0.02 for share in used.values()), used


def test_abort_request_by_id_ends_every_choice_of_that_request(url):
    import threading

    finishes: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{url}/v1/completions", headers={"X-Request-Id": "abort-me"}, json={
                    "model": MODEL, "prompt": "go on", "max_tokens": None, "n": 2, "stream": True,
                    "ignore_eos": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        started.set()
                        choice = json.loads(line[6:])["choices"]
                        if choice and choice[0].get("finish_reason"):
                            finishes.append(choice[0]["finish_reason"])

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert started.wait(30)
    assert httpx.post(f"{url}/abort_request", json={"rid": "abort-me"}).json() == {"success": True}
    reader.join(timeout=30)
    assert not reader.is_alive()
    assert finishes == ["abort", "abort"]
    assert httpx.post(f"{url}/abort_request", json={"rid": "abort-me"}).json() == {"success": False}


def test_logprobs_name_tokens_by_their_text(client):
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == 4 and len(logprobs.token_logprobs) == 4
    assert not any(token.startswith("token_id:") for token in logprobs.tokens)
    assert all(lp <= 0.0 for lp in logprobs.token_logprobs)
    if "\ufffd" not in reply.choices[0].text:
        assert "".join(logprobs.tokens) == reply.choices[0].text


def test_a_request_larger_than_a_channel_is_a_413_and_the_server_keeps_serving(url):
    response = httpx.post(f"{url}/generate", json={"text": "a" * 9_000_000, "sampling_params": {"max_new_tokens": 1}},
                          timeout=60)
    assert response.status_code == 413
    assert "too large" in response.json()["message"]
    assert httpx.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"text": "hi", "priority": 1}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "priority": 0}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "priority": -3}),
])
def test_a_priority_without_priority_scheduling_is_a_400_saying_how_to_turn_it_on(url, path, body):
    response = httpx.post(f"{url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["param"] == "priority"
    assert "--enable-priority-scheduling" in response.json()["message"]
