"""Stop strings over streamed text: emit what cannot be the start of a stop string, hold the rest.

Used by the detokenizer actor (and the offline Engine) on each request's text deltas. Text
is held back only while it could still grow into a stop string: the longest suffix of what
has arrived that is a prefix of some stop string. On a match, the text before it is the
request's last text and the stop string itself is trimmed (and reported as ``matched``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopCheck(NamedTuple):
    text: str  # safe to emit now
    matched: str | None  # the stop string that ended the request, if one did


class StopStringMatcher:
    """Per-request state: the held-back tail."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._held = ""
        self.matched: str | None = None

    def push(self, delta: str) -> StopCheck:
        """Add new text; once a stop string matched, everything after it is dropped."""
        if self.matched is not None:
            return StopCheck("", self.matched)
        if not self._stops:
            return StopCheck(delta, None)
        text = self._held + delta
        first: tuple[int, str] | None = None
        for stop in self._stops:
            index = text.find(stop)
            if index >= 0 and (first is None or index < first[0]):
                first = (index, stop)
        if first is not None:
            self._held = ""
            self.matched = first[1]
            return StopCheck(text[: first[0]], first[1])
        keep = self._longest_partial(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopCheck(text[: len(text) - keep], None)

    def flush(self) -> str:
        """At the end of the request: the held-back text (it never became a stop string)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _longest_partial(self, text: str) -> int:
        longest = min(len(text), max(len(s) for s in self._stops) - 1)
        for k in range(longest, 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0
