"""The OpenAPI 3.1 document, generated from the route table and the msgspec Structs it names.

Nothing here is written by hand per route: a route's request body, response and stream event
types are its documentation, so the document cannot drift from what the server validates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from app import __version__
from app.http.errors import ErrorBody, StreamError
from app.http.primitives import Access, Route
from app.http.schemas import SCHEMA_EXTRAS

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
        # Before OpenAPI 3.2 (``itemSchema``), an event stream's ``schema`` describes one event, as
        # parsed from the stream: an object whose ``data`` is the event's text.
        event = schema_of[route.stream_event]
        content["text/event-stream"] = {
            "schema": {
                "type": "object",
                "required": ["data"],
                "properties": {"data": {"anyOf": [
                    {
                        "type": "string",
                        "description": "An event's JSON (x-event-schema), or an error event.",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": [event, schema_of[StreamError]]},
                    },
                    {"const": "[DONE]", "description": "The last event."},
                ]}},
            },
            "x-event-schema": event,
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


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra``'s keys added, maps merged key by key."""
    merged = dict(base)
    for key, value in extra.items():
        both_maps = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merged(merged[key], value) if both_maps else value
    return merged


def openapi_document(routes: Sequence[Route], *, title: str = "app", secured: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document for ``routes`` (a JSON-able dict); ``secured``: keys are
    configured, so each route declares whether it needs the bearer key (API fuzzers test it)."""
    types: list[Any] = [ErrorBody, StreamError]
    for route in routes:
        types += [t for t in (route.body, route.response, route.stream_event) if t is not None and t not in types]
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    for name, extra in SCHEMA_EXTRAS.items():
        if name in components:
            components[name] = _merged(components[name], extra)
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


class FieldRange(NamedTuple):
    """The range of one number (or the length of one string, list or map) a route accepts."""

    route: str  # "POST /v1/completions"
    field: str  # "sampling_params.stop[]": [] an item of a list, {} a value of a map
    kind: str  # integer, number, string, array, object
    range: str  # "[0, 2147483647]", "(0.0, 1.0]", "length <= 1024"


_LENGTH_KEYS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))


def _range_text(schema: dict[str, Any]) -> str | None:
    """``[low, high]`` with ``(``/``)`` for exclusive ends, for a number; ``length ...`` for sizes."""
    if schema.get("type") in ("integer", "number"):
        low = (f"[{schema['minimum']}" if "minimum" in schema
               else f"({schema['exclusiveMinimum']}" if "exclusiveMinimum" in schema else "(-inf")
        high = (f"{schema['maximum']}]" if "maximum" in schema
                else f"{schema['exclusiveMaximum']})" if "exclusiveMaximum" in schema else "inf)")
        return f"{low}, {high}"
    for low_key, high_key in _LENGTH_KEYS:
        if high_key in schema or low_key in schema:
            return f"length {schema.get(low_key, 0)} to {schema[high_key]}" if high_key in schema else None
    return None


def request_ranges(routes: Sequence[Route]) -> list[FieldRange]:
    """Every number in every request body, with its range (``(-inf, inf)`` where it has none),
    and every string, list or map that has a length bound. docs/security.md lists them; a test
    checks that the two agree and that no number is unbounded."""
    bodies = [route for route in routes if route.body is not None]
    schemas, components = msgspec.json.schema_components([route.body for route in bodies], ref_template=_REF)
    found: list[FieldRange] = []

    def walk(route: str, schema: dict[str, Any], path: str, seen: frozenset[str]) -> None:
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            if name not in seen:
                for field, sub in components[name].get("properties", {}).items():
                    walk(route, sub, f"{path}.{field}" if path else field, seen | {name})
            return
        for sub in schema.get("anyOf", ()):
            walk(route, sub, path, seen)
        text = _range_text(schema)
        kind = schema.get("type")
        if text is not None or kind in ("integer", "number"):
            found.append(FieldRange(route, path, kind, text or "(-inf, inf)"))
        if kind == "array" and "items" in schema:
            walk(route, schema["items"], f"{path}[]", seen)
        if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
            walk(route, schema["additionalProperties"], f"{path}{{}}", seen)

    for route, schema in zip(bodies, schemas):
        walk(f"{route.method} {route.path}", schema, "", frozenset())
    return list(dict.fromkeys(found))  # a field reached through two branches of a union, once
