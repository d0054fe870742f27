"""API keys through real sockets: every cell of auth.py's matrix, the admin view of /server_info,
the OpenAPI security scheme, and the Secret type that keeps keys out of every text."""

from __future__ import annotations

import copy
import json
import pickle
from dataclasses import asdict

import httpx
import pytest

from app.http.asgi import make_app
from app.http.auth import ApiKeys, Secret
from app.server_args import parse_server_args

API, ADMIN, WRONG = "api-key-1234", "admin-key-5678", "not-a-key"

CONFIGS = {
    "none": ApiKeys(),
    "api": ApiKeys(api=Secret(API)),
    "admin": ApiKeys(admin=Secret(ADMIN)),
    "both": ApiKeys(api=Secret(API), admin=Secret(ADMIN)),
}
CREDENTIALS = {"none": None, "wrong": WRONG, "api": API, "admin": ADMIN}

# (config, credential) -> the status of an open, an API and an admin route.
EXPECTED = {
    ("none", "none"): (200, 200, 200),
    ("none", "wrong"): (200, 200, 200),
    ("none", "api"): (200, 200, 200),
    ("none", "admin"): (200, 200, 200),
    ("api", "none"): (200, 401, 401),
    ("api", "wrong"): (200, 401, 401),
    ("api", "api"): (200, 200, 200),
    ("api", "admin"): (200, 401, 401),  # no admin key configured: ADMIN is just a wrong key
    ("admin", "none"): (200, 200, 401),
    ("admin", "wrong"): (200, 200, 401),
    ("admin", "api"): (200, 200, 401),  # no API key configured: API is just a wrong key
    ("admin", "admin"): (200, 200, 200),
    ("both", "none"): (200, 401, 401),
    ("both", "wrong"): (200, 401, 401),
    ("both", "api"): (200, 200, 403),
    ("both", "admin"): (200, 200, 200),
}

# One route of each access, and what each answers when allowed.
OPEN_ROUTE = ("GET", "/health", None)
API_ROUTES = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "ab"}), ("GET", "/model_info", None),
              ("GET", "/health_generate", None), ("GET", "/openapi.json", None), ("GET", "/server_info", None),
              ("POST", "/generate", {"text": "ab"})]
ADMIN_ROUTES = [("POST", "/flush_cache", None), ("GET", "/flush_cache", None), ("POST", "/abort_request", {"abort_all": True})]


def _headers(credential: str | None) -> dict[str, str]:
    return {} if credential is None else {"authorization": f"Bearer {credential}"}


async def _call(client: httpx.AsyncClient, route: tuple[str, str, dict | None], credential: str | None) -> httpx.Response:
    method, path, body = route
    return await client.request(method, path, json=body, headers=_headers(credential))


@pytest.mark.parametrize("config", list(CONFIGS))
async def test_every_cell_of_the_key_matrix(serve, backend, config):
    url = await serve(make_app(backend, keys=CONFIGS[config]))
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        for credential, token in CREDENTIALS.items():
            open_status, api_status, admin_status = EXPECTED[(config, credential)]
            cell = f"keys={config} credential={credential}"
            assert (await _call(client, OPEN_ROUTE, token)).status_code == open_status, cell
            for route in API_ROUTES:
                response = await _call(client, route, token)
                assert response.status_code == api_status, (cell, route, response.text)
            for route in ADMIN_ROUTES:
                response = await _call(client, route, token)
                assert response.status_code == admin_status, (cell, route, response.text)
                if admin_status == 401:
                    assert response.headers["www-authenticate"] == "Bearer"
                    assert response.json() == {
                        "object": "error", "message": "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                        "type": "AuthenticationError", "param": None, "code": "invalid_api_key"}
                elif admin_status == 403:
                    assert response.json()["type"] == "PermissionDeniedError"
                    assert response.json()["code"] == "admin_key_required"


async def test_a_refused_request_never_reaches_the_backend(serve, backend):
    url = await serve(make_app(backend, keys=CONFIGS["both"]))
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        refused = await client.post("/v1/completions", json={"prompt": "ab"}, headers=_headers(WRONG))
        forbidden = await client.post("/flush_cache", headers=_headers(API))
        allowed = await client.post("/flush_cache", headers=_headers(ADMIN))

    assert (refused.status_code, forbidden.status_code, allowed.status_code) == (401, 403, 200)
    assert backend.requests == [] and len(backend.controls) == 1


async def test_unknown_paths_and_other_schemes_need_the_key_too(serve, backend):
    url = await serve(make_app(backend, keys=CONFIGS["api"]))
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        unknown = await client.get("/v2/secret-route")
        unknown_with_key = await client.get("/v2/secret-route", headers=_headers(API))
        basic = await client.get("/v1/models", headers={"authorization": f"Basic {API}"})
        bare = await client.get("/v1/models", headers={"authorization": API})
        lower = await client.get("/v1/models", headers={"authorization": f"bearer {API}"})
        options = await client.options("/v1/models")

    assert unknown.status_code == 401 and unknown_with_key.status_code == 404
    assert basic.status_code == bare.status_code == 401
    assert lower.status_code == 200  # the scheme is case-insensitive (RFC 7235)
    assert options.status_code == 405  # OPTIONS needs no key (CORS preflights send none); no route has it


async def test_server_info_shows_its_details_to_an_admin_only(serve, backend):
    url = await serve(make_app(backend, keys=CONFIGS["both"]))
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        public = (await client.get("/server_info", headers=_headers(API))).json()
        full = (await client.get("/server_info", headers=_headers(ADMIN))).json()

    assert public == {"state": "serving", "requests_in_flight": 0, "scheduler": {
        "running_requests": 0, "queued_requests": 0, "token_usage": 0.0, "max_total_tokens": 4096}}
    assert full["args"] == {"model_path": "/models/echo", "api_key": None}
    assert full["scheduler"]["device"] == "cpu" and full["scheduler"]["step_timing"] == {"steps": 0}


async def test_the_openapi_document_declares_the_bearer_scheme_when_keys_are_set(serve, backend):
    secured_url = await serve(make_app(backend, keys=CONFIGS["both"]))
    open_url = await serve(make_app(backend))
    async with httpx.AsyncClient(timeout=10) as client:
        secured = (await client.get(f"{secured_url}/openapi.json", headers=_headers(API))).json()
        plain = (await client.get(f"{open_url}/openapi.json")).json()

    assert secured["components"]["securitySchemes"] == {
        "bearerAuth": {"type": "http", "scheme": "bearer", "description": "--api-key or --admin-api-key"}}
    paths = secured["paths"]
    assert paths["/health"]["get"]["security"] == []
    assert paths["/v1/completions"]["post"]["security"] == [{"bearerAuth": []}]
    assert set(paths["/v1/completions"]["post"]["responses"]) == {"200", "401", "default"}
    assert set(paths["/flush_cache"]["post"]["responses"]) == {"200", "401", "403", "default"}
    assert "securitySchemes" not in plain["components"]
    assert "security" not in plain["paths"]["/v1/completions"]["post"]


def test_a_secret_never_shows_its_value():
    key = Secret("s3cr3t-value")
    holder = {"key": key, "nested": [key]}

    texts = [repr(key), str(key), f"{key}", json.dumps(holder, default=str), repr(holder)]
    assert all("s3cr3t-value" not in text for text in texts)
    assert str(key) == "<redacted>" and repr(key) == "Secret('<redacted>')"
    assert copy.deepcopy(key) is key and key.reveal() == "s3cr3t-value"
    assert key.matches("s3cr3t-value") and not key.matches("s3cr3t-valuf") and not key.matches("")
    assert not key.matches("s3cr3t-value\u00e9")  # a non-ASCII token compares, never raises
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(key)


@pytest.mark.parametrize("bad", ["", "has space", "tab\there", "caf\u00e9", "x" * 4097])
def test_a_key_must_be_visible_ascii(bad):
    with pytest.raises(ValueError, match="--api-key .* must be 1 to 4096 visible ASCII characters"):
        parse_server_args(["--api-key", bad])


def test_keys_come_from_the_environment_and_the_flags_win():
    from_env = parse_server_args([], environ={"APP_API_KEY": API, "APP_ADMIN_API_KEY": ADMIN})
    flag_wins = parse_server_args(["--api-key", "from-flag"], environ={"APP_API_KEY": API})
    empty_env = parse_server_args([], environ={"APP_API_KEY": ""})

    assert from_env.api_key.reveal() == API and from_env.admin_api_key.reveal() == ADMIN
    assert flag_wins.api_key.reveal() == "from-flag" and flag_wins.admin_api_key is None
    assert empty_env.api_key is None
    shown = [repr(from_env), str(from_env), json.dumps(from_env.to_dict()), json.dumps(asdict(from_env), default=str)]
    assert all(API not in text and ADMIN not in text for text in shown)
    assert from_env.to_dict()["api_key"] == from_env.to_dict()["admin_api_key"] == "<set>"
