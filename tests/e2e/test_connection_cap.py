"""More stalled connections than the worker's connection cap, through the real gunicorn server (handler/process/
worker.py): /ping and fresh work are answered throughout, because at the cap a new connection takes the place of
the quietest one.

The server runs with a cap of 64 connections and a read deadline far beyond the test (120 s), so no stalled
connection is cut by its deadline while the test runs: a /ping can get in only if the worker makes room at the cap
(before, it waited in the listen backlog until a deadline freed a place). 80 connections send a request head one
byte at a time and are re-opened when the server closes them, as a persistent client fleet would.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import requests

from tests.e2e.conftest import RunningServer, start_server, stop_server

CAP = 64
STALLED = 80
READ_TIMEOUT_S = 120
ROUNDS = 20
# A client timeout far below the read deadline: a /ping that waited for a stalled connection's deadline fails here.
CLIENT_TIMEOUT_S = 10
HEAD = b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 4000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("cap"), {"OPTION_MAX_CONNECTIONS": str(CAP),
                                                            "OPTION_REQUEST_READ_TIMEOUT": str(READ_TIMEOUT_S)})
    yield running
    stop_server(running)


class Stalled:
    """``count`` connections trickling ``HEAD`` one byte per ``drip``; one the server closes is opened again."""

    def __init__(self, address: tuple[str, int], count: int) -> None:
        self.address = address
        self.sockets = [self._open() for _ in range(count)]
        self.sent = [0] * count
        self.closed_by_server = 0

    def _open(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=CLIENT_TIMEOUT_S)
        sock.setblocking(False)
        return sock

    def drip(self) -> None:
        for index, sock in enumerate(self.sockets):
            try:
                if sock.recv(65536) == b"":  # closed by the server (nothing is ever answered before the head ends)
                    raise ConnectionResetError
            except BlockingIOError:
                pass
            except OSError:
                self.closed_by_server += 1
                sock.close()
                self.sockets[index], self.sent[index] = self._open(), 0
                continue
            try:
                sock.send(HEAD[self.sent[index]:self.sent[index] + 1])
                self.sent[index] += 1
            except OSError:
                pass  # found closed on the next drip

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def test_ping_and_fresh_work_get_in_past_the_connection_cap(server: RunningServer) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    stalled = Stalled((host, int(port)), STALLED)
    try:
        statuses = []
        for round_number in range(ROUNDS):
            stalled.drip()
            statuses.append(requests.get(f"{server.url}/ping", timeout=CLIENT_TIMEOUT_S,
                                         headers={"Connection": "close"}).status_code)
            if round_number == ROUNDS // 2:
                work = requests.post(f"{server.url}/invocations", timeout=60,
                                     json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
                assert work.status_code == 200, work.text
        assert statuses == [200] * ROUNDS
        # the stalled connections past the cap, and those a /ping or the request took the place of, were cut
        assert stalled.closed_by_server >= STALLED - CAP
    finally:
        stalled.close()
    assert f"at the connection cap (option.max_connections={CAP}): closed" in server.log()
    assert "Traceback" not in server.log()
