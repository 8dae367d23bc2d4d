"""Background responses (``background: true``): generated on a thread of the worker that took the request, after its
answer (the ``queued`` response) has gone, with their progress, end and (when created streaming) events written to the
shared store, where any worker reads them.

- Progress: the stored response goes ``queued`` -> ``in_progress`` (its first token) -> its end (``completed``,
  ``incomplete``, ``failed``), each written only while the run is active, so a cancel is never overwritten.
- Cancel: ``POST /v1/responses/{id}/cancel`` on any worker marks the stored response ``cancelled``. The owner's watcher
  (one thread per worker, polling every ``POLL_S`` while runs are going) then cancels the generation, which frees its
  batch slot; a cancel that reaches the owner cancels at once. A cancelled run writes no more events, and never its
  terminal event (that is written only after its end was stored, which a cancel prevents).
- Events: ``replay`` reads them back for ``GET /v1/responses/{id}?stream=true&starting_after=N`` (and for the POST
  that created it streaming), waiting for more until the terminal event, or until the run is no longer active.
- SIGTERM: a run counts as work in flight (``count_work``), so the drain waits for it like a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from handler import request_log
from handler.engine.types import TokenEvent
from handler.errors import EngineError, ServingError
from handler.formatting.responses import ResponseEvents
from handler.request_log import RequestRecord
from handler.store.responses import ACTIVE, TERMINAL_EVENTS, ResponseStore

log = logging.getLogger(__name__)

POLL_S = 0.2          # how often the watcher asks the store which runs were cancelled
REPLAY_WAIT_S = 0.05  # how long a replay waits for more events before asking the store again


class Handle(Protocol):
    """What a run reads: the engine handle (as the request log observes it)."""

    def __iter__(self) -> Iterator[TokenEvent]: ...

    def cancel(self) -> None: ...


@dataclass(eq=False)
class BackgroundRun:
    """One response generating in the background."""

    response_id: str
    handle: Handle
    events: ResponseEvents                  # the typed events of its response
    stream: bool                            # created streaming: keep its events
    record: RequestRecord                   # its own log line, written when it ends
    on_done: Callable[[dict], None] = lambda response: None   # what its end does besides being stored
    stopped: threading.Event = field(default_factory=threading.Event)

    def stop(self) -> None:
        self.stopped.set()
        self.handle.cancel()


class BackgroundRuns:
    """This worker's background runs, and the watcher that stops those cancelled elsewhere."""

    def __init__(self, responses: ResponseStore, count_work: Callable[[int], None]) -> None:
        self.responses = responses
        self._count_work = count_work
        self._runs: dict[str, BackgroundRun] = {}
        self._lock = threading.Lock()
        self._news = threading.Condition()   # a local run wrote events: its local readers wake at once
        self._watcher: threading.Thread | None = None

    def start(self, run: BackgroundRun) -> None:
        with self._lock:
            self._runs[run.response_id] = run
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(target=self._watch, name="background-watcher", daemon=True)
                self._watcher.start()
        self._count_work(1)
        threading.Thread(target=self._execute, args=(run,), name=f"background-{run.response_id}",
                         daemon=True).start()

    def cancel(self, response_id: str) -> None:
        """Stop a run of this worker now (the store already says cancelled)."""
        with self._lock:
            run = self._runs.get(response_id)
        if run is not None:
            run.stop()

    def _execute(self, run: BackgroundRun) -> None:
        status = 200
        try:
            self._generate(run)
        except Exception:  # a run must never take the worker down: it is failed in the store instead
            log.exception("background response %s failed", run.response_id)
            status = 500
            self.responses.update(run.events.error_event(EngineError("internal error; see the server log"))
                                  ["response"])
        finally:
            run.handle.cancel()
            with self._lock:
                self._runs.pop(run.response_id, None)
            self._notify()
            self._count_work(-1)
            request_log.finish(run.record, status)

    def _generate(self, run: BackgroundRun) -> None:
        for event in _guarded(run.events, run.handle):
            if run.stopped.is_set():
                return
            kind = event["type"]
            if kind in TERMINAL_EVENTS:
                if self.responses.update(event["response"]):  # stored first: a cancelled run never ends here
                    self._keep(run, event)
                    run.on_done(event["response"])
                return
            if kind == "response.in_progress" and not self.responses.update(event["response"]):
                return  # cancelled (or deleted) while queued
            self._keep(run, event)

    def _keep(self, run: BackgroundRun, event: dict) -> None:
        if run.stream:
            self.responses.add_events(run.response_id, [event])
            self._notify()

    def _notify(self) -> None:
        with self._news:
            self._news.notify_all()

    def wait_for_news(self, seconds: float) -> None:
        with self._news:
            self._news.wait(seconds)

    def _watch(self) -> None:
        """Stop the runs the store says were cancelled, deleted or forgotten; end when no run is left."""
        while True:
            time.sleep(POLL_S)
            with self._lock:
                runs = dict(self._runs)
                if not runs:
                    self._watcher = None
                    return
            try:
                stopped = self.responses.stopped(list(runs))
            except Exception:  # the store busy past its timeout: ask again next time
                log.exception("background watcher could not read the store")
                continue
            for response_id in stopped:
                runs[response_id].stop()


def _guarded(events: ResponseEvents, handle: Handle) -> Iterator[dict]:
    """The run's typed events; a failure ends them with ``response.failed``, as a stream's guard does."""
    try:
        yield from events.events(handle)
    except ServingError as error:
        yield events.error_event(error)


def replay(runs: BackgroundRuns, response_id: str, after: int) -> Iterator[dict]:
    """A streaming background run's events after sequence number ``after``, then each new one as it is written,
    until its terminal event, or until the run is no longer active and nothing more was written."""
    while True:
        events = runs.responses.events(response_id, after)
        for event in events:
            yield event
            after = event["sequence_number"]
            if event["type"] in TERMINAL_EVENTS:
                return
        if not events:
            if runs.responses.status(response_id) not in ACTIVE:
                if not runs.responses.events(response_id, after):  # nothing came between the two reads
                    return
                continue
            runs.wait_for_news(REPLAY_WAIT_S)
