"""The scheduler's memory of its requests, for a crash dump: first-token times and the
requests finished in the last five minutes.

:class:`RequestHistory` is a SchedulerEvents observer. On the hot path it does two cheap
things: a dict store at a request's first token, and at its end a tuple appended to a deque
(the Request itself is kept, not copied; its fields are read only when a dump is written). The
deque is bounded three ways, so a busy server pays for it in memory no more than this: by age
(``HISTORY_SECONDS``), by count (``HISTORY_MAX_REQUESTS``) and by the tokens the kept requests
hold (``HISTORY_MAX_TOKENS``). tools/bench_request_history.py measures its cost per request
(docs/performance.md).

:func:`request_record` says what a dump shows of one request, as ``--log-requests-level``
allows: 0 metadata only, 1 with the sampling parameters, 2 with the prompt's token ids cut to
``INPUT_CUT`` ids, 3 with every id.
"""

from __future__ import annotations

import collections
from typing import Any

import msgspec

from app.engine.request import Request
from app.engine.scheduling.events import SchedulerEvents

HISTORY_SECONDS = 300.0
HISTORY_MAX_REQUESTS = 4096
HISTORY_MAX_TOKENS = 1 << 21  # prompt and output ids held alive by the kept requests
INPUT_CUT = 2048  # --log-requests-level 2: ids (or characters) of an input shown at most


class RequestHistory(SchedulerEvents):
    """First-token times of live requests; the requests finished in the last five minutes."""

    def __init__(self, *, seconds: float = HISTORY_SECONDS, max_requests: int = HISTORY_MAX_REQUESTS,
                 max_tokens: int = HISTORY_MAX_TOKENS) -> None:
        self.seconds = seconds
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.first_tokens: dict[str, float] = {}  # rid -> time of its first token, while it lives
        self.finished_requests: collections.deque[tuple[float, float | None, Request]] = collections.deque()
        self.tokens_held = 0

    def first_token(self, req: Request, now: float) -> None:
        self.first_tokens[req.rid] = now

    def finished(self, req: Request, now: float) -> None:
        self.finished_requests.append((now, self.first_tokens.pop(req.rid, None), req))
        self.tokens_held += req.fill_len
        self._trim(now)

    def _trim(self, now: float) -> None:
        kept, oldest = self.finished_requests, now - self.seconds
        while kept and (kept[0][0] < oldest or len(kept) > self.max_requests or self.tokens_held > self.max_tokens):
            self.tokens_held -= kept.popleft()[2].fill_len

    def recent(self, now: float, level: int) -> list[dict[str, Any]]:
        """The finished requests of the last ``seconds``, oldest first, as a dump shows them."""
        return [request_record(req, level, first_token_time=first, finished_time=finished)
                for finished, first, req in self.finished_requests if finished >= now - self.seconds]


def cut_input(values: Any, level: int) -> tuple[Any, bool]:
    """An input (ids, text) as ``level`` allows: (the value or its start, whether it was cut)."""
    if level >= 3 or len(values) <= INPUT_CUT:
        return values, False
    return values[:INPUT_CUT], True


def request_record(req: Request, level: int, *, first_token_time: float | None = None,
                   finished_time: float | None = None) -> dict[str, Any]:
    """What a dump says about one scheduler request (see the module docstring for ``level``)."""
    record: dict[str, Any] = {
        "rid": req.rid,
        "state": req.status.value,
        "priority": req.priority,
        "stream": req.stream,
        "arrival_time": req.arrival_time or None,
        "first_token_time": first_token_time,
        "finished_time": finished_time,
        "prompt_tokens": len(req.prompt_ids),
        "output_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "kv_tokens": req.kv_len,
        "times_retracted": req.times_retracted,
    }
    if req.finish is not None:
        finish = req.finish
        record["finish"] = {"reason": finish.reason.value, "matched": finish.matched,
                            "message": finish.message, "status_code": finish.status_code}
    if level >= 1:
        record["sampling"] = msgspec.to_builtins(req.params)
    if level >= 2:
        ids, cut = cut_input(req.prompt_ids, level)
        record["input_ids"] = list(ids)
        record["input_cut"] = cut
    return record
