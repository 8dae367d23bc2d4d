"""A local stand-in for the SageMaker runtime service, for local testing and CI only.

It lets the UNMODIFIED boto3 ``sagemaker-runtime`` client talk to a container running on this machine::

    python -m devtools.local_runtime --container-url http://127.0.0.1:8080 --host 127.0.0.1 --port 8081

    client = boto3.client("sagemaker-runtime", endpoint_url="http://127.0.0.1:8081", region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")

It implements the two operations of botocore's ``sagemaker-runtime`` service model (rest-json protocol), and the
bidirectional stream boto3 cannot call (``local_bidi``):

* ``InvokeEndpoint`` -- ``POST /endpoints/{EndpointName}/invocations``, forwarded to ``{container}/invocations``.
* ``InvokeEndpointWithResponseStream`` -- ``POST /endpoints/{EndpointName}/invocations-response-stream``,
  forwarded to ``{container}/invocations`` and relayed as ``application/vnd.amazon.eventstream``: every read
  from the container socket becomes one ``PayloadPart`` event (optionally cut to ``--max-part-bytes``), so
  part boundaries do not follow JSON lines -- as with the real service.
* ``InvokeEndpointWithBidirectionalStream`` -- ``POST /endpoints/{EndpointName}/invocations-bidirectional-stream``,
  a WebSocket to the container's ``/invocations-bidirectional-stream``, its frames and the request's and answer's
  ``PayloadPart`` events mapped as SageMaker maps them (``devtools.local_bidi``).

Error mapping (what a boto3 user sees):

* container answers non-2xx                  -> 424 ``ModelError`` (``OriginalStatusCode``, ``OriginalMessage``,
  ``LogStreamArn``), for both operations, before any stream starts;
* container does not answer in time          -> 424 ``ModelError`` with ``OriginalStatusCode`` 0 (as SageMaker
  reports "Your invocation timed out while waiting for a response from container primary.");
* container closes the socket without answer -> 424 ``ModelError`` with ``OriginalStatusCode`` 0;
* container not reachable (refused, no route, connect timeout) -> 503 ``ServiceUnavailable``, which botocore
  retries by itself (useful while the container is still starting) before raising
  ``client.exceptions.ServiceUnavailable``;
* stream breaks / stalls after it started    -> a ``ModelStreamError`` exception event (``ErrorCode``
  ``StreamBroken`` / ``ModelInvocationTimeExceeded``); botocore raises ``EventStreamError`` while iterating;
* unknown path                               -> 404 ``UnknownOperationException``;
* malformed request framing                  -> 400 ``ValidationError``; any other failure calling the container
  -> 500 ``InternalFailure``.

``--invocation-timeout`` (default 60 s, SageMaker's real-time limit) bounds each wait for container data: the
first byte of the answer and, for streams, every gap between reads.

Adapters (inference components): ``InferenceComponentName`` naming one of ``--adapter-component`` reaches the
container as ``X-Amzn-SageMaker-Adapter-Identifier`` (SageMaker routes an adapter component's invocations to its
base component's container with the adapter named in that header); any other component name stays routing-only.

Stateful sessions: ``SessionId`` reaches the container as ``X-Amzn-SageMaker-Session-Id`` (``NEW_SESSION`` too, as
boto3 sends it), and the container's ``X-Amzn-SageMaker-New-Session-Id`` / ``-Closed-Session-Id`` come back as
``NewSessionId`` / ``ClosedSessionId``. As the service does, a ``SessionId`` that is not ``NEW_SESSION`` or an id of
the API's pattern (letters, digits and inner hyphens, at most 256 characters) is a 400 ``ValidationError``, and so
is ``NEW_SESSION`` on ``InvokeEndpointWithResponseStream`` (a session is opened with ``InvokeEndpoint`` only); a
NEW_SESSION answer without a ``NewSessionId`` of the API's form (``<id>; Expires=<ISO-8601>``) is logged as a
warning, since SageMaker would have no session to route to. One container: the routing itself is not emulated.

Not emulated: SigV4 checking (any credentials pass), endpoint names (any name is accepted; the invoked
variant is ``AllTraffic`` unless ``TargetVariant`` is given), the 6 MB payload limit, multi-model routing.
``GET /ping`` is an extra, not a SageMaker operation: it reports whether the container's ``/ping`` is 200.
It uses only the standard library's HTTP server plus ``requests``; it is not meant for production traffic.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import re
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import BinaryIO

import requests
import urllib3

from devtools import eventstream, local_bidi

LOG = logging.getLogger("devtools.local_runtime")

_ROUTE = re.compile(r"^/endpoints/(?P<name>[^/]+)/"
                    r"(?P<op>invocations|invocations-response-stream|invocations-bidirectional-stream)$")
_MAX_MESSAGE_CHARS = 2048  # the service model's ``Message`` shape has max 2048
_READ_SIZE = 64 * 1024
_CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
_SESSION_ID = "X-Amzn-SageMaker-Session-Id"
_NEW_SESSION_ID = "X-Amzn-SageMaker-New-Session-Id"

# (header the client sends, header the container receives). Routing-only headers (Target-Variant,
# Target-Container-Hostname, Inference-Component, Enable-Explanations, Prefix-Aware-Id) stay here.
_INVOKE_REQUEST_HEADERS = (
    ("Content-Type", "Content-Type"),
    ("Accept", "Accept"),
    (_CUSTOM_ATTRIBUTES, _CUSTOM_ATTRIBUTES),
    ("X-Amzn-SageMaker-Target-Model", "X-Amzn-SageMaker-Target-Model"),
    ("X-Amzn-SageMaker-Inference-Id", "X-Amzn-SageMaker-Inference-Id"),
    (_SESSION_ID, _SESSION_ID),
)
_STREAM_REQUEST_HEADERS = (
    ("Content-Type", "Content-Type"),
    ("X-Amzn-SageMaker-Accept", "Accept"),
    (_CUSTOM_ATTRIBUTES, _CUSTOM_ATTRIBUTES),
    ("X-Amzn-SageMaker-Inference-Id", "X-Amzn-SageMaker-Inference-Id"),
    (_SESSION_ID, _SESSION_ID),
)
# The API's patterns (SessionIdOrNewSessionConstantHeader, NewSessionResponseHeader; at most 256 characters each)
_SESSION_ID_PATTERN = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")
_NEW_SESSION_PATTERN = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*;\sExpires=\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")
_MAX_SESSION_CHARS = 256
# Container response headers that the operation's output shape carries back.
_PASSTHROUGH_RESPONSE_HEADERS = (
    _CUSTOM_ATTRIBUTES,
    _NEW_SESSION_ID,
    "X-Amzn-SageMaker-Closed-Session-Id",
)


@dataclass(frozen=True)
class RuntimeConfig:
    """Settings of one local runtime."""

    container_url: str = "http://127.0.0.1:8080"
    max_part_bytes: int | None = None
    invocation_timeout: float = 60.0
    connect_timeout: float = 5.0
    region: str = "us-east-1"
    account_id: str = "000000000000"
    variant_name: str = "AllTraffic"
    adapter_components: frozenset[str] = frozenset()  # inference components that are LoRA adapters


class ServiceError(Exception):
    """An error answer of the runtime service: status, error code and JSON body."""

    def __init__(self, status: int, code: str, body: dict[str, object], namespace: str = "com.amazon.sagemaker"):
        super().__init__(f"{status} {code}: {body.get('Message')}")
        self.status = status
        self.code = code
        self.body = body
        self.error_type = f"{code}:http://internal.amazon.com/coral/{namespace}/"


class StreamFailure(Exception):
    """The container stream failed after the response started; becomes a ModelStreamError event."""

    def __init__(self, error_code: str, message: str):
        super().__init__(message)
        self.error_code = error_code
        self.message = message


def simple_error(status: int, code: str, message: str) -> ServiceError:
    """A non-model error (``ServiceUnavailable``, ``ValidationError``, ...) with a ``Message`` body."""
    namespace = "com.amazon.coral.validate" if code == "ValidationError" else "com.amazon.sagemaker"
    return ServiceError(status, code, {"Message": message}, namespace)


def _model_error_message(kind: str, status: int, original: str, see_also: str) -> str:
    """SageMaker's sentence, with the container's message shortened so the whole stays <= 2048 chars."""
    prefix = f"Received {kind} error ({status}) from primary with message \""
    suffix = f"\". {see_also}"
    room = max(0, _MAX_MESSAGE_CHARS - len(prefix) - len(suffix))
    return prefix + original[:room] + suffix


def model_error(config: RuntimeConfig, endpoint: str, status: int, text: str) -> ServiceError:
    """The 424 ``ModelError`` SageMaker answers when the container fails (``status`` 0: no answer)."""
    kind = "client" if 400 <= status < 500 else "server"
    log_group = f"/aws/sagemaker/Endpoints/{endpoint}"
    see_also = (
        f"See https://{config.region}.console.aws.amazon.com/cloudwatch/home?region={config.region}"
        f"#logEventViewer:group={log_group} in account {config.account_id} for more information."
    )
    original = text[:_MAX_MESSAGE_CHARS]
    body: dict[str, object] = {
        "ErrorCode": "CLIENT_ERROR_FROM_MODEL" if kind == "client" else "INTERNAL_FAILURE_FROM_MODEL",
        "LogStreamArn": f"arn:aws:logs:{config.region}:{config.account_id}:log-group:{log_group}",
        "Message": _model_error_message(kind, status, original, see_also),
        "OriginalMessage": original,
        "OriginalStatusCode": status,
    }
    return ServiceError(424, "ModelError", body)


def forward_headers(incoming: http.client.HTTPMessage, mapping: tuple[tuple[str, str], ...],
                    adapter_components: frozenset[str] = frozenset()) -> dict[str, str]:
    """The container request headers: the mapped client headers, the adapter an adapter component names, and no
    compression."""
    out = {target: incoming[source] for source, target in mapping if incoming.get(source) is not None}
    component = incoming.get("X-Amzn-SageMaker-Inference-Component")
    if component in adapter_components:
        out["X-Amzn-SageMaker-Adapter-Identifier"] = component
    out["Accept-Encoding"] = "identity"
    return out


def check_session_id(value: str | None, streaming: bool) -> None:
    """The service's checks of ``SessionId`` (module doc): a ValidationError for a malformed one."""
    if value is None:
        return
    if value == "NEW_SESSION":
        if streaming:
            raise simple_error(400, "ValidationError", "A stateful session cannot be created with "
                               "InvokeEndpointWithResponseStream; use InvokeEndpoint with SessionId NEW_SESSION")
        return
    if len(value) > _MAX_SESSION_CHARS or not _SESSION_ID_PATTERN.match(value):
        raise simple_error(400, "ValidationError", f"1 validation error detected: Value '{value[:300]}' at "
                           "'sessionId' failed to satisfy constraint: Member must satisfy regular expression "
                           "pattern: ^(NEW_SESSION)$|^[a-zA-Z0-9](-*[a-zA-Z0-9])*$ and have length <= 256")


def check_new_session(requested: str | None, response: requests.Response) -> None:
    """A NEW_SESSION the container answered without a NewSessionId of the API's form: SageMaker could not route to
    it (logged; the answer still goes back)."""
    if requested != "NEW_SESSION" or not 200 <= response.status_code < 300:
        return
    created = response.headers.get(_NEW_SESSION_ID)
    if created is None or len(created) > _MAX_SESSION_CHARS or not _NEW_SESSION_PATTERN.match(created):
        LOG.warning("the container answered NEW_SESSION without a valid %s header (got %r): SageMaker expects "
                    "'<id>; Expires=YYYY-MM-DDTHH:MM:SSZ'", _NEW_SESSION_ID, created)


def _post(url: str, **kwargs: object) -> requests.Response:
    """``requests.post`` that ignores proxy environment variables (the container is local)."""
    with requests.Session() as session:
        session.trust_env = False
        return session.post(url, **kwargs)


def call_container(config: RuntimeConfig, endpoint: str, body: bytes, headers: dict[str, str]) -> requests.Response:
    """POST to the container's ``/invocations`` (streamed); transport failures become ServiceErrors."""
    url = config.container_url.rstrip("/") + "/invocations"
    timeout = (config.connect_timeout, config.invocation_timeout)
    try:
        return _post(url, data=body, headers=headers, timeout=timeout, stream=True, allow_redirects=False)
    except requests.ConnectTimeout as exc:
        raise simple_error(503, "ServiceUnavailable", f"Container at {url} is not reachable: {exc}") from exc
    except requests.ReadTimeout as exc:
        message = "Your invocation timed out while waiting for a response from container primary."
        raise model_error(config, endpoint, 0, message) from exc
    except requests.ConnectionError as exc:
        if exc.args and isinstance(exc.args[0], urllib3.exceptions.ProtocolError):
            message = f"The container closed the connection without a response: {exc}"
            raise model_error(config, endpoint, 0, message) from exc
        raise simple_error(503, "ServiceUnavailable", f"Container at {url} is not reachable: {exc}") from exc
    except requests.RequestException as exc:
        raise simple_error(500, "InternalFailure", f"Calling the container failed: {exc}") from exc


def check_container_status(config: RuntimeConfig, endpoint: str, response: requests.Response) -> None:
    """Raise the ``ModelError`` for a non-2xx container answer (reading its body, closing it)."""
    if 200 <= response.status_code < 300:
        return
    try:
        text = response.content.decode("utf-8", errors="replace")
    except requests.RequestException:
        text = ""
    finally:
        response.close()
    raise model_error(config, endpoint, response.status_code, text)


def container_chunks(response: requests.Response) -> Iterator[bytes]:
    """Whatever each socket read of the container body gives, as it arrives; failures -> StreamFailure."""
    try:
        while True:
            data = response.raw.read1(_READ_SIZE)
            if not data:
                return
            yield data
    except urllib3.exceptions.ReadTimeoutError as exc:
        raise StreamFailure("ModelInvocationTimeExceeded", f"Model response stream timed out: {exc}") from exc
    except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
        raise StreamFailure("StreamBroken", f"Model response stream broken: {exc}") from exc


def split_parts(data: bytes, max_part_bytes: int | None) -> Iterator[bytes]:
    """``data`` cut into pieces of at most ``max_part_bytes`` (unlimited when None or 0)."""
    if not max_part_bytes:
        yield data
        return
    for start in range(0, len(data), max_part_bytes):
        yield data[start : start + max_part_bytes]


def read_chunked_body(rfile: BinaryIO) -> bytes:
    """A ``Transfer-Encoding: chunked`` request body (trailers are skipped)."""
    parts = []
    while True:
        size_line = rfile.readline(1024).split(b";", 1)[0].strip()
        size = int(size_line or b"0", 16)
        if size == 0:
            break
        parts.append(rfile.read(size))
        rfile.readline(1024)
    while rfile.readline(8192) not in (b"\r\n", b"\n", b""):
        pass
    return b"".join(parts)


class LocalRuntimeServer(ThreadingHTTPServer):
    """The HTTP server; one thread per connection, holding the runtime's settings."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], config: RuntimeConfig):
        super().__init__(address, RuntimeRequestHandler)
        self.config = config


class RuntimeRequestHandler(BaseHTTPRequestHandler):
    """Routes the two SageMaker runtime operations (and ``GET /ping``)."""

    protocol_version = "HTTP/1.1"
    server: LocalRuntimeServer

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        """Dispatch ``InvokeEndpoint`` / ``InvokeEndpointWithResponseStream``."""
        try:
            self._dispatch_post()
        except OSError as exc:  # the client went away while we were writing
            LOG.info("client connection lost: %s", exc)
            self.close_connection = True

    def _dispatch_post(self) -> None:
        """Route by path; a ServiceError becomes the service's error answer."""
        match = _ROUTE.match(urllib.parse.urlsplit(self.path).path)
        try:
            if match is not None and match["op"] == "invocations-bidirectional-stream":
                self._invoke_bidirectional(urllib.parse.unquote(match["name"]))  # its body streams both ways
                return
            body = self._read_body()
            if match is None:
                raise simple_error(404, "UnknownOperationException", f"No operation at POST {self.path}")
            endpoint = urllib.parse.unquote(match["name"])
            if match["op"] == "invocations":
                self._invoke(endpoint, body)
            else:
                self._invoke_stream(endpoint, body)
        except ServiceError as error:
            self._send_error(error)

    def do_GET(self) -> None:  # noqa: N802
        """``GET /ping``: 200 when the container's ``/ping`` is 200, else 503."""
        if urllib.parse.urlsplit(self.path).path != "/ping":
            self._send_error(simple_error(404, "UnknownOperationException", f"No operation at GET {self.path}"))
            return
        url = self.server.config.container_url.rstrip("/") + "/ping"
        try:
            with requests.Session() as session:
                session.trust_env = False
                healthy = session.get(url, timeout=self.server.config.connect_timeout).status_code == 200
        except requests.RequestException:
            healthy = False
        payload = {"container": url, "healthy": healthy}
        self._send_bytes(200 if healthy else 503, json.dumps(payload).encode(), {"Content-Type": "application/json"})

    def _read_body(self) -> bytes:
        """The request body (Content-Length or chunked); a malformed framing is a ValidationError."""
        try:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                return read_chunked_body(self.rfile)
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True  # the rest of the request cannot be framed
            raise simple_error(400, "ValidationError", "Malformed request body framing") from None
        return self.rfile.read(length) if length > 0 else b""

    def _variant(self) -> str:
        """The invoked production variant: the requested one, else the configured default."""
        return self.headers.get("X-Amzn-SageMaker-Target-Variant") or self.server.config.variant_name

    def _passthrough_headers(self, response: requests.Response) -> dict[str, str]:
        """Headers every successful answer carries: request id, variant, and the container's extras."""
        headers = {"x-amzn-RequestId": str(uuid.uuid4()), "x-Amzn-Invoked-Production-Variant": self._variant()}
        for name in _PASSTHROUGH_RESPONSE_HEADERS:
            if response.headers.get(name) is not None:
                headers[name] = response.headers[name]
        return headers

    def _invoke(self, endpoint: str, body: bytes) -> None:
        """``InvokeEndpoint``: forward, then answer 200 with the container's body."""
        config = self.server.config
        check_session_id(self.headers.get(_SESSION_ID), streaming=False)
        headers = forward_headers(self.headers, _INVOKE_REQUEST_HEADERS, config.adapter_components)
        response = call_container(config, endpoint, body, headers)
        check_container_status(config, endpoint, response)
        check_new_session(self.headers.get(_SESSION_ID), response)
        with response:
            try:
                content = response.content
            except requests.RequestException as exc:
                message = f"The container closed the connection before the response ended: {exc}"
                raise model_error(config, endpoint, 0, message) from exc
        headers = self._passthrough_headers(response)
        headers["Content-Type"] = response.headers.get("Content-Type", "application/octet-stream")
        self._send_bytes(200, content, headers)

    def _invoke_stream(self, endpoint: str, body: bytes) -> None:
        """``InvokeEndpointWithResponseStream``: forward, then relay the body as PayloadPart events."""
        config = self.server.config
        check_session_id(self.headers.get(_SESSION_ID), streaming=True)
        headers = forward_headers(self.headers, _STREAM_REQUEST_HEADERS, config.adapter_components)
        response = call_container(config, endpoint, body, headers)
        check_container_status(config, endpoint, response)
        with response:
            headers = self._passthrough_headers(response)
            headers["X-Amzn-SageMaker-Content-Type"] = response.headers.get("Content-Type", "application/octet-stream")
            headers["Content-Type"] = "application/vnd.amazon.eventstream"
            headers["Transfer-Encoding"] = "chunked"
            self._send_head(200, headers)
            self._relay_events(response)

    def _invoke_bidirectional(self, endpoint: str) -> None:
        """``InvokeEndpointWithBidirectionalStream``: a WebSocket to the container, bridged both ways
        (``local_bidi``)."""
        config = self.server.config
        url = local_bidi.container_url(config.container_url, self.headers)
        try:
            conn, frames = local_bidi.open_container(url, config.connect_timeout)
        except local_bidi.InvalidStatus as exc:
            text = exc.response.body.decode("utf-8", errors="replace") if exc.response.body else str(exc)
            raise model_error(config, endpoint, exc.response.status_code, text) from exc
        except (OSError, TimeoutError, local_bidi.InvalidHandshake) as exc:
            raise simple_error(503, "ServiceUnavailable", f"Container at {url} is not reachable: {exc}") from exc
        self.close_connection = True  # the request body is the stream's: nothing follows it on this connection
        headers = {"x-amzn-RequestId": str(uuid.uuid4()), "x-Amzn-Invoked-Production-Variant": self._variant(),
                   "Content-Type": "application/vnd.amazon.eventstream", "Transfer-Encoding": "chunked"}
        self._send_head(200, headers)
        local_bidi.bridge(self.rfile, conn, frames, self._write_chunk)
        self.wfile.write(b"0\r\n\r\n")

    def _relay_events(self, response: requests.Response) -> None:
        """Write each container read as PayloadPart events; a failure as one ModelStreamError event."""
        try:
            for chunk in container_chunks(response):
                for part in split_parts(chunk, self.server.config.max_part_bytes):
                    self._write_chunk(eventstream.payload_part(part))
        except StreamFailure as failure:
            LOG.warning("container stream failed: %s", failure.message)
            self._write_chunk(eventstream.exception_event("ModelStreamError", failure.message, failure.error_code))
        self.wfile.write(b"0\r\n\r\n")

    def _write_chunk(self, data: bytes) -> None:
        """One HTTP/1.1 chunk, sent at once (``wfile`` is unbuffered)."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _send_head(self, status: int, headers: dict[str, str]) -> None:
        """Status line and headers."""
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _send_bytes(self, status: int, content: bytes, headers: dict[str, str]) -> None:
        """A complete response with a Content-Length."""
        self._send_head(status, {**headers, "Content-Length": str(len(content))})
        self.wfile.write(content)

    def _send_error(self, error: ServiceError) -> None:
        """A rest-json error: ``x-amzn-ErrorType`` header (what botocore reads the code from) + JSON body."""
        LOG.info("answering %s %s", error.status, error.code)
        headers = {
            "Content-Type": "application/json",
            "x-amzn-RequestId": str(uuid.uuid4()),
            "x-amzn-ErrorType": error.error_type,
        }
        self._send_bytes(error.status, json.dumps(error.body).encode("utf-8"), headers)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's signature)
        """Access log through :mod:`logging` instead of raw stderr."""
        LOG.info("%s - %s", self.address_string(), format % args)


def make_server(config: RuntimeConfig, host: str = "127.0.0.1", port: int = 8081) -> LocalRuntimeServer:
    """A bound, not yet serving, local runtime (``port`` 0 picks a free port: see ``server_address``)."""
    return LocalRuntimeServer((host, port), config)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description="Local SageMaker runtime forwarding to a container (testing only).")
    parser.add_argument("--container-url", default="http://127.0.0.1:8080", help="base URL of the container")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    parser.add_argument("--port", type=int, default=8081, help="port to listen on (0: any free port)")
    parser.add_argument(
        "--max-part-bytes", type=int, default=0, help="cut stream PayloadParts to at most N bytes (0: unlimited)"
    )
    parser.add_argument("--invocation-timeout", type=float, default=60.0, help="seconds to wait for container data")
    parser.add_argument("--region", default="us-east-1", help="region used in error messages and ARNs")
    parser.add_argument("--log-level", default="INFO", help="logging level")
    parser.add_argument("--adapter-component", action="append", default=[], metavar="NAME",
                        help="an inference component that is a LoRA adapter (repeatable): its InferenceComponentName "
                             "reaches the container as X-Amzn-SageMaker-Adapter-Identifier")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the local runtime until interrupted."""
    args = parse_args(argv)
    if args.max_part_bytes < 0:
        raise SystemExit("--max-part-bytes must be >= 0")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = RuntimeConfig(
        container_url=args.container_url,
        max_part_bytes=args.max_part_bytes or None,
        invocation_timeout=args.invocation_timeout,
        region=args.region,
        adapter_components=frozenset(args.adapter_component),
    )
    server = make_server(config, args.host, args.port)
    host, port = server.server_address[:2]
    # The one line on stdout: scripts (and the tests) read the bound port from it when --port is 0.
    print(f"local SageMaker runtime listening on http://{host}:{port} -> {config.container_url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
