"""The transport through the real gunicorn server (process/worker.py): slow and idle clients cannot starve /ping,
each request is read under one deadline, and HTTP-level mistakes are answered in JSON (issue #17).

The server runs with 8 threads and a 2 s read timeout, so a handful of sockets outnumber its threads and the
deadlines pass quickly. Raw sockets on 127.0.0.1 send the malformed traffic. No assertion is about speed: only
that /ping answers (with generous client timeouts) while stalled connections are open, and that the server
closes those within a bounded wait.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import requests

from tests.e2e.conftest import RunningServer, start_server, stop_server

THREADS = 8
READ_TIMEOUT_S = 2
STALLED = 3 * THREADS          # more stalled connections than request threads
CLOSE_WAIT_S = 30              # bound on how long the server may take to close a stalled connection
MAX_BODY_BYTES = 6 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("transport"),
                           {"OPTION_THREADS": str(THREADS), "OPTION_REQUEST_READ_TIMEOUT": str(READ_TIMEOUT_S)})
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def address(server: RunningServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def connect(address: tuple[str, int], timeout: float = 30) -> socket.socket:
    return socket.create_connection(address, timeout=timeout)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response (past any 100 Continue): status, headers (lower-case names) and the Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data or data.startswith(b"HTTP/1.1 100 "):
        if data.startswith(b"HTTP/1.1 100 ") and b"\r\n\r\n" in data:
            data = data.partition(b"\r\n\r\n")[2]
            continue
        part = sock.recv(65536)
        assert part, f"the connection closed before a response: {data!r}"
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        part = sock.recv(65536)
        assert part, "the connection closed inside the body"
        body += part
    return int(status_line.split()[1]), headers, body


def exchange(address: tuple[str, int], request: bytes) -> tuple[int, dict[str, str], dict]:
    with connect(address) as sock:
        sock.sendall(request)
        status, headers, body = read_response(sock)
    assert headers["content-type"] == "application/json"
    return status, headers, json.loads(body)


def assert_legacy_error(payload: dict, status: int) -> None:
    assert payload["code"] == status and payload["error_type"] == "invalid_request_error"
    assert isinstance(payload["error"], str) and payload["error"]


def assert_openai_error(payload: dict) -> None:
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["type"] == "invalid_request_error" and payload["error"]["message"]


def ping(url: str) -> int:
    return requests.get(f"{url}/ping", timeout=30).status_code


def closed_by_server(sock: socket.socket) -> bytes | None:
    """What the server sent before closing (b"" for a bare close), or None while the connection is still open."""
    sock.setblocking(False)
    try:
        data = b""
        while True:
            part = sock.recv(65536)
            if not part:
                return data
            data += part
    except BlockingIOError:
        return data or None  # an answer arrived (the close follows it), or nothing yet
    except OSError:
        return b""
    finally:
        sock.setblocking(True)


def wait_closed(sockets: list[socket.socket], trickle: bytes = b"") -> list[bytes]:
    """Keep the connections going (one byte each of ``trickle`` every 0.5 s, if given) until the server has closed
    every one of them; returns what each received."""
    answers: list[bytes | None] = [None] * len(sockets)
    deadline = time.monotonic() + CLOSE_WAIT_S
    position = 0
    while None in answers and time.monotonic() < deadline:
        for i, sock in enumerate(sockets):
            if answers[i] is not None:
                continue
            answers[i] = closed_by_server(sock)
            if answers[i] is None and trickle:
                try:
                    sock.send(trickle[position % len(trickle):][:1])
                except OSError:
                    answers[i] = b""
        position += 1
        time.sleep(0.5)
    assert None not in answers, f"{answers.count(None)} connections still open after {CLOSE_WAIT_S} s"
    return answers


def assert_408(answer: bytes) -> None:
    """A stalled request is answered 408 in JSON, or (the answer lost to a reset) just closed."""
    if not answer:
        return
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), head
    assert_legacy_error(json.loads(body), 408)


# ---- routes (already JSON before the worker) --------------------------------------------------------------------
def test_unknown_route_is_a_json_404(server: RunningServer) -> None:
    response = requests.get(f"{server.url}/nope", timeout=30)
    assert response.status_code == 404 and response.json()["code"] == 404
    response = requests.post(f"{server.url}/v1/nope", json={}, timeout=30)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


# ---- slow and idle clients --------------------------------------------------------------------------------------
def test_stalled_headers_are_cut_and_ping_still_answers(server: RunningServer, address: tuple[str, int]) -> None:
    head = b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 200
    sockets = [connect(address) for _ in range(STALLED)]
    try:
        for sock in sockets:
            sock.sendall(head[:10])
        assert [ping(server.url) for _ in range(3)] == [200, 200, 200]
        # one byte every 0.5 s from each: the deadline is a total, so trickling does not keep a request alive
        answers = wait_closed(sockets, trickle=head[10:])
    finally:
        for sock in sockets:
            sock.close()
    for answer in answers:
        assert_408(answer)
    assert ping(server.url) == 200


def test_idle_connections_are_closed_and_ping_still_answers(server: RunningServer,
                                                            address: tuple[str, int]) -> None:
    sockets = [connect(address) for _ in range(STALLED)]
    try:
        assert [ping(server.url) for _ in range(3)] == [200, 200, 200]
        answers = wait_closed(sockets)
    finally:
        for sock in sockets:
            sock.close()
    assert answers == [b""] * STALLED  # nothing was asked, nothing is answered


def test_a_body_that_never_arrives_is_cut(server: RunningServer, address: tuple[str, int]) -> None:
    sockets = [connect(address) for _ in range(STALLED)]
    try:
        for sock in sockets:
            sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"inputs\": ")
        assert ping(server.url) == 200
        answers = wait_closed(sockets)
    finally:
        for sock in sockets:
            sock.close()
    for answer in answers:
        assert_408(answer)


def test_a_body_read_on_a_request_thread_has_the_same_deadline(server: RunningServer,
                                                              address: tuple[str, int]) -> None:
    """With ``Expect: 100-continue`` the body is read on the request's thread (gunicorn sends 100 Continue first):
    trickling it one byte every 0.5 s still ends at the deadline, in a 408 from the route, and the connection
    closes."""
    with connect(address) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Expect: 100-continue\r\nContent-Length: 1000\r\n\r\n")
        answer = b""
        for _ in range(int(CLOSE_WAIT_S / 0.5)):
            answer += closed_by_server(sock) or b""
            if b"408" in answer:
                break
            try:
                sock.sendall(b" ")
            except OSError:
                break
            time.sleep(0.5)
        sock.settimeout(30)
        while not answer.endswith(b"}"):
            part = sock.recv(65536)
            if not part:
                break
            answer += part
    response = answer.partition(b"HTTP/1.1 100 Continue\r\n\r\n")[2]
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head, head
    assert_openai_error(json.loads(body))
    assert ping(server.url) == 200


def test_a_kept_alive_connection_waits_for_its_next_request(server: RunningServer,
                                                            address: tuple[str, int]) -> None:
    """Idle time between requests is the keep-alive timeout's, not the read deadline's."""
    with connect(address) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 200
        time.sleep(READ_TIMEOUT_S + 1.5)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = read_response(sock)
    assert status == 200 and json.loads(body)["object"] == "list"


# ---- transport errors in JSON -----------------------------------------------------------------------------------
def test_a_chunked_body_over_the_limit_is_413(server: RunningServer, address: tuple[str, int]) -> None:
    piece = b" " * 65536
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)

    def send_body(sock: socket.socket) -> None:
        try:
            sock.sendall(b"{\r\n")
            for _ in range(MAX_BODY_BYTES // len(piece) + 16):  # 1 MiB past the limit
                sock.sendall(chunk)
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed before the rest arrived

    with connect(address) as sock:
        sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n1\r\n")
        sender = threading.Thread(target=send_body, args=(sock,), daemon=True)
        sender.start()
        status, headers, body = read_response(sock)
        sender.join(timeout=60)
    assert status == 413 and headers["content-type"] == "application/json"
    assert str(MAX_BODY_BYTES) in json.loads(body)["error"]["message"]
    assert headers["connection"] == "close"
    assert ping(server.url) == 200


def test_a_chunked_body_within_the_limit_is_served(server: RunningServer, address: tuple[str, int]) -> None:
    body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    status, _, payload = exchange(address, b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                           b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                                           + chunks + b"0\r\n\r\n")
    assert status == 200 and isinstance(payload["generated_text"], str)


@pytest.mark.parametrize("framing", [b"zz\r\n{}\r\n0\r\n\r\n",          # not a hexadecimal size
                                     b"2\r\n{}XX0\r\n\r\n",              # no CRLF after the chunk
                                     b"2;=x\r\n{}\r\n0\r\n\r\n"])       # a broken chunk extension
def test_a_malformed_chunk_is_400_without_a_traceback(server: RunningServer, address: tuple[str, int],
                                                      framing: bytes) -> None:
    status, headers, payload = exchange(address, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                                 b"Content-Type: application/json\r\nTransfer-Encoding: chunked"
                                                 b"\r\n\r\n" + framing)
    assert status == 400 and headers["connection"] == "close"
    assert_openai_error(payload)
    assert "chunk" in payload["error"]["message"]
    assert ping(server.url) == 200
    assert "Traceback" not in server.log()


@pytest.mark.parametrize(("path", "shape"), [("/ping", "legacy"), ("/v1/chat/completions", "openai")])
def test_an_oversized_header_is_431(server: RunningServer, address: tuple[str, int], path: str,
                                    shape: str) -> None:
    status, headers, payload = exchange(address, f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode()
                                        + b"X-Big: " + b"a" * 9000 + b"\r\n\r\n")
    assert status == 431 and headers["connection"] == "close"
    assert_legacy_error(payload, 431) if shape == "legacy" else assert_openai_error(payload)


def test_an_oversized_request_head_is_431(server: RunningServer, address: tuple[str, int]) -> None:
    fields = b"".join(b"X-Field-%d: %s\r\n" % (i, b"a" * 8000) for i in range(10))  # each within the field limit
    status, _, payload = exchange(address, b"GET /ping HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
    assert status == 431
    assert_legacy_error(payload, 431)


@pytest.mark.parametrize(("path", "shape"), [("/invocations", "legacy"), ("/v1/completions", "openai")])
def test_an_oversized_request_line_is_414(server: RunningServer, address: tuple[str, int], path: str,
                                          shape: str) -> None:
    status, _, payload = exchange(address, f"GET {path}?q={'a' * 5000} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert status == 414
    assert_legacy_error(payload, 414) if shape == "legacy" else assert_openai_error(payload)


def test_a_malformed_request_line_is_400(server: RunningServer, address: tuple[str, int]) -> None:
    status, _, payload = exchange(address, b"GET /ping HTTP/9.x\r\nHost: x\r\n\r\n")
    assert status == 400
    assert_legacy_error(payload, 400)


def test_the_server_log_has_no_traceback_for_client_mistakes(server: RunningServer) -> None:
    assert ping(server.url) == 200
    assert "Traceback" not in server.log()
