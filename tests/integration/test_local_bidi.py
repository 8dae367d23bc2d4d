"""The local runtime's bidirectional stream against a stand-in container (websockets' own server on loopback): the
mapping of PayloadParts to frames and back, as SageMaker's developer guide states it, frame by frame."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from websockets.frames import Opcode
from websockets.sync.server import ServerConnection, serve

from devtools.local_bidi import BidirectionalCall
from devtools.local_runtime import RuntimeConfig, make_server


class Container:
    """Records each data frame it gets (opcode, bytes, FIN) and the path it was opened on; answers each message
    ``m`` with the frames ``m`` asks for: ``"close"`` closes with 1011, anything else comes back as a text message
    of two fragments and a binary frame."""

    def __init__(self) -> None:
        self.frames: list[tuple[Opcode, bytes, bool]] = []
        self.paths: list[str] = []

    def handle(self, ws: ServerConnection) -> None:
        self.paths.append(ws.request.path)
        for message in ws:
            if message == "close":
                ws.close(1011, "the model failed")
                return
            ws.send(iter([f"{message}-1", f"{message}-2"]))
            ws.send(b"\x00\x01")


@pytest.fixture()
def runtime() -> Iterator[tuple[str, Container]]:
    container = Container()
    recorded = container.frames

    class Recording(ServerConnection):
        def process_event(self, event) -> None:
            if getattr(event, "opcode", None) in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
                recorded.append((event.opcode, event.data, event.fin))
            super().process_event(event)

    with serve(container.handle, "127.0.0.1", 0, create_connection=Recording, compression=None) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.socket.getsockname()[1]
        runtime = make_server(RuntimeConfig(container_url=f"http://127.0.0.1:{port}"), "127.0.0.1", 0)
        threading.Thread(target=runtime.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{runtime.server_address[1]}", container
        finally:
            runtime.shutdown()
            runtime.server_close()
            server.shutdown()


def parts(events) -> list[tuple[bytes, str, str]]:
    return [(e.payload, e.headers["DataType"], e.headers["CompletionState"]) for e in events]


def test_parts_become_frames_and_frames_parts(runtime) -> None:
    url, container = runtime
    call = BidirectionalCall(url, {"X-Amzn-SageMaker-Model-Query-String": "a=1&b=2"})
    call.send(b"he", "PARTIAL")
    call.send(b"llo")  # COMPLETE: the message's last fragment, FIN set
    text = call.answer()
    binary = call.answer()
    call.send(b"\x07", data_type="BINARY")
    call.answer(), call.answer()
    call.end()
    assert call.answer() == []  # the client ended: the WebSocket closes with no error event
    assert container.paths == ["/invocations-bidirectional-stream?a=1&b=2"]
    assert container.frames == [(Opcode.TEXT, b"he", False), (Opcode.CONT, b"llo", True),
                                (Opcode.BINARY, b"\x07", True)]
    assert parts(text) == [(b"hello-1", "UTF8", "PARTIAL"), (b"hello-2", "UTF8", "PARTIAL"), (b"", "UTF8", "COMPLETE")]
    assert parts(binary) == [(b"\x00\x01", "BINARY", "COMPLETE")]


def test_the_containers_close_is_a_model_stream_error_and_the_path_moves(runtime) -> None:
    url, container = runtime
    call = BidirectionalCall(url, {"X-Amzn-SageMaker-Model-Invocation-Path": "v1/chat/completions"})
    call.send(b"close")
    [error] = call.answer()
    assert container.paths == ["/v1/chat/completions"]
    assert error.headers[":exception-type"] == "ModelStreamError"
    assert error.payload == b'{"Message": "the model failed", "ErrorCode": "1011"}'
