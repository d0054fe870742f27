"""Streaming detokenization: one request's output tokens in, text deltas out, in O(1) per token.

Decoding the whole sequence again at every step costs O(n) per token, O(n^2) per request. We
decode only a short window instead, between two offsets into the token list::

    token ids:  ... | t[prefix] ... t[read-1] | t[read] ... t[n-1]
                      └ already emitted text ┘ └ not yet emitted ┘
                      └─────── decoded every step: window ───────┘

``decode(window)`` minus ``decode(ids[prefix:read])`` is the new text. The window starts a little
before the new tokens (at ``prefix``) so that decoders which treat the first token specially (a
SentencePiece leading space, say) see the same context the full decode sees.

A character may span tokens (byte-level BPE splits emoji and CJK into byte tokens), and a decode
that stops inside it ends with U+FFFD. Such text is held back until the character is complete;
``read`` only advances to a token boundary where the decoded text ends with a whole character,
so the window always starts on a character boundary and the concatenation of all deltas (and the
final ``flush``) equals ``decode(all_ids)`` exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for bytes that are not (yet) a whole character
# A UTF-8 character has at most 4 bytes, so an incomplete one usually spans at most the last 3
# tokens (more only with skipped special tokens in between; then we merely hold text a bit longer).
_MAX_INCOMPLETE_TOKENS = 3
_TRIM_AT = 1024  # drop ids before the window once this many pile up, so memory stays bounded too


class Decoder(Protocol):
    """Anything with a transformers-style ``decode`` (our ``Tokenizer``, or a transformers one)."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for one request, fed its output token ids a batch at a time."""

    def __init__(
        self, tokenizer: Decoder, *, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()
    ) -> None:
        """``context_ids``: the last few prompt tokens (about 5), decoded as context only, so the
        first output token gets the spacing it has after the prompt; their own text is not emitted.
        Ignored if they end inside a character."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(context_ids)
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context  # context, then the output ids from the window start on
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(context)  # the text of ids[:read_offset] is emitted (or is context)

    @property
    def pending_tokens(self) -> int:
        """Tokens whose text is held back (an incomplete character at the end)."""
        return len(self._ids) - self._read_offset

    def push(self, token_ids: Sequence[int]) -> str:
        """Add output tokens; return the text they complete (possibly ""), never a partial character."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        end = len(self._ids)
        if text.endswith(REPLACEMENT_CHAR):
            # Emit what is complete before the trailing partial character, if a batch brought more.
            end, text = self._last_complete()
            if end == self._read_offset:
                return ""
        delta = text[len(prefix_text) :]
        self._advance(end)
        return delta

    def flush(self) -> str:
        """At the end of the request: whatever was held back, U+FFFD for bytes never completed."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._advance(len(self._ids))
        return text[len(prefix_text) :]

    def _advance(self, end: int) -> None:
        """The text up to ``end`` is out: the next window starts where this one's new text began."""
        self._prefix_offset, self._read_offset = self._read_offset, end
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _last_complete(self) -> tuple[int, str]:
        """The largest token boundary past ``read_offset`` whose window text ends in a whole
        character, with that text; ``read_offset`` itself when there is none."""
        lowest = max(self._read_offset + 1, len(self._ids) - _MAX_INCOMPLETE_TOKENS)
        for end in range(len(self._ids) - 1, lowest - 1, -1):
            text = self._decode(self._ids[self._prefix_offset : end])
            if not text.endswith(REPLACEMENT_CHAR):
                return end, text
        return self._read_offset, ""

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
