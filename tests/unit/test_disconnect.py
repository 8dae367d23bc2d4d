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
