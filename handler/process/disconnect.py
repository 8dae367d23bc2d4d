"""Notice a client that went away while its request waits or generates, and cancel its generation at once.

A response learns that its client closed the connection only when a write fails: never, for a non-streaming
request until its whole answer is ready, and for a stream only between tokens, and a request still waiting for a
batch slot writes nothing at all. After 200 streams were dropped within 2 s, dead requests held batch slots for
about 11 s. So one thread per worker watches the sockets of the requests in flight: a socket that turns readable
and peeks as end-of-file (or fails) belongs to a client that left; its handles are cancelled, and the engine frees
their slots at its next step.

HTTP/1.1 clients send nothing while they wait for a response, so a readable socket is a close; bytes that do
arrive early (a pipelined request) are left where they are (``MSG_PEEK``) and the socket is no longer watched.
"""

from __future__ import annotations

import itertools
import logging
import selectors
import socket
import threading
from collections.abc import Callable

from handler.threads import start_supervised

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
THREAD_NAME = "disconnect-watcher"


class DisconnectWatcher:
    """Each socket is watched once, however many generations its request submitted (a legacy batch submits one per
    prompt): its close calls every ``on_close`` given for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: dict[socket.socket, dict[int, Callable[[], None]]] = {}
        self._sockets: dict[int, socket.socket] = {}   # key -> its socket
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, sock: socket.socket, on_close: Callable[[], None]) -> int:
        """Call ``on_close`` (once, on the watcher's thread) if the peer closes ``sock``; returns a key for
        ``unwatch``."""
        key = next(self._ids)
        with self._lock:
            self._callbacks.setdefault(sock, {})[key] = on_close
            self._sockets[key] = sock
            if self._thread is None or not self._thread.is_alive():
                self._thread = start_supervised(THREAD_NAME, self._run)
        return key

    def unwatch(self, key: int) -> None:
        with self._lock:
            self._forget(key)

    def _forget(self, key: int) -> None:
        sock = self._sockets.pop(key, None)
        callbacks = self._callbacks.get(sock)
        if callbacks is not None:
            callbacks.pop(key, None)
            if not callbacks:
                del self._callbacks[sock]

    @property
    def num_watched(self) -> int:
        """Sockets watched (one per request, whatever its number of generations)."""
        return len(self._callbacks)

    def _run(self) -> None:
        while True:
            with self._lock:
                watched = list(self._callbacks)
            if not watched:
                threading.Event().wait(POLL_SECONDS)
                continue
            for sock in self._readable(watched):
                self._check(sock)

    def _readable(self, watched: list[socket.socket]) -> list[socket.socket]:
        selector = selectors.DefaultSelector()
        try:
            for sock in watched:
                try:
                    selector.register(sock, selectors.EVENT_READ)
                except (ValueError, OSError):  # already closed by the server: nothing left to watch
                    self._drop(sock)
                except Exception:  # anything else about one socket ends its watch, never the watcher
                    log.exception("cannot watch a request's connection; its disconnect goes unnoticed")
                    self._drop(sock)
            return [selector_key.fileobj for selector_key, _events in selector.select(POLL_SECONDS)]
        finally:
            selector.close()

    def _drop(self, sock: socket.socket) -> list[Callable[[], None]]:
        with self._lock:
            callbacks = self._callbacks.pop(sock, {})
            for key in callbacks:
                self._sockets.pop(key, None)
        return list(callbacks.values())

    def _check(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return  # a spurious wake-up
        except OSError:
            data = b""  # reset by the peer, or closed under us: either way nobody reads the answer
        callbacks = self._drop(sock)
        if data:
            return  # the client sent more (pipelining): not a close, and no longer ours to judge
        for on_close in callbacks:
            try:
                on_close()
            except Exception:  # a cancel must never stop the watcher
                log.exception("cancelling a disconnected request failed")
