"""The disconnect watcher on socket pairs: a peer that closes is reported once; one that sends data, or a socket
no longer watched, is not."""

from __future__ import annotations

import socket
import threading

from handler.process.disconnect import DisconnectWatcher


def test_a_closed_peer_is_reported_once() -> None:
    watcher = DisconnectWatcher()
    server_side, client_side = socket.socketpair()
    closed = threading.Event()
    calls = []
    watcher.watch(server_side, lambda: (calls.append(1), closed.set()))
    client_side.close()
    assert closed.wait(10)
    assert calls == [1] and watcher.num_watched == 0
    server_side.close()


def test_early_bytes_are_left_in_place_and_not_a_close() -> None:
    watcher = DisconnectWatcher()
    server_side, client_side = socket.socketpair()
    calls = []
    watcher.watch(server_side, lambda: calls.append(1))
    client_side.sendall(b"GET / HTTP/1.1\r\n")
    for _ in range(200):  # the watcher stops watching it once it has seen the bytes
        if watcher.num_watched == 0:
            break
        threading.Event().wait(0.05)
    assert watcher.num_watched == 0 and calls == []
    assert server_side.recv(100) == b"GET / HTTP/1.1\r\n"  # peeked, not consumed
    server_side.close()
    client_side.close()


def test_an_unwatched_socket_is_not_reported() -> None:
    watcher = DisconnectWatcher()
    server_side, client_side = socket.socketpair()
    calls = []
    key = watcher.watch(server_side, lambda: calls.append(1))
    watcher.unwatch(key)
    client_side.close()
    threading.Event().wait(0.5)
    assert calls == []
    server_side.close()


def test_one_socket_watched_for_several_generations_cancels_them_all() -> None:
    """A legacy batch watches its one socket once per prompt: every generation is cancelled by the one close, and
    the watcher keeps working for the next request (it used to die on the second registration)."""
    watcher = DisconnectWatcher()
    server_side, client_side = socket.socketpair()
    calls: list[int] = []
    done = threading.Event()
    for index in range(3):
        watcher.watch(server_side, lambda index=index: (calls.append(index), len(calls) == 3 and done.set()))
    assert watcher.num_watched == 1
    client_side.close()
    assert done.wait(10)
    assert sorted(calls) == [0, 1, 2] and watcher.num_watched == 0
    server_side.close()
    second, peer = socket.socketpair()
    closed = threading.Event()
    watcher.watch(second, closed.set)
    peer.close()
    assert closed.wait(10)
    second.close()


def test_a_socket_that_cannot_be_registered_is_dropped_and_the_others_still_watched(monkeypatch) -> None:
    """An unexpected error registering one socket drops that watch (logged); the watcher goes on with the rest."""
    import selectors

    watcher = DisconnectWatcher()
    bad, bad_peer = socket.socketpair()
    good, good_peer = socket.socketpair()
    real_register = selectors.DefaultSelector.register

    def register(self, fileobj, events, data=None):
        if fileobj is bad:
            raise KeyError("already registered")
        return real_register(self, fileobj, events, data)

    monkeypatch.setattr(selectors.DefaultSelector, "register", register)
    closed = threading.Event()
    watcher.watch(bad, lambda: None)
    watcher.watch(good, closed.set)
    good_peer.close()
    assert closed.wait(10)
    assert watcher.num_watched == 0
    for sock in (bad, bad_peer, good):
        sock.close()


def test_a_watcher_whose_loop_raises_is_restarted_and_counted(monkeypatch) -> None:
    from handler import threads
    from handler.process import disconnect

    watcher = DisconnectWatcher()
    failures = iter([RuntimeError("boom")])
    real_readable = DisconnectWatcher._readable

    def readable(self, watched):
        error = next(failures, None)
        if error is not None:
            raise error
        return real_readable(self, watched)

    monkeypatch.setattr(DisconnectWatcher, "_readable", readable)
    before = threads.restarts().get(disconnect.THREAD_NAME, 0)
    server_side, client_side = socket.socketpair()
    closed = threading.Event()
    watcher.watch(server_side, closed.set)
    client_side.close()
    assert closed.wait(10)
    assert threads.restarts()[disconnect.THREAD_NAME] == before + 1
    server_side.close()
