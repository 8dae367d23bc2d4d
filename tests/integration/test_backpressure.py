"""The real engine thread around a scripted runner: the bounded wait queue, per-request deadlines, step stats, and
how the server answers them (429, 504, a stream's final error record) through ``app.test_client()``.

The runner always picks the token " world" and can be held before a step, so which requests hold a slot and which
wait is decided by the test, not by speed. Deadlines run on a fake clock; nothing here asserts how fast anything is.
"""

from __future__ import annotations

import json
import threading
import types
from pathlib import Path

import pytest
import torch

from handler import metrics, server
from handler.config import DEFAULT_MODEL_DIR, Settings
from handler.endpoints import base as endpoint_base
from handler.engine.backend import Admission, EngineLimits, EngineStats
from handler.engine.core import admission as admission_module
from handler.engine.lean.engine import Engine, LoadedModel, wait_until_ready
from handler.engine.runners.base import StepOutput, StepPlan, Unbounded, advance
from handler.engine.types import ErrorKind, FinishReason, GenerationRequest, StopConditions
from handler.errors import Overloaded
from handler.prompt.renderer import PromptRenderer
from handler.service import RequestDefaults
from tests.integration.conftest import post

WORLD, EOS = 905, 2                          # " world", "<|im_end|>" in the embedded tokenizer
LONG = StopConditions(max_new_tokens=400, ignore_eos=True)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


class _Space(Unbounded):
    bytes_per_token, num_bytes = 8, 4096


class GatedRunner:
    """A runner whose steps can be held: ``hold()`` stops the next step until ``open_gate()``."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.space = _Space()
        self.prefix_ids: tuple[int, ...] = ()  # no shared chat-template prefix
        self._open = threading.Event()
        self._open.set()
        self.waiting_at_gate = threading.Event()

    def hold(self) -> None:
        self.waiting_at_gate.clear()
        self._open.clear()

    def open_gate(self) -> None:
        self._open.set()

    def run(self, plan: StepPlan) -> StepOutput:
        if not self._open.is_set():
            self.waiting_at_gate.set()
            self._open.wait()
        rows = [s for s in plan.decode if not s.is_prefilling]
        rows += [s for s, start, length in plan.prefill if start + length == s.prefill_target]
        advance(plan)
        logits = torch.zeros(len(rows), self.vocab_size)
        logits[:, WORLD] = 10.0
        return StepOutput(rows, logits)

    def match_prefix(self, sequence) -> None:
        return None

    def clear_prefix_cache(self) -> None:
        return None


class FakeClock:
    """``time.monotonic`` for admission control: each reading is one second later than the one before."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            self.now += 1.0
            return self.now


@pytest.fixture(scope="module")
def tokenizer():
    if not (DEFAULT_MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip("the embedded model is not assembled (make model)")
    from handler.engine.core.tokenizer import load_tokenizer

    return load_tokenizer(Path(DEFAULT_MODEL_DIR))


class Harness:
    def __init__(self, tokenizer, admission: Admission, max_running: int = 1) -> None:
        vocab_size = len(tokenizer)
        self.runner = GatedRunner(vocab_size)
        self.stats: list[EngineStats] = []
        loaded = LoadedModel(self.runner, tokenizer.backend_tokenizer, frozenset({EOS}), frozenset({EOS}), vocab_size)
        self.engine = Engine(lambda: loaded, EngineLimits(max_running=max_running, max_model_len=512,
                                                          max_step_tokens=64), admission, self.stats.append)

    def start(self) -> Harness:
        self.engine.start()
        wait_until_ready(self.engine, timeout=60)
        return self

    def hold_after_admitting(self, request: GenerationRequest):
        """Submit a request, then hold the runner once it holds a slot; returns its handle."""
        self.runner.hold()
        handle = self.engine.submit(request)
        assert self.runner.waiting_at_gate.wait(30)
        return handle


def generation(name: str, stop: StopConditions = LONG, n: int = 1) -> GenerationRequest:
    return GenerationRequest(name, prompt_ids=(1, 2, 3), stop=stop, n=n)


@pytest.fixture()
def harness(tokenizer):
    made: list[Harness] = []

    def make(admission: Admission, max_running: int = 1) -> Harness:
        made.append(Harness(tokenizer, admission, max_running).start())
        return made[-1]

    yield make
    for h in made:
        h.runner.open_gate()
        h.engine.stop()


@pytest.fixture()
def fake_clock(monkeypatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(admission_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    # a chat request's deadline counts from its arrival, which the endpoints stamp: the same clock
    monkeypatch.setattr(endpoint_base, "monotonic", clock.monotonic)
    return clock


def finals(handle) -> list:
    return [e for e in handle if e.finish_reason is not None]


# ---- the wait queue ---------------------------------------------------------------------------------------

def test_full_queue_refuses_at_once_then_accepts_when_room(harness) -> None:
    h = harness(Admission(max_waiting=2))
    running = h.hold_after_admitting(generation("a", StopConditions(max_new_tokens=2)))
    waiting = [h.engine.submit(generation(name, StopConditions(max_new_tokens=2))) for name in ("b", "c")]
    with pytest.raises(Overloaded, match=r"2 requests are already waiting .*option\.max_queue_size"):
        h.engine.submit(generation("d"))
    h.runner.open_gate()
    for handle in [running, *waiting]:
        assert [e.finish_reason for e in finals(handle)] == [FinishReason.LENGTH]
    assert finals(h.engine.submit(generation("e", StopConditions(max_new_tokens=1))))[0].finish_reason \
        is FinishReason.LENGTH


def test_cancelled_waiting_request_leaves_the_queue(harness) -> None:
    h = harness(Admission(max_waiting=1))
    running = h.hold_after_admitting(generation("a", StopConditions(max_new_tokens=2)))
    h.engine.submit(generation("b")).cancel()
    third = h.engine.submit(generation("c", StopConditions(max_new_tokens=2)))  # the cancelled one does not count
    h.runner.open_gate()
    assert finals(running)[0].finish_reason is FinishReason.LENGTH
    assert finals(third)[0].finish_reason is FinishReason.LENGTH


# ---- deadlines ----------------------------------------------------------------------------------------------

def test_waiting_request_past_its_deadline_ends_with_an_error(harness, fake_clock) -> None:
    h = harness(Admission(), max_running=2)
    running = h.hold_after_admitting(generation("a", StopConditions(max_new_tokens=3)))
    h.engine.admission = Admission(timeout_s=0.5)
    late = h.engine.submit(generation("b", n=2))  # waits: a holds one of the two slots
    h.runner.open_gate()
    late_finals = finals(late)
    assert [(e.index, e.finish_reason) for e in late_finals] == [(0, FinishReason.ERROR), (1, FinishReason.ERROR)]
    assert late_finals[0].error == "request timed out after 0.5 s (option.request_timeout)"
    assert late_finals[0].error_kind is ErrorKind.TIMEOUT
    assert finals(running)[0].finish_reason is FinishReason.LENGTH  # its own deadline is unlimited


def test_running_request_past_its_deadline_ends_with_its_text_and_frees_its_slot(harness, fake_clock) -> None:
    h = harness(Admission(timeout_s=5))
    overdue = h.engine.submit(generation("a"))  # 400 tokens; the clock passes 5 s after a few steps
    events = list(overdue)
    assert events[-1].finish_reason is FinishReason.DEADLINE and events[-1].error is None
    generated = events[-1].num_generated_tokens
    assert 0 < generated < LONG.max_new_tokens
    assert "".join(e.text for e in events) == " world" * generated
    h.engine.admission = Admission()
    assert finals(h.engine.submit(generation("b", StopConditions(max_new_tokens=2))))[0].finish_reason \
        is FinishReason.LENGTH


# ---- stopping ---------------------------------------------------------------------------------------------

def test_stop_with_a_reason_ends_running_and_waiting_requests_with_a_final_event(harness) -> None:
    h = harness(Admission(), max_running=2)
    running = h.hold_after_admitting(generation("a"))
    waiting = h.engine.submit(generation("b", n=2))  # waits: a holds one of the two slots
    h.engine.stop("the server is stopping")
    h.runner.open_gate()
    for handle, n in ((running, 1), (waiting, 2)):
        ends = finals(handle)
        assert [(e.finish_reason, e.error_kind, e.error) for e in ends] == \
            [(FinishReason.ERROR, ErrorKind.STOPPED, "the server is stopping")] * n


# ---- stats --------------------------------------------------------------------------------------------------

def test_stats_report_running_waiting_and_settle_at_zero(harness) -> None:
    h = harness(Admission(), max_running=1)
    running = h.hold_after_admitting(generation("a", StopConditions(max_new_tokens=2)))
    waiting = h.engine.submit(generation("b", StopConditions(max_new_tokens=2)))
    h.runner.open_gate()
    finals(running), finals(waiting)
    wait_for(lambda: h.stats and h.stats[-1].num_running == 0 and h.stats[-1].num_waiting == 0)
    stepped = [s for s in h.stats if s.batch_size]
    assert any(s.num_running == 1 and s.num_waiting == 1 for s in h.stats)
    assert all(s.batch_size == 1 for s in stepped)
    assert sum(s.num_sampled for s in h.stats) >= 4   # a and b, 2 tokens each (plus the warm-up's)
    assert any(s.kv_cache_used_bytes > 0 for s in stepped)
    assert h.stats[-1].kv_cache_used_bytes == 0


def wait_for(predicate, attempts: int = 300) -> None:
    event = threading.Event()
    for _ in range(attempts):
        if predicate():
            return
        event.wait(0.05)
    raise AssertionError("condition not reached")


# ---- through the server -------------------------------------------------------------------------------------

@pytest.fixture()
def app_for(tokenizer):
    made = []

    def make(h: Harness, settings: Settings):
        service = types.SimpleNamespace(settings=settings, model_name="m", defaults=RequestDefaults(0.0, 256),
                                        serves_builtin=True,
                                        renderer=PromptRenderer(tokenizer), engine=h.engine, user_handler=None,
                                        is_ready=True, load_error=None, adapters=None)
        made.append(server.create_app(service))
        return made[-1].test_client()

    return make


def counter(name: str) -> float:
    return metrics.REGISTRY.get_sample_value(name) or 0.0


def test_server_answers_a_full_queue_with_429_in_openai_shape(harness, app_for) -> None:
    h = harness(Admission(max_waiting=1))                      # the service builds its engine with these
    client = app_for(h, Settings(max_queue_size=1))
    h.runner.hold()
    first = post(client, "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 2}, buffered=False)
    assert h.runner.waiting_at_gate.wait(30)
    second = post(client, "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 2}, buffered=False)
    rejected_before = counter("llm_queue_rejections_total")
    third = post(client, "/invocations", {**CHAT, "max_tokens": 2})
    assert third.status_code == 429
    assert third.get_json()["error"]["type"] == "rate_limit_error"
    assert "option.max_queue_size" in third.get_json()["error"]["message"]
    assert third.headers["X-Request-Id"].startswith("req-")
    assert counter("llm_queue_rejections_total") == rejected_before + 1
    h.runner.open_gate()
    for response in (first, second):
        assert response.get_data().endswith(b"data: [DONE]\n\n")
        response.close()


def test_server_answers_a_deadline_after_tokens_with_the_text_so_far(harness, app_for, fake_clock) -> None:
    """What the deadline cut is the answer, ended like max_tokens ends one ("length"): non-streaming with the
    X-Request-Timeout header, streams with their usual last record. Each is counted as a timeout."""
    h = harness(Admission(timeout_s=5))
    client = app_for(h, Settings(request_timeout=5))
    timeouts_before = counter("llm_request_timeouts_total")
    response = post(client, "/invocations", {**CHAT, "max_tokens": 400, "ignore_eos": True})
    assert response.status_code == 200 and response.headers["X-Request-Timeout"] == "5"
    choice = response.get_json()["choices"][0]
    generated = response.get_json()["usage"]["completion_tokens"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == " world" * generated
    assert 0 < generated < 400
    legacy = post(client, "/invocations", {"inputs": "hi", "parameters": {"max_new_tokens": 400, "ignore_eos": True,
                                                                          "details": True}})
    assert legacy.status_code == 200 and legacy.headers["X-Request-Timeout"] == "5"
    details = legacy.get_json()["details"]
    assert details["finish_reason"] == "length" and legacy.get_json()["generated_text"] == " world" * \
        details["generated_tokens"]
    stream = post(client, "/invocations", {"inputs": "hi", "stream": True,
                                           "parameters": {"max_new_tokens": 400, "ignore_eos": True,
                                                          "details": True}})
    last = json.loads(stream.get_data().decode().splitlines()[-1])
    assert stream.status_code == 200 and "X-Request-Timeout" not in stream.headers
    assert last["details"]["finish_reason"] == "length" and last["generated_text"].startswith(" world")
    chat_stream = post(client, "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 400,
                                                        "ignore_eos": True})
    frames = chat_stream.get_data().decode().split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    assert json.loads(frames[-3].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert counter("llm_request_timeouts_total") == timeouts_before + 4


def test_server_answers_a_deadline_before_any_token_with_504_or_a_final_stream_record(harness, app_for,
                                                                                       fake_clock) -> None:
    """Nothing generated yet (waiting for a slot): nothing to give, so the timeout is an error."""
    h = harness(Admission())
    client = app_for(h, Settings(request_timeout=0.5))
    holder = h.hold_after_admitting(generation("hold", StopConditions(max_new_tokens=1)))
    h.engine.admission = Admission(timeout_s=0.5)  # every clock reading is a second later: overdue at once
    timeouts_before = counter("llm_request_timeouts_total")
    results: dict = {}
    bodies = {"chat": {**CHAT, "max_tokens": 4}, "legacy": {"inputs": "hi", "parameters": {"max_new_tokens": 4}},
              "stream": {"inputs": "hi", "stream": True, "parameters": {"max_new_tokens": 4}},
              "chat_stream": {**CHAT, "stream": True, "max_tokens": 4}}

    def send(name: str) -> None:
        headers = {"Accept": "text/event-stream"} if name == "chat_stream" else {}
        response = post(client, "/invocations", bodies[name], headers=headers)
        results[name] = (response.status_code, response.get_data().decode())

    threads = [threading.Thread(target=send, args=(name,), daemon=True) for name in bodies]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: h.engine._inbox.qsize() == 4)  # all four wait behind the held step
    finally:
        h.runner.open_gate()
    finals(holder)
    for thread in threads:
        thread.join(30)
    assert {name: status for name, (status, _) in results.items()} == {"chat": 504, "legacy": 504, "stream": 200,
                                                                        "chat_stream": 200}
    chat, legacy = (json.loads(results[name][1]) for name in ("chat", "legacy"))
    assert chat["error"] == {"message": "request timed out after 0.5 s (option.request_timeout)",
                             "type": "timeout_error", "param": None, "code": None}
    assert legacy["error_type"] == "timeout_error"
    last = json.loads(results["stream"][1].splitlines()[-1])
    assert last["token"]["id"] == -1 and "timed out after 0.5 s" in last["error"]
    frames = results["chat_stream"][1].split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    assert json.loads(frames[-3].removeprefix("data: "))["error"]["type"] == "timeout_error"
    assert counter("llm_request_timeouts_total") == timeouts_before + 4
