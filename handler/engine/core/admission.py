"""Backpressure: how many requests may wait for a batch slot, and how long a request may take.

Only the engine knows what waits, so it asks this class at ``submit``: past ``Admission.max_waiting`` requests without
a slot, a request is refused at once (``Overloaded``, 429) rather than letting callers queue without bound. A request
gets its deadline then: ``Admission.timeout_s`` after it arrived (``GenerationRequest.arrived_at``: the time spent
rendering its prompt, fetching and encoding its images, counts), or after submit when it carries no arrival time.
Before each step the engine takes the requests past it and ends them with an error that names the limit, which
frees their slots. The settings are read anew each time, so the engine's ``admission`` can be replaced while it
runs.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

from handler.engine.backend import Admission
from handler.engine.core.request import RequestState
from handler.errors import Overloaded


class Queues(Protocol):
    """Where a backend keeps its requests (the lean engine's scheduler): the waiting ones past a time are taken out,
    the running ones are listed."""

    def take_expired(self, now: float) -> list[RequestState]: ...

    def running_requests(self) -> list[RequestState]: ...


class AdmissionControl:
    def __init__(self, settings: Callable[[], Admission]) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._pending: list[RequestState] = []    # submitted requests that may still be waiting

    def deadline(self, arrived_at: float | None = None) -> float:
        """The ``time.monotonic()`` value by which a request that arrived at ``arrived_at`` (None: now) must be
        finished."""
        timeout = self._settings().timeout_s
        start = time.monotonic() if arrived_at is None else arrived_at
        return start + timeout if timeout is not None else math.inf

    def enqueue(self, state: RequestState, put: Callable[[RequestState], None]) -> None:
        """Hand ``state`` to ``put``, or raise ``Overloaded`` when ``Admission.max_waiting`` requests already wait."""
        with self._lock:  # count and put as one, or two callers could both take the last place
            self._pending = [s for s in self._pending if s.is_waiting]
            limit = self._settings().max_waiting
            if limit is not None and len(self._pending) >= limit:
                raise Overloaded(f"the server is busy: {len(self._pending)} requests are already waiting for a batch "
                                 "slot (option.max_queue_size); retry later")
            self._pending.append(state)
            put(state)

    def take_overdue(self, queues: Queues) -> list[RequestState]:
        """The requests past their deadline: waiting ones leave the queue, running ones still hold their slots (the
        engine ends their sequences)."""
        now = time.monotonic()
        return queues.take_expired(now) + [s for s in queues.running_requests() if s.deadline <= now]

    def timeout_error(self) -> str:
        return f"request timed out after {self._settings().timeout_s:g} s (option.request_timeout)"
