"""The store the workers share (``handler.store``): stored responses (bounded, least recently used forgotten first,
seen by every worker), background runs (progress written only while active, cancelled from another worker, events
replayed from any sequence number), conversations, and the reasoning seal (what opens, what does not, key rotation).
Two stores opened on one folder stand for two gunicorn workers: each has its own connections, as each process does.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from handler.config_sources import load_settings
from handler.engine.types import FinishReason, TokenEvent
from handler.errors import ConfigError
from handler.formatting.responses import ResponseEvents, ResponsesContext, response_object
from handler.request_log import RequestRecord
from handler.store.background import BackgroundRun, BackgroundRuns, replay
from handler.store.conversations import ConversationStore
from handler.store.database import Database
from handler.store.responses import ResponseStore, StoredResponse
from handler.store.sealing import ReasoningSeal, new_key
from tests.unit.test_formatting import ctx


def stored(response_id: str, status: str = "completed", **fields) -> StoredResponse:
    return StoredResponse({"id": response_id, "status": status, "output": [{"type": "message"}]}, [{"role": "user"}],
                          **fields)


def test_the_store_forgets_the_least_recently_used_first_and_every_worker_sees_it(tmp_path: Path) -> None:
    store, other_worker = ResponseStore(Database(tmp_path), 2), ResponseStore(Database(tmp_path), 2)
    store.put(stored("a"))
    store.put(stored("b"))
    assert other_worker.get("a") is not None  # a is now the most recent, for both
    store.put(stored("c"))
    assert other_worker.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.get("a").conversation == [{"role": "user"}, {"type": "message"}]
    assert other_worker.delete("a") and not store.delete("a") and store.get("a") is None
    empty = ResponseStore(Database(tmp_path / "none"), 0)
    assert not empty.put(stored("a")) and empty.get("a") is None


def test_a_background_run_still_going_is_never_forgotten(tmp_path: Path) -> None:
    store = ResponseStore(Database(tmp_path), 1)
    store.put(stored("running", "in_progress", background=True))
    store.put(stored("done"))
    assert store.get("running") is not None and store.get("done") is not None  # over the bound, but running


def test_progress_is_written_only_while_active_and_cancel_wins(tmp_path: Path) -> None:
    store, other_worker = ResponseStore(Database(tmp_path), 10), ResponseStore(Database(tmp_path), 10)
    store.put(stored("r", "queued", background=True, owner=None))
    assert store.update({"id": "r", "status": "in_progress", "output": []})
    assert store.stopped(["r"]) == set()
    assert other_worker.cancel("r") and not other_worker.cancel("r")  # cancelled once; then it is not active
    assert store.stopped(["r"]) == {"r"}
    assert not store.update({"id": "r", "status": "completed", "output": []})  # the end never overwrites it
    assert store.get("r").response["status"] == "cancelled"
    assert store.stopped(["gone"]) == {"gone"}  # deleted or forgotten: stop too


def test_a_run_whose_worker_died_is_failed_by_its_first_reader(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store = ResponseStore(Database(tmp_path), 10)
    store.put(stored("r", "in_progress", background=True, owner=dead.pid))
    assert store.status("r") == "failed"
    assert store.get("r").response["error"]["message"].startswith("the worker generating this response stopped")


def test_events_are_read_back_after_a_sequence_number(tmp_path: Path) -> None:
    store = ResponseStore(Database(tmp_path), 10)
    store.put(stored("r", "in_progress", background=True, stream=True))
    store.add_events("r", [{"type": "x", "sequence_number": n} for n in range(5)])
    assert [e["sequence_number"] for e in store.events("r", 2)] == [3, 4]
    assert store.delete("r") and store.events("r", -1) == []


def test_conversations_keep_items_in_order_and_are_bounded(tmp_path: Path) -> None:
    conversations = ConversationStore(Database(tmp_path), 2)
    made = conversations.create("c1", {"k": "v"}, [{"id": "i1", "type": "message"}])
    assert made["object"] == "conversation" and made["metadata"] == {"k": "v"}
    assert conversations.add_items("c1", [{"id": "i2"}, {"id": "i3"}]) and not conversations.add_items("nope", [])
    assert [i["id"] for i in conversations.items("c1")] == ["i1", "i2", "i3"]
    assert conversations.delete_item("c1", "i2") and conversations.delete_item("c1", "i2") is False
    assert conversations.delete_item("nope", "i1") is None
    assert [i["id"] for i in conversations.items("c1")] == ["i1", "i3"]
    assert conversations.update("c1", {"a": "b"})["metadata"] == {"a": "b"} and conversations.update("x", {}) is None
    conversations.create("c2", {}, [])
    conversations.get("c1")  # c2 is now the least recently used
    conversations.create("c3", {}, [])
    assert conversations.get("c2") is None and conversations.items("c2") is None and conversations.get("c1")
    assert conversations.delete("c1") and not conversations.delete("c1") and conversations.items("c1") is None


def test_sealed_reasoning_opens_only_under_the_deployments_keys() -> None:
    old, new = new_key(), new_key()
    blob = ReasoningSeal(old).seal("I think so.")
    assert "I think so" not in blob and ReasoningSeal(old).open(blob) == "I think so."
    assert ReasoningSeal(new).open(blob) is None  # another deployment's key
    assert ReasoningSeal(old).open(blob[:-4] + "AAAA") is None and ReasoningSeal(old).open("not a blob") is None
    rotated = ReasoningSeal(f"{new},{old}")  # a new key first; the old one still opens what it sealed
    assert rotated.open(blob) == "I think so." and ReasoningSeal(new).open(rotated.seal("x")) == "x"


@pytest.mark.parametrize("value", ["abc", "", " , "])
def test_an_encryption_key_that_is_not_a_fernet_key_stops_the_start(value: str) -> None:
    with pytest.raises(ConfigError, match="responses_encryption_key"):
        load_settings({"OPTION_RESPONSES_ENCRYPTION_KEY": value})


# ---- background runs --------------------------------------------------------------------------------------------

class GatedHandle:
    """Yields its events, holding before the last until released (or cancelled: then it ends as the engine ends a
    cancelled request, with ABORT)."""

    def __init__(self, events: list[TokenEvent]) -> None:
        self.events, self.release, self.cancelled = events, threading.Event(), threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()
        self.release.set()

    def __iter__(self):
        yield from self.events[:-1]
        self.release.wait(30)
        if self.cancelled.is_set():
            yield TokenEvent(0, None, "", finish_reason=FinishReason.ABORT)
            return
        yield self.events[-1]


def hello() -> list[TokenEvent]:
    return [TokenEvent(0, 1, "Hello", -0.5), TokenEvent(0, 2, " world", -0.25),
            TokenEvent(0, 3, "", finish_reason=FinishReason.EOS, num_prompt_tokens=2, num_generated_tokens=3)]


def start_run(runs: BackgroundRuns, handle: GatedHandle, response_id: str = "resp_1") -> ResponseEvents:
    context = dataclasses.replace(ctx(ResponsesContext, queued=True), request_id=response_id)
    runs.responses.put(StoredResponse(response_object(context, "queued", []), [], background=True, stream=True))
    events = ResponseEvents(context)
    runs.start(BackgroundRun(response_id, handle, events, True, RequestRecord(response_id, "/v1/responses", 0.0)))
    return events


def wait_for(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_run_ends_stored_and_its_events_replay_from_any_point(tmp_path: Path) -> None:
    counted = []
    runs = BackgroundRuns(ResponseStore(Database(tmp_path), 10), counted.append)
    handle = GatedHandle(hello())
    start_run(runs, handle)
    wait_for(lambda: runs.responses.status("resp_1") == "in_progress")
    handle.release.set()
    events = list(replay(runs, "resp_1", -1))  # waits for the run's end
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert events[0]["response"]["status"] == "queued"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert list(replay(runs, "resp_1", 3)) == events[4:]
    assert runs.responses.get("resp_1").response == events[-1]["response"]
    wait_for(lambda: counted == [1, -1])  # counted as work in flight while it ran (the SIGTERM drain waits)


def test_a_run_cancelled_by_another_worker_stops_and_never_ends_completed(tmp_path: Path) -> None:
    runs = BackgroundRuns(ResponseStore(Database(tmp_path), 10), lambda delta: None)
    other_worker = ResponseStore(Database(tmp_path), 10)
    handle = GatedHandle(hello())
    start_run(runs, handle)
    wait_for(lambda: other_worker.status("resp_1") == "in_progress")
    assert other_worker.cancel("resp_1")
    wait_for(handle.cancelled.is_set)  # the owner's watcher saw it in the store
    events = list(replay(runs, "resp_1", -1))
    assert events[-1]["type"] == "response.output_text.delta"  # what it said before; no terminal event
    assert other_worker.get("resp_1").response["status"] == "cancelled"
