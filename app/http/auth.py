"""API keys: who may call which route, checked in constant time, and never written anywhere.

Two keys, as SGLang names them: ``--api-key`` guards every route but the open ones, and
``--admin-api-key`` guards the control routes (those that change the server's state or show its
configuration). Each route declares its :class:`Access`; the matrix, for a request carrying no
key, a wrong key, the API key or the admin key:

================  ===========  ==================  ======================
keys configured   open routes  API routes          admin routes
================  ===========  ==================  ======================
none              any          any                 any
API key only      any          API key             API key
admin key only    any          any                 admin key
both              any          API or admin key    admin key (API key: 403)
================  ===========  ==================  ======================

"any" means any request, with or without a key, right or wrong (the openai SDK always sends
one); otherwise a request without the key it needs, or with a wrong one, gets 401. The admin key
opens every route the API key opens. A route's access is resolved before it is
routed, so an unknown path answers 401 to a caller without a key rather than telling them which
paths exist. Keys are held in :class:`Secret`, whose ``repr`` and ``str`` never show the value,
so that a key passed to a logger or a crash dump by mistake prints as ``<redacted>``.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any, NamedTuple

from app.http.errors import ApiError
from app.http.primitives import Access, Handler, Middleware, Request, Responder, Route, error_response

REDACTED = "<redacted>"
API_KEY_ENV = "APP_API_KEY"
ADMIN_API_KEY_ENV = "APP_ADMIN_API_KEY"
_MAX_KEY_CHARS = 4096


class Secret:
    """A key: compared in constant time, shown as ``<redacted>`` by ``repr``, ``str`` and JSON."""

    __slots__ = ("_value",)

    def __init__(self, value: str, *, name: str = "key") -> None:
        if not value or len(value) > _MAX_KEY_CHARS or not all("!" <= c <= "~" for c in value):
            raise ValueError(f"{name} must be 1 to {_MAX_KEY_CHARS} visible ASCII characters (no spaces)")
        self._value = value

    def reveal(self) -> str:
        """The key itself, for the few places that must send it (a client's header)."""
        return self._value

    def matches(self, given: str) -> bool:
        """Whether ``given`` is this key, in time that does not depend on where they differ."""
        return hmac.compare_digest(given.encode("latin-1", "replace"), self._value.encode())

    def __repr__(self) -> str:
        return f"Secret({REDACTED!r})"

    def __str__(self) -> str:
        return REDACTED

    def __deepcopy__(self, memo: dict[int, Any]) -> Secret:
        return self  # immutable; dataclasses.asdict deep-copies its fields

    def __reduce__(self) -> Any:
        raise TypeError("a Secret is never pickled")


class ApiKeys(NamedTuple):
    api: Secret | None = None
    admin: Secret | None = None

    @property
    def any(self) -> bool:
        return self.api is not None or self.admin is not None


def _bearer(request: Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``; None when absent or another scheme."""
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _unauthorized() -> ApiError:
    message = "Invalid or missing API key: send 'Authorization: Bearer <key>'."
    return ApiError(401, message, code="invalid_api_key", headers=(("www-authenticate", "Bearer"),))  # RFC 7235


def _forbidden() -> ApiError:
    return ApiError(403, "This route needs the admin API key.", code="admin_key_required")


def grant(keys: ApiKeys, access: Access, token: str | None) -> tuple[bool, ApiError | None]:
    """(whether the caller may use admin routes, the error that refuses this request or None).

    Every configured key is compared whatever the outcome, so the time taken does not say which
    key a token nearly matched.
    """
    is_api = keys.api is not None and token is not None and keys.api.matches(token)
    is_admin = keys.admin is not None and token is not None and keys.admin.matches(token)
    admin_ok = is_admin if keys.admin is not None else (is_api or keys.api is None)
    api_ok = keys.api is None or is_api or is_admin
    if access is Access.OPEN:
        return admin_ok, None
    if access is Access.API:
        return admin_ok, None if api_ok else _unauthorized()
    if admin_ok:
        return True, None
    return False, _forbidden() if is_api and keys.admin is not None else _unauthorized()


def require_keys(keys: ApiKeys, routes: Iterable[Route]) -> Middleware:
    """The middleware that checks ``keys`` against each request's route; it sets
    ``request.admin`` for the handlers (``/server_info`` shows more to an admin)."""
    access_of: dict[str, Access] = {}
    for route in routes:
        if access_of.setdefault(route.path, route.access) is not route.access:
            raise ValueError(f"{route.path} needs one access for all its methods")

    def middleware(handler: Handler) -> Handler:
        async def checked(request: Request) -> Responder:
            if request.method == "OPTIONS":
                access = Access.OPEN
            else:
                access = access_of.get(request.path.rstrip("/") or "/", Access.API)
            request.admin, refusal = grant(keys, access, _bearer(request))
            if refusal is not None:
                return error_response(refusal)
            return await handler(request)

        return checked

    return middleware
