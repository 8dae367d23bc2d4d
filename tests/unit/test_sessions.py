"""Stateful sessions' file store (two stores on one folder stand for two gunicorn workers) and the custom attributes
a request's properties are read from."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from handler.errors import BadRequest
from handler.protocol.attributes import CUSTOM_ATTRIBUTES_HEADER, RequestProperties, parse_custom_attributes
from handler.sessions import RECONCILE_S, SessionStore


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def workers(folder: Path, clock: Clock, expiration_s: int = 1200) -> tuple[SessionStore, SessionStore, list]:
    ended: list[tuple[str, str]] = []
    one = SessionStore(folder, expiration_s, lambda s: ended.append(("one", s)), clock=clock)
    two = SessionStore(folder, expiration_s, lambda s: ended.append(("two", s)), clock=clock)
    return one, two, ended


def test_a_session_made_by_one_worker_is_used_and_closed_by_the_other(tmp_path: Path, clock: Clock) -> None:
    one, two, _ended = workers(tmp_path, clock)
    session = one.create()
    assert str(uuid.UUID(session.session_id)) == session.session_id
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", session.expires)
    assert session.expires_at == clock.now + 1200
    assert two.get(session.session_id) == session
    two.close(session.session_id)
    with pytest.raises(BadRequest) as info:
        one.get(session.session_id)
    assert info.value.param == "X-Amzn-SageMaker-Session-Id" and info.value.code == "session_not_found"


def test_a_second_close_is_refused(tmp_path: Path, clock: Clock) -> None:
    one, two, _ended = workers(tmp_path, clock)
    session = one.create()
    one.close(session.session_id)
    with pytest.raises(BadRequest):
        two.close(session.session_id)


@pytest.mark.parametrize("session_id", [str(uuid.uuid4()), "../../etc/passwd", "NEW_SESSION", "",
                                        str(uuid.uuid4()).upper()])
def test_an_id_never_issued_is_unknown(tmp_path: Path, clock: Clock, session_id: str) -> None:
    one, _two, _ended = workers(tmp_path, clock)
    with pytest.raises(BadRequest):
        one.get(session_id)
    with pytest.raises(BadRequest):
        one.close(session_id)


def test_an_expired_session_is_unknown_and_swept(tmp_path: Path, clock: Clock) -> None:
    one, _two, _ended = workers(tmp_path, clock, expiration_s=10)
    session = one.create()
    clock.now += 11
    with pytest.raises(BadRequest):
        one.get(session.session_id)
    other = one.create()
    clock.now += 11
    one.create()  # creating sweeps the expired
    assert not (tmp_path / f"{session.session_id}.json").exists()   # removed when it was looked up
    assert not (tmp_path / f"{other.session_id}.json").exists()     # removed by the sweep
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_the_workers_that_served_a_session_hear_that_it_ended(tmp_path: Path, clock: Clock) -> None:
    one, two, ended = workers(tmp_path, clock)
    session = one.create()
    one.get(session.session_id)      # served by both workers: both engines pin its blocks
    two.get(session.session_id)
    one.close(session.session_id)    # the worker that closes tells its engine at once
    assert ended == [("one", session.session_id)]
    later = two.create()
    two.get(later.session_id)        # the other looked a moment ago: not yet
    assert ended == [("one", session.session_id)]
    clock.now += RECONCILE_S
    two.get(later.session_id)        # it learns at its next session request after RECONCILE_S
    assert ended == [("one", session.session_id), ("two", session.session_id)]


def test_an_expiry_reaches_the_engines_that_served_the_session(tmp_path: Path, clock: Clock) -> None:
    one, _two, ended = workers(tmp_path, clock, expiration_s=10)
    session = one.create()
    one.get(session.session_id)
    clock.now += 11
    fresh = one.create()
    one.get(fresh.session_id)
    assert ended == [("one", session.session_id)]


@pytest.mark.parametrize(("header", "properties"), [
    (None, RequestProperties()),
    ("", RequestProperties()),
    ("x-priority=3", RequestProperties(priority=3)),
    (" X-Priority = -2 ; extra-parameters=ignore", RequestProperties(extra_parameters="ignore", priority=-2)),
    ("trace-id=abc; tenant=7; flag", RequestProperties()),   # the caller's own attributes: not errors
    ("extra-parameters=pass-through;;", RequestProperties(extra_parameters="pass-through")),
])
def test_custom_attributes_become_the_requests_properties(header: str | None, properties: RequestProperties) -> None:
    assert parse_custom_attributes(header) == properties


@pytest.mark.parametrize("header", ["x-priority=high", "x-priority=", "x-priority=1.5", "a=" + "b" * 1030,
                                    "x-priority=1; note=caf\u00e9"])
def test_a_malformed_custom_attributes_header_is_a_400_naming_it(header: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_custom_attributes(header)
    assert info.value.param == CUSTOM_ATTRIBUTES_HEADER


def test_an_unknown_attribute_is_logged_at_debug_level(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("DEBUG", logger="handler.protocol.attributes"):
        parse_custom_attributes("trace-id=abc")
    assert [record.levelname for record in caplog.records] == ["DEBUG"]
    assert "trace-id=abc" in caplog.records[0].getMessage()
