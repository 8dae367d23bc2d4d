"""Graceful shutdown the way SageMaker needs it: SIGTERM, then SIGKILL 30 s later.

On SIGTERM a worker keeps accepting connections but turns away new work: /ping answers 503 and new requests get a
503, while the requests in flight run to completion. Once none is left, the worker hands the signal to gunicorn,
which closes it; the master then exits 0. gunicorn alone would stop accepting at once, so /ping would hang instead
of saying 503. When the grace period ends with requests still running, ``on_grace_over`` ends them (the engine
stops with a reason), and the worker waits up to ``FLUSH_S`` more for their responses to close: each stream sends
its final error record and each request gets its log line before the worker exits. Either way the engine is
stopped before the worker exits (``stop_engine(None)`` when nothing was left in flight): a backend that stops in
order logs its stop at INFO, where one left to the interpreter's exit (vLLM's engine process) logged a crash.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

FLUSH_S = 2.0  # after the grace period: time for ended streams to write their final record (the engine answers at once)


class Drain:
    """Counts requests in flight (a WSGI middleware) and other work the server does for its clients (background
    responses, through ``count``), and runs the SIGTERM sequence."""

    def __init__(self, grace_s: float, stop_engine: Callable[[str | None], None] = lambda reason: None,
                 grace_over_message: str = "the server is stopping") -> None:
        """``stop_engine(reason)``: with a reason, what still runs ends with an error carrying it."""
        self.grace_s = grace_s
        self._stop_engine = stop_engine
        self._grace_over_message = grace_over_message
        self.draining = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0

    def wrap(self, app: Callable) -> Callable:
        """WSGI middleware: a request counts until its response iterable is closed (streams included)."""

        def counted(environ: dict, start_response: Callable) -> Iterable[bytes]:
            self.count(1)
            try:
                return _ClosingIterable(app(environ, start_response), lambda: self.count(-1))
            except BaseException:
                self.count(-1)
                raise

        return counted

    def count(self, delta: int) -> None:
        """Work in flight besides requests (a background response) starts (+1) or ends (-1)."""
        with self._lock:
            self._in_flight += delta

    def install(self) -> None:
        """Replace the SIGTERM handler (gunicorn's) with: drain, then call gunicorn's."""
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum: int, frame: object) -> None:
            if self.draining.is_set():
                return
            self.draining.set()
            threading.Thread(target=self._finish, args=(previous, signum, frame), daemon=True).start()

        signal.signal(signal.SIGTERM, on_term)

    def _finish(self, previous: object, signum: int, frame: object) -> None:
        if self._wait_idle(self.grace_s):
            self._stop_engine(None)
        else:
            log.warning("ending %d requests still in flight after the %.0f s grace period", self._in_flight,
                        self.grace_s)
            self._stop_engine(self._grace_over_message)
            if not self._wait_idle(FLUSH_S):
                log.warning("stopping with %d responses still open", self._in_flight)
        if callable(previous):
            previous(signum, frame)

    def _wait_idle(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self._in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._in_flight == 0


class _ClosingIterable:
    """Passes a WSGI response through and calls ``on_close`` exactly once when the server closes it."""

    def __init__(self, inner: Iterable[bytes], on_close: Callable[[], None]) -> None:
        self._inner = inner
        self._on_close = on_close
        self._closed = False

    def __iter__(self):
        return iter(self._inner)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self._inner, "close", None)
            if close is not None:
                close()
        finally:
            self._on_close()
