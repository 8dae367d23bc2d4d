"""SageMaker's bidirectional stream: a WebSocket (RFC 6455) at ``/invocations-bidirectional-stream`` whose messages
are requests to one of our routes, answered in order on the same connection.

SageMaker's side (``InvokeEndpointWithBidirectionalStream``) opens the WebSocket and turns each ``PayloadPart`` the
client sends into a data frame: a text frame for ``DataType`` UTF8, a binary one otherwise, the ``PARTIAL`` parts of
one chunk as the fragments of one message. What it does with ours is the reverse: each frame one ``PayloadPart``,
``PARTIAL`` until a frame with FIN set (``COMPLETE``); a close frame becomes a ``ModelStreamError`` with its code
and reason. Here:

- **Which route.** ``/invocations-bidirectional-stream`` takes what ``/invocations`` takes (the body names its API,
  or a user's ``model.py`` answers). ``X-Amzn-SageMaker-Model-Invocation-Path`` moves SageMaker's connection to
  another path, so each route in ``routes`` opens a WebSocket too (``/v1/chat/completions``: every message is a
  chat request, answered as that route answers); the same header on an upgrade to the default path names the route
  as well.
- **The query string** (``X-Amzn-SageMaker-Model-Query-String``, which SageMaker appends to the path, or that
  header itself): each ``X-Amzn-SageMaker-*`` or ``extra-parameters`` parameter is read as the request header of
  that name, for every request on the connection: what ``invoke_endpoint`` carries in headers (the adapter, custom
  attributes, a session) a bidirectional stream carries there. Other parameters are ignored.
- **Messages.** A message, text or binary, its fragments reassembled, is one request body. Its answer is one
  message: the route's answer, byte for byte. A stream's chunks (a JSON line, or a server-sent event where the
  route frames so) are its fragments, each sent as it is made, and an empty final fragment ends the answer (so a
  SageMaker client gets each record as a ``PARTIAL`` part and a ``COMPLETE`` part at its end); a JSON answer, an
  error included, is a message of one frame. Requests are answered one after another, in order.
- **Control.** Pings are answered; every close frame from here carries a code and a reason: 1009 for a message
  over the body limit, 1008 for a message not complete within ``option.request_read_timeout`` of its first frame,
  1000 for a connection idle (no frame, no request) for ``IDLE_S``, 1001 when the server is stopping.
- **A client that leaves** (its close frame, or a dropped connection) cancels the request it is waiting for: the
  connection's reading thread sees it and calls the request's cancel (``Call.on_client_gone``).

The worker runs each upgrade on a thread of its own for the connection's life and hands the socket over
(``Call.take_socket``). The WebSocket itself is websockets' threaded ``Connection``: its sans-I/O protocol makes the
handshake from the head gunicorn already read, its reading thread answers pings and reassembles messages, and it
sends an answer's fragments from an iterator. ``bench/websocket_libs.py`` measured it against wsproto and
simple-websocket (bench/RESULTS.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from urllib.parse import parse_qsl

from flask import Response
from websockets.datastructures import Headers as HandshakeHeaders
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode, Frame, Opcode
from websockets.http11 import Request
from websockets.server import ServerProtocol
from websockets.sync.connection import Connection
from werkzeug.datastructures import Headers

from handler import request_log
from handler.endpoints.base import Call, Endpoint, FrontDoor, answers
from handler.endpoints.body import bounded
from handler.errors import BadRequest, NotFound
from handler.protocol.common import new_request_id

log = logging.getLogger(__name__)

DEFAULT_PATH = "/invocations-bidirectional-stream"
INVOCATION_PATH_HEADER = "X-Amzn-SageMaker-Model-Invocation-Path"
QUERY_STRING_HEADER = "X-Amzn-SageMaker-Model-Query-String"
POLL_S = 1.0           # how often an open connection looks at its deadlines and at the server stopping
IDLE_S = 75.0          # gunicorn's keep-alive here; SageMaker pings every 60 s, so its connections never idle out
CLOSE_WAIT_S = 2.0     # how long a close from here waits for the client's close frame
# frames read ahead while a request is answered (websockets' default); past it, reading waits for the answer, pings
# and a close included. Each frame is at most the body limit.
MAX_QUEUED_FRAMES = 16

Route = Callable[[Call], Response]


class BidirectionalStream(Endpoint):
    """``routes``: the paths a WebSocket may be opened on (besides ``DEFAULT_PATH``, which takes ``/invocations``'s
    bodies) -> the route function that answers each of its messages."""

    schema = "websocket"

    def __init__(self, door: FrontDoor, routes: Mapping[str, Route]) -> None:
        super().__init__(door)
        self.routes = {DEFAULT_PATH: routes["/invocations"], **routes}

    @property
    def paths(self) -> list[str]:
        return list(self.routes)

    @answers
    def connect(self, call: Call) -> Response:
        """The upgrade: refused with a JSON error before the socket is taken, then served until it closes."""
        path, route = self._route(call)
        if call.socket is None or call.take_socket is None:
            raise BadRequest("a WebSocket needs the server's own connection (gunicorn), not a test client")
        protocol = ServerProtocol(max_size=self.door.service.settings.max_request_size)
        protocol.receive_data(Request(path, HandshakeHeaders(list(call.headers.items()))).serialize())
        [request] = protocol.events_received()  # the head gunicorn read, parsed again by the protocol
        response = protocol.accept(request)
        if response.status_code != 101:
            error = BadRequest(f"not a WebSocket upgrade: {protocol.handshake_exc}", code="bad_handshake")
            error.status_code = response.status_code
            raise error
        sock = call.take_socket()
        protocol.send_response(response)
        sock.sendall(b"".join(protocol.data_to_send()))
        session = Session(self, call.record.route, route, message_headers(call.headers, call.query))
        session.run(sock, protocol)
        return Response(status=101)  # never sent: the socket is no longer gunicorn's

    def _route(self, call: Call) -> tuple[str, Route]:
        named = call.headers.get(INVOCATION_PATH_HEADER)
        path = "/" + named.strip().strip("/") if named else call.record.route
        route = self.routes.get(path)
        if route is None:
            raise NotFound(f"{INVOCATION_PATH_HEADER} {named!r}: WebSocket messages are taken on "
                           f"{', '.join(self.routes)}", param=INVOCATION_PATH_HEADER, code="not_found")
        return path, route


def message_headers(headers: Mapping[str, str], query: Mapping[str, str]) -> Headers:
    """The headers each message's request is read with: the upgrade's, then each ``X-Amzn-SageMaker-*`` or
    ``extra-parameters`` parameter of the query string (the URL's, then the Model-Query-String header's) as the
    header of its name; a JSON body unless they say otherwise."""
    out = Headers([(name, value) for name, value in headers.items()
                   if not name.lower().startswith("sec-websocket-") and name.lower() not in ("connection", "upgrade")])
    parameters = [*query.items(), *parse_qsl(headers.get(QUERY_STRING_HEADER, ""))]
    for name, value in parameters:
        if name.lower().startswith("x-amzn-sagemaker-") or name.lower() == "extra-parameters":
            out[name] = value
        else:
            log.debug("query parameter %r ignored: not a header a request reads", name)
    out.setdefault("Content-Type", "application/json")
    return out


class WatchedConnection(Connection):
    """websockets' threaded connection, telling when its reading ends (the client closed, or the connection dropped:
    ``on_closed``, on its reading thread), when its last frame came and since when a message has been arriving."""

    def __init__(self, sock, protocol: ServerProtocol, on_closed: Callable[[], None]) -> None:
        self.on_closed = on_closed
        self.last_frame_at = time.monotonic()
        self.message_started_at: float | None = None
        super().__init__(sock, protocol, ping_interval=None, close_timeout=CLOSE_WAIT_S,
                         max_queue=MAX_QUEUED_FRAMES)  # starts the reading thread: attributes first

    def process_event(self, event) -> None:
        now = time.monotonic()
        self.last_frame_at = now
        if isinstance(event, Frame) and event.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
            self.message_started_at = None if event.fin else (self.message_started_at or now)
        super().process_event(event)

    def recv_events(self) -> None:
        try:
            super().recv_events()
        finally:
            self.on_closed()


class Session:
    """One WebSocket: its messages read one after another, each answered through ``route`` as a request of its own
    (its own log line, route ``path``); the client's leaving cancels the request being answered."""

    def __init__(self, endpoint: BidirectionalStream, path: str, route: Route, headers: Headers) -> None:
        self.endpoint, self.path, self.route, self.headers = endpoint, path, route, headers
        self._lock = threading.Lock()
        self._cancels: list[Callable[[], None]] = []
        self._closed = False
        self._answered_at = time.monotonic()

    def run(self, sock, protocol: ServerProtocol) -> None:
        conn = WatchedConnection(sock, protocol, self._client_gone)
        try:
            while True:
                try:
                    message = conn.recv(timeout=POLL_S)
                except TimeoutError:
                    reason = self._why_close(conn)
                    if reason is not None:
                        conn.close(*reason)
                        return
                    continue
                self._answer(conn, message)
                if self.endpoint.door.is_draining():  # the answer said so (503); nothing more is taken here
                    conn.close(CloseCode.GOING_AWAY, "the server is stopping")
                    return
        except ConnectionClosed:
            return
        except Exception:  # the socket is ours: nothing may reach gunicorn's error path
            log.exception("a WebSocket failed; it is closed")
            conn.close(CloseCode.INTERNAL_ERROR, "internal error; see the server log")

    def _why_close(self, conn: WatchedConnection) -> tuple[int, str] | None:
        now = time.monotonic()
        read_timeout = self.endpoint.service.settings.request_read_timeout
        if conn.message_started_at is not None and now - conn.message_started_at > read_timeout:
            return (CloseCode.POLICY_VIOLATION,
                    f"the message was not received within {read_timeout:g} s (option.request_read_timeout)")
        if self.endpoint.door.is_draining():
            return CloseCode.GOING_AWAY, "the server is stopping"
        if now - max(conn.last_frame_at, self._answered_at) > IDLE_S:
            return CloseCode.NORMAL_CLOSURE, f"idle for {IDLE_S:g} s"
        return None

    def _answer(self, conn: WatchedConnection, message: str | bytes) -> None:
        body = message.encode() if isinstance(message, str) else message
        record = request_log.start(new_request_id("req"), self.path)
        limit = self.endpoint.door.service.settings.max_request_size
        call = Call(self.headers, lambda: bounded(body, limit), record, on_client_gone=self._on_client_gone)
        status = 500
        try:
            response = self.route(call)  # route functions answer their own errors, in their API's shape
            status = response.status_code
            try:
                send_answer(conn, response)
            finally:
                response.close()
        finally:
            with self._lock:
                self._cancels.clear()
            self._answered_at = time.monotonic()
            request_log.finish(record, status)

    def _on_client_gone(self, cancel: Callable[[], None]) -> None:
        """``Call.on_client_gone``: ``cancel`` runs when the client leaves while its request is answered."""
        with self._lock:
            if not self._closed:
                self._cancels.append(cancel)
                return
        cancel()

    def _client_gone(self) -> None:
        with self._lock:
            self._closed = True
            cancels, self._cancels = self._cancels, []
        for cancel in cancels:
            try:
                cancel()
            except Exception:  # a cancel must never stop the connection's reading thread from ending
                log.exception("cancelling a WebSocket's request failed")


def send_answer(conn: Connection, response: Response) -> None:
    """A route's response as one message: a stream's chunks as fragments, ended by an empty final fragment; a whole
    body as one frame. Text frames: every answer here is UTF-8 (JSON, JSON lines, server-sent events)."""
    if not response.is_streamed:
        conn.send(response.get_data(), text=True)
        return
    sent = [0]
    conn.send(_counted(response.response, sent), text=True)
    if sent[0] == 0:  # a stream that made no chunk still ends its answer
        conn.send(b"", text=True)


def _counted(chunks: Iterable[bytes | str], sent: list[int]) -> Iterator[bytes]:
    for chunk in chunks:
        if chunk:
            sent[0] += 1
            yield chunk.encode() if isinstance(chunk, str) else chunk
