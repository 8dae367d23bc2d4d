"""A request's images under budgets: fetched together within a time budget, their pixels counted from the headers
before anything is decoded, and, per worker, a cap on the URL fetches and on the decoded-image memory in flight.

Why: fetched one after another and outside the request's deadline, a few slow image hosts hold a request thread
for minutes, and enough such requests take every thread (``/ping`` too). Images under every per-image limit can
still decode to hundreds of MB each, and the processor's copies multiply that. The figures are in
``docs/api.md`` (Images) and ``bench/RESULTS.md``.

So ``ImageLoader.load`` takes a request's image references through four steps:

1. inline images (data: URIs, base64) are read first: a bad reference is refused before any fetch starts;
2. the URLs are fetched at once on this worker's fetch slots (``option.image_fetch_concurrency``): the request takes
   the free slots it can use, at least one (waiting up to ``option.image_wait_timeout`` for it, else 429 naming the
   setting), and its URLs share them. Every connect and read ends by the request's fetch deadline,
   ``option.image_fetch_budget`` after the request started (never later than its ``option.request_timeout``): past
   it the request is a 400 naming the image and the budget;
3. every image's header is read and the pixels summed: over ``option.image_max_total_pixels`` is a 400 naming the
   image that crossed it and the setting;
4. decoding reserves ``pixels x BYTES_PER_PIXEL`` of this worker's ``option.image_memory_budget`` (waiting up to
   ``option.image_wait_timeout``, else 429 naming the setting); the reservation lasts until the caller is done with
   the images (they are encoded), then the images are dropped and, after a large reservation, the freed memory is
   handed back to the OS at once (``handler.process.heap``: request threads allocate from their own malloc arenas,
   whose freed memory glibc otherwise keeps until the worker's next periodic trim).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from PIL import Image

from handler.errors import BadRequest, Overloaded
from handler.images.decode import DecodeLimits, decode_image_bytes, fetch_policy, image_size, inline_bytes
from handler.images.fetch import Deadline, fetch_image_bytes
from handler.images.policy import FetchFailure, FetchPolicy, ImageFetchError
from handler.process.heap import give_back

# What one decoded pixel costs at the peak of a request's image work: the RGB image and its decode buffers (about
# 3.8 B/px measured) plus the processor's copies (the tiny Idefics3's peak was 7.9 B/px in one thread).
BYTES_PER_PIXEL = 8
# After a reservation this large ends, freed memory is handed back to the OS.
TRIM_AFTER_BYTES = 64 << 20
# How long past the fetch deadline the request waits for its fetch threads to report (they stop at the deadline).
_FETCH_GRACE_S = 0.5


class ImageSource(Protocol):
    """An image reference as a request holds it (``handler.prompt.renderer.ImageRef``)."""

    @property
    def ref(self) -> str: ...

    @property
    def param(self) -> str: ...


@dataclass(frozen=True, slots=True)
class LoadBudget:
    """The per-request and per-worker budgets (the ``option.image_*`` settings)."""

    fetch_budget_s: float = 30.0            # all of a request's URL fetches, from the request's start
    fetch_concurrency: int = 16             # URL fetches in flight in this worker
    max_total_pixels: int = 64_000_000      # a request's images together
    memory_budget: int = 2 << 30            # bytes of image work in flight in this worker (BYTES_PER_PIXEL a pixel)
    wait_timeout_s: float = 2.0             # the longest wait for a fetch slot or for memory before a 429
    request_timeout_s: float | None = None  # the request's whole time: the fetch deadline is never later


class LoadObserver:
    """What the loader reports (metrics); every method is a no-op here."""

    def fetch_failed(self, reason: str) -> None:
        """An image URL failed; ``reason`` is a ``FetchFailure`` value."""

    def waited(self, resource: str) -> None:
        """A request had to wait: ``fetch_slot`` or ``memory``."""

    def refused(self, reason: str) -> None:
        """A request was refused by a budget: ``fetch_concurrency``, ``memory_budget`` or ``total_pixels``."""


class Gate:
    """A counted resource (fetch slots, bytes) shared by a worker's request threads, with bounded waits. An ask
    larger than the capacity is cut to it: such a request waits until it has the whole resource to itself."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._used = 0
        self._changed = threading.Condition()

    @property
    def used(self) -> int:
        return self._used

    def take(self, amount: int, timeout: float, *, at_least: int | None = None) -> int:
        """Take ``amount`` units, or as many as are free when that is at least ``at_least`` (default: all of
        ``amount``), waiting up to ``timeout`` seconds for that; 0 when the wait ran out."""
        amount = min(amount, self.capacity)
        minimum = amount if at_least is None else max(1, min(at_least, amount))
        end = time.monotonic() + timeout
        with self._changed:
            while self.capacity - self._used < minimum:
                left = end - time.monotonic()
                if left <= 0:
                    return 0
                self._changed.wait(left)
            granted = min(amount, self.capacity - self._used)
            self._used += granted
            return granted

    def give(self, amount: int) -> None:
        with self._changed:
            self._used -= amount
            self._changed.notify_all()


Fetch = Callable[..., bytes]  # fetch_image_bytes(url, policy, *, param, deadline)


class ImageLoader:
    """Loads a request's images (``load``) under ``budget``; one per worker, shared by its request threads."""

    def __init__(self, policy: FetchPolicy, limits: DecodeLimits, budget: LoadBudget, *,
                 fetch: Fetch = fetch_image_bytes, observer: LoadObserver | None = None) -> None:
        self.limits = limits
        self.budget = budget
        self.fetch_slots = Gate(budget.fetch_concurrency)
        self.memory = Gate(budget.memory_budget)
        self._policy = fetch_policy(policy, limits)
        self._fetch = fetch
        self._observer = observer or LoadObserver()

    @contextlib.contextmanager
    def load(self, refs: Sequence[ImageSource], *, started_at: float | None = None) -> Iterator[list[Image.Image]]:
        """The RGB images ``refs`` refer to, in order, for the ``with`` block; ``started_at`` (``time.monotonic()``)
        is when the request started, which the fetch budget counts from. Every failure names the image's field."""
        started = time.monotonic() if started_at is None else started_at
        if not refs:
            yield []
            return
        data = self._read(refs, started)
        pixels = self._check_total_pixels(refs, data)
        held = self._reserve_memory(refs, pixels * BYTES_PER_PIXEL)
        images: list[Image.Image] = []
        try:
            for index, ref in enumerate(refs):
                images.append(decode_image_bytes(data[index], self.limits, param=ref.param))
                data[index] = b""  # the encoded bytes go as soon as their image is decoded
            yield images
        finally:
            images.clear()
            self.memory.give(held)
            if held >= TRIM_AFTER_BYTES:
                give_back()

    # --- 1, 2: bytes --------------------------------------------------------------------------------------------

    def _read(self, refs: Sequence[ImageSource], started: float) -> list[bytes]:
        data = [inline_bytes(ref.ref, self.limits, param=ref.param) for ref in refs]
        urls = [index for index, body in enumerate(data) if body is None]
        if urls:
            fetched = self._fetch_all([refs[index] for index in urls], self._fetch_deadline(started))
            for index, body in zip(urls, fetched, strict=True):
                data[index] = body
        return data

    def _fetch_deadline(self, started: float) -> Deadline:
        budget, timeout = self.budget.fetch_budget_s, self.budget.request_timeout_s
        if timeout is not None and timeout < budget:
            return Deadline(started + timeout, f"the request's time limit of {timeout:g} s (option.request_timeout)")
        return Deadline(started + budget,
                        f"the request's image fetch budget of {budget:g} s (option.image_fetch_budget)")

    def _fetch_all(self, refs: list[ImageSource], deadline: Deadline) -> list[bytes]:
        lanes = self.fetch_slots.take(len(refs), 0, at_least=1)
        if not lanes:
            self._observer.waited("fetch_slot")
            wait = max(0.0, min(self.budget.wait_timeout_s, deadline.remaining()))
            lanes = self.fetch_slots.take(len(refs), wait, at_least=1)
        if not lanes:
            self._observer.refused("fetch_concurrency")
            raise Overloaded(f"the server is busy: {self.fetch_slots.capacity} image fetches are already in flight "
                             f"(option.image_fetch_concurrency) and none ended within "
                             f"{self.budget.wait_timeout_s:g} s (option.image_wait_timeout); retry later",
                             param=refs[0].param, code="image_fetch_concurrency")
        job = _FetchJob(refs, lambda ref: self._fetch_one(ref, deadline), deadline, self.fetch_slots.give)
        for _ in range(lanes):
            threading.Thread(target=job.lane, name="image-fetch", daemon=True).start()
        try:
            return job.wait()
        except ImageFetchError as error:
            self._observer.fetch_failed(error.reason.value)
            raise

    def _fetch_one(self, ref: ImageSource, deadline: Deadline) -> bytes:
        if deadline.remaining() <= 0:
            raise budget_spent(ref, deadline)
        return self._fetch(ref.ref.strip(), self._policy, param=ref.param, deadline=deadline)

    # --- 3, 4: pixels and memory --------------------------------------------------------------------------------

    def _check_total_pixels(self, refs: Sequence[ImageSource], data: list[bytes]) -> int:
        """The pixels of all images, from their headers; over the limit is a 400 naming the image that crossed it."""
        sizes = [image_size(body, self.limits, param=ref.param) for ref, body in zip(refs, data, strict=True)]
        total = sum(width * height for width, height in sizes)
        limit = self.budget.max_total_pixels
        if total <= limit:
            return total
        running = 0
        for ref, (width, height) in zip(refs, sizes, strict=True):
            running += width * height
            if running > limit:
                self._observer.refused("total_pixels")
                raise BadRequest(
                    f"the request's images have {total} pixels together, over the limit of {limit} pixels "
                    f"(option.image_max_total_pixels); the image in {ref.param} ({width}x{height}) takes the total "
                    "past it", param=ref.param, code="image_max_total_pixels")
        raise AssertionError("unreachable")

    def _reserve_memory(self, refs: Sequence[ImageSource], cost: int) -> int:
        held = self.memory.take(cost, 0)
        if not held and cost:
            self._observer.waited("memory")
            held = self.memory.take(cost, self.budget.wait_timeout_s)
            if not held:
                self._observer.refused("memory_budget")
                raise Overloaded(
                    f"the server is busy: this request's images need about {_mib(cost)} MiB to decode and "
                    f"{_mib(self.memory.used)} of the {_mib(self.memory.capacity)} MiB option.image_memory_budget "
                    f"allows are in use, and not enough was freed within {self.budget.wait_timeout_s:g} s "
                    "(option.image_wait_timeout); retry later", param=refs[0].param, code="image_memory_budget")
        return held


class _FetchJob:
    """One request's URLs, fetched by up to ``lanes`` threads that each take the next unfetched URL. The first
    failure stops the lanes from starting more; each lane gives its fetch slot back when it ends."""

    def __init__(self, refs: list[ImageSource], fetch: Callable[[ImageSource], bytes], deadline: Deadline,
                 give_slot: Callable[[int], None]) -> None:
        self._refs = refs
        self._fetch = fetch
        self._deadline = deadline
        self._give_slot = give_slot
        self._pending = collections.deque(range(len(refs)))
        self._results: list[bytes | None] = [None] * len(refs)
        self._errors: dict[int, BaseException] = {}
        self._left = len(refs)
        self._changed = threading.Condition()

    def lane(self) -> None:
        try:
            while True:
                with self._changed:
                    if not self._pending or self._errors:
                        return
                    index = self._pending.popleft()
                try:
                    body = self._fetch(self._refs[index])
                except Exception as error:  # reported to the request's thread, which raises it
                    with self._changed:
                        self._errors[index] = error
                        self._changed.notify_all()
                    return
                with self._changed:
                    self._results[index] = body
                    self._left -= 1
                    self._changed.notify_all()
        finally:
            self._give_slot(1)

    def wait(self) -> list[bytes]:
        """Every body, in order; the first failure (lowest index) as soon as one is known; a budget error naming
        the first unfetched image when the lanes have not finished shortly after the deadline."""
        end = self._deadline.at + _FETCH_GRACE_S
        with self._changed:
            while self._left and not self._errors:
                left = end - time.monotonic()
                if left <= 0:
                    unfinished = next(i for i, body in enumerate(self._results) if body is None)
                    raise budget_spent(self._refs[unfinished], self._deadline)
                self._changed.wait(left)
            if self._errors:
                raise self._errors[min(self._errors)]
            return list(self._results)


def budget_spent(ref: ImageSource, deadline: Deadline) -> ImageFetchError:
    return ImageFetchError(f"the image in {ref.param} was not fetched within {deadline.name}; refused",
                           param=ref.param, reason=FetchFailure.BUDGET)


def _mib(amount: int) -> int:
    return round(amount / 2**20)
