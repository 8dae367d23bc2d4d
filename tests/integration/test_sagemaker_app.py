"""SageMaker's contracts through ``app.test_client()`` with a scripted engine: stateful sessions (every case the
standards package tests), priority from the body or the custom attributes, adapter registration by query string,
the body limit as a setting, and asynchronous endpoints' Content-Length on streams."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from handler import server
from handler.config import Settings
from handler.engine.types import AdapterInfo
from handler.service import RequestDefaults
from handler.sessions import SessionStore
from tests.integration.conftest import post
from tests.integration.test_server_app import CHAT, MODEL_NAME, FakeEngine, FakeService, renderer  # noqa: F401

SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION = "X-Amzn-SageMaker-New-Session-Id"
CLOSED = "X-Amzn-SageMaker-Closed-Session-Id"
ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
DISABLED = "Invalid payload. stateful sessions not enabled"


class FakeAdapters:
    def __init__(self) -> None:
        self.registered: list[tuple] = []

    def register(self, name: str, src: str, *, preload: bool = True, pin: bool = False) -> AdapterInfo:
        self.registered.append((name, src, preload, pin))
        return AdapterInfo(name, src, pinned=pin, loaded=preload)

    def drain_events(self) -> list:
        return []


def make_client(renderer, tmp_path: Path | None = None, **settings):  # noqa: F811
    ended: list[str] = []
    sessions = None if tmp_path is None else SessionStore(tmp_path, 1200, ended.append)
    service = FakeService(settings=Settings(**settings), model_name=MODEL_NAME, defaults=RequestDefaults(0.0, 256),
                          renderer=renderer, engine=FakeEngine(), user_handler=None, sessions=sessions,
                          adapters=FakeAdapters())
    return server.create_app(service).test_client(), service, ended


@pytest.fixture()
def sessions_on(renderer, tmp_path: Path):  # noqa: F811
    return make_client(renderer, tmp_path)


def new_session(client) -> str:
    response = post(client, "/invocations", {"requestType": "NEW_SESSION"}, headers={SESSION: "NEW_SESSION"})
    assert response.status_code == 200, response.get_data(as_text=True)
    header = response.headers[NEW_SESSION]
    assert re.fullmatch(r"[0-9a-f-]{36}; Expires=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", header)
    assert "created" in response.get_json()["message"]
    return header.split(";")[0]


def test_a_session_opens_carries_its_requests_to_the_engine_and_closes(sessions_on) -> None:
    client, service, ended = sessions_on
    session_id = new_session(client)
    for _turn in range(2):
        assert post(client, "/invocations", CHAT, headers={SESSION: session_id}).status_code == 200
    assert [h.request.session.session_id for h in service.engine.handles] == [session_id, session_id]
    assert post(client, "/invocations", CHAT).status_code == 200  # no header: stateless
    assert service.engine.handles[-1].request.session is None
    closed = post(client, "/invocations", {"requestType": "CLOSE"}, headers={SESSION: session_id})
    assert closed.status_code == 200 and closed.headers[CLOSED] == session_id
    assert ended == [session_id]  # this worker's engine lets its pins go
    after = post(client, "/invocations", CHAT, headers={SESSION: session_id})
    assert after.status_code == 400 and "session not found" in after.get_json()["error"]["message"]


def test_sessions_are_told_apart(sessions_on) -> None:
    client, _service, _ended = sessions_on
    assert new_session(client) != new_session(client)


@pytest.mark.parametrize(("body", "headers", "field"), [
    ({"requestType": "CLOSE"}, {}, SESSION),                                        # CLOSE names no session
    ({"requestType": "CLOSE"}, {SESSION: "7b0c6a34-40a3-4dbb-9b2e-3f1c6f0d8e21"}, SESSION),  # unknown id
    ({"requestType": "INVALID_TYPE"}, {}, "requestType"),
    ({"requestType": "NEW_SESSION", "extra_field": "x"}, {}, "extra_field"),
    ({"requestType": "NEW_SESSION", "messages": CHAT["messages"]}, {}, "messages"),  # requestType decides
])
def test_malformed_session_requests_are_400s_naming_the_field(sessions_on, body: dict, headers: dict,
                                                              field: str) -> None:
    client, _service, _ended = sessions_on
    response = post(client, "/invocations", body, headers=headers)
    assert response.status_code == 400
    assert response.get_json()["param"] == field


def test_an_unknown_session_header_on_a_generation_request_is_a_400(sessions_on) -> None:
    client, service, _ended = sessions_on
    response = post(client, "/v1/chat/completions", CHAT, headers={SESSION: "not-a-session"})
    assert response.status_code == 400 and response.get_json()["error"]["param"] == SESSION
    assert service.engine.handles == []


@pytest.mark.parametrize(("body", "headers"), [
    ({"requestType": "NEW_SESSION"}, {}),
    ({"requestType": "CLOSE"}, {SESSION: "some-session-id"}),
    (CHAT, {SESSION: "some-session-id"}),
])
def test_with_sessions_off_a_session_request_or_header_is_a_400(renderer, body: dict, headers: dict) -> None:  # noqa: F811
    client, service, _ended = make_client(renderer)
    response = post(client, "/invocations", body, headers=headers)
    assert response.status_code == 400 and DISABLED in response.get_data(as_text=True)
    assert service.engine.handles == []


@pytest.mark.parametrize(("path", "body", "attributes", "priority"), [
    ("/v1/chat/completions", CHAT, None, 0),
    ("/v1/chat/completions", {**CHAT, "priority": -3}, None, -3),
    ("/v1/chat/completions", CHAT, "trace=1; x-priority=5", 5),
    ("/v1/chat/completions", {**CHAT, "priority": 2}, "x-priority=5", 2),        # the body's own wins
    ("/v1/completions", {"prompt": "hi", "priority": 7}, None, 7),
    ("/invocations", {"inputs": "hi"}, "x-priority=-1", -1),                     # legacy: the attribute
])
def test_priority_comes_from_the_body_else_the_custom_attributes(renderer, path, body, attributes,  # noqa: F811
                                                                  priority) -> None:
    client, service, _ended = make_client(renderer)
    headers = {ATTRIBUTES: attributes} if attributes else {}
    assert post(client, path, body, headers=headers).status_code == 200
    assert service.engine.handles[-1].request.priority == priority


def test_a_bad_priority_attribute_is_a_400_naming_the_header(renderer) -> None:  # noqa: F811
    client, service, _ended = make_client(renderer)
    response = post(client, "/v1/chat/completions", CHAT, headers={ATTRIBUTES: "x-priority=soon"})
    assert response.status_code == 400 and response.get_json()["error"]["param"] == ATTRIBUTES
    assert service.engine.handles == []


def test_an_adapter_is_registered_by_query_string(renderer) -> None:  # noqa: F811
    client, service, _ended = make_client(renderer)
    response = client.post("/adapters?name=a1&src=/models/a1&preload=false&pin=true")
    assert response.status_code == 200, response.get_data(as_text=True)
    assert service.adapters.registered == [("a1", "/models/a1", False, True)]
    missing = client.post("/adapters?name=a2")
    assert missing.status_code == 400 and missing.get_json()["error"]["param"] == "src"


def test_the_body_limit_is_the_setting(renderer) -> None:  # noqa: F811
    client, _service, _ended = make_client(renderer, max_request_size=4096)
    padded = {**CHAT, "user": "x" * 5000}
    response = post(client, "/v1/chat/completions", padded)
    assert response.status_code == 413 and "4096" in response.get_json()["error"]["message"]
    assert post(client, "/v1/chat/completions", {**CHAT, "user": "x" * 3000}).status_code == 200


def test_under_async_inference_a_stream_is_one_body_with_a_content_length(renderer) -> None:  # noqa: F811
    streamed, _service, _ended = make_client(renderer)
    buffered, _service, _ended = make_client(renderer, async_inference=True)
    body = {**CHAT, "stream": True}
    chunked = post(streamed, "/invocations", body)
    whole = post(buffered, "/invocations", body)
    assert "Content-Length" not in chunked.headers  # a stream: gunicorn sends it chunked
    assert int(whole.headers["Content-Length"]) == len(whole.get_data())
    records = [json.loads(line) for line in whole.get_data(as_text=True).splitlines()]
    assert records[-1]["choices"][0]["finish_reason"] == "stop"
    expected = [json.loads(line) for line in chunked.get_data(as_text=True).splitlines()]
    assert [r["choices"] for r in records] == [r["choices"] for r in expected]  # the same records, in order
