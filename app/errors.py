"""Finding the exception that matters inside trio's exception groups."""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


def find_exception(exc: BaseException, kind: type[E]) -> E | None:
    """``exc`` itself or the first exception of type ``kind`` in its (nested) groups."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = find_exception(inner, kind)
            if found is not None:
                return found
    return None
