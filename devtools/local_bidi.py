"""The local runtime's ``InvokeEndpointWithBidirectionalStream``: SageMaker's side of a bidirectional stream, for
testing a container and the client code that calls it before deploying.

``POST /endpoints/{EndpointName}/invocations-bidirectional-stream`` (the runtime's REST path, ``sagemaker-runtime-
http2``'s only operation) takes an ``application/vnd.amazon.eventstream`` request body of ``PayloadPart`` events
(``Bytes`` the event payload; ``DataType`` and ``CompletionState`` event headers) and answers with an event stream
of the same, both at once: the request body is read as it arrives (HTTP/1.1 chunked) while the answer is written.
Between them, a WebSocket to the container, mapped as SageMaker's developer guide says
("Container Contract to Support Bidirectional Streaming Capabilities"):

* the connection: ``ws://{container}/invocations-bidirectional-stream``; ``X-Amzn-SageMaker-Model-Invocation-Path``
  replaces the path and ``X-Amzn-SageMaker-Model-Query-String`` is appended as its query string;
* each request ``PayloadPart`` is one data frame, as it arrives: a text frame for ``DataType: UTF8``, else binary;
  ``CompletionState: PARTIAL`` parts are the FIN-clear fragments of one message, the next ``COMPLETE`` its last;
* each data frame of the container is one response ``PayloadPart``: ``DataType`` ``UTF8`` for text (a continuation
  takes its message's), ``CompletionState`` ``PARTIAL`` until the frame with FIN set, ``COMPLETE`` then;
* a close frame from the container ends the answer with a ``ModelStreamError`` event carrying its code and reason; a
  connection lost without one, with ``ErrorCode`` ``StreamBroken``; the end of the request body closes the WebSocket
  (1000) and the answer then ends without error;
* pings every 60 s (SageMaker's interval; the container must answer, and pings of its own are answered).

Before the answer starts, errors are the service's: the container refusing the WebSocket is a 424 ``ModelError``
with its status, a container not reachable a 503. Which clients can call it: boto3 cannot (botocore has no
``sagemaker-runtime-http2`` model and strips bidirectional operations); AWS's ``aws-sdk-sagemaker-runtime-http2``
(Python 3.12+) can, with ``endpoint_uri`` pointed here: its default transport is aiohttp's HTTP/1.1 client, which
sends the request body while it reads the answer. Not emulated: HTTP/2, SigV4 checking, the ``P`` padding header.
"""

from __future__ import annotations

import functools
import http.client
import logging
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import urlsplit

from botocore.eventstream import EventStreamBuffer
from websockets.exceptions import InvalidHandshake, InvalidStatus
from websockets.frames import Frame, Opcode
from websockets.sync.client import ClientConnection, connect

from devtools import eventstream

LOG = logging.getLogger("devtools.local_runtime")

DEFAULT_PATH = "invocations-bidirectional-stream"
INVOCATION_PATH_HEADER = "X-Amzn-SageMaker-Model-Invocation-Path"
QUERY_STRING_HEADER = "X-Amzn-SageMaker-Model-Query-String"
PING_INTERVAL_S = 60.0
PINGS_UNANSWERED = 5  # SageMaker closes the connection after this many unanswered pings
_DATA = (Opcode.TEXT, Opcode.BINARY, Opcode.CONT)


class FrameConnection(ClientConnection):
    """websockets' client connection that hands each data frame, as it came, to ``frames`` (None once the
    connection's reading ends) instead of reassembling messages: each becomes one response ``PayloadPart``."""

    def __init__(self, *args, frames: queue.SimpleQueue, **kwargs) -> None:
        self.frames = frames
        super().__init__(*args, **kwargs)

    def process_event(self, event) -> None:
        if isinstance(event, Frame) and event.opcode in _DATA:
            self.frames.put(event)
            return
        super().process_event(event)

    def recv_events(self) -> None:
        try:
            super().recv_events()
        finally:
            self.frames.put(None)


def container_url(base: str, headers) -> str:
    """The WebSocket URL SageMaker connects to for a request with ``headers``."""
    path = (headers.get(INVOCATION_PATH_HEADER) or DEFAULT_PATH).strip("/")
    query = headers.get(QUERY_STRING_HEADER)
    url = base.rstrip("/").replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/" + path
    return f"{url}?{query}" if query else url


def open_container(url: str, connect_timeout: float) -> tuple[FrameConnection, queue.SimpleQueue]:
    """The WebSocket to the container; ``InvalidStatus`` when it refuses, ``OSError`` or ``InvalidHandshake``
    when there is none."""
    frames: queue.SimpleQueue = queue.SimpleQueue()
    conn = connect(url, create_connection=functools.partial(FrameConnection, frames=frames),
                   open_timeout=connect_timeout, ping_interval=PING_INTERVAL_S,
                   ping_timeout=PING_INTERVAL_S * PINGS_UNANSWERED, max_size=None, compression=None)
    return conn, frames


def iter_chunked(rfile: BinaryIO) -> Iterator[bytes]:
    """A ``Transfer-Encoding: chunked`` body, chunk by chunk as it arrives (trailers skipped)."""
    while True:
        size = int(rfile.readline(1024).split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            break
        yield rfile.read(size)
        rfile.readline(1024)
    while rfile.readline(8192) not in (b"\r\n", b"\n", b""):
        pass


@dataclass
class _Sending:
    in_message: bool = False  # a PARTIAL part was sent: the next part continues its message


def forward_request(chunks: Iterator[bytes], conn: FrameConnection) -> None:
    """Each ``PayloadPart`` event of the request body, as it arrives, as one frame; the body's end closes the
    WebSocket."""
    events, sending = EventStreamBuffer(), _Sending()
    try:
        for chunk in chunks:
            events.add_data(chunk)
            for message in events:
                if message.headers.get(":event-type") == "PayloadPart":
                    send_part(conn, message.payload, message.headers, sending)
        conn.close()
    except Exception as error:  # the client's side broke: SageMaker closes the container's connection
        LOG.info("request stream ended: %s", error)
        conn.close(1001, "the client's request stream ended")


def send_part(conn: FrameConnection, data: bytes, headers: dict, sending: _Sending) -> None:
    fin = headers.get("CompletionState", "COMPLETE") != "PARTIAL"
    with conn.send_context():
        if sending.in_message:
            conn.protocol.send_continuation(data, fin=fin)
        elif headers.get("DataType") == "UTF8":
            conn.protocol.send_text(data, fin=fin)
        else:
            conn.protocol.send_binary(data, fin=fin)
    sending.in_message = not fin


def relay_answer(conn: FrameConnection, frames: queue.SimpleQueue, write: Callable[[bytes], None]) -> None:
    """Each data frame of the container as a ``PayloadPart`` event, as it arrives; how the WebSocket ended as the
    last event when the container ended it."""
    data_type = "UTF8"
    while (frame := frames.get()) is not None:
        if frame.opcode is not Opcode.CONT:
            data_type = "UTF8" if frame.opcode is Opcode.TEXT else "BINARY"
        write(eventstream.payload_part(frame.data, data_type, "COMPLETE" if frame.fin else "PARTIAL"))
    received, protocol = conn.protocol.close_rcvd, conn.protocol
    if received is not None and protocol.close_rcvd_then_sent:  # the container closed it
        write(eventstream.exception_event("ModelStreamError", received.reason, str(received.code)))
    elif received is None:
        write(eventstream.exception_event("ModelStreamError", "the container's connection was lost", "StreamBroken"))


def bridge(rfile: BinaryIO, conn: FrameConnection, frames: queue.SimpleQueue, write: Callable[[bytes], None]) -> None:
    """Both directions at once: the request body on a thread of its own, the answer on the caller's."""
    reader = threading.Thread(target=forward_request, args=(iter_chunked(rfile), conn), daemon=True,
                              name="bidi-request")
    reader.start()
    relay_answer(conn, frames, write)
    reader.join(1.0)


# ---- a client, on the wire -------------------------------------------------------------------------------------
class BidirectionalCall:
    """A client of the local runtime's ``InvokeEndpointWithBidirectionalStream``, on the wire as AWS's SDK sends it
    over HTTP/1.1 (for tests, and to try a container without that SDK): an event-stream request body sent part by
    part while the event-stream answer is read."""

    def __init__(self, runtime_url: str, headers: dict[str, str] | None = None) -> None:
        address = urlsplit(runtime_url)
        self.sock = socket.create_connection((address.hostname, address.port), timeout=120)
        lines = ["POST /endpoints/my-endpoint/invocations-bidirectional-stream HTTP/1.1", f"Host: {address.netloc}",
                 "Content-Type: application/vnd.amazon.eventstream", "Transfer-Encoding: chunked",
                 *(f"{name}: {value}" for name, value in (headers or {}).items())]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        self.response: http.client.HTTPResponse | None = None
        self.events = EventStreamBuffer()

    def send(self, data: bytes, completion_state: str = "COMPLETE", data_type: str = "UTF8") -> None:
        event = eventstream.encode_message({":event-type": "PayloadPart", ":message-type": "event",
                                            "DataType": data_type, "CompletionState": completion_state}, data)
        self.sock.sendall(b"%x\r\n%s\r\n" % (len(event), event))

    def end(self) -> None:
        self.sock.sendall(b"0\r\n\r\n")

    def status(self) -> int:
        if self.response is None:
            self.response = http.client.HTTPResponse(self.sock)
            self.response.begin()
        return self.response.status

    def answer(self) -> list:
        """The events (botocore's ``EventStreamMessage``) up to a COMPLETE part, or to the stream's end."""
        if self.status() != 200:
            raise RuntimeError(f"the runtime answered {self.status()}")
        found = []
        while True:
            for message in self.events:
                found.append(message)
                if message.headers.get("CompletionState") == "COMPLETE":
                    return found
            data = self.response.read1(65536)
            if not data:
                return found
            self.events.add_data(data)


__all__ = ["BidirectionalCall", "InvalidHandshake", "InvalidStatus", "bridge", "container_url", "open_container"]
