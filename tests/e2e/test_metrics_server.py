"""GET /metrics on a real server (--enable-metrics) after real traffic, parsed with
prometheus_client's parser: every counter moves by what the clients sent and received, the
histograms count the requests, the gauges fall back to 0 at rest, and every metric the Grafana
dashboard queries exists.

One server for the module: one request decodes at a time and one may wait
(``--max-running-requests 1 --max-queued-requests 1``), so that a burst meets a full queue;
``--max-connections 16`` so that a connection past the cap can be provoked. Each test compares
scrapes taken before and after its own traffic. The scheduler's and the other actors' metrics
reach the ingress in snapshots (every 0.5 s while they change, and when the scheduler goes
idle): a test waits until they have caught up, then checks exact values.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server import serving

MODEL = "tiny-llama-v1"
CONTEXT = 256
MAX_CONNECTIONS = 16
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "app-dashboard.json"
GAUGES_AT_REST = ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "token_usage", "full_token_usage",
                  "pending_prealloc_token_usage", "swa_token_usage", "mamba_usage", "gen_throughput")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def url(cache_dir):
    with serving("--enable-metrics", "--context-length", str(CONTEXT), "--max-total-tokens", "4096",
                 "--max-running-requests", "1", "--max-queued-requests", "1",
                 "--max-connections", str(MAX_CONNECTIONS), cache_dir=cache_dir) as served:
        yield served


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


class Scrape:
    """One GET /metrics, parsed: its families (by name and type) and every sample's value."""

    def __init__(self, url: str) -> None:
        response = httpx.get(f"{url}/metrics", timeout=10)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        self.types: dict[str, str] = {}
        self.samples: Samples = {}
        for family in text_string_to_metric_families(response.text):
            self.types[family.name] = family.type
            for sample in family.samples:
                labels = dict(sample.labels)
                assert labels.pop("model_name") == MODEL, sample  # every sample names the model
                self.samples[(sample.name, frozenset(labels.items()))] = sample.value

    def value(self, name: str, **labels: str) -> float:
        """The sample ``app:<name>`` with exactly ``labels`` (besides model_name); 0 when absent."""
        return self.samples.get(("app:" + name, frozenset(labels.items())), 0.0)

    def total(self, name: str, **labels: str) -> float:
        """The sum of the samples ``app:<name>`` whose labels include ``labels``."""
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == "app:" + name and wanted <= ls)


def settled(url: str, check: Callable[[Scrape], bool], timeout: float = 15.0) -> Scrape:
    """The first scrape for which ``check`` holds (the actors' snapshots have caught up), or the
    last one after ``timeout`` (the caller's exact assertions then say what is off)."""
    deadline = time.monotonic() + timeout
    while True:
        scrape = Scrape(url)
        if check(scrape) or time.monotonic() > deadline:
            return scrape
        time.sleep(0.1)


def quiet(url: str, timeout: float = 15.0) -> Scrape:
    """A scrape once nothing moves: at rest, and equal to one taken a snapshot interval (0.5 s)
    earlier, so that no actor has a snapshot still to send (the baseline of a test)."""
    deadline = time.monotonic() + timeout
    previous = Scrape(url)
    while True:
        time.sleep(0.7)
        scrape = Scrape(url)
        moving = {k for k in scrape.samples.keys() | previous.samples.keys()
                  if k[0] != "app:http_requests_total" and scrape.samples.get(k) != previous.samples.get(k)}
        if (at_rest(scrape) and not moving) or time.monotonic() > deadline:
            assert not moving, sorted(moving)
            return scrape
        previous = scrape


def at_rest(scrape: Scrape) -> bool:
    return all(scrape.value(gauge) == 0 for gauge in GAUGES_AT_REST)


def completion_stream(client: openai.OpenAI, **args) -> tuple[object, str | None]:
    """A streamed completion read to its end: (its final usage, its finish reason)."""
    usage, finish = None, None
    for chunk in client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **args):
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    return usage, finish


def cached(usage) -> int:
    details = usage.prompt_tokens_details
    return details.cached_tokens if details is not None and details.cached_tokens else 0


def test_tokens_requests_and_latencies_count_what_the_clients_sent_and_received(url, client):
    before = quiet(url)
    long = dict(prompt="The metrics of a server", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    free = client.completions.create(model=MODEL, **long)  # greedy: the text a stop string is taken from
    text = free.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip() and text.index(stop) > 0, text
    stopped = client.completions.create(model=MODEL, stop=[stop], **long)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 40, stopped
    streamed, streamed_finish = completion_stream(client, prompt="Streams count", max_tokens=12,
                                                  extra_body={"ignore_eos": True})
    assert (streamed.completion_tokens, streamed_finish) == (12, "length")
    stop_streamed, stop_streamed_finish = completion_stream(client, stop=[stop], **long)
    assert stop_streamed_finish == "stop" and stop_streamed.completion_tokens == stopped.usage.completion_tokens
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5
    usages = [free.usage, stopped.usage, streamed, stop_streamed, chat.usage]
    delivered = sum(u.completion_tokens for u in usages)
    requests = len(usages)

    def caught_up(s: Scrape) -> bool:  # the scheduler's, tokenizer's and detokenizer's snapshots
        return at_rest(s) and all(s.total(name) - before.total(name) >= count for name, count in (
            ("queue_time_seconds_count", requests), ("tokenize_time_seconds_count", requests),
            ("stop_string_hits_total", 2)))

    after = settled(url, caught_up)

    def delta(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    # generation_tokens_total: what the clients received (tokens decoded past a stop string never count)
    assert delta("generation_tokens_total") == delivered
    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("cached_tokens_total") == sum(cached(u) for u in usages)
    assert delta("num_requests_total", finish_reason="length") == 3
    assert delta("num_requests_total", finish_reason="stop") == 2
    assert delta("num_requests_total", finish_reason="abort") == 0
    assert delta("num_rejected_requests_total") == 0
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "queue_time_seconds"):
        assert delta(f"{histogram}_count") == requests, histogram
        assert delta(f"{histogram}_bucket", le="+Inf") == requests, histogram
        assert delta(f"{histogram}_sum") > 0, histogram
    # every streamed token after a request's first output is one inter-token gap
    assert delta("inter_token_latency_seconds_count") >= streamed.completion_tokens - 1
    assert delta("http_requests_total", route="/v1/completions", status="200") == 4
    assert delta("http_requests_total", route="/v1/chat/completions", status="200") == 1
    assert delta("decode_time_seconds_count") >= delivered - requests  # one step per token after the first
    assert delta("prefill_time_seconds_count") >= requests
    assert delta("tokenize_time_seconds_count") == requests
    assert delta("stop_string_hits_total") == 2
    assert delta("detokenize_time_seconds_count") > 0
    assert after.value("max_total_num_tokens") == 4096
    assert after.value("cache_hit_rate") >= 0 and after.types["app:cache_hit_rate"] == "gauge"


def test_a_client_that_leaves_is_an_abort(url):
    before = quiet(url)
    body = {"model": MODEL, "prompt": "Leave early", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: {"))
        assert json.loads(first[6:])["choices"]
    # the connection closed with the stream half read: the server aborts the request
    after = settled(url, lambda s: at_rest(s) and s.total("num_aborted_requests_total")
                    > before.total("num_aborted_requests_total"))
    assert after.total("num_requests_total", finish_reason="abort") - before.total(
        "num_requests_total", finish_reason="abort") == 1
    assert after.total("num_aborted_requests_total") - before.total("num_aborted_requests_total") == 1
    assert after.total("time_to_first_token_seconds_count") - before.total("time_to_first_token_seconds_count") == 1
    assert after.total("e2e_request_latency_seconds_count") == before.total("e2e_request_latency_seconds_count")
    assert after.total("generation_tokens_total") - before.total("generation_tokens_total") >= 1


def test_bad_requests_are_counted_by_where_they_were_refused(url, client):
    before = quiet(url)
    with pytest.raises(openai.BadRequestError):  # the schema refuses it: the backend never sees it
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1)
    with pytest.raises(openai.BadRequestError):  # the tokenizer refuses it: over the context
        client.completions.create(model=MODEL, prompt="x", max_tokens=CONTEXT + 10)
    assert httpx.get(f"{url}/no/such/route").status_code == 404
    after = Scrape(url)
    assert after.value("num_rejected_requests_total", reason="invalid") - before.value(
        "num_rejected_requests_total", reason="invalid") == 1
    assert after.value("http_requests_total", route="/v1/completions", status="400") - before.value(
        "http_requests_total", route="/v1/completions", status="400") == 2
    assert after.value("http_requests_total", route="other", status="404") - before.value(
        "http_requests_total", route="other", status="404") == 1
    assert after.total("num_requests_total") == before.total("num_requests_total")


def test_a_burst_past_the_queue_counts_each_refusal_once(url):
    before = quiet(url)
    body = {"model": MODEL, "prompt": "A burst", "max_tokens": 60, "ignore_eos": True}

    def send(_: int) -> int:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code

    with ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(send, range(6)))
    refused, served = statuses.count(503), statuses.count(200)
    assert refused >= 1 and served >= 1 and refused + served == 6, statuses
    after = settled(url, lambda s: at_rest(s) and s.value("queue_time_seconds_count") - before.value(
        "queue_time_seconds_count") >= served)
    assert after.value("num_rejected_requests_total", reason="queue_full") - before.value(
        "num_rejected_requests_total", reason="queue_full") == refused
    assert after.value("num_requests_total", finish_reason="length") - before.value(
        "num_requests_total", finish_reason="length") == served
    assert after.value("http_requests_total", route="/v1/completions", status="503") - before.value(
        "http_requests_total", route="/v1/completions", status="503") == refused
    assert after.value("generation_tokens_total") - before.value("generation_tokens_total") == 60 * served
    assert after.value("queue_time_seconds_count") - before.value("queue_time_seconds_count") == served


def test_the_gauges_show_a_busy_scheduler_then_fall_to_zero(url):
    settled(url, at_rest)
    body = {"model": MODEL, "prompt": "Busy", "max_tokens": CONTEXT - 8, "ignore_eos": True, "stream": True}
    busy: list[Scrape] = []
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if not busy or busy[-1].value("num_running_reqs") == 0:
                busy.append(Scrape(url))
            if line == "data: [DONE]":
                break
    running = [s for s in busy if s.value("num_running_reqs") == 1]
    assert running, [s.value("num_running_reqs") for s in busy]
    seen = running[-1]
    assert seen.value("num_used_tokens") > 0 and 0 < seen.value("token_usage") <= 1
    assert seen.value("full_token_usage") == seen.value("token_usage")
    assert seen.value("swa_token_usage") == 0 and seen.value("mamba_usage") == 0
    rest = settled(url, at_rest)
    for gauge in GAUGES_AT_REST:
        assert rest.value(gauge) == 0, gauge
        assert rest.types["app:" + gauge] == "gauge"


def test_a_connection_past_the_cap_is_counted_as_a_503(url):
    before = Scrape(url)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    held: list[socket.socket] = []
    refusal = b""
    try:
        for _ in range(MAX_CONNECTIONS + 4):
            sock = socket.create_connection((host, int(port)), timeout=5)
            held.append(sock)
            sock.settimeout(0.3)
            try:
                refusal = sock.recv(64)
            except TimeoutError:
                continue  # held open, unanswered: under the cap
            break
    finally:
        for sock in held:
            sock.close()
    assert refusal.startswith(b"HTTP/1.1 503"), refusal
    after = settled(url, lambda s: s.value("http_requests_total", route="connection", status="503") > before.value(
        "http_requests_total", route="connection", status="503"))
    assert after.value("http_requests_total", route="connection", status="503") - before.value(
        "http_requests_total", route="connection", status="503") == 1


def dashboard_metrics() -> set[str]:
    """Every ``app:`` metric the dashboard's PromQL expressions name."""
    document = json.loads(DASHBOARD.read_text())
    expressions: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            expressions.extend(v for k, v in node.items() if k == "expr" and isinstance(v, str))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(document)
    assert expressions
    return {m for expr in expressions for m in re.findall(r"app:[A-Za-z0-9_:]+", expr)}


def test_every_metric_the_dashboard_queries_exists(url, client):
    client.completions.create(model=MODEL, prompt="Dashboards", max_tokens=4, extra_body={"ignore_eos": True})
    scrape = settled(url, at_rest)
    names = {name for name, _ in scrape.samples}
    queried = dashboard_metrics()
    assert len(queried) >= 10, queried
    missing = sorted(m for m in queried if m not in names)
    assert not missing, missing


def test_the_dashboard_is_a_grafana_dashboard_over_a_datasource_variable():
    document = json.loads(DASHBOARD.read_text())
    assert document["title"] and document["schemaVersion"] >= 30 and document["uid"]
    variables = {v["name"]: v for v in document["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in document["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in document["panels"]}) == len(document["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("queue", "kv", "time to first token", "inter-token", "throughput", "error", "preempt"):
        assert topic in titles, topic
