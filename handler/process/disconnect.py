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

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1


class DisconnectWatcher:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[socket.socket, Callable[[], None]]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, sock: socket.socket, on_close: Callable[[], None]) -> int:
        """Call ``on_close`` (once, on the watcher's thread) if the peer closes ``sock``; returns a key for
        ``unwatch``."""
        key = next(self._ids)
        with self._lock:
            self._watched[key] = (sock, on_close)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="disconnect-watcher", daemon=True)
                self._thread.start()
        return key

    def unwatch(self, key: int) -> None:
        with self._lock:
            self._watched.pop(key, None)

    @property
    def num_watched(self) -> int:
        return len(self._watched)

    def _run(self) -> None:
        while True:
            with self._lock:
                watched = list(self._watched.items())
            if not watched:
                threading.Event().wait(POLL_SECONDS)
                continue
            for key in self._readable(watched):
                self._check(key)

    @staticmethod
    def _readable(watched: list[tuple[int, tuple[socket.socket, Callable[[], None]]]]) -> list[int]:
        selector = selectors.DefaultSelector()
        try:
            for key, (sock, _on_close) in watched:
                try:
                    selector.register(sock, selectors.EVENT_READ, key)
                except (ValueError, OSError):  # already closed by the server: nothing left to watch
                    continue
            return [selector_key.data for selector_key, _events in selector.select(POLL_SECONDS)]
        finally:
            selector.close()

    def _check(self, key: int) -> None:
        with self._lock:
            entry = self._watched.get(key)
        if entry is None:
            return
        sock, on_close = entry
        try:
            data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return  # a spurious wake-up
        except OSError:
            data = b""  # reset by the peer, or closed under us: either way nobody reads the answer
        self.unwatch(key)
        if data:
            return  # the client sent more (pipelining): not a close, and no longer ours to judge
        try:
            on_close()
        except Exception:  # a cancel must never stop the watcher
            log.exception("cancelling a disconnected request failed")
