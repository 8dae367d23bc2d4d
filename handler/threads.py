"""The worker's long-lived background threads, kept alive: a thread whose loop raises is logged, counted by name and
started again, so one bad input never silently ends a service the worker relies on.

A thread's loop should catch what it expects per item itself; ``start_supervised`` is the net for what it did not
expect. The count reaches ``/metrics`` (``llm_thread_restarts_total{thread}``) through the listener the wiring sets
(``on_restart``): this module is in the base layer and knows nothing of Prometheus.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

log = logging.getLogger(__name__)

RESTART_PAUSE_S = 0.1  # a loop that fails at once again does not spin a core

_lock = threading.Lock()
_restarts: Counter[str] = Counter()
_listeners: list[Callable[[str], None]] = []


def on_restart(listener: Callable[[str], None]) -> None:
    """Call ``listener(thread_name)`` at each restart from now on (the metrics wiring's counter)."""
    with _lock:
        _listeners.append(listener)


def restarts() -> dict[str, int]:
    """Restarts so far in this process, by thread name."""
    with _lock:
        return dict(_restarts)


def record_restart(name: str) -> None:
    """Count one restart of ``name`` (for a loop that recovers in place rather than through ``start_supervised``);
    call it from an ``except`` block so that the log carries the cause."""
    log.exception("background thread %s failed; it starts again", name)
    with _lock:
        _restarts[name] += 1
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener(name)
        except Exception:  # a metrics failure must not end the thread it reports
            log.exception("thread restart listener failed")


def start_supervised(name: str, target: Callable[[], None]) -> threading.Thread:
    """A daemon thread running ``target`` until it returns; each exception it raises is logged and counted, and
    ``target`` runs again."""

    def run() -> None:
        while True:
            try:
                target()
                return
            except Exception:
                record_restart(name)
                time.sleep(RESTART_PAUSE_S)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
