"""Host name lookups for the image fetcher that end at the caller's deadline, on a few threads a worker shares.

``socket.getaddrinfo`` has no timeout of its own: a resolver that never answers (a dead nameserver, a hung NSS
module, a domain whose nameserver drops queries) blocks its caller until the C library gives up, if it ever does,
and a fetch waiting on it holds its fetch slot as long. To stop at a deadline the caller has to wait for the lookup
on another thread; a thread per lookup would leave one thread behind for every lookup that never answers.

So ``Resolver`` runs lookups on at most ``threads`` threads, shared by the worker's fetches:

- a caller waits for its answer only until its timeout (``TimeoutError``), then goes on (its fetch ends and gives
  its slot back);
- the same (host, port) asked again while its lookup is queued or running waits on that lookup, not a new one;
- a queued lookup every caller has given up on is dropped before it starts.

A resolver that never answers therefore holds at most ``threads`` threads however many requests come; the lookups
queued behind them end with their callers' deadlines. Answers are not cached: each fetch looks its host up once
(``handler.images.policy`` checks the addresses, ``handler.images.fetch`` connects to exactly those).
"""

from __future__ import annotations

import collections
import os
import socket
import threading
from typing import Any

# Lookups in flight per worker: twice the default image fetch concurrency, so that lookups left stuck by a dead
# resolver or a black-holed domain do not stop every other fetch's lookup at once.
LOOKUP_THREADS = 32
# A lookup thread with nothing to do for this long ends (the next lookup starts one again).
IDLE_EXIT_S = 60.0


def system_lookup(host: str, port: int) -> list[tuple[Any, ...]]:
    """The C library's answer for a TCP connection to ``host``: /etc/hosts, DNS and whatever nsswitch names."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


class _Lookup:
    """One (host, port) being looked up: its callers wait on ``done``."""

    __slots__ = ("answer", "done", "error", "key", "started", "waiters")

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.waiters = 0
        self.started = False
        self.done = threading.Event()
        self.answer: list[tuple[Any, ...]] = []
        self.error: BaseException | None = None


class Resolver:
    """Name lookups on at most ``threads`` shared threads, each caller waiting no longer than its timeout."""

    def __init__(self, lookup=system_lookup, threads: int = LOOKUP_THREADS) -> None:
        self._lookup = lookup
        self.max_threads = threads
        self._num_threads = 0
        self._idle = 0
        self._queue: collections.deque[_Lookup] = collections.deque()
        self._pending: dict[tuple[str, int], _Lookup] = {}
        self._changed = threading.Condition()

    @property
    def num_threads(self) -> int:
        """Lookup threads alive now (never more than ``max_threads``)."""
        return self._num_threads

    @property
    def num_queued(self) -> int:
        """Lookups waiting for a thread."""
        return len(self._queue)

    def resolve(self, host: str, port: int, timeout: float) -> list[tuple[Any, ...]]:
        """``socket.getaddrinfo``'s answers for ``host``; ``TimeoutError`` when none came within ``timeout``
        seconds; the lookup's own error (``socket.gaierror``, ...) when it failed."""
        key = (host, port)
        with self._changed:
            lookup = self._pending.get(key)
            if lookup is None:
                lookup = self._pending[key] = _Lookup(key)
                self._queue.append(lookup)
                self._wake_or_start()
            lookup.waiters += 1
        lookup.done.wait(timeout)
        with self._changed:
            lookup.waiters -= 1
            if not lookup.done.is_set():
                if lookup.waiters == 0 and not lookup.started:  # nobody wants it any more: never start it
                    self._queue.remove(lookup)
                    del self._pending[key]
                raise TimeoutError(f"the name resolver did not answer within {timeout:.3g} s")
        if lookup.error is not None:
            raise lookup.error
        return lookup.answer

    def _wake_or_start(self) -> None:
        """Under the lock: an idle thread takes the new lookup, else a new thread does, up to ``max_threads``."""
        if self._idle >= len(self._queue):
            self._changed.notify()
        elif self._num_threads < self.max_threads:
            self._num_threads += 1
            threading.Thread(target=self._serve, name="image-dns", daemon=True).start()

    def _next(self) -> _Lookup | None:
        """The next lookup to run, waiting for one up to ``IDLE_EXIT_S``; None: this thread ends."""
        with self._changed:
            if not self._queue:
                self._idle += 1
                try:
                    self._changed.wait_for(lambda: self._queue, IDLE_EXIT_S)
                finally:
                    self._idle -= 1
            if not self._queue:
                self._num_threads -= 1
                return None
            lookup = self._queue.popleft()
            lookup.started = True
            return lookup

    def _serve(self) -> None:
        while (lookup := self._next()) is not None:
            try:
                lookup.answer = list(self._lookup(*lookup.key))
            except Exception as error:  # the callers raise it
                lookup.error = error
            with self._changed:
                if self._pending.get(lookup.key) is lookup:
                    del self._pending[lookup.key]
            lookup.done.set()


_shared: Resolver | None = None
_shared_lock = threading.Lock()


def shared_resolver() -> Resolver:
    """This process's resolver (made on first use, so after gunicorn's fork, in the worker)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Resolver()
        return _shared


def _forget_shared() -> None:
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()  # a forked child has none of its parent's threads


os.register_at_fork(after_in_child=_forget_shared)
