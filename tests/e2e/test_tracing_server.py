"""--enable-trace on a real server, received by a real OTLP/HTTP receiver on localhost.

One server for the module (context 256, prefill chunks of 16 tokens), its spans sent to the
receiver of otlp_receiver.py every 50 ms (OTEL_BSP_SCHEDULE_DELAY). Each request's spans must
form one trace of its own, from four processes: the ingress's HTTP root span, and the tokenize,
queue, prefill (one per chunk), decode and detokenize spans of each of its choices, every parent
link intact, with the request ids and the token counts the client was answered with. A client's
sampled ``traceparent`` is continued (its trace id, its span as the root's parent); an unsampled
one is honoured (nothing exported); a malformed one starts a new trace. Without --enable-trace
nothing is exported at all.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import httpx
import pytest

# The trace extra (app[trace], pulled in by the test extra) carries the receiver's protobuf
# classes; a machine without it (the lent GPU's image) skips this module.
pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

from otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver
from server import ServerProcess

MODEL = "tiny-llama-v1"
CHUNK = 16  # --chunked-prefill-size
CONTEXT = 256
ACTORS = {"ingress", "tokenizer", "scheduler", "detokenizer"}
PER_CHOICE = ("tokenize", "queue", "prefill", "decode", "detokenize")
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
SPAN_KIND_SERVER = 2
STATUS_ERROR = 2
CLOCK_SLACK_NS = 2_000_000  # times of different processes on one host clock, rounded to ns


@pytest.fixture(scope="module")
def receiver():
    with otlp_receiver() as received:
        yield received


@pytest.fixture(scope="module")
def server(receiver, cache_dir):
    served = ServerProcess("--context-length", str(CONTEXT), "--max-total-tokens", "4096",
                           "--chunked-prefill-size", str(CHUNK),
                           "--enable-trace", "--otlp-traces-endpoint", receiver.endpoint,
                           cache_dir=cache_dir, env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
    try:
        served.wait_serving()
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def answers(server, receiver):
    """Every request of the module's tests, sent once; their answers by name, once the spans of
    the last one have arrived."""
    url = server.url
    done: dict[str, dict] = {}
    with httpx.Client(base_url=url, timeout=60) as http:
        unsampled = http.post("/v1/completions", headers={"x-request-id": "trace-unsampled",
                                                          "traceparent": f"00-{'1' * 32}-{'2' * 16}-00"},
                              json={"model": MODEL, "prompt": "Not sampled", "max_tokens": 2})
        done["unsampled"] = {"status": unsampled.status_code}
        plain = http.post("/v1/completions", headers={"x-request-id": "trace-plain"},
                          json={"model": MODEL, "prompt": "A plain request", "max_tokens": 4, "ignore_eos": True})
        done["plain"] = {"status": plain.status_code, "usage": plain.json()["usage"],
                         "finish": plain.json()["choices"][0]["finish_reason"]}
        with http.stream("POST", "/v1/chat/completions",
                         headers={"x-request-id": "trace-stream", "traceparent": "00-not-a-trace-context"},
                         json={"model": MODEL, "messages": [{"role": "user", "content": "Stream this"}],
                               "max_tokens": 3, "stream": True, "ignore_eos": True,
                               "stream_options": {"include_usage": True}}) as streamed:
            events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
        done["stream"] = {"status": streamed.status_code, "usage": events[-1]["usage"],
                          "finish": [e for e in events if e["choices"]][-1]["choices"][0]["finish_reason"]}
        prompt = list(range(100, 140))  # 40 tokens: prefill chunks of 16, 16 and 8 (less what is cached)
        parented = http.post("/generate", headers={"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"},
                             json={"rid": "trace-parent", "input_ids": prompt,
                                   "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        meta = parented.json()["meta_info"]
        done["parent"] = {"status": parented.status_code, "usage": {"prompt_tokens": meta["prompt_tokens"],
                                                                  "completion_tokens": meta["completion_tokens"]}}
        choices = http.post("/v1/completions", headers={"x-request-id": "trace-n"},
                            json={"model": MODEL, "prompt": "Two choices", "max_tokens": 2, "n": 2, "seed": 7,
                                  "ignore_eos": True})
        done["n"] = {"status": choices.status_code, "usage": choices.json()["usage"]}
        too_long = http.post("/generate", json={"rid": "trace-rejected", "input_ids": [5] * (CONTEXT + 10)})
        done["rejected"] = {"status": too_long.status_code}
    expected = {("POST /v1/completions", "trace-plain"), ("POST /v1/chat/completions", "trace-stream"),
                ("POST /generate", "trace-parent"), ("POST /v1/completions", "trace-n"),
                ("POST /generate", "trace-rejected"), ("tokenize", "trace-rejected")}
    expected |= {(name, rid) for rid in ("trace-plain", "trace-stream", "trace-parent", "trace-n-0", "trace-n-1")
                 for name in PER_CHOICE}
    receiver.wait_for(lambda spans: expected <= {(s.name, s.attributes.get("app.request_id")) for s in spans})
    return done


def spans_by_trace(receiver: OtlpReceiver) -> dict[str, list[ReceivedSpan]]:
    traces: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for span in receiver.snapshot():
        traces[span.trace_id].append(span)
    return traces


def trace_of(receiver: OtlpReceiver, request_id: str) -> list[ReceivedSpan]:
    """The one trace whose root span is the HTTP request ``request_id``'s."""
    roots = [s for s in receiver.snapshot() if s.kind == SPAN_KIND_SERVER and s.attributes["app.request_id"] == request_id]
    assert len(roots) == 1, roots
    return spans_by_trace(receiver)[roots[0].trace_id]


def check_trace(spans: list[ReceivedSpan], route: str, choices: list[str], external_parent: str = "") -> ReceivedSpan:
    """The checks every served request's trace passes; returns its root span."""
    [root] = [s for s in spans if s.kind == SPAN_KIND_SERVER]
    assert root.name == route and root.parent_span_id == external_parent
    assert root.attributes["http.response.status_code"] == 200 and root.status_code != STATUS_ERROR
    ids = {s.span_id for s in spans}
    for span in spans:
        if span is not root:  # every other span's parent is in this trace: here, the root
            assert span.parent_span_id in ids and span.parent_span_id == root.span_id, span
            assert root.start_ns - CLOCK_SLACK_NS <= span.start_ns <= span.end_ns <= root.end_ns + CLOCK_SLACK_NS, span
    actors = {s.resource["app.actor"]: s.resource["process.pid"] for s in spans}
    assert set(actors) == ACTORS and len(set(actors.values())) == 4  # four processes
    assert {s.resource["service.name"] for s in spans} == {"app"}
    for rid in choices:
        names = sorted(s.name for s in spans if s is not root and s.attributes.get("app.request_id") == rid)
        assert set(names) == set(PER_CHOICE) and names.count("tokenize") == 1 and names.count("decode") == 1, names
        by_actor = {s.name: s.resource["app.actor"] for s in spans
                    if s is not root and s.attributes.get("app.request_id") == rid}
        assert by_actor == {"tokenize": "tokenizer", "queue": "scheduler", "prefill": "scheduler",
                            "decode": "scheduler", "detokenize": "detokenizer"}
    return root


def choice_spans(spans: list[ReceivedSpan], rid: str) -> dict[str, list[ReceivedSpan]]:
    named: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for span in sorted(spans, key=lambda s: s.start_ns):
        if span.kind != SPAN_KIND_SERVER and span.attributes.get("app.request_id") == rid:
            named[span.name].append(span)
    return named


def test_a_request_is_one_trace_with_every_span_and_its_token_counts(answers, receiver):
    assert answers["plain"]["status"] == 200
    spans = trace_of(receiver, "trace-plain")
    check_trace(spans, "POST /v1/completions", ["trace-plain"])
    usage = answers["plain"]["usage"]
    named = choice_spans(spans, "trace-plain")
    assert named["tokenize"][0].attributes["app.prompt_tokens"] == usage["prompt_tokens"]
    [queue], [decode], [detokenize] = named["queue"], named["decode"], named["detokenize"]
    assert queue.attributes["app.prompt_tokens"] == usage["prompt_tokens"]
    cached = queue.attributes["app.cached_tokens"]
    assert cached == usage.get("prompt_tokens_details", {}).get("cached_tokens", cached)
    assert sum(p.attributes["app.chunk_tokens"] for p in named["prefill"]) == usage["prompt_tokens"] - cached
    assert decode.attributes["app.completion_tokens"] == usage["completion_tokens"] == 4
    assert decode.attributes["app.finish_reason"] == answers["plain"]["finish"] == "length"
    assert detokenize.attributes["app.completion_tokens"] == 4
    assert detokenize.attributes["app.finish_reason"] == "length"
    # the request's path in time: queued after tokenization began, decoded after its prefill
    assert named["tokenize"][0].start_ns >= queue.start_ns - CLOCK_SLACK_NS
    assert queue.end_ns <= named["prefill"][0].start_ns + CLOCK_SLACK_NS
    assert named["prefill"][-1].end_ns <= decode.start_ns + CLOCK_SLACK_NS
    assert detokenize.end_ns >= decode.end_ns - CLOCK_SLACK_NS


def test_a_stream_with_a_malformed_traceparent_is_a_new_trace(answers, receiver):
    assert answers["stream"]["status"] == 200
    spans = trace_of(receiver, "trace-stream")
    root = check_trace(spans, "POST /v1/chat/completions", ["trace-stream"])
    assert root.trace_id != "0" * 32 and root.parent_span_id == ""
    named = choice_spans(spans, "trace-stream")
    assert named["decode"][0].attributes["app.completion_tokens"] == answers["stream"]["usage"]["completion_tokens"] == 3
    assert named["detokenize"][0].attributes["app.outputs"] >= 2  # streamed: several outputs
    assert named["tokenize"][0].attributes["app.prompt_tokens"] == answers["stream"]["usage"]["prompt_tokens"]


def test_an_incoming_traceparent_is_continued_and_each_prefill_chunk_is_a_span(answers, receiver):
    assert answers["parent"]["status"] == 200
    spans = spans_by_trace(receiver)[CLIENT_TRACE_ID]  # the client's trace id
    root = check_trace(spans, "POST /generate", ["trace-parent"], external_parent=CLIENT_SPAN_ID)
    assert root.attributes["app.request_id"] == "trace-parent"  # the body's rid
    named = choice_spans(spans, "trace-parent")
    cached = named["queue"][0].attributes["app.cached_tokens"]
    computed = 40 - cached
    chunks = [p.attributes["app.chunk_tokens"] for p in named["prefill"]]
    assert len(chunks) == math.ceil(computed / CHUNK) >= 2 and sum(chunks) == computed
    assert all(c == CHUNK for c in chunks[:-1])
    assert [p.attributes["app.prompt_complete"] for p in named["prefill"]] == [False] * (len(chunks) - 1) + [True]
    for earlier, later in zip(named["prefill"], named["prefill"][1:]):
        assert earlier.end_ns <= later.start_ns + CLOCK_SLACK_NS
    assert named["decode"][0].attributes["app.completion_tokens"] == answers["parent"]["usage"]["completion_tokens"] == 3


def test_the_choices_of_one_request_share_its_trace(answers, receiver):
    assert answers["n"]["status"] == 200
    spans = trace_of(receiver, "trace-n")
    check_trace(spans, "POST /v1/completions", ["trace-n-0", "trace-n-1"])
    decoded = sum(choice_spans(spans, rid)["decode"][0].attributes["app.completion_tokens"]
                  for rid in ("trace-n-0", "trace-n-1"))
    assert decoded == answers["n"]["usage"]["completion_tokens"] == 4


def test_a_rejected_request_ends_in_its_tokenize_span(answers, receiver):
    assert answers["rejected"]["status"] == 400
    spans = trace_of(receiver, "trace-rejected")
    assert sorted(s.name for s in spans) == ["POST /generate", "tokenize"]
    [tokenize] = [s for s in spans if s.name == "tokenize"]
    [root] = [s for s in spans if s.name == "POST /generate"]
    assert tokenize.parent_span_id == root.span_id
    assert tokenize.status_code == STATUS_ERROR and "context length" in tokenize.status_message
    assert tokenize.attributes["app.status_code"] == 400 == root.attributes["http.response.status_code"]


def test_every_trace_is_its_own_and_nothing_is_orphaned(answers, receiver):
    traces = spans_by_trace(receiver)
    roots = {rid: trace_of(receiver, rid)[0].trace_id for rid in ("trace-plain", "trace-stream", "trace-n")}
    roots["trace-parent"] = CLIENT_TRACE_ID
    assert len(set(roots.values())) == len(roots)  # one trace per request
    for trace_id, spans in traces.items():  # the warm-up and the health probes have no spans
        ids = {s.span_id for s in spans}
        external = CLIENT_SPAN_ID if trace_id == CLIENT_TRACE_ID else ""
        for span in spans:
            assert span.parent_span_id in ids or span.parent_span_id == external, span


def test_an_unsampled_traceparent_is_honoured(answers, receiver):
    assert answers["unsampled"]["status"] == 200
    # it was sent first: had any of its spans been recorded, they would have arrived before the others
    assert "1" * 32 not in spans_by_trace(receiver)
    assert not [s for s in receiver.snapshot() if s.attributes.get("app.request_id") == "trace-unsampled"]


def test_without_enable_trace_nothing_is_exported(cache_dir):
    with otlp_receiver() as idle:
        server = ServerProcess("--context-length", str(CONTEXT), "--max-total-tokens", "4096",
                               "--otlp-traces-endpoint", idle.endpoint,
                               cache_dir=cache_dir, env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
        try:
            url = server.wait_serving()
            answer = httpx.post(f"{url}/v1/completions", timeout=60,
                                headers={"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"},
                                json={"model": MODEL, "prompt": "Untraced", "max_tokens": 2})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
        finally:
            server.stop()  # a tracing server would have flushed its spans by now
        assert idle.exports == 0 and idle.snapshot() == []


def test_a_client_that_leaves_mid_stream_ends_its_trace_with_errors(server, receiver):
    body = {"rid": "trace-abort", "text": "Leave early", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/generate", json=body) as streamed:
        assert streamed.status_code == 200
        next(line for line in streamed.iter_lines() if line.startswith("data: {"))  # one event, then leave
    spans = receiver.wait_for(lambda got: {"decode", "detokenize", "POST /generate"} <= {
        s.name for s in got if s.attributes.get("app.request_id") == "trace-abort"})
    named = {s.name: s for s in spans if s.attributes.get("app.request_id") == "trace-abort"}
    root = named["POST /generate"]
    assert root.status_code == STATUS_ERROR and "not sent in full" in root.status_message
    for name in ("decode", "detokenize"):
        span = named[name]
        assert span.trace_id == root.trace_id and span.parent_span_id == root.span_id
        assert span.status_code == STATUS_ERROR and span.attributes["app.finish_reason"] == "abort"
        assert span.attributes["app.status_code"] == 499
    assert 1 <= named["decode"].attributes["app.completion_tokens"] < 200
