"""A request's images under budgets (``handler.images.loader``), with fake fetchers: URLs fetched at once, the fetch
budget, the worker's fetch cap and image memory budget (waits, 429s naming the setting), the total-pixel limit read
from headers before decoding, memory handed back after large images; and the request deadline counted from arrival
(``AdmissionControl`` with ``GenerationRequest.arrived_at``, ``ChatCompletionRequest.prepare``).

Fakes block on events, not on sleeps, wherever the order matters; the only waits are the loader's own bounded ones
(tenths of a second here), and nothing asserts how fast anything ran beyond generous bounds.
"""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from dataclasses import dataclass

import pytest
from PIL import Image, ImageFile

from handler.config import Settings
from handler.endpoints.base import arrival
from handler.engine.backend import Admission
from handler.engine.core.admission import AdmissionControl
from handler.engine.core.request import RequestState
from handler.engine.types import GenerationRequest
from handler.errors import BadRequest, Overloaded
from handler.images import Deadline, DecodeLimits, FetchPolicy, ImageFetchError, fetch_image_bytes, image_size
from handler.images import loader as loader_module
from handler.images.loader import BYTES_PER_PIXEL, Gate, ImageLoader, LoadBudget, LoadObserver
from handler.prompt.renderer import RenderedPrompt
from handler.protocol.chat import ChatCompletionRequest
from handler.protocol.common import parse_model


def png(width: int = 4, height: int = 4) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (9, 99, 199)).save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(width: int = 4, height: int = 4) -> str:
    return "data:image/png;base64," + base64.b64encode(png(width, height)).decode()


@dataclass(frozen=True)
class Ref:
    ref: str
    param: str


def urls(count: int, first: int = 1) -> list[Ref]:
    return [Ref(f"http://img.test/{i}.png", f"messages[0].content[{i}]") for i in range(first, first + count)]


class Recorder(LoadObserver):
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def fetch_failed(self, reason: str) -> None:
        self.events.append(("fetch_failed", reason))

    def waited(self, resource: str) -> None:
        self.events.append(("waited", resource))

    def refused(self, reason: str) -> None:
        self.events.append(("refused", reason))


class FakeFetch:
    """Answers every URL with a 4x4 PNG after ``release`` is set (set from the start unless ``hold``); counts the
    fetches in flight at once and the deadlines it was given."""

    def __init__(self, hold: bool = False, body: bytes | None = None) -> None:
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.body = body or png()
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.started = threading.Semaphore(0)
        self.calls: list[tuple[str, str, Deadline]] = []
        self.ended = 0

    def __call__(self, url: str, policy: FetchPolicy, *, param: str, deadline: Deadline) -> bytes:
        with self.lock:
            self.calls.append((url, param, deadline))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.started.release()
        try:
            if not self.release.wait(max(0.0, deadline.remaining()) + 5):
                raise AssertionError("the fake fetch was never released")
            return self.body
        finally:
            with self.lock:
                self.in_flight -= 1
                self.ended += 1

    def wait_started(self, count: int) -> None:
        for _ in range(count):
            assert self.started.acquire(timeout=10), "a fetch did not start"


def make_loader(fetch=None, observer: LoadObserver | None = None, **budget) -> ImageLoader:
    return ImageLoader(FetchPolicy(), DecodeLimits(), LoadBudget(**budget), fetch=fetch or FakeFetch(),
                       observer=observer)


def load(loader: ImageLoader, refs, **kwargs) -> list[tuple[int, int]]:
    with loader.load(refs, **kwargs) as images:
        return [image.size for image in images]


def wait_until(predicate, timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


def in_thread(function, *args, **kwargs) -> tuple[threading.Thread, list]:
    """Run ``function`` on a thread; the list gets its result or the exception it raised."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(function(*args, **kwargs))
        except Exception as error:
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


# --- Gate --------------------------------------------------------------------------------------------------------


def test_gate_grants_waits_times_out_and_clamps() -> None:
    gate = Gate(10)
    assert gate.take(4, 0) == 4 and gate.used == 4
    assert gate.take(7, 0) == 0                       # all or nothing by default
    assert gate.take(7, 0, at_least=1) == 6           # or what is free, down to at_least
    assert gate.take(1, 0.05) == 0                    # a bounded wait that runs out
    thread, outcome = in_thread(gate.take, 3, 10)
    gate.give(6)
    thread.join(10)
    assert outcome == [3] and gate.used == 7
    gate.give(7)
    assert gate.take(50, 0) == 10                     # larger than the whole: cut to it, so it waits for all of it
    gate.give(10)
    assert gate.used == 0


# --- fetching ----------------------------------------------------------------------------------------------------


def test_a_requests_urls_are_fetched_at_once_not_one_after_another() -> None:
    fetch = FakeFetch(hold=True)
    loader = make_loader(fetch)
    thread, outcome = in_thread(load, loader, urls(3))
    fetch.wait_started(3)                             # all three are in flight before any answers
    assert fetch.max_in_flight == 3
    fetch.release.set()
    thread.join(10)
    assert outcome == [[(4, 4)] * 3]
    assert [param for _, param, _ in fetch.calls] == sorted(param for _, param, _ in fetch.calls)  # in order
    assert loader.fetch_slots.used == 0


def test_inline_and_url_images_keep_their_order() -> None:
    fetch = FakeFetch(body=png(8, 2))
    refs = [Ref(data_uri(4, 4), "m[0].c[0]"), *urls(1), Ref(data_uri(2, 6), "m[0].c[2]")]
    assert load(make_loader(fetch), refs) == [(4, 4), (8, 2), (2, 6)]


def test_a_bad_inline_reference_is_refused_before_any_fetch() -> None:
    fetch = FakeFetch()
    with pytest.raises(BadRequest) as error:
        load(make_loader(fetch), [*urls(2), Ref("data:image/png;base64,@@@", "messages[0].content[3]")])
    assert error.value.param == "messages[0].content[3]" and fetch.calls == []


def test_the_fetch_cap_spreads_a_requests_urls_over_the_free_slots() -> None:
    fetch = FakeFetch(hold=True)
    loader = make_loader(fetch, fetch_concurrency=2)
    thread, outcome = in_thread(load, loader, urls(5))
    fetch.wait_started(2)
    assert loader.fetch_slots.used == 2
    fetch.release.set()
    thread.join(10)
    assert outcome == [[(4, 4)] * 5] and fetch.max_in_flight == 2 and loader.fetch_slots.used == 0


def test_over_the_fetch_cap_a_request_waits_then_gets_429_naming_the_setting() -> None:
    fetch, observer = FakeFetch(hold=True), Recorder()
    loader = make_loader(fetch, observer, fetch_concurrency=1, wait_timeout_s=0.2)
    first, first_outcome = in_thread(load, loader, urls(1))
    fetch.wait_started(1)
    with pytest.raises(Overloaded) as error:
        load(loader, urls(2, first=5))
    assert error.value.status_code == 429
    assert "option.image_fetch_concurrency" in error.value.message
    assert "option.image_wait_timeout" in error.value.message
    assert error.value.param == "messages[0].content[5]" and error.value.code == "image_fetch_concurrency"
    assert observer.events == [("waited", "fetch_slot"), ("refused", "fetch_concurrency")]
    assert len(fetch.calls) == 1                      # the refused request fetched nothing
    fetch.release.set()
    first.join(10)
    assert first_outcome == [[(4, 4)]]


def test_a_request_waiting_for_a_fetch_slot_gets_it_when_one_frees() -> None:
    fetch, observer = FakeFetch(hold=True), Recorder()
    loader = make_loader(fetch, observer, fetch_concurrency=1, wait_timeout_s=30)
    first, first_outcome = in_thread(load, loader, urls(1))
    fetch.wait_started(1)
    second, second_outcome = in_thread(load, loader, urls(1, first=2))
    wait_until(lambda: ("waited", "fetch_slot") in observer.events)
    fetch.release.set()
    first.join(10)
    second.join(10)
    assert first_outcome == second_outcome == [[(4, 4)]]


def test_the_fetch_budget_ends_a_request_naming_the_image_and_the_setting() -> None:
    fetch, observer = FakeFetch(hold=True), Recorder()    # never answers: only the budget ends the request
    loader = make_loader(fetch, observer, fetch_budget_s=0.3)
    started = time.monotonic()
    with pytest.raises(ImageFetchError) as error:
        load(loader, urls(2))
    assert error.value.status_code == 400 and error.value.code == "fetch_budget"  # the budget, not the fake, ended it
    assert "option.image_fetch_budget" in error.value.message and "0.3 s" in error.value.message
    assert error.value.param == "messages[0].content[1]"
    assert observer.events == [("fetch_failed", "fetch_budget")]
    assert all(abs(deadline.at - (started + 0.3)) < 0.2 for _, _, deadline in fetch.calls)
    fetch.release.set()
    wait_until(lambda: loader.fetch_slots.used == 0)   # the fetch threads give their slots back


def test_the_budget_counts_from_the_requests_start() -> None:
    fetch = FakeFetch()
    with pytest.raises(ImageFetchError) as error:
        load(make_loader(fetch, fetch_budget_s=5), urls(1), started_at=time.monotonic() - 6)
    assert error.value.code == "fetch_budget" and fetch.calls == []


def test_a_shorter_request_timeout_bounds_the_fetches_and_is_named() -> None:
    fetch = FakeFetch()
    with pytest.raises(ImageFetchError) as error:
        load(make_loader(fetch, fetch_budget_s=30, request_timeout_s=2), urls(1), started_at=time.monotonic() - 3)
    assert "option.request_timeout" in error.value.message and error.value.code == "fetch_budget"


def test_the_first_failure_ends_the_request_without_waiting_for_the_others() -> None:
    slow = FakeFetch(hold=True)

    def fetch(url: str, policy: FetchPolicy, *, param: str, deadline: Deadline) -> bytes:
        if url.endswith("/2.png"):
            raise ImageFetchError("host answered HTTP 404", param=param, reason=loader_module.FetchFailure.HTTP_STATUS)
        return slow(url, policy, param=param, deadline=deadline)

    observer = Recorder()
    loader = make_loader(fetch, observer, fetch_concurrency=2)
    with pytest.raises(ImageFetchError) as error:
        load(loader, urls(4))                          # 1 hangs, 2 fails: 3 and 4 are never started
    assert error.value.param == "messages[0].content[2]" and observer.events == [("fetch_failed", "http_status")]
    slow.release.set()
    wait_until(lambda: loader.fetch_slots.used == 0)
    assert [url for url, _, _ in slow.calls] == ["http://img.test/1.png"]


# --- pixels and memory -------------------------------------------------------------------------------------------


def test_total_pixels_are_checked_from_the_headers_before_any_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self.size) or real_load(self))
    observer = Recorder()
    loader = make_loader(observer=observer, max_total_pixels=250)
    refs = [Ref(data_uri(10, 10), f"messages[0].content[{i}]") for i in range(3)]
    with pytest.raises(BadRequest) as error:
        load(loader, refs)
    assert error.value.status_code == 400 and error.value.param == "messages[0].content[2]"
    assert error.value.code == "image_max_total_pixels"
    assert "300 pixels" in error.value.message and "option.image_max_total_pixels" in error.value.message
    assert decoded == [] and observer.events == [("refused", "total_pixels")]
    assert load(loader, refs[:2]) == [(10, 10), (10, 10)]  # 200: within


def test_image_size_reads_the_header_only() -> None:
    assert image_size(png(7, 3), DecodeLimits(), param="p") == (7, 3)
    with pytest.raises(BadRequest, match="over the limit of 20 pixels"):
        image_size(png(7, 3), DecodeLimits(max_pixels=20), param="p")
    with pytest.raises(BadRequest, match="not a decodable image"):
        image_size(b"not an image at all", DecodeLimits(), param="p")


def test_decoded_images_hold_their_memory_until_the_block_ends() -> None:
    loader = make_loader(memory_budget=10**9)
    with loader.load([Ref(data_uri(10, 10), "a"), Ref(data_uri(5, 4), "b")]) as images:
        assert loader.memory.used == (100 + 20) * BYTES_PER_PIXEL
        held = images
    assert loader.memory.used == 0 and held == []      # the images are dropped with the reservation
    with pytest.raises(RuntimeError), loader.load([Ref(data_uri(), "a")]):
        raise RuntimeError("the encoder failed")
    assert loader.memory.used == 0


def test_over_the_memory_budget_a_request_waits_then_gets_429_naming_the_setting() -> None:
    observer = Recorder()
    budget = 150 * BYTES_PER_PIXEL
    loader = make_loader(observer=observer, memory_budget=budget, wait_timeout_s=0.2)
    with loader.load([Ref(data_uri(10, 10), "messages[0].content[1]")]):
        with pytest.raises(Overloaded) as error:
            load(loader, [Ref(data_uri(10, 10), "messages[0].content[4]")])
        assert error.value.status_code == 429 and error.value.param == "messages[0].content[4]"
        assert "option.image_memory_budget" in error.value.message and error.value.code == "image_memory_budget"
        assert observer.events == [("waited", "memory"), ("refused", "memory_budget")]
        assert load(loader, [Ref(data_uri(5, 5), "small")]) == [(5, 5)]  # what fits goes ahead
    assert loader.memory.used == 0


def test_a_request_waiting_for_memory_goes_ahead_when_it_is_freed() -> None:
    observer = Recorder()
    loader = make_loader(observer=observer, memory_budget=150 * BYTES_PER_PIXEL, wait_timeout_s=30)
    with loader.load([Ref(data_uri(10, 10), "first")]):
        thread, outcome = in_thread(load, loader, [Ref(data_uri(10, 10), "second")])
        wait_until(lambda: ("waited", "memory") in observer.events)
        assert outcome == []
    thread.join(10)
    assert outcome == [[(10, 10)]]


def test_a_request_larger_than_the_whole_budget_runs_alone() -> None:
    loader = make_loader(memory_budget=10 * BYTES_PER_PIXEL, wait_timeout_s=0)
    assert load(loader, [Ref(data_uri(10, 10), "big")]) == [(10, 10)]


def test_memory_goes_back_to_the_os_after_a_large_reservation(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []
    monkeypatch.setattr(loader_module, "give_back", lambda: trims.append(1))
    monkeypatch.setattr(loader_module, "TRIM_AFTER_BYTES", 1000 * BYTES_PER_PIXEL)
    loader = make_loader()
    load(loader, [Ref(data_uri(10, 10), "small")])
    assert trims == []
    load(loader, [Ref(data_uri(40, 40), "large")])
    assert trims == [1]


def test_settings_reach_the_loader() -> None:
    from handler.prompt.vision import image_loader

    loader = image_loader(Settings(image_fetch_budget=7, image_fetch_concurrency=3, image_max_total_pixels=99,
                                   image_memory_budget=1234, image_wait_timeout=0.5, request_timeout=5))
    assert loader.budget == LoadBudget(fetch_budget_s=7, fetch_concurrency=3, max_total_pixels=99, memory_budget=1234,
                                       wait_timeout_s=0.5, request_timeout_s=5)
    assert loader.fetch_slots.capacity == 3 and loader.memory.capacity == 1234
    defaults = Settings()
    assert (defaults.image_fetch_budget, defaults.image_fetch_concurrency, defaults.image_max_total_pixels) == (
        30, 16, 64_000_000)
    assert defaults.image_fetch_budget < defaults.request_timeout
    assert 8 * 2048 * 2048 < defaults.image_max_total_pixels < 8 * 6000 * 6000  # 8 common photos pass, 8 bombs not


# --- the real fetcher under a deadline (loopback only) -----------------------------------------------------------


def test_the_real_fetcher_stops_at_the_deadline_and_names_it() -> None:
    answer = threading.Event()

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            answer.wait(10)
            body = png()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/x.png"
    policy = FetchPolicy(allowed_hosts=("127.0.0.1",))
    try:
        with pytest.raises(ImageFetchError) as error:
            fetch_image_bytes(url, policy, param="p", deadline=Deadline(time.monotonic() + 0.3, "THE BUDGET (x)"))
        assert error.value.code == "fetch_budget" and "THE BUDGET (x)" in error.value.message
        answer.set()
        assert fetch_image_bytes(url, policy, deadline=Deadline(time.monotonic() + 10)) == png()
    finally:
        answer.set()
        server.shutdown()
        server.server_close()


# --- the request deadline counts from arrival ---------------------------------------------------------------------


def state(request: GenerationRequest, control: AdmissionControl) -> RequestState:
    """As ``Engine.submit`` builds it: the deadline counted from the request's arrival when it carries one."""
    return RequestState(request, lambda state, index: None, deadline=control.deadline(request.arrived_at))


def test_admission_counts_the_deadline_from_arrival_when_the_request_says() -> None:
    control = AdmissionControl(lambda: Admission(timeout_s=60))
    now = time.monotonic()
    arrived = state(GenerationRequest("a", (1, 2), arrived_at=now - 50), control)
    control.enqueue(arrived, lambda s: None)
    assert arrived.deadline == pytest.approx(now + 10, abs=1)
    plain = state(GenerationRequest("b", (1, 2)), control)
    control.enqueue(plain, lambda s: None)
    assert plain.deadline == pytest.approx(now + 60, abs=1)
    unlimited = AdmissionControl(lambda: Admission())
    assert unlimited.deadline(now - 50) == float("inf")


def test_chat_requests_carry_the_time_they_arrived_before_rendering() -> None:
    class Renderer:
        tool_format, tool_marker_id, has_chat_template = "hermes", None, True
        reasoning_parser, reasoning_keep_ids, speaks_harmony = None, (), False
        rendered_at = 0.0

        def render_prompt(self, messages, tools=None, images=None, arrived_at=None,
                          template_kwargs=None) -> RenderedPrompt:
            time.sleep(0.05)                           # stands in for fetching and encoding images
            Renderer.rendered_at = time.monotonic()
            return RenderedPrompt((1, 2, 3))

    parsed = parse_model(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})
    generation = parsed.prepare(Renderer(), 0.0, arrival()).generation
    assert generation.arrived_at is not None and generation.arrived_at <= Renderer.rendered_at - 0.05
