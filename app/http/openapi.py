"""The OpenAPI 3.1 document, generated from the route table and the msgspec Structs it names.

Nothing here is written by hand per route: a route's request body, response and stream event
types are its documentation, so the document cannot drift from what the server validates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from app import __version__
from app.http.errors import ErrorBody, StreamError
from app.http.primitives import Access, Route

_REF = "#/components/schemas/{name}"


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


_SCHEME = "bearerAuth"


def _security(route: Route, error: dict[str, Any]) -> dict[str, Any]:
    """The route's security requirement and the answers a missing or wrong key gets."""
    if route.access is Access.OPEN:
        return {"security": []}
    responses = {"401": {"description": "A missing or wrong API key", "content": error}}
    if route.access is Access.ADMIN:
        responses["403"] = {"description": "The API key where the admin key is needed", "content": error}
    return {"security": [{_SCHEME: []}], "responses": responses}


def _operation(route: Route, schema_of: dict[Any, dict[str, Any]], secured: bool) -> dict[str, Any]:
    content = _json(schema_of[route.response]) if route.response is not None else {}
    if route.stream_event is not None:
        content["text/event-stream"] = {
            "schema": {"type": "string", "description": "`data: <event JSON>` events, then `data: [DONE]`."},
            "x-event-schema": schema_of[route.stream_event],
        }
    operation: dict[str, Any] = {
        "summary": route.summary,
        "operationId": f"{route.method.lower()}_{route.path.strip('/').replace('/', '_').replace('.', '_')}",
        "responses": {
            "200": {"description": "Success", "content": content},
            "default": {"description": "An error", "content": _json(schema_of[ErrorBody])},
        },
    }
    if route.body is not None:
        operation["requestBody"] = {"required": True, "content": _json(schema_of[route.body])}
    if secured:
        security = _security(route, _json(schema_of[ErrorBody]))
        operation["security"] = security["security"]
        operation["responses"].update(security.get("responses", {}))
    return operation


def openapi_document(routes: Sequence[Route], *, title: str = "app", secured: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document for ``routes`` (a JSON-able dict); ``secured``: keys are
    configured, so each route declares whether it needs the bearer key (API fuzzers test it)."""
    types: list[Any] = [ErrorBody, StreamError]
    for route in routes:
        types += [t for t in (route.body, route.response, route.stream_event) if t is not None and t not in types]
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    schema_of = dict(zip(types, schemas))
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, schema_of, secured)
    security_schemes = {_SCHEME: {"type": "http", "scheme": "bearer", "description": "--api-key or --admin-api-key"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": __version__},
        "paths": paths,
        "components": {"schemas": components, **({"securitySchemes": security_schemes} if secured else {})},
    }
