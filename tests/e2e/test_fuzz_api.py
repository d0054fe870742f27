"""Hostile input against one live server: no request may take it down or get a 5xx.

Every field of every route that takes a body (``/v1/completions``, ``/v1/chat/completions``,
``/generate`` with its ``sampling_params``, ``/abort_request``), plus an unknown field in every
object, gets the extremes a hostile or broken client sends: integers around the int32, int64 and
uint64 edges and far beyond, floats from tiny to out of range, ``NaN`` and ``Infinity`` as raw
tokens (not JSON), wrong types, huge lists and objects, deep nesting, invalid UTF-8, very long
strings. Each body is a valid one with one or a few fields replaced, so validation reaches the
field (the fields are read from the request Structs, so a new one is fuzzed too); fully random
JSON and bytes come last. The tests:

- the issue's exact requests (explicit): each a 400 whose ``param`` names the field;
- a grid (explicit): every extreme at every field, one request each, all failures of a field
  listed in one assertion, so a run names every failing input;
- hypothesis: one to three fields replaced by extremes or random values, random JSON objects
  over the route's field names, random and mangled bytes (derandomized: the same examples every
  run; no shrinking, which would replay crashing requests against a restarting server);
- malformed bodies (empty, truncated, not an object, 100,000 levels deep...) on every POST route;
- after every test (``still_serving``) and after the whole module: ``/health`` is 200, a normal
  completion is 200, the server and its actors run, its log has no ``Traceback``; and the
  fields fuzzed here are those the live ``/openapi.json`` declares.

Every answer must be below 500 (a 503 too is a failure here), except the 503 of an expired timeout
(the server sets none of its own, so a request that gets one asked for it with a tiny ``timeout`` or
``waiting_timeout``: the documented answer); a 4xx must be our JSON error body,
and a 400 for a replaced field names it in ``param`` (or a field inside or around it), unless
the body was malformed JSON or too deeply nested to parse, where no field can be named.

One server serves the module. A request that takes it down fails its test; the next request
then starts a fresh one (at most ``MAX_RESTARTS`` times), so that one crash does not hide the
failures after it, and the module's last test fails when any restart was needed.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from app.http.schemas import AbortBody, ChatCompletionRequest, CompletionRequest, GenerateBody
from server import ServerProcess, alive, wait_until

SERVER_FLAGS = ("--context-length", "256", "--max-total-tokens", "4096")
MODEL = "tiny-llama-v1"
NORMAL_REQUEST = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
REQUEST_TIMEOUT_S = 20.0  # the slowest valid request here (16 choices of 254 tokens) takes a few seconds
MAX_RESTARTS = 6  # past this many crashes in a module, stop restarting: the rest fails at once
JSON_HEADERS = {"content-type": "application/json"}


# ---------------------------------------------------------------- values


class Value(NamedTuple):
    """One JSON value as the bytes sent, shown by ``label`` (huge values stay readable)."""

    label: str
    json: bytes
    # Whether a 400 for it must name its field: false where the body is no longer JSON (NaN,
    # invalid UTF-8) or is nested too deeply to parse, so the server cannot know the field.
    nameable: bool = True

    def __repr__(self) -> str:
        return self.label

    @classmethod
    def of(cls, value: Any, label: str | None = None) -> Value:
        """A Python value; non-finite floats become the raw tokens ``NaN``/``Infinity`` (not JSON)."""
        text = json.dumps(value, ensure_ascii=False).encode()
        shown = label or repr(value)
        return cls(shown if len(shown) <= 80 else shown[:77] + "...", text, _finite(value))

    def in_list(self) -> Value:
        return Value(f"[{self.label}]", b"[" + self.json + b"]", self.nameable)

    def in_object(self, key: str = "1") -> Value:
        return Value(f"{{{key!r}: {self.label}}}", b"{" + json.dumps(key).encode() + b":" + self.json + b"}",
                     self.nameable)


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


INT_EXTREMES = [Value.of(value, label) for label, value in (
    ("0", 0), ("-1", -1), ("1", 1), ("2**31-1", 2**31 - 1), ("2**31", 2**31), ("2**63-1", 2**63 - 1),
    ("2**63", 2**63), ("2**64-1", 2**64 - 1), ("2**64", 2**64), ("-2**63", -(2**63)), ("-2**63-1", -(2**63) - 1),
    ("-2**31-1", -(2**31) - 1), ("10**30", 10**30), ("-10**30", -(10**30)))]
FLOAT_EXTREMES = [
    *(Value.of(v) for v in (0.0, -0.0, 0.5, 5e-324, -5e-324, 2.2250738585072014e-308, 1e308, -1e308, 2.0000000001)),
    Value("1e400", b"1e400"),
    Value("-1e400", b"-1e400"),
    Value("NaN", b"NaN", nameable=False),
    Value("Infinity", b"Infinity", nameable=False),
    Value("-Infinity", b"-Infinity", nameable=False),
]
WRONG_TYPES = [Value.of(v) for v in ("", "x", "1", [], [1], {}, {"a": 1}, None, True, False)]
STRING_EXTREMES = [
    Value('"a"*100000', b'"' + b"a" * 100_000 + b'"'),
    Value('"\\u00e9"*50000', ('"' + "\u00e9" * 50_000 + '"').encode()),
    Value('"\\xff\\xfe" (invalid UTF-8)', b'"a\xff\xfeb"', nameable=False),
    Value('"\\ud800" (lone surrogate)', b'"\\ud800"', nameable=False),
    Value.of("\u0000\u001f\u2028"),
    Value.of("\U0001f600" * 10),
]
HUGE = [
    Value("[1]*100000", b"[" + b",".join([b"1"] * 100_000) + b"]"),
    Value('["a"]*10000', b"[" + b",".join([b'"a"'] * 10_000) + b"]"),
    Value('[{"role":"user","content":"a"}]*10000',
              b"[" + b",".join([b'{"role":"user","content":"a"}'] * 10_000) + b"]"),
    Value('{"0":0,...,"9999":0}', b"{" + b",".join(f'"{i}":0'.encode() for i in range(10_000)) + b"}"),
    Value("[[[...]]] 20000 deep", b"[" * 20_000 + b"]" * 20_000, nameable=False),
    Value('{"a":{"a":...}} 10000 deep', b'{"a":' * 10_000 + b"1" + b"}" * 10_000, nameable=False),
]
# All of them; the grid gives each field those its type makes distinct (values_for).
EXTREMES = [*INT_EXTREMES, *FLOAT_EXTREMES, *WRONG_TYPES, *STRING_EXTREMES, *HUGE]

# What a field's type does not matter to: the parser must get through them (or refuse them).
PARSER_EXTREMES = [*(v for v in INT_EXTREMES if v.label in {"2**64", "-2**63-1", "10**30"}), *FLOAT_EXTREMES[-5:],
                   *STRING_EXTREMES, *HUGE]
# Inside a list or an object (a token id, a stop string, a bias).
ELEMENT_EXTREMES = [v for v in EXTREMES if v.label in {
    "-1", "2**31", "2**63", "2**64", "-2**63-1", "10**30", "5e-324", "1e308", "1e400", "NaN", "Infinity",
    "''", "None", "{}", "[]", '"a"*100000', '"\\xff\\xfe" (invalid UTF-8)', "[[[...]]] 20000 deep"}]
# JSON object keys where a token id is expected (logit_bias); Python's int() accepts some oddly.
KEY_EXTREMES = [Value(f"{{{label}: 1}}", b"{" + json.dumps(key).encode() + b":1}") for label, key in (
    *((repr(k), k) for k in ("-1", "2147483648", "9223372036854775808", "18446744073709551616", "", "x", "1.5",
                             " 1", "+1", "1_000", "0x10", "\u0661", "\u0000")),
    ("'1'*40", "1" * 40), ("'9'*5000", "9" * 5000))]


# ---------------------------------------------------------------- routes and their fields


class Route(NamedTuple):
    path: str
    schema: type  # the request body's Struct
    base: dict[str, Any]  # a valid body, answered quickly
    # Fields the base drops when one is replaced (exactly one of text and input_ids).
    exclusive: dict[str, tuple[str, ...]] = {}
    # Where a 400 about a replaced field may name another (both of a pair that excludes each other).
    also_named: dict[str, tuple[str, ...]] = {}


ROUTES = {
    "completions": Route("/v1/completions", CompletionRequest,
                         {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}}),
    "chat": Route("/v1/chat/completions", ChatCompletionRequest,
                  {"model": MODEL, "max_tokens": 2, "stream_options": {"include_usage": True},
                   "messages": [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    "generate": Route("/generate", GenerateBody, {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                      exclusive={"input_ids": ("text",)}, also_named={"input_ids": ("text",)}),
    "abort": Route("/abort_request", AbortBody, {"rid": "fuzz-no-such-request"}),
}
UNKNOWN = "zz_unknown_field"  # a field no Struct has: ignored in OpenAI bodies, refused in sampling_params


class Field(NamedTuple):
    path: str  # as the server names it in ``param``: ``sampling_params.top_k``, ``messages[1].content``
    type: msgspec.inspect.Type | None  # None: the unknown field

    def kinds(self) -> set[type]:
        """The kinds of value the field's type takes: ``IntType``, ``ListType``, ``StrType``..."""
        found: set[type] = set()
        pending = [self.type]
        while pending:
            t = pending.pop()
            if isinstance(t, msgspec.inspect.UnionType):
                pending.extend(t.types)
            else:
                found.add(type(t))
        return found


def _nested_struct(t: msgspec.inspect.Type, container: type) -> msgspec.inspect.StructType | None:
    """The Struct a value of type ``t`` holds directly (``container`` dict) or as list items (list)."""
    members = t.types if isinstance(t, msgspec.inspect.UnionType) else (t,)
    for member in members:
        if container is dict and isinstance(member, msgspec.inspect.StructType):
            return member
        if (container is list and isinstance(member, msgspec.inspect.ListType)
                and isinstance(member.item_type, msgspec.inspect.StructType)):
            return member.item_type
    return None


def fields_of(schema: type, body: dict[str, Any], prefix: str = "") -> list[Field]:
    """Every field of ``schema``, and of the Structs nested where ``body`` holds an object (or a
    list of them), plus an unknown field in each; derived from the Structs, so a new field is
    fuzzed without editing this file."""
    info = msgspec.inspect.type_info(schema)
    assert isinstance(info, msgspec.inspect.StructType)
    found = [Field(prefix + UNKNOWN, None)]
    for field in info.fields:
        path = prefix + field.encode_name
        found.append(Field(path, field.type))
        value = body.get(field.encode_name)
        if isinstance(value, dict) and (nested := _nested_struct(field.type, dict)):
            found += fields_of(nested.cls, value, path + ".")
        elif isinstance(value, list) and (nested := _nested_struct(field.type, list)):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    found += fields_of(nested.cls, item, f"{path}[{i}].")
    return found


FIELDS = {name: fields_of(route.schema, route.base) for name, route in ROUTES.items()}
TOP_LEVEL = {name: [f.path for f in fields if f.type is not None and "." not in f.path and "[" not in f.path]
             for name, fields in FIELDS.items()}  # the body's own fields


_NUMBERS = {msgspec.inspect.IntType, msgspec.inspect.FloatType, msgspec.inspect.AnyType}


def values_for(field: Field) -> list[Value]:
    """The grid's values for one field: the extremes that test the parser and the wrong types,
    every number where the field takes numbers (elsewhere all of them take one path, the wrong
    type's), extremes inside the lists and objects it takes; only the parser's for an unknown
    field (ignored, or refused by name)."""
    if field.type is None:
        return list(PARSER_EXTREMES)
    kinds = field.kinds()
    values = [v for v in EXTREMES if kinds & _NUMBERS or v in PARSER_EXTREMES or v in WRONG_TYPES]
    if msgspec.inspect.ListType in kinds:
        values += [v.in_list() for v in ELEMENT_EXTREMES]
    if msgspec.inspect.DictType in kinds:
        values += [v.in_object() for v in ELEMENT_EXTREMES] + KEY_EXTREMES
    return values


_STEP = re.compile(r"\.?([^.\[]+)|\[(\d+)\]")


def _steps(path: str) -> list[str | int]:
    return [int(index) if index else name for name, index in _STEP.findall(path)]


def encode(node: Any) -> bytes:
    """A body with Values inside as JSON bytes (Values are sent exactly as they are)."""
    if isinstance(node, Value):
        return node.json
    if isinstance(node, dict):
        return b"{" + b",".join(json.dumps(k).encode() + b":" + encode(v) for k, v in node.items()) + b"}"
    if isinstance(node, list):
        return b"[" + b",".join(encode(v) for v in node) + b"]"
    return json.dumps(node).encode()


class Case(NamedTuple):
    """One request: a route's base body with some fields replaced."""

    route: str
    replaced: dict[str, Value]  # by path

    def __repr__(self) -> str:
        fields = ", ".join(f"{path}={value!r}" for path, value in self.replaced.items())
        return f"POST {ROUTES[self.route].path} with {fields}"

    def body(self) -> bytes:
        route = ROUTES[self.route]
        body = json.loads(json.dumps(route.base))  # a deep copy
        for path in self.replaced:
            for dropped in route.exclusive.get(path, ()):
                body.pop(dropped, None)
        for path, value in self.replaced.items():
            *parents, last = _steps(path)
            node = body
            for step in parents:
                node = node[step]
            node[last] = value
        return encode(body)

    def names(self) -> set[str]:
        """The params a 400 may name: a replaced field, one inside it or one around it."""
        route = ROUTES[self.route]
        return {name for path in self.replaced for name in (path, *route.also_named.get(path, ()))}


# ---------------------------------------------------------------- the server


class Outcome(NamedTuple):
    status: int | None  # None: no answer
    body: bytes
    error: str | None  # why there was no answer
    went_down: bool  # the server stopped serving after this request
    log: list[str]  # the server's error lines while it was answered (gathered for failures only)


class LogMark(NamedTuple):
    """A place in the servers' logs."""

    generation: int  # which server (0: the first; one more per restart)
    line: int  # lines of its log before the mark
    reported: int  # tracebacks reported with failed answers before the mark


def _tracebacks(lines: list[str]) -> int:
    return sum("Traceback" in line for line in lines)


_ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|^[\s|+]*[A-Za-z_][\w.]*(Error|Exception|Group)\b(:|$)")


class LiveServer:
    """The module's server and a client to it. A request that takes the server down is reported
    (``Outcome.went_down``); the next request finds it down and starts a fresh one."""

    def __init__(self, cache_dir: Path) -> None:
        self._cache_dir = cache_dir
        self.generations: list[ServerProcess] = []  # the first, then one per restart
        self._client: httpx.Client | None = None
        self._suspect = False  # the last request failed: check the server before the next
        self.tracebacks_reported = 0  # in the logs of answers reported as failures
        self._start()

    @property
    def server(self) -> ServerProcess:
        return self.generations[-1]

    @property
    def restarts(self) -> int:
        return len(self.generations) - 1

    def _start(self) -> None:
        if self.restarts >= MAX_RESTARTS:
            pytest.fail(f"the server went down {self.restarts + 1} times in this module; not restarting it again")
        server = ServerProcess(*SERVER_FLAGS, cache_dir=self._cache_dir)
        self.generations.append(server)
        server.wait_serving()
        if self._client is not None:
            self._client.close()
        self._client = httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S)
        self._suspect = False

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        for server in self.generations:
            server.stop()

    def serving(self) -> bool:
        """The server process runs and ``/health`` answers 200."""
        if self.server.popen.poll() is not None:
            return False
        try:
            return self._client.get("/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def ensure_serving(self) -> None:
        """Replace a server that a request took down (or left without answers)."""
        if (self._suspect or self.server.popen.poll() is not None) and not self.serving():
            self.server.stop()
            self._start()
        self._suspect = False

    def mark(self) -> LogMark:
        return LogMark(len(self.generations) - 1, len(self.server.lines), self.tracebacks_reported)

    def log_since(self, mark: LogMark) -> list[str]:
        """The log lines of every server since ``mark`` (the whole tail when it rotated past it)."""
        generation, offset, _ = mark
        lines: list[str] = []
        for i, server in enumerate(self.generations[generation:], generation):
            tail = list(server.lines)
            lines += tail[offset:] if i == generation and len(tail) < (server.lines.maxlen or 0) else tail
        return lines

    def error_lines(self, mark: LogMark, limit: int = 6) -> list[str]:
        found: list[str] = []
        for line in self.log_since(mark):
            if _ERROR_LINE.search(line) and line.strip() not in found:
                found.append(line.strip()[:300])
        return found[:limit]

    def post(self, path: str, body: bytes, headers: dict[str, str] = JSON_HEADERS) -> Outcome:
        self.ensure_serving()
        mark = self.mark()
        try:
            response = self._client.post(path, content=body, headers=headers)
            status, content, error = response.status_code, response.content, None
        except httpx.TimeoutException:
            status, content, error = None, b"", f"no answer within {REQUEST_TIMEOUT_S:g} s"
        except httpx.HTTPError as exc:
            status, content, error = None, b"", repr(exc)
        if status is not None and status < 500:
            return Outcome(status, content, None, False, [])
        self._suspect = True
        # The log lines reach us a moment after the answer (a pipe and a thread).
        wait_until(lambda: len(self.server.lines) > mark.line, timeout=0.5)
        time.sleep(0.05)
        down = not self.serving()
        self.tracebacks_reported += _tracebacks(self.log_since(mark))
        return Outcome(status, content, error, down, self.error_lines(mark))

    def get(self, path: str) -> httpx.Response:
        self.ensure_serving()
        return self._client.get(path)

    def check_serving(self, since: LogMark, *, count_reported: bool = False) -> list[str]:
        """What is wrong with the server now: it must answer /health and a normal request, run
        with all its actors, and have logged no traceback since ``since`` but those of answers
        already reported as failures (``count_reported``: none at all)."""
        problems = []
        if self.restarts > since[0]:
            problems.append(f"the server went down and was restarted {self.restarts - since[0]} time(s)")
        if self.server.popen.poll() is not None:
            problems.append(f"the server exited with {self.server.popen.returncode}")
        dead = [name for name, pid in self.server.started_actors.items() if not alive(pid)]
        if dead:
            problems.append(f"actors died: {dead}")
        try:
            health = self._client.get("/health", timeout=5)
            if health.status_code != 200:
                problems.append(f"/health answered {health.status_code}: {health.text[:200]}")
            normal = self._client.post("/v1/completions", json=NORMAL_REQUEST)
            if normal.status_code != 200:
                problems.append(f"a normal request answered {normal.status_code}: {normal.text[:200]}")
            else:
                choice = normal.json()["choices"][0]
                if not isinstance(choice["text"], str) or choice["finish_reason"] not in ("length", "stop"):
                    problems.append(f"a normal request's choice is {choice}")
        except httpx.HTTPError as exc:
            problems.append(f"the server does not answer: {exc!r}")
        tracebacks = _tracebacks(self.log_since(since))
        if not count_reported:
            tracebacks -= self.tracebacks_reported - since.reported
        if tracebacks > 0:
            lines = "\n".join(self.error_lines(since, limit=20))
            problems.append(f"its log has {tracebacks} Traceback(s) no failed answer explains:\n{lines}")
        return problems


@pytest.fixture(scope="module")
def fuzz(cache_dir) -> Iterator[LiveServer]:
    target = LiveServer(cache_dir)
    try:
        yield target
    finally:
        target.close()


@pytest.fixture(autouse=True)
def still_serving(fuzz: LiveServer) -> Iterator[None]:
    """Before each test: a server; after it: the server still serves, with no traceback logged."""
    fuzz.ensure_serving()
    mark = fuzz.mark()
    yield
    problems = fuzz.check_serving(mark)
    assert not problems, "after this test: " + "; ".join(problems)


# ---------------------------------------------------------------- checks of one answer


def _message(body: bytes) -> str:
    try:
        decoded = json.loads(body)
    except ValueError:
        return body[:200].decode("utf-8", "replace")
    return str(decoded.get("message", decoded))[:200] if isinstance(decoded, dict) else str(decoded)[:200]


# The answer to a request whose own timeout expired (app/engine/scheduling/deadlines.py's messages).
EXPIRED_TIMEOUT = re.compile(r"the request (waited|took) longer than the (waiting|request) timeout")


def _asked_to_time_out(status: object, message: object) -> bool:
    return status == 503 and isinstance(message, str) and EXPIRED_TIMEOUT.match(message) is not None


def problems_of(outcome: Outcome, case: Case | None) -> list[str]:
    """What is wrong with an answer: a 5xx or none, a 4xx without our error body, a 400 for a
    replaced field that names no field near it, a stream with a server error inside."""
    log = "".join(f"\n    log: {line}" for line in outcome.log)
    if outcome.status is None:
        return [f"no answer ({outcome.error}){' and the server went down' if outcome.went_down else ''}{log}"]
    if _asked_to_time_out(outcome.status, _message(outcome.body)):
        return []
    if outcome.status >= 500:
        down = " and the server went down" if outcome.went_down else ""
        return [f"{outcome.status} {_message(outcome.body)!r}{down}{log}"]
    if outcome.status >= 400:
        try:
            error = json.loads(outcome.body)
        except ValueError:
            return [f"{outcome.status} without a JSON body: {outcome.body[:200]!r}"]
        if not isinstance(error, dict) or error.get("object") != "error" or not isinstance(error.get("message"), str):
            return [f"{outcome.status} without an error body: {outcome.body[:200]!r}"]
        if outcome.status == 400 and case is not None and all(v.nameable for v in case.replaced.values()):
            param = error.get("param")
            if not any(_near(param, name) for name in case.names()):
                return [f"400 names param={param!r}, not {sorted(case.replaced)}: {error['message'][:200]!r}"]
        return []
    return _stream_problems(outcome.body) if outcome.body.startswith(b"data:") else _json_problems(outcome.body)


def _near(param: object, path: str) -> bool:
    """Whether ``param`` is ``path``, a field inside it, or one that holds it (not the whole body)."""
    if not isinstance(param, str) or not param:
        return False
    return any(a == b or a.startswith(b + ".") or a.startswith(b + "[") for a, b in ((param, path), (path, param)))


def _json_problems(body: bytes) -> list[str]:
    try:
        json.loads(body)
    except ValueError:
        return [f"2xx whose body is not JSON: {body[:200]!r}"]
    return []


def _stream_problems(body: bytes) -> list[str]:
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            code = event.get("error", {}).get("code") if isinstance(event.get("error"), dict) else None
            if isinstance(code, int) and code >= 500 and not _asked_to_time_out(code, event["error"].get("message")):
                return [f"the stream failed: {event['error']}"]
    return []


def send(fuzz: LiveServer, case: Case) -> list[str]:
    outcome = fuzz.post(ROUTES[case.route].path, case.body())
    return [f"{case!r}: {problem}" for problem in problems_of(outcome, case)]


# ---------------------------------------------------------------- the issue's requests


ISSUE_CASES = [
    ("completions", "max_tokens", 2**63),
    ("chat", "max_tokens", 2**63),
    ("generate", "sampling_params.max_new_tokens", 2**64 - 1),
    ("completions", "min_tokens", 2**63),
    ("chat", "min_tokens", 2**63),
    ("completions", "max_tokens", 2**64),
    ("chat", "max_tokens", 2**64),
]


@pytest.mark.parametrize(("route", "path", "value"), ISSUE_CASES, ids=[f"{r}-{p}-{v}" for r, p, v in ISSUE_CASES])
def test_the_issues_requests_are_a_400_naming_the_field(fuzz, route, path, value):
    outcome = fuzz.post(ROUTES[route].path, Case(route, {path: Value.of(value)}).body())
    assert outcome.status == 400, problems_of(outcome, None) or outcome.body[:300]
    error = json.loads(outcome.body)
    assert error["object"] == "error" and error["param"] == path, error
    problems = fuzz.check_serving(fuzz.mark())
    assert not problems, "after it: " + "; ".join(problems)


# ---------------------------------------------------------------- every extreme at every field

GRID = [(route, field) for route, fields in FIELDS.items() for field in fields]


@pytest.mark.parametrize(("route", "field"), GRID, ids=[f"{route}-{field.path}" for route, field in GRID])
def test_every_extreme_at_every_field(fuzz, route, field):
    failures = [problem for value in values_for(field) for problem in send(fuzz, Case(route, {field.path: value}))]
    assert not failures, f"{len(failures)} failing values:\n" + "\n".join(failures)


# ---------------------------------------------------------------- hypothesis

FUZZ = settings(
    max_examples=100,
    deadline=None,
    database=None,
    derandomize=True,  # the same examples every run
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a crash would restart the server per replay
    suppress_health_check=list(HealthCheck),
)
_json_leaves = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
                | st.integers(min_value=-(2**80), max_value=2**80))
_json = st.recursive(_json_leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)
any_value = st.one_of(st.sampled_from(EXTREMES), st.sampled_from(ELEMENT_EXTREMES).map(Value.in_list),
                   st.sampled_from(KEY_EXTREMES), _json.map(Value.of))


@st.composite
def replaced_fields(draw: st.DrawFn, route: str) -> Case:
    """The route's base body with one to three fields replaced."""
    fields = draw(st.lists(st.sampled_from([f.path for f in FIELDS[route]]), min_size=1, max_size=3, unique=True))
    # A parent and a field inside it cannot both be replaced: keep the parent.
    fields = [f for f in fields if not any(f != p and _near(f, p) and f.startswith(p) for p in fields)]
    return Case(route, {path: draw(any_value) for path in fields})


@pytest.mark.parametrize("route", list(ROUTES))
@FUZZ
@given(data=st.data())
def test_fields_replaced_by_extremes_and_random_values(fuzz, route, data):
    case = data.draw(replaced_fields(route))
    problems = send(fuzz, case)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("route", list(ROUTES))
@settings(FUZZ, max_examples=50)
@given(data=st.data())
def test_random_json_objects_over_the_fields(fuzz, route, data):
    """Objects whose keys are the route's top-level fields and other names, with random values."""
    keys = st.sampled_from(TOP_LEVEL[route]) | st.text(max_size=10)
    body = data.draw(st.dictionaries(keys, any_value, max_size=6))
    outcome = fuzz.post(ROUTES[route].path, encode(body))
    problems = problems_of(outcome, None)
    assert not problems, "\n".join(problems)


def _mangled(valid: bytes) -> st.SearchStrategy[bytes]:
    """``valid`` cut short, with a byte replaced, or with bytes inserted; or any bytes."""
    cut = st.integers(0, len(valid)).map(lambda i: valid[:i])
    flip = st.tuples(st.integers(0, len(valid) - 1), st.binary(min_size=1, max_size=1)).map(
        lambda t: valid[:t[0]] + t[1] + valid[t[0] + 1:])
    insert = st.tuples(st.integers(0, len(valid)), st.binary(min_size=1, max_size=8)).map(
        lambda t: valid[:t[0]] + t[1] + valid[t[0]:])
    return st.one_of(cut, flip, insert, st.binary(max_size=64))


@pytest.mark.parametrize("route", list(ROUTES))
@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_random_and_mangled_bytes(fuzz, route, data):
    body = data.draw(_mangled(Case(route, {}).body()))
    outcome = fuzz.post(ROUTES[route].path, body)
    problems = problems_of(outcome, None)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- malformed bodies, every POST route

MALFORMED = {
    "empty": b"",
    "truncated": b'{"prompt": "hi", "max_tok',
    "trailing comma": b'{"prompt": "hi",}',
    "null": b"null",
    "a list": b"[]",
    "a number": b"1",
    "a string": b'"hi"',
    "NaN": b"NaN",
    "a byte order mark": b'\xef\xbb\xbf{"prompt": "hi"}',
    "two objects": b'{"prompt": "hi"}{"prompt": "hi"}',
    "duplicate keys": b'{"prompt": "hi", "prompt": 5, "text": "hi", "text": [1]}',
    "binary": bytes(range(256)),
    "a million spaces": b" " * 1_000_000,
    "100000 deep lists": b"[" * 100_000 + b"]" * 100_000,
    "10000 deep objects": b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
    "half-open nesting": b"[" * 100_000,
    "100000 unknown keys": b"{" + b",".join(f'"k{i}":{i}'.encode() for i in range(100_000)) + b"}",
    "an invalid UTF-8 key": b'{"\xff": 1}',
    "a lone surrogate key": b'{"\\udfff": 1}',
}
POST_PATHS = [route.path for route in ROUTES.values()] + ["/flush_cache"]


@pytest.mark.parametrize("path", POST_PATHS)
def test_malformed_bodies(fuzz, path):
    failures = []
    for name, body in MALFORMED.items():
        for headers in (JSON_HEADERS, {"content-type": "text/plain"}):
            failures += [f"{name} ({headers['content-type']}): {p}" for p in problems_of(fuzz.post(path, body, headers),
                                                                                           None)]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- the module's end


def test_the_fuzzer_covers_every_field_the_openapi_document_declares(fuzz):
    document = fuzz.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    for name, route in ROUTES.items():
        ref = document["paths"][route.path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert set(schemas[ref.rsplit("/", 1)[1]]["properties"]) == set(TOP_LEVEL[name]), name


def test_one_server_served_the_whole_module(fuzz):
    """Last: the module's first server still runs, so no request took it down."""
    assert fuzz.restarts == 0, f"the server went down {fuzz.restarts} time(s) during the module"
    problems = fuzz.check_serving(LogMark(0, 0, 0), count_reported=True)
    assert not problems, "; ".join(problems)
