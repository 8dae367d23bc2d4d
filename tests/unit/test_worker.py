"""process/request_reader.py without a server: when the event loop holds a request as complete, and the error answers.

The worker itself (deadlines, /ping beside busy threads, JSON errors) is exercised through the real server in
tests/e2e/test_transport.py.
"""

from __future__ import annotations

import json

import pytest
from gunicorn.http import errors as http_errors

from handler.__main__ import gunicorn_options
from handler.config import Settings
from handler.process.answers import ReadTimeout, describe, error_response
from handler.process.request_reader import (
    MORE,
    READY,
    Refusal,
    RequestScanner,
    ScanLimits,
)

LIMITS = ScanLimits(line=100, head=1000, body=50)


def scan(*pieces: bytes) -> list[str | Refusal]:
    scanner = RequestScanner(LIMITS)
    return [scanner.feed(piece) for piece in pieces]


def test_a_request_is_ready_only_when_its_head_is_in() -> None:
    assert scan(b"GE", b"T /ping HTTP/1.1\r\nHost: x\r\n", b"\r\n") == [MORE, MORE, READY]
    assert scan(b"\r", b"\nGET / HTTP/1.1\r\nHost: x\r\n\r\n") == [MORE, READY]  # one empty line first is allowed
    scanner = RequestScanner(LIMITS)
    assert scanner.feed(b"\r\nGET /ping?x=1 HTTP/1.1\r\nHost: x\r\n\r\n") == READY
    assert (scanner.method, scanner.path) == (b"GET", "/ping")


def test_an_http11_request_without_host_is_refused_by_the_event_loop() -> None:
    """RFC 9112 section 3.2 (gunicorn would serve it): refused at once, so its body can never hold a pool thread."""
    scanner = RequestScanner(LIMITS)
    verdict = scanner.feed(b"POST /invocations HTTP/1.1\r\nContent-Length: 5\r\n\r\n")
    assert isinstance(verdict, Refusal) and (verdict.status, verdict.code) == (400, "missing_host")
    assert scanner.path == "/invocations"


def test_pipelined_bytes_stay_in_the_buffer() -> None:
    scanner = RequestScanner(LIMITS)
    second = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"
    assert scanner.feed(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}" + second) == READY
    assert scanner.buffer.endswith(b"{}" + second) and scanner.path == "/"


def test_a_body_is_gathered_before_the_request_is_ready() -> None:
    head = b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n"
    assert scan(head + b"ab", b"cd", b"e") == [MORE, MORE, READY]
    assert scan(head[:20], head[20:], b"abcde") == [MORE, MORE, READY]
    chunked = b"POST /invocations HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert scan(chunked + b"5\r\nab", b"cde\r\n", b"0\r\n", b"\r\n") == [MORE, MORE, MORE, READY]
    assert scan(chunked + b"2;name=value\r\nab\r\n0\r\nTrailer: x\r\n", b"\r\n") == [MORE, READY]


@pytest.mark.parametrize("request_bytes", [
    b"GET / HTTP/1.1\nHost: x\r\n\r\n",                                               # bare LF: gunicorn's 400
    b"GET / HTTP/1.1\r\nHost: x\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",         # bad chunk size
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXX",      # no chunk terminator
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",                 # gunicorn judges it
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 51\r\n\r\n",                      # over the limit: the app's 413
    b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n",  # body after 100 Continue
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n" + b"a" * 51,  # chunked past the limit
])
def test_what_gunicorn_or_the_app_refuses_goes_on_at_once(request_bytes: bytes) -> None:
    assert scan(request_bytes) == [READY]


def test_an_oversized_request_line_or_head_is_refused_by_the_event_loop() -> None:
    scanner = RequestScanner(LIMITS)
    verdict = scanner.feed(b"GET /v1/" + b"a" * 200)
    assert isinstance(verdict, Refusal) and verdict.status == 414
    assert scanner.path.startswith("/v1/")  # the error shape follows the path, even a partial one
    [verdict] = scan(b"GET / HTTP/1.1\r\nX: " + b"a" * 2000)
    assert isinstance(verdict, Refusal) and verdict.status == 431
    [verdict] = scan(b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 2000 + b"\r\n\r\n")  # whole, in one read
    assert isinstance(verdict, Refusal) and verdict.status == 431


def test_the_limits_are_exact() -> None:
    line = b"GET /" + b"a" * 86 + b" HTTP/1.1"                    # 100 bytes: the line limit
    assert scan(line + b"\r", b"\nHost: x\r\n\r\n") == [MORE, READY]
    [verdict] = scan(b"GET /a" + line[5:] + b"\r\n")
    assert isinstance(verdict, Refusal) and verdict.status == 414
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX: "
    head += b"a" * (1000 - len(head) - 4) + b"\r\n\r\n"               # 1000 bytes: the head limit
    assert scan(head) == [READY]
    [verdict] = scan(head[:-4] + b"a\r\n\r\n")
    assert isinstance(verdict, Refusal) and verdict.status == 431
    chunked = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert scan(chunked + b"32\r\n" + b"a" * 50 + b"\r\n", b"0\r\n\r\n") == [MORE, READY]  # 50 bytes: allowed
    assert scan(chunked + b"32\r\n" + b"a" * 50 + b"\r\n1\r\n", b"a") == [MORE, READY]     # one more: over it


@pytest.mark.parametrize(("path", "shape"), [("/ping", "legacy"), ("/v1/chat/completions", "openai")])
def test_error_answers_have_the_servers_json_shapes(path: str, shape: str) -> None:
    response = error_response(408, "Request Timeout", "too slow", "request_timeout", path)
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and b"Connection: close" in head
    assert f"Content-Length: {len(body)}".encode() in head
    payload = json.loads(body)
    if shape == "legacy":
        assert payload == {"error": "too slow", "error_type": "invalid_request_error", "param": None, "code": 408}
    else:
        assert payload == {"error": {"message": "too slow", "type": "invalid_request_error", "param": None,
                                     "code": "request_timeout"}}


def test_gunicorns_client_errors_keep_their_statuses() -> None:
    assert describe(http_errors.LimitRequestLine(5000, 4094))[0] == 414
    assert describe(http_errors.LimitRequestHeaders("limit request headers fields size"))[0] == 431
    assert describe(http_errors.InvalidChunkSize(b"zz"))[0] == 400
    assert describe(http_errors.InvalidRequestLine("GET"))[0] == 400
    assert describe(http_errors.UnsupportedTransferCoding("gzip"))[0] == 501
    assert describe(ReadTimeout("late"))[:3] == (408, "Request Timeout", "late")
    assert describe(http_errors.InvalidResponseHeader("X")) is None  # the application's fault: a 500
    assert describe(ValueError("bug")) is None


def test_the_settings_reach_the_worker() -> None:
    options = gunicorn_options(Settings(host="127.0.0.1", request_read_timeout=3, max_connections=50))
    assert options["worker_class"].read_timeout_s == 3 and options["worker_connections"] == 50
    assert Settings().request_read_timeout < 60  # SageMaker's own timeout


def test_an_unexpected_error_reading_one_connection_closes_it_and_not_the_event_loop() -> None:
    """A connection the reader holds in no state it knows (here: neither reading nor kept alive) raised out of the
    event loop's callback, which ends the worker and every connection on it; now it closes that connection only."""
    import logging
    import selectors
    import socket

    from handler.process.request_reader import RequestReader

    class Worker:
        log = logging.getLogger("test-worker")
        poller = selectors.DefaultSelector()
        keepalived_conns: list = []
        nr_conns = 1
        read_timeout_s = 5.0

    class Conn:
        scanner = None
        client = ("127.0.0.1", 1)

        def __init__(self, sock: socket.socket) -> None:
            self.sock, self.closed = sock, False

        def close(self) -> None:
            self.closed = True
            self.sock.close()

    ours, peer = socket.socketpair()
    worker, conn = Worker(), Conn(ours)
    peer.sendall(b"GET /ping HTTP/1.1\r\n")
    RequestReader(worker, LIMITS).on_readable(conn, ours)
    assert conn.closed and worker.nr_conns == 0
    peer.close()


def test_the_reader_knows_which_connection_has_been_quiet_longest() -> None:
    """The order the worker makes room in at its connection cap: by last activity (start, bytes, error answer), not
    by when a connection was opened; a closed connection leaves it."""
    import logging
    import selectors
    import socket

    from handler.process.request_reader import DeadlineConn, RequestReader

    class Worker:
        log = logging.getLogger("test-worker")
        poller = selectors.DefaultSelector()
        keepalived_conns: list = []
        nr_conns = 3
        read_timeout_s = 5.0

    class Cfg:  # what gunicorn's TConn reads of its config
        is_ssl = False

    worker = Worker()
    reader = RequestReader(worker, LIMITS)
    pairs = [socket.socketpair() for _ in range(3)]
    conns = [DeadlineConn(Cfg(), ours, ("127.0.0.1", n), ("127.0.0.1", 8080), 5.0) for n, (ours, _) in
             enumerate(pairs)]
    for conn in conns:
        reader.start(conn, b"")
        worker.poller.register(conn.sock, selectors.EVENT_READ)
    assert reader.quietest() is conns[0]
    pairs[0][1].sendall(b"G")        # the oldest sends a byte: now the second is the quietest
    conns[0].sock.setblocking(False)
    reader.on_readable(conns[0], conns[0].sock)
    assert reader.quietest() is conns[1] and conns[0].received == 1
    reader.drop(conns[1])
    assert reader.quietest() is conns[2] and worker.nr_conns == 2
    reader.on_readable(conns[1], conns[1].sock)  # its event came in the same turn as the close: ignored
    assert worker.nr_conns == 2
    for conn in (conns[0], conns[2]):
        reader.drop(conn)
    for _, peer in pairs:
        peer.close()
