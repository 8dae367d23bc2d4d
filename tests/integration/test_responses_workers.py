"""The Responses API's state across gunicorn workers, with two apps on one store folder and one key standing for two
workers (each app has its own front door, store connections and background runs, as each worker process does):
what one stores the other finds and continues, a background run one generates the other polls and cancels, a
conversation one makes the other answers in, and reasoning one seals the other opens (a deployment with another key
cannot). The engine is scripted (``test_server_app``'s fake, with a run that waits to be released or cancelled).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from handler import server
from handler.config import Settings
from handler.engine.types import FinishReason, GenerationRequest, TokenEvent
from handler.service import RequestDefaults
from handler.store.sealing import ReasoningSeal, new_key
from tests.integration.conftest import post
from tests.integration.test_server_app import MODEL_NAME, FakeEngine, FakeService, hello_script

KEY = new_key()


class HeldHandle:
    """Says "Hello", then waits to be released (the rest of the script) or cancelled (ABORT, as an engine ends a
    cancelled request)."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request, self.script = request, hello_script(request)
        self.release, self.cancelled = threading.Event(), threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()
        self.release.set()

    def __iter__(self) -> Iterator[TokenEvent]:
        yield self.script[0]
        self.release.wait(60)
        if self.cancelled.is_set():
            yield TokenEvent(0, None, "", finish_reason=FinishReason.ABORT)
            return
        yield from self.script[1:]


class HeldEngine(FakeEngine):
    def submit(self, request: GenerationRequest) -> HeldHandle:
        handle = HeldHandle(request)
        self.handles.append(handle)
        return handle


def worker(renderer, folder: Path, key: str = KEY, engine: FakeEngine | None = None):
    settings = Settings(responses_store_dir=str(folder), responses_encryption_key=key)
    service = FakeService(settings=settings, model_name=MODEL_NAME, defaults=RequestDefaults(0.0, 256),
                          renderer=renderer, engine=engine or FakeEngine(), user_handler=None)
    return server.create_app(service).test_client()


@pytest.fixture()
def workers(renderer, tmp_path: Path):
    return worker(renderer, tmp_path), worker(renderer, tmp_path)


def wait_for(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_what_one_worker_stores_another_finds_continues_and_lists(workers) -> None:
    first, second = workers
    answer = post(first, "/v1/responses", {"input": "hi", "instructions": "Be brief"}).get_json()
    assert second.get(f"/v1/responses/{answer['id']}").get_json() == answer
    follow = post(second, "/v1/responses", {"input": "more", "previous_response_id": answer["id"]})
    assert follow.status_code == 200 and follow.get_json()["previous_response_id"] == answer["id"]
    items = second.get(f"/v1/responses/{follow.get_json()['id']}/input_items?order=asc").get_json()
    assert [i["type"] for i in items["data"]] == ["message", "message", "message"]  # hi, its answer, more
    assert [i["role"] for i in items["data"]] == ["user", "assistant", "user"] and not items["has_more"]
    assert items["first_id"] == items["data"][0]["id"] and items["data"][0]["id"].startswith("msg_")
    assert first.delete(f"/v1/responses/{answer['id']}").status_code == 200
    assert second.get(f"/v1/responses/{answer['id']}").status_code == 404


def test_a_background_run_is_polled_and_cancelled_from_another_worker(renderer, tmp_path: Path) -> None:
    engine = HeldEngine()
    owner, other = worker(renderer, tmp_path, engine=engine), worker(renderer, tmp_path)
    queued = post(owner, "/v1/responses", {"input": "hi", "background": True}).get_json()
    assert queued["status"] == "queued" and queued["background"] is True
    url = f"/v1/responses/{queued['id']}"
    wait_for(lambda: other.get(url).get_json()["status"] == "in_progress")  # its first token
    cancelled = post(other, f"{url}/cancel", {}).get_json()
    assert cancelled["status"] == "cancelled"
    wait_for(engine.handles[0].cancelled.is_set)  # the owner's watcher saw the mark and stopped the generation
    time.sleep(0.5)
    assert owner.get(url).get_json()["status"] == "cancelled"  # its end never overwrote the cancel
    again = post(other, f"{url}/cancel", {})
    assert again.status_code == 200 and again.get_json()["status"] == "cancelled"  # cancelling again: as it is


def test_a_background_run_ends_stored_and_its_stream_resumes_from_any_event(renderer, tmp_path: Path) -> None:
    engine = HeldEngine()
    owner, other = worker(renderer, tmp_path, engine=engine), worker(renderer, tmp_path)
    queued = post(owner, "/v1/responses", {"input": "hi", "background": True, "stream": True},
                  buffered=False)
    url = f"/v1/responses/{engine.handles[0].request.request_id}"  # submitted before the stream's first byte
    wait_for(lambda: other.get(url).get_json()["status"] == "in_progress")
    engine.handles[0].release.set()
    frames = [frame for frame in queued.data.decode().split("\n\n") if frame]
    kinds = [frame.split("\n")[0].removeprefix("event: ") for frame in frames]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    resumed = other.get(f"{url}?stream=true&starting_after=3").data.decode()
    assert [f for f in resumed.split("\n\n") if f] == frames[4:]
    done = other.get(url).get_json()
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Hello world"
    assert other.get(f"{url}?stream=true").status_code == 200
    plain = post(other, "/v1/responses", {"input": "hi"}).get_json()["id"]
    assert other.get(f"/v1/responses/{plain}?stream=true").get_json()["error"]["param"] == "stream"
    assert post(other, f"/v1/responses/{plain}/cancel", {}).get_json()["error"]["param"] == "response_id"


def test_a_conversation_made_on_one_worker_is_answered_in_on_another(workers) -> None:
    first, second = workers
    made = post(first, "/v1/conversations", {"items": [{"role": "user", "content": "My name is Ada."}],
                                             "metadata": {"topic": "names"}}).get_json()
    assert made["object"] == "conversation" and made["id"].startswith("conv_")
    answer = post(second, "/v1/responses", {"input": "Who am I?", "conversation": made["id"]}).get_json()
    assert answer["conversation"] == {"id": made["id"]}
    items = first.get(f"/v1/conversations/{made['id']}/items?order=asc").get_json()["data"]
    assert [(i["type"], i["role"]) for i in items] == [("message", "user"), ("message", "user"),
                                                        ("message", "assistant")]
    added = post(second, f"/v1/conversations/{made['id']}/items", {"items": [{"role": "user", "content": "x"}]})
    assert added.get_json()["data"][0]["content"] == [{"type": "input_text", "text": "x"}]
    item_url = f"/v1/conversations/{made['id']}/items/{items[0]['id']}"
    assert first.get(item_url).get_json() == items[0]
    assert first.delete(item_url).get_json()["id"] == made["id"] and second.get(item_url).status_code == 404
    assert post(second, f"/v1/conversations/{made['id']}", {"metadata": {"a": "b"}}).get_json()["metadata"] == {
        "a": "b"}
    assert first.delete(f"/v1/conversations/{made['id']}").get_json()["deleted"] is True
    gone = post(second, "/v1/responses", {"input": "x", "conversation": made["id"]})
    assert gone.status_code == 404 and gone.get_json()["error"]["param"] == "conversation"


def test_sealed_reasoning_opens_on_every_worker_of_the_deployment_only(renderer, tmp_path: Path) -> None:
    sealed = ReasoningSeal(KEY).seal("I should greet.")
    items = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": sealed},
             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "again"}]
    body = {"input": items, "store": False, "include": ["reasoning.encrypted_content"]}
    assert post(worker(renderer, tmp_path), "/v1/responses", body).status_code == 200
    elsewhere = post(worker(renderer, tmp_path / "other", new_key()), "/v1/responses", body)
    assert elsewhere.status_code == 400
    assert elsewhere.get_json()["error"]["param"] == "input[1].encrypted_content"
