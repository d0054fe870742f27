"""Every number a client may send has a range, and docs/security.md lists exactly those ranges."""

from __future__ import annotations

import re
from pathlib import Path

from echo_backend import EchoBackend

from app.http.openai_adapter import token_id_name
from app.http.openapi import request_ranges
from app.http.routes import Api, RouteSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
_ROW = re.compile(r"^\| `(?P<field>[^`]+)` \| (?P<kind>\w+) \| `(?P<range>[^`]+)` \| (?P<routes>[^|]+) \|$")


def _ranges():
    return request_ranges(Api(EchoBackend(), RouteSettings(), token_id_name).routes())


def test_no_number_in_any_request_body_is_unbounded():
    numbers = [r for r in _ranges() if r.kind in ("integer", "number")]

    assert len(numbers) > 40  # the walk reached the nested Structs (sampling_params, prompt lists)
    unbounded = [r for r in numbers if "inf" in r.range]
    assert unbounded == []
    fields = {(r.route, r.field) for r in numbers}
    assert ("POST /generate", "sampling_params.max_new_tokens") in fields
    assert ("POST /v1/completions", "prompt[][]") in fields and ("POST /generate", "priority") in fields


def test_the_documented_table_is_the_schemas_ranges():
    documented = {}
    for line in DOC.read_text().splitlines():
        if match := _ROW.match(line):
            for route in match["routes"].split(", "):
                documented[(route.strip(), match["field"], match["kind"])] = match["range"]
    actual = {(r.route.split()[1], r.field, r.kind): r.range for r in _ranges()}

    assert documented == actual
