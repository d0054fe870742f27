"""Errors as clients see them: one exception type and one body shape for every failure.

Bodies follow vLLM's and SGLang's OpenAI-style shape (``{"object": "error", ...}`` with the
status as ``code``), which the official ``openai`` client parses into its ``APIError`` fields
(``message``, ``type``, ``param``, ``code``). Validation errors name the offending field in
``param``, so a client can tell which argument to fix without parsing the message.
"""

from __future__ import annotations

import re
from types import MappingProxyType

import msgspec

from app.http.backend import RequestError, ServerError

# The openai SDK's exception class names, so an error reads the same on both sides of the wire.
_ERROR_TYPES = MappingProxyType({
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "PayloadTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
})


def error_type(status: int) -> str:
    """The ``type`` an error body carries for an HTTP status."""
    return _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """The JSON body of every error response."""

    object: str = "error"
    message: str
    type: str
    param: str | None
    code: int | str  # the HTTP status, or OpenAI's string code where it has one (model_not_found)


class StreamErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: str
    code: int | str


class StreamError(msgspec.Struct, frozen=True):
    """What an SSE stream sends in place of further chunks when the request fails mid-way."""

    error: StreamErrorDetail


# Seconds a 503's Retry-After tells the client to wait: a 503 means overload (the queue is full,
# --max-queued-requests; a request timed out) or a server not serving yet, and a busy queue
# drains in about this long. The openai SDK honours the header when it retries.
RETRY_AFTER_S = 1


class ApiError(Exception):
    """A request answered with an error: raised anywhere in a handler, rendered in one place."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: int | str | None = None,
        type: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = status if code is None else code
        self.type = type or error_type(status)
        if status == 503 and not any(name.lower() == "retry-after" for name, _ in headers):
            headers = (*headers, ("retry-after", str(RETRY_AFTER_S)))
        self.headers = headers  # e.g. Allow for 405, Retry-After for 503

    def body(self) -> ErrorBody:
        return ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)

    def stream_event(self) -> StreamError:
        return StreamError(StreamErrorDetail(message=self.message, type=self.type, code=self.code))

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> ApiError:
        return cls(400, message, param=param)


def from_backend(exc: RequestError | ServerError) -> ApiError:
    """The client-facing form of an exception the Backend raised."""
    if isinstance(exc, RequestError):
        return ApiError(exc.status_code, exc.message, param=exc.param)
    return ApiError(exc.status_code, exc.message, type=exc.error_type)


# msgspec: "Expected `int`, got `str` - at `$.messages[0].role`", "Object missing required field
# `model`", "Object contains unknown field `x` - at `$.sampling_params`".
_AT_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_AT_KEY = re.compile(r" - at `key` in `\$(?P<path>[^`]*)`$")  # a map's key (logit_bias's token ids)
_NAMED_FIELD = re.compile(r"(?:missing required|contains unknown) field `(?P<field>[^`]+)`")
# A range: "Expected `int` <= 2147483647", "Expected `str` of length <= 1024".
_OUT_OF_RANGE = re.compile(r"^Expected `(?P<type>[^`]+)` (?P<bound>(?:of length )?[<>]=? \S+)$")


def _path_to_param(path: str) -> str | None:
    """``.messages[0].role`` → ``messages[0].role``; the root (empty path) has no param."""
    return path.lstrip(".") or None


def from_validation(exc: msgspec.ValidationError | msgspec.DecodeError) -> ApiError:
    """A 400 that names the field msgspec rejected; malformed JSON names none."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return ApiError.bad_request(f"Invalid JSON body: {text}")
    if key := _AT_KEY.search(text):
        param = _path_to_param(key.group("path"))
        return ApiError.bad_request(f"a key of {param}: {text[: key.start()]}", param)
    at = _AT_PATH.search(text)
    message = text[: at.start()] if at else text
    param = _path_to_param(at.group("path")) if at else None
    named = _NAMED_FIELD.search(message)
    if named:  # the missing/unknown field is one level below the reported path
        param = f"{param}.{named.group('field')}" if param else named.group("field")
    out_of_range = _OUT_OF_RANGE.match(message)
    if out_of_range and param:  # "max_tokens must be an int <= 2147483647", as the client named it
        kind, bound = out_of_range.group("type"), out_of_range.group("bound")
        return ApiError.bad_request(f"{param} must be {'an' if kind[0] in 'aeiou' else 'a'} {kind} {bound}", param)
    return ApiError.bad_request(f"{message} (at {param})" if param else message, param)
