"""`--api-key` and `--admin-api-key`: every route needs a key; admin routes need the admin key."""

from __future__ import annotations

import httpx
import openai
import pytest

from engram.args import EngineArgs, ServerArgs
from engram.launch_server import build_app
from engram.models.embedded import ensure_embedded_model
from engram.server.auth import AuthConfig
from engram.server.background import BackgroundServer

MODEL = "tiny-hybrid"
USER, ADMIN = "user-key", "admin-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = ensure_embedded_model(tmp_path_factory.getbasetemp() / "engram-cache")
    engine_args = EngineArgs(model_path=str(path), max_running_requests=2, max_total_tokens=4096, context_length=512)
    server_args = ServerArgs(served_model_name=MODEL, api_key=USER, admin_api_key=ADMIN)
    with BackgroundServer(build_app(engine_args, server_args)) as srv:
        yield srv


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("route", ["/v1/models", "/get_model_info", "/flush_cache", "/docs", "/Health", "/metrics/"])
@pytest.mark.parametrize("headers", [{}, bearer("wrong"), {"Authorization": USER}], ids=["missing", "wrong", "no-scheme"])
def test_every_route_but_the_probes_needs_a_key(server, route, headers):
    r = httpx.get(server.url + route, headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("route", ["/health", "/health_generate", "/metrics"])
def test_probes_need_no_key(server, route):
    assert httpx.get(server.url + route).status_code == 200


def test_auth_comes_before_body_parsing(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 401


def test_user_key(server):
    assert httpx.get(server.url + "/health", headers=bearer(USER)).status_code == 200
    r = httpx.post(server.url + "/generate", headers=bearer(USER), json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1
    assert httpx.post(server.url + "/flush_cache", headers=bearer(USER)).status_code == 401  # admin route
    assert httpx.post(server.url + "/abort_request", headers=bearer(USER), json={"abort_all": True}).status_code == 401


def test_admin_key(server):
    assert httpx.post(server.url + "/flush_cache", headers=bearer(ADMIN)).status_code == 200
    assert httpx.get(server.url + "/health", headers=bearer(ADMIN)).status_code == 200


def test_server_paths_go_to_the_admin_only(server, tmp_path_factory):
    """The model's and snapshot folder's paths are the admin's (a snapshot's, below the folder)."""
    base = str(tmp_path_factory.getbasetemp())  # the model and the snapshot folder are under it
    model_path = str(server.app.state.serving.engine.engine.model_path)
    routes = ("/v1/models", "/get_model_info", "/get_server_info")
    user, admin = ({route: httpx.get(server.url + route, headers=bearer(key)) for route in routes} for key in (USER, ADMIN))
    assert all(r.status_code == 200 and base not in r.text for r in user.values())
    assert user["/v1/models"].json()["data"][0]["root"] == MODEL and user["/get_model_info"].json()["model_path"] == MODEL
    assert admin["/v1/models"].json()["data"][0]["root"] == model_path
    assert admin["/get_model_info"].json()["model_path"] == model_path
    assert admin["/get_server_info"].json()["engine_args"]["model_path"] == model_path

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "conversation_id": "paths"}
    assert httpx.post(server.url + "/v1/chat/completions", headers=bearer(USER), json=body, timeout=60).status_code == 200
    for route in ("/list_snapshots", "/get_snapshot_info"):
        r = httpx.post(server.url + route, headers=bearer(ADMIN), json={"conversation_id": "paths"})
        assert r.status_code == 200 and base not in r.text
        entries = r.json()["snapshots"] if route == "/list_snapshots" else [r.json()]
        assert [e["manifest"]["path"] for e in entries] == ["paths/main/000001.json"]


def test_openai_client(server):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=USER, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="a", max_tokens=2).usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.parametrize(
    ("api_key", "admin_api_key", "user_route", "admin_route"),
    [
        ([], None, [], []),
        (["u"], None, ["u"], ["u"]),
        (["u", "v"], None, ["u", "v"], ["u", "v"]),
        ([], "a", [], ["a"]),
        (["u"], "a", ["u", "a"], ["a"]),
    ],
)
def test_key_policy(api_key, admin_api_key, user_route, admin_route):
    config = AuthConfig.of(api_key, None, admin_api_key, frozenset({"/flush_cache"}))
    assert config.allowed_keys("/generate") == user_route
    assert config.allowed_keys("/flush_cache") == admin_route
    for token in (None, "u", "a"):  # an admin holds the admin key (everyone, without keys); a tenant never is
        assert config.caller(token).admin == (token == admin_api_key if admin_api_key else not api_key)
