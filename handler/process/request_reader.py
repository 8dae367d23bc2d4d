"""How a worker reads requests on its event loop, without a thread, before a pool thread runs them (``worker``).

The request line, the headers and a body of up to ``ScanLimits.body`` bytes (the server's
``option.max_request_size``; ``Content-Length`` or chunked) are gathered with non-blocking reads into a buffer
(``RequestScanner``: h11 tells where each request ends), under one deadline per request
(``option.request_read_timeout``), and only a complete request goes on (``RequestReader``): its bytes are handed to
gunicorn's own parser (``DeadlineConn``), which then never waits on the socket, and what it still reads is bounded
by the same deadline (``DeadlineUnreader``). Its error answers are ``answers``'.

May import: ``handler.errors``, gunicorn and h11 (it runs before any route: nothing of the app).
"""

from __future__ import annotations

import collections
import socket
import time
from dataclasses import dataclass

import h11
from gunicorn.http.unreader import SocketUnreader
from gunicorn.workers import gthread

from handler.process.answers import ReadTimeout, error_response

# SageMaker's invoke_endpoint limit, the body a worker reads unless configured otherwise (``DeadlineWorker.configure``
# passes option.max_request_size); the app answers a longer body with a 413
DEFAULT_BODY_BYTES = 6 * 1024 * 1024
# Pool threads for GET /ping alone: it never waits on the model, so two keep it answered whatever else is running.
PING_THREADS = 2
# The request line and headers together; nginx, ALB and Node stop between 8 and 64 KiB.
MAX_HEAD_BYTES = 64 * 1024
# Request bytes the event loop holds for requests not yet complete, all connections together. Past it, a request
# whose head has arrived goes to a pool thread at once and its thread reads the rest (under the same deadline).
BUFFER_BUDGET_BYTES = 256 * 1024 * 1024
RECV_BYTES = 256 * 1024
# After an error answer the worker half-closes and reads what the client still sends, for at most this long or
# this much, before closing (RFC 9112 section 9.6: a close with unread data would reset the answer away).
CLOSE_LINGER_S = 2.0
CLOSE_DRAIN_BYTES = 64 * 1024
MAX_REQUEST_LINE = 8190  # gunicorn's own ceiling on limit_request_line
FD_RESERVE = 256         # file descriptors a worker needs besides its connections (model files, pipes, fetches)


# ---- the request scanner: when has a whole request arrived? -------------------------------------------------------
MORE, READY = "more", "ready"


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str
    message: str
    code: str


@dataclass(frozen=True)
class ScanLimits:
    line: int = 4094                    # gunicorn's limit_request_line
    head: int = MAX_HEAD_BYTES
    body: int = DEFAULT_BODY_BYTES      # a larger body is refused by the app (413) after it reads one byte more


class RequestScanner:
    """Follows one request's bytes as they arrive; ``feed`` says ``MORE`` (keep reading), ``READY`` (hand the
    bytes to gunicorn's parser: the request is complete, or its error is already in the buffer) or a ``Refusal``.

    h11 (a sans-IO HTTP/1.1 implementation) follows the framing: the head, then a Content-Length or chunked body.
    It only finds where the request ends; ``buffer`` keeps every byte, and gunicorn's parser still parses and
    judges the request. What h11 refuses (a malformed head or chunk, a Transfer-Encoding other than chunked) is
    READY at once, for gunicorn to answer, and so is ``Expect: 100-continue`` once the head is in: the pool thread
    reads the rest under the deadline."""

    def __init__(self, limits: ScanLimits) -> None:
        self.limits = limits
        self.buffer = bytearray()
        self.request: h11.Request | None = None  # the head, once h11 has it
        # h11 refuses an incomplete event over this size (431); a head of ``limits.head`` bytes is complete only
        # with its last byte, so one still incomplete at that size is over the limit
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.head - 1)
        self._start = -1            # where the request line starts: past one empty line (RFC 9112 section 2.2)
        self._line_done = False     # the request line's LF has arrived
        self._given = 0             # how much of the buffer h11 has been given
        self._body_bytes = 0

    @property
    def head_done(self) -> bool:
        """The head has arrived and the body is being gathered."""
        return self.request is not None

    @property
    def is_websocket(self) -> bool:
        """The head asks to open a WebSocket (RFC 6455 section 4.1): its connection is handed over for good."""
        return self.request is not None and any(name == b"upgrade" and value.strip().lower() == b"websocket"
                                                for name, value in self.request.headers)

    @property
    def method(self) -> bytes:
        return self.request.method if self.request is not None else self._request_line()[0]

    @property
    def path(self) -> str:
        """The request's path; before h11 has the head (or when it refused it, or for a 414), what the request
        line holds of it."""
        target = self.request.target if self.request is not None else self._request_line()[1]
        return target.split(b"?", 1)[0].decode("latin-1")

    def _request_line(self) -> tuple[bytes, bytes]:
        start = max(self._start, 0)
        parts = bytes(self.buffer[start:start + self.limits.line + 2]).split(b"\n", 1)[0].split(b" ", 2)
        return parts[0], parts[1] if len(parts) > 1 else b""

    def feed(self, data: bytes) -> str | Refusal:
        self.buffer += data
        if self._start < 0:
            if self.buffer in (b"", b"\r"):
                return MORE
            self._start = self._given = 2 if self.buffer.startswith(b"\r\n") else 0
        if not self._line_done and self._line_too_long():
            limit = self.limits.line
            return Refusal(414, "URI Too Long", f"the request line is over {limit} bytes", "request_line_too_long")
        try:
            return self._follow()
        except h11.RemoteProtocolError as error:
            if self.request is None and error.error_status_hint == 431:  # h11's max_incomplete_event_size
                return Refusal(431, "Request Header Fields Too Large",
                               f"the request head (request line and headers) is over {self.limits.head} bytes",
                               "headers_too_large")
            if self.request is None and "Host" in str(error):  # RFC 9112 3.2: an HTTP/1.1 request needs a Host
                return Refusal(400, "Bad Request", "an HTTP/1.1 request must carry a Host header", "missing_host")
            return READY  # gunicorn finds the mistake itself (400, 501) and answers it

    def _line_too_long(self) -> bool:
        """h11 cannot tell a long request line from a long head: measure the line (without its CRLF) here."""
        buf, start, limit = self.buffer, self._start, self.limits.line
        window = min(len(buf), start + limit + 2)
        end = buf.find(b"\n", start, window)
        self._line_done = end >= 0
        stop = end if end >= 0 else window
        return stop - start - (buf[stop - 1:stop] == b"\r") > limit

    def _bare_lf(self) -> bool:
        """h11 takes a bare LF for a line end, gunicorn refuses it (400): a head with one goes on at once."""
        head = (self._start, self._given)
        return self.buffer.count(b"\n", *head) != self.buffer.count(b"\r\n", *head)

    def _follow(self) -> str:
        """Give h11 the bytes it has not seen (of the head, no more than its limit) and read its events."""
        conn = self._h11
        while True:
            end = len(self.buffer) if self.request else min(len(self.buffer), self._start + self.limits.head)
            if self._given < end:
                conn.receive_data(self.buffer[self._given:end])
                self._given = end
            event = conn.next_event()
            if event is h11.NEED_DATA:
                return READY if self.request is None and self._bare_lf() else MORE
            if isinstance(event, h11.Request):
                self.request = event
                declared = max((int(value) for name, value in event.headers if name == b"content-length"), default=0)
                if conn.they_are_waiting_for_100_continue or declared > self.limits.body:
                    return READY  # gunicorn sends 100 Continue first; the app refuses a long body from its header (413)
            elif isinstance(event, h11.Data):
                self._body_bytes += len(event.data)
                if self._body_bytes > self.limits.body:
                    return READY  # over the limit: the app reads one byte more than it allows and says 413
            else:
                return READY  # EndOfMessage (or PAUSED: an upgrade, for gunicorn to judge)


# ---- the worker -------------------------------------------------------------------------------------------------
def closing_after_broken_bodies(app):
    """WSGI middleware: an answer after a body that failed to read (timed out, malformed) or was too large (413)
    says ``Connection: close``; gunicorn closes such connections anyway, since where the next request starts is
    unknown, and the header tells the client not to reuse it."""

    def wrapped(environ: dict, start_response):
        def start(status: str, headers: list, exc_info=None):
            body = environ.get("wsgi.input")
            response = getattr(start_response, "__self__", None)  # gunicorn's Response
            if (status[:3] == "413" or getattr(body, "failed", False)) and hasattr(response, "force_close"):
                response.force_close()
            return start_response(status, headers, exc_info)

        return app(environ, start)

    return wrapped


class DeadlineUnreader(SocketUnreader):
    """gunicorn's socket reader with the request's deadline on every ``recv``."""

    def __init__(self, sock: socket.socket, conn: DeadlineConn) -> None:
        super().__init__(sock)
        self.conn = conn

    def chunk(self, size_hint: int | None = None) -> bytes:
        remaining = self.conn.deadline - time.monotonic()
        if remaining <= 0:
            raise self.conn.timeout_error()
        prior = self.sock.gettimeout()
        self.sock.settimeout(remaining if prior is None else min(prior, remaining))
        try:
            return super().chunk(size_hint)
        except TimeoutError:
            raise self.conn.timeout_error() from None
        finally:
            self.sock.settimeout(prior)


class DeadlineConn(gthread.TConn):
    READING, CLOSING = "reading", "closing"

    def __init__(self, cfg, sock, client, server, read_timeout_s: float) -> None:
        super().__init__(cfg, sock, client, server)
        self.read_timeout_s = read_timeout_s
        self.scanner: RequestScanner | None = None
        self.state = self.READING
        self.deadline = 0.0
        self.received = 0
        self.pending = b""    # the request's bytes, for the parser
        self.path = ""
        self.is_ping = False
        self.active_at = 0.0  # time.monotonic() of its last activity while the event loop reads it
        self.is_websocket = False   # an upgrade: its pool thread keeps the connection until it closes
        self.taken = False          # the app took the socket over (``take_socket``): the worker only forgets it

    def timeout_error(self) -> ReadTimeout:
        return ReadTimeout(f"the request was not received within {self.read_timeout_s:g} s "
                           "(option.request_read_timeout)")

    def init(self) -> None:
        """On the pool thread, before each request: the parser reads the bytes the event loop gathered first."""
        first = not self.initialized
        super().init()
        if first:
            self.parser.unreader = DeadlineUnreader(self.sock, self)
        if self.pending:
            self.parser.unreader.unread(self.pending)
            self.pending = b""


class RequestReader:
    """A worker's requests while they arrive, on its event loop: each connection's bytes go to its
    ``RequestScanner`` under one read deadline; a whole request goes to the worker's pool (``enqueue_req``), a
    refused or late one gets its error answer here and the connection lingers briefly, then closes. The worker
    owns the sockets' registration (``poller``), the connection count and the log.

    ``reading`` is kept in order of each connection's last activity (its start, its last bytes, its error answer):
    the first is the one that has been quiet longest (``quietest``), which the worker closes for a new connection
    when it is at its connection cap."""

    def __init__(self, worker, limits: ScanLimits) -> None:
        self.worker = worker              # gunicorn's ThreadWorker (DeadlineWorker)
        self.limits = limits
        # connections whose request is arriving (or being closed), the quietest first
        self.reading: collections.OrderedDict[DeadlineConn, None] = collections.OrderedDict()
        self.buffered = 0

    def start(self, conn: DeadlineConn, data: bytes) -> None:
        """A request starts: its deadline runs from now."""
        conn.scanner = RequestScanner(self.limits)
        conn.state, conn.received = DeadlineConn.READING, 0
        conn.deadline = time.monotonic() + self.worker.read_timeout_s
        self._active(conn)
        if data:
            self.take(conn, data)

    def _active(self, conn: DeadlineConn) -> None:
        conn.active_at = time.monotonic()
        self.reading[conn] = None
        self.reading.move_to_end(conn)

    def quietest(self) -> DeadlineConn | None:
        """The connection still sending its request (or lingering after an answer) that has been quiet longest."""
        return next(iter(self.reading), None)

    def on_readable(self, conn: DeadlineConn, _sock) -> None:
        """The event loop's callback for a connection: an unexpected error closes that connection, never the
        worker's loop (it runs every connection of the worker)."""
        try:
            self._readable(conn)
        except Exception:
            self.worker.log.exception("reading a request from %s failed; its connection is closed", conn.client[0])
            try:
                self.drop(conn)
            except Exception:  # already half-forgotten: the close is what matters
                conn.close()

    def _readable(self, conn: DeadlineConn) -> None:
        if conn.sock.fileno() < 0:  # closed earlier in this turn of the event loop (to make room at the cap)
            return
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if conn not in self.reading:  # kept alive and idle until now: its next request starts
            self.worker.keepalived_conns.remove(conn)
            if not data:
                self.drop(conn)
                return
            self.start(conn, b"")
        if not data:
            self.drop(conn)
            return
        self._active(conn)
        if conn.state == DeadlineConn.CLOSING:
            conn.received += len(data)
            if conn.received > CLOSE_DRAIN_BYTES:
                self.drop(conn)
        else:
            self.take(conn, data)

    def take(self, conn: DeadlineConn, data: bytes) -> None:
        conn.received += len(data)
        self.buffered += len(data)
        verdict = conn.scanner.feed(data)
        if isinstance(verdict, Refusal):
            self.worker.log.info("refused a request from %s: %d %s", conn.client[0], verdict.status, verdict.message)
            self.refuse(conn, verdict.status, verdict.reason, verdict.message, verdict.code)
        elif verdict == READY or (self.buffered > BUFFER_BUDGET_BYTES and conn.scanner.head_done):
            self._dispatch(conn)

    def _forget(self, conn: DeadlineConn) -> None:
        self.reading.pop(conn, None)
        if conn.scanner is not None:
            self.buffered -= len(conn.scanner.buffer)
        try:
            self.worker.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _dispatch(self, conn: DeadlineConn) -> None:
        scanner = conn.scanner
        self._forget(conn)
        conn.pending, conn.scanner = bytes(scanner.buffer), None
        conn.path = scanner.path
        conn.is_ping = scanner.method == b"GET" and conn.path == "/ping"
        conn.is_websocket = scanner.is_websocket
        conn.data_ready = True  # gthread must not wait for data: it is all here
        self.worker.enqueue_req(conn)

    def refuse(self, conn: DeadlineConn, status: int, reason: str, message: str, code: str) -> None:
        """Answer an error from the event loop, then close without resetting the answer away."""
        path = conn.scanner.path if conn.scanner is not None else ""
        try:
            conn.sock.send(error_response(status, reason, message, code, path))  # small: the socket buffer takes it
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.drop(conn)
            return
        self.linger(conn)

    def linger(self, conn: DeadlineConn) -> None:
        if conn.scanner is not None:
            self.buffered -= len(conn.scanner.buffer)
            conn.scanner = None
        conn.state, conn.received = DeadlineConn.CLOSING, 0
        conn.deadline = time.monotonic() + CLOSE_LINGER_S
        self._active(conn)

    def drop(self, conn: DeadlineConn) -> None:
        self._forget(conn)
        conn.scanner = None
        self.worker.nr_conns -= 1
        conn.close()

    def expire(self) -> None:
        """Requests past their read deadline get a 408 (closed if nothing came); closing ones past their linger go."""
        now = time.monotonic()
        for conn in [c for c in self.reading if c.deadline <= now]:
            if conn.state == DeadlineConn.CLOSING or conn.received == 0:
                self.drop(conn)
            else:
                error = conn.timeout_error()
                self.worker.log.info("request from %s timed out: %s", conn.client[0], error)
                self.refuse(conn, 408, "Request Timeout", str(error), "request_timeout")

    def close_idle_by(self, deadline: float) -> None:
        """Stopping: connections that have not started a request close by ``deadline``."""
        for conn in self.reading:
            if conn.received == 0:
                conn.deadline = min(conn.deadline, deadline)

    def drop_all(self) -> None:
        for conn in list(self.reading):
            self.drop(conn)
