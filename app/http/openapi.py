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
from app.http.primitives import Route

_REF = "#/components/schemas/{name}"


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _operation(route: Route, schema_of: dict[Any, dict[str, Any]]) -> dict[str, Any]:
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
    return operation


def openapi_document(routes: Sequence[Route], *, title: str = "app") -> dict[str, Any]:
    """The OpenAPI 3.1 document for ``routes`` (a JSON-able dict)."""
    types: list[Any] = [ErrorBody, StreamError]
    for route in routes:
        types += [t for t in (route.body, route.response, route.stream_event) if t is not None and t not in types]
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    schema_of = dict(zip(types, schemas))
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, schema_of)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": __version__},
        "paths": paths,
        "components": {"schemas": components},
    }
