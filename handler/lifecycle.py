"""Graceful shutdown the way SageMaker needs it: SIGTERM, then SIGKILL 30 s later.

On SIGTERM a worker keeps accepting connections but turns away new work: /ping answers 503 and new requests get a
503, while the requests in flight run to completion. Once none is left (or the grace period is over), the worker
hands the signal to gunicorn, which closes it; the master then exits 0. gunicorn alone would stop accepting at
once, so /ping would hang instead of saying 503.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


class Drain:
    """Counts requests in flight (a WSGI middleware) and runs the SIGTERM sequence."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.draining = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0

    def wrap(self, app: Callable) -> Callable:
        """WSGI middleware: a request counts until its response iterable is closed (streams included)."""

        def counted(environ: dict, start_response: Callable) -> Iterable[bytes]:
            self._add(1)
            try:
                return _ClosingIterable(app(environ, start_response), lambda: self._add(-1))
            except BaseException:
                self._add(-1)
                raise

        return counted

    def _add(self, delta: int) -> None:
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
        deadline = time.monotonic() + self.grace_s
        while self._in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._in_flight:
            log.warning("stopping with %d requests still in flight after %.0f s", self._in_flight, self.grace_s)
        if callable(previous):
            previous(signum, frame)


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
