"""The local SageMaker runtime, driven by the UNMODIFIED boto3 ``sagemaker-runtime`` client.

A fake container (stdlib HTTP server on loopback) stands in for the model server; the local runtime runs
in a thread (and once as ``python -m devtools.local_runtime``) in front of it. Only 127.0.0.1 is used.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest
import requests
from botocore.config import Config
from botocore.exceptions import EventStreamError

_REPO_ROOT = str(Path(__file__).resolve().parents[2])

from devtools.local_runtime import RuntimeConfig, make_server  # noqa: E402

STREAM_LINES = [
    json.dumps({"token": {"id": i, "text": text, "special": False}})
    for i, text in enumerate(["Hel", "lo", ",", " wor", "ld", "!"])
] + [json.dumps({"generated_text": "Hello, world!", "details": None})]
STREAM_BYTES = b"".join(line.encode() + b"\n" for line in STREAM_LINES)
CHUNK_SIZES = (5, 13, 3, 21, 8, 34)  # odd sizes, unrelated to line ends
BREAK_AFTER = 40  # bytes sent before the "break" mode drops the connection
CONTAINER_ERROR = "Input payload must contain an 'inputs' key"
NEW_SESSION_ID = "0b9e4c2a-5f0e-4b7a-9c1d-2e3f4a5b6c7d"
SESSION_ANSWERS = {
    "NEW_SESSION": lambda _sent: {"X-Amzn-SageMaker-New-Session-Id": f"{NEW_SESSION_ID}; Expires=2030-01-31T12:00:00Z"},
    "CLOSE": lambda sent: {"X-Amzn-SageMaker-Closed-Session-Id": sent},
}


def odd_chunks(data: bytes) -> Iterator[bytes]:
    """``data`` cut into the cycling CHUNK_SIZES."""
    start, index = 0, 0
    while start < len(data):
        size = CHUNK_SIZES[index % len(CHUNK_SIZES)]
        yield data[start : start + size]
        start, index = start + size, index + 1


class FakeContainerServer(ThreadingHTTPServer):
    """Records what it was sent; ``gate`` lets a test hold a stream half-way."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FakeContainerHandler)
        self.seen: list[dict] = []
        self.gate = threading.Event()
        self.gate_results: list[bool] = []


class FakeContainerHandler(BaseHTTPRequestHandler):
    """Mimics the model container: ``/ping``, JSON ``/invocations``, JSON-lines streams, failures."""

    protocol_version = "HTTP/1.1"
    server: FakeContainerServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:  # noqa: N802
        self._json(200 if self.path == "/ping" else 404, {})

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.seen.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}})
        session = SESSION_ANSWERS.get(json.loads(body).get("requestType") if body.startswith(b"{") else None)
        if session is not None:  # a stateful session's NEW_SESSION or CLOSE, answered as the real server does
            self._json(200, {}, session(self.headers.get("X-Amzn-SageMaker-Session-Id", "")))
            return
        try:
            request = json.loads(body)
            inputs = request["inputs"]
        except (ValueError, KeyError, TypeError):
            self._json(400, {"error": CONTAINER_ERROR})
            return
        mode = request.get("mode")
        if mode == "fail500":
            self._json(500, {"error": "engine crashed " + "x" * 3000})
        elif mode == "sleep":
            time.sleep(request["seconds"])
            self._json(200, {"generated_text": "late"})
        elif mode == "hangup":  # close the socket without any answer
            self.close_connection = True
        elif mode in ("stream", "gated", "break"):
            self._stream(mode)
        else:
            attributes = "echo=" + self.headers.get("X-Amzn-SageMaker-Custom-Attributes", "")
            self._json(200, {"generated_text": f"echo: {inputs}"}, {"X-Amzn-SageMaker-Custom-Attributes": attributes})

    def _json(self, status: int, payload: dict, extra: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        headers = {"Content-Type": "application/json", "Content-Length": str(len(data)), **(extra or {})}
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, mode: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/jsonlines")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if mode == "gated":  # first line, then wait for the test to have received it through boto3
            self._chunk(STREAM_BYTES[: STREAM_BYTES.index(b"\n") + 1])
            self.server.gate_results.append(self.server.gate.wait(timeout=5))
            rest = STREAM_BYTES[STREAM_BYTES.index(b"\n") + 1 :]
        else:
            rest = STREAM_BYTES[:BREAK_AFTER] if mode == "break" else STREAM_BYTES
        for piece in odd_chunks(rest):
            self._chunk(piece)
            time.sleep(0.01)
        if mode == "break":  # no terminating chunk: the connection just closes
            self.close_connection = True
            return
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))


def _serve(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return thread


def _url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def container() -> Iterator[FakeContainerServer]:
    server = FakeContainerServer()
    _serve(server)
    yield server
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def _runtime(config: RuntimeConfig) -> Iterator[str]:
    """A local runtime on a free loopback port, served from a thread."""
    server = make_server(config, "127.0.0.1", 0)
    _serve(server)
    try:
        yield _url(server)
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def runtime_url(container: FakeContainerServer) -> Iterator[str]:
    """The runtime as CI runs it for stream tests: PayloadParts cut to 7 bytes."""
    with _runtime(RuntimeConfig(container_url=_url(container), max_part_bytes=7, invocation_timeout=10)) as url:
        yield url


def _client(url: str, **config: object):  # noqa: ANN202 (boto3 clients are generated classes)
    return boto3.client(
        "sagemaker-runtime",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
        config=Config(proxies={}, **config),
    )


@pytest.fixture(scope="module")
def client(runtime_url: str):  # noqa: ANN201
    return _client(runtime_url)


def _lines_and_parts(event_stream) -> tuple[list[bytes], list[bytes]]:  # noqa: ANN001
    """What a user does: concatenate PayloadPart bytes and split on newlines."""
    parts, lines, buffer = [], [], b""
    for event in event_stream:
        parts.append(event["PayloadPart"]["Bytes"])
        buffer += parts[-1]
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            lines.append(line)
    assert buffer == b"", "stream ended in the middle of a line"
    return lines, parts


def test_invoke_endpoint_returns_the_container_body_and_forwards_headers(client, container) -> None:
    response = client.invoke_endpoint(
        EndpointName="local",
        ContentType="application/json",
        Accept="application/json",
        Body=json.dumps({"inputs": "hi"}),
        CustomAttributes="a=b",
        TargetModel="model-a.tar.gz",
        InferenceId="req-123",
    )
    assert json.loads(response["Body"].read()) == {"generated_text": "echo: hi"}
    assert response["ContentType"] == "application/json"
    assert response["InvokedProductionVariant"] == "AllTraffic"
    assert response["CustomAttributes"] == "echo=a=b"
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 200
    seen = container.seen[-1]
    assert seen["path"] == "/invocations"
    assert seen["headers"]["content-type"] == "application/json"
    assert seen["headers"]["accept"] == "application/json"
    assert seen["headers"]["x-amzn-sagemaker-custom-attributes"] == "a=b"
    assert seen["headers"]["x-amzn-sagemaker-target-model"] == "model-a.tar.gz"
    assert seen["headers"]["x-amzn-sagemaker-inference-id"] == "req-123"
    assert "authorization" not in seen["headers"]


def test_target_variant_is_reported_as_the_invoked_variant(client) -> None:
    response = client.invoke_endpoint(
        EndpointName="any-name", ContentType="application/json", Body=b'{"inputs": 1}', TargetVariant="blue"
    )
    assert response["InvokedProductionVariant"] == "blue"


def test_container_400_is_a_model_error(client, container) -> None:
    before = len(container.seen)
    with pytest.raises(client.exceptions.ModelError) as caught:
        client.invoke_endpoint(EndpointName="local", ContentType="application/json", Body=b'{"prompt": "no inputs"}')
    error = caught.value.response
    assert error["Error"]["Code"] == "ModelError"
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 424
    assert error["OriginalStatusCode"] == 400
    assert CONTAINER_ERROR in error["OriginalMessage"]
    assert json.loads(error["OriginalMessage"]) == {"error": CONTAINER_ERROR}
    assert error["Error"]["Message"].startswith("Received client error (400) from primary with message")
    assert "/aws/sagemaker/Endpoints/local" in error["LogStreamArn"]
    assert len(container.seen) == before + 1, "a ModelError must not be retried"


def test_container_500_is_a_model_error_with_truncated_original_message(client) -> None:
    with pytest.raises(client.exceptions.ModelError) as caught:
        client.invoke_endpoint(
            EndpointName="local", ContentType="application/json", Body=b'{"inputs": 1, "mode": "fail500"}'
        )
    error = caught.value.response
    assert error["OriginalStatusCode"] == 500
    assert error["OriginalMessage"].startswith('{"error": "engine crashed')
    assert len(error["OriginalMessage"]) == 2048
    assert len(error["Error"]["Message"]) <= 2048
    assert error["Error"]["Message"].startswith("Received server error (500)")


def test_stream_reassembles_lines_from_parts_that_cut_lines(client, container) -> None:
    response = client.invoke_endpoint_with_response_stream(
        EndpointName="local",
        ContentType="application/json",
        Accept="application/jsonlines",
        CustomAttributes="c=d",
        Body=json.dumps({"inputs": "hi", "mode": "stream"}),
    )
    assert response["ContentType"] == "application/jsonlines"
    assert response["InvokedProductionVariant"] == "AllTraffic"
    lines, parts = _lines_and_parts(response["Body"])
    assert [json.loads(line) for line in lines] == [json.loads(line) for line in STREAM_LINES]
    assert b"".join(parts) == STREAM_BYTES
    assert max(len(part) for part in parts) <= 7
    assert any(not part.endswith(b"\n") for part in parts), "part boundaries must not follow lines"
    seen = container.seen[-1]["headers"]
    assert seen["accept"] == "application/jsonlines"
    assert seen["content-type"] == "application/json"
    assert seen["x-amzn-sagemaker-custom-attributes"] == "c=d"


def test_stream_is_relayed_while_the_container_is_still_sending(client, container) -> None:
    container.gate.clear()
    response = client.invoke_endpoint_with_response_stream(
        EndpointName="local", ContentType="application/json", Body=b'{"inputs": 1, "mode": "gated"}'
    )
    events = iter(response["Body"])
    first = next(events)["PayloadPart"]["Bytes"]  # arrives while the container waits on the gate
    container.gate.set()
    rest = b"".join(event["PayloadPart"]["Bytes"] for event in events)
    assert container.gate_results[-1] is True, "the first part only arrived after the container finished"
    assert STREAM_BYTES.startswith(first) and first + rest == STREAM_BYTES


def test_stream_container_400_is_a_model_error_before_any_event(client) -> None:
    with pytest.raises(client.exceptions.ModelError) as caught:
        client.invoke_endpoint_with_response_stream(
            EndpointName="local", ContentType="application/json", Body=b"not json"
        )
    assert caught.value.response["OriginalStatusCode"] == 400
    assert CONTAINER_ERROR in caught.value.response["OriginalMessage"]


def test_stream_broken_mid_way_raises_model_stream_error(client) -> None:
    response = client.invoke_endpoint_with_response_stream(
        EndpointName="local", ContentType="application/json", Body=b'{"inputs": 1, "mode": "break"}'
    )
    received = b""
    with pytest.raises(EventStreamError) as caught:
        for event in response["Body"]:
            received += event["PayloadPart"]["Bytes"]
    assert caught.value.response["Error"]["Code"] == "ModelStreamError"
    assert "broken" in caught.value.response["Error"]["Message"]
    assert received == STREAM_BYTES[:BREAK_AFTER]


def test_container_timeout_is_a_model_error_with_status_0(container) -> None:
    body = b'{"inputs": 1, "mode": "sleep", "seconds": 1.5}'
    with _runtime(RuntimeConfig(container_url=_url(container), invocation_timeout=0.3)) as url:
        client = _client(url)
        with pytest.raises(client.exceptions.ModelError) as caught:
            client.invoke_endpoint(EndpointName="local", ContentType="application/json", Body=body)
        assert caught.value.response["OriginalStatusCode"] == 0
        assert "timed out" in caught.value.response["OriginalMessage"]


def test_container_hanging_up_without_answer_is_a_model_error_with_status_0(client) -> None:
    with pytest.raises(client.exceptions.ModelError) as caught:
        client.invoke_endpoint(
            EndpointName="local", ContentType="application/json", Body=b'{"inputs": 1, "mode": "hangup"}'
        )
    assert caught.value.response["OriginalStatusCode"] == 0
    assert "closed the connection" in caught.value.response["OriginalMessage"]


def test_unreachable_container_is_service_unavailable() -> None:
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    with _runtime(RuntimeConfig(container_url=f"http://127.0.0.1:{closed_port}", connect_timeout=1)) as url:
        client = _client(url, retries={"mode": "standard", "max_attempts": 1})
        with pytest.raises(client.exceptions.ServiceUnavailable) as caught:
            client.invoke_endpoint(EndpointName="local", ContentType="application/json", Body=b'{"inputs": 1}')
        assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        assert "not reachable" in caught.value.response["Error"]["Message"]


def test_unknown_path_and_ping(runtime_url: str) -> None:
    with requests.Session() as session:
        session.trust_env = False  # loopback only, whatever proxy variables say
        response = session.post(f"{runtime_url}/nope", data=b"{}", timeout=5)
        ping = session.get(f"{runtime_url}/ping", timeout=5)
        chunked = session.post(  # a generator body goes out with Transfer-Encoding: chunked
            f"{runtime_url}/endpoints/x/invocations", data=iter([b'{"inp', b'uts": ', b'"chunked"}']), timeout=5
        )
    assert chunked.status_code == 200 and chunked.json() == {"generated_text": "echo: chunked"}
    assert response.status_code == 404
    assert response.headers["x-amzn-ErrorType"].startswith("UnknownOperationException:")
    assert ping.status_code == 200 and ping.json()["healthy"] is True


def test_command_line_runtime(container) -> None:
    command = [
        sys.executable, "-m", "devtools.local_runtime", "--container-url", _url(container),
        "--host", "127.0.0.1", "--port", "0", "--max-part-bytes", "3", "--log-level", "WARNING",
    ]  # fmt: skip
    with subprocess.Popen(command, cwd=_REPO_ROOT, stdout=subprocess.PIPE, text=True) as process:
        try:
            _check_command_line_runtime(process)
        finally:
            process.terminate()
            process.wait(timeout=10)


def _check_command_line_runtime(process: subprocess.Popen) -> None:
    banner = process.stdout.readline()
    assert "listening on http://127.0.0.1:" in banner, banner
    url = banner.split("listening on ")[1].split()[0]
    client = _client(url)
    answer = client.invoke_endpoint(EndpointName="cli", ContentType="application/json", Body=b'{"inputs": "x"}')
    assert json.loads(answer["Body"].read()) == {"generated_text": "echo: x"}
    stream = client.invoke_endpoint_with_response_stream(
        EndpointName="cli", ContentType="application/json", Body=b'{"inputs": 1, "mode": "stream"}'
    )
    lines, parts = _lines_and_parts(stream["Body"])
    assert lines == [line.encode() for line in STREAM_LINES] and max(map(len, parts)) <= 3


def test_a_stateful_session_opens_is_used_and_closes_through_boto3(client, container) -> None:
    """``SessionId`` reaches the container as its header (NEW_SESSION too), and the container's session headers
    come back as boto3's NewSessionId and ClosedSessionId."""
    opened = client.invoke_endpoint(EndpointName="local", ContentType="application/json", SessionId="NEW_SESSION",
                                    Body=json.dumps({"requestType": "NEW_SESSION"}))
    assert opened["NewSessionId"] == f"{NEW_SESSION_ID}; Expires=2030-01-31T12:00:00Z"
    assert container.seen[-1]["headers"]["x-amzn-sagemaker-session-id"] == "NEW_SESSION"
    client.invoke_endpoint(EndpointName="local", ContentType="application/json", SessionId=NEW_SESSION_ID,
                           Body=json.dumps({"inputs": "hi"}))
    assert container.seen[-1]["headers"]["x-amzn-sagemaker-session-id"] == NEW_SESSION_ID
    closed = client.invoke_endpoint(EndpointName="local", ContentType="application/json", SessionId=NEW_SESSION_ID,
                                    Body=json.dumps({"requestType": "CLOSE"}))
    assert closed["ClosedSessionId"] == NEW_SESSION_ID


@pytest.mark.parametrize("session_id", ["../etc", "a" * 257, "-leading-hyphen", "under_score"])
def test_a_session_id_outside_the_apis_pattern_is_a_validation_error(client, container, session_id: str) -> None:
    before = len(container.seen)
    with pytest.raises(client.exceptions.ClientError) as info:
        client.invoke_endpoint(EndpointName="local", ContentType="application/json", SessionId=session_id,
                               Body=json.dumps({"inputs": "hi"}))
    assert info.value.response["Error"]["Code"] == "ValidationError"
    assert len(container.seen) == before  # refused by the runtime, as by the service: the container never saw it


def test_a_session_cannot_be_opened_on_a_stream(client, container) -> None:
    with pytest.raises(client.exceptions.ClientError) as info:
        client.invoke_endpoint_with_response_stream(EndpointName="local", ContentType="application/json",
                                                    SessionId="NEW_SESSION", Body=json.dumps({"inputs": "hi"}))
    assert info.value.response["Error"]["Code"] == "ValidationError"
