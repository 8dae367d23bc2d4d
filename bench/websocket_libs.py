"""Which WebSocket library serves ``/invocations-bidirectional-stream``: three candidates driven the way the worker
drives them (a thread owns a socket whose HTTP upgrade request was already read), measured with one client.

    python -m bench.websocket_libs [--libs websockets,wsproto,simple-websocket] [--frames 20000]

wsproto and simple-websocket are not requirements of the server: install them beside it to run their rows
(``pip install --target /tmp/wslibs wsproto==1.3.2 simple-websocket==1.1.0`` and ``PYTHONPATH=/tmp/wslibs``).

Per library: the accept latency (TCP connect to the 101 read by the client, 200 connections one after another),
the rate of server-to-client text frames (one answer's records: ``--frames`` frames of 120 bytes) and of
request/answer round trips on one connection (2,000 messages of 200 bytes echoed).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

from websockets.sync.client import connect

RECORD = "x" * 119 + "\n"


def read_head(sock: socket.socket) -> tuple[str, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("closed before the head")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return lines[0].split(" ")[1], headers, head + b"\r\n\r\n"


# ---- the three servers: each answers "stream N" with N frames, and echoes anything else ------------------------
def serve_websockets(sock: socket.socket, path: str, headers: dict[str, str], raw: bytes) -> None:
    from websockets.datastructures import Headers
    from websockets.http11 import Request
    from websockets.server import ServerProtocol
    from websockets.sync.connection import Connection

    protocol = ServerProtocol()
    protocol.receive_data(Request(path, Headers(headers)).serialize())  # the head the server already read
    [request] = protocol.events_received()
    protocol.send_response(protocol.accept(request))
    sock.sendall(b"".join(protocol.data_to_send()))
    conn = Connection(sock, protocol, ping_interval=None)
    try:
        for message in conn:
            if message.startswith("stream "):
                for _ in range(int(message.split()[1])):
                    conn.send(RECORD)
            else:
                conn.send(message)
    except Exception:
        pass


def _wsproto_answer(sock: socket.socket, ws, message: str) -> None:
    from wsproto.events import TextMessage

    if message.startswith("stream "):
        for _ in range(int(message.split()[1])):
            sock.sendall(ws.send(TextMessage(RECORD)))
    else:
        sock.sendall(ws.send(TextMessage(message)))


def serve_wsproto(sock: socket.socket, path: str, headers: dict[str, str], raw: bytes) -> None:
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, CloseConnection, Ping, Request, TextMessage

    ws = WSConnection(ConnectionType.SERVER)
    ws.receive_data(raw)
    parts: list[str] = []
    while True:
        for event in ws.events():
            if isinstance(event, Request):
                sock.sendall(ws.send(AcceptConnection()))
            elif isinstance(event, (Ping, CloseConnection)):
                sock.sendall(ws.send(event.response()))
                if isinstance(event, CloseConnection):
                    sock.close()
                    return
            elif isinstance(event, TextMessage):
                parts.append(event.data)
                if event.message_finished:
                    _wsproto_answer(sock, ws, "".join(parts))
                    parts = []
        data = sock.recv(65536)
        if not data:
            return
        ws.receive_data(data)


def serve_simple_websocket(sock: socket.socket, path: str, headers: dict[str, str], raw: bytes) -> None:
    from simple_websocket import ConnectionClosed, Server

    environ = {"gunicorn.socket": sock, **{"HTTP_" + k.upper().replace("-", "_"): v for k, v in headers.items()}}
    ws = Server(environ, receive_bytes=65536)
    try:
        while True:
            message = ws.receive()
            if message.startswith("stream "):
                for _ in range(int(message.split()[1])):
                    ws.send(RECORD)
            else:
                ws.send(message)
    except ConnectionClosed:
        pass


SERVERS = {"websockets": serve_websockets, "wsproto": serve_wsproto, "simple-websocket": serve_simple_websocket}


def start_server(serve) -> int:
    listener = socket.create_server(("127.0.0.1", 0))

    def session(sock: socket.socket) -> None:
        path, headers, raw = read_head(sock)
        serve(sock, path, headers, raw)

    def accept_loop() -> None:
        while True:
            sock, _ = listener.accept()
            threading.Thread(target=session, args=(sock,), daemon=True).start()

    threading.Thread(target=accept_loop, daemon=True).start()
    return listener.getsockname()[1]


def measure(name: str, num_frames: int) -> dict[str, float]:
    url = f"ws://127.0.0.1:{start_server(SERVERS[name])}/invocations-bidirectional-stream"
    accepts = []
    for _ in range(200):
        start = time.perf_counter()
        with connect(url) as ws:
            accepts.append(time.perf_counter() - start)
    with connect(url, max_size=None) as ws:
        start = time.perf_counter()
        ws.send(f"stream {num_frames}")
        for _ in range(num_frames):
            ws.recv()
        out_rate = num_frames / (time.perf_counter() - start)
        message = "y" * 200
        start = time.perf_counter()
        for _ in range(2000):
            ws.send(message)
            ws.recv()
        echo_rate = 2000 / (time.perf_counter() - start)
    accepts.sort()
    return {"accept_p50_ms": statistics.median(accepts) * 1e3, "accept_p99_ms": accepts[197] * 1e3,
            "frames_per_s": out_rate, "round_trips_per_s": echo_rate}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--libs", default=",".join(SERVERS))
    parser.add_argument("--frames", type=int, default=20000)
    args = parser.parse_args()
    for name in args.libs.split(","):
        result = measure(name, args.frames)
        print(f"{name:17s} " + "  ".join(f"{k} {v:,.2f}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
