"""handler.images.fetch and .policy: SSRF rules, pinning to the checked address, redirects, timeouts and byte caps.

Only loopback is ever contacted: a tiny threaded HTTP server on 127.0.0.1 plays the image host, name lookups
are faked by patching ``socket.getaddrinfo``, and ``socket.socket.connect`` is patched to record every
connection and to fail the test on any connection other than to the test's own servers.
"""

from __future__ import annotations

import dataclasses
import io
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from handler.errors import BadRequest
from handler.images import FetchPolicy, fetch_image_bytes
from handler.images import fetch as fetch_module
from handler.images import policy as policy_module

LOOPBACK = FetchPolicy(allowed_hosts=("127.0.0.1",), timeout_s=5.0)
HUGE_TOTAL = 64 * 1024 * 1024


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (10, 200, 30)).save(buf, "PNG")
    return buf.getvalue()


PNG = _png()


class _Handler(BaseHTTPRequestHandler):
    """Routes: see do_GET. State lives on the server object (seen, release, huge_sent, huge_done, sni)."""

    server: _ImageServer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.seen.append((self.path, self.headers.get("Host")))
        path = self.path
        port = self.server.server_address[1]
        if path == "/img.png":
            self._send(200, PNG, {"Content-Type": "image/png"})
        elif path.startswith("/r/"):
            hops = int(path[3:])
            self._redirect(302, "/img.png" if hops <= 1 else f"/r/{hops - 1}")  # relative Locations
        elif path.startswith("/status/"):
            self._redirect(int(path[8:]), "/img.png")
        elif path == "/abs":
            self._redirect(302, f"http://127.0.0.1:{port}/img.png")
        elif path == "/to-metadata":
            self._redirect(302, "http://169.254.169.254/latest/meta-data/")
        elif path == "/to-internal-name":
            self._redirect(302, f"http://internal.test:{port}/img.png")
        elif path == "/to-second":
            self._redirect(302, f"http://second.test:{port}/img.png")
        elif path == "/no-location":
            self._send(302, b"", {})
        elif path == "/missing":
            self._send(404, b"not here", {"Content-Type": "text/plain"})
        elif path == "/huge":
            self._huge()
        elif path == "/huge-declared":
            self._send_headers(200, {"Content-Length": str(1 << 30)})
            self.wfile.write(b"x" * 10)
        elif path == "/slow":
            self.server.release.wait(3.0)
            self._send(200, PNG, {})
        elif path == "/slow-body":
            self._send_headers(200, {"Content-Length": "1000"})
            self.wfile.write(b"x" * 10)
            self.wfile.flush()
            self.server.release.wait(3.0)
        elif path == "/drip":
            self._drip()
        elif path == "/short":
            self._send_headers(200, {"Content-Length": "1000"})
            self.wfile.write(b"x" * 10)
        else:
            self._send(500, b"unknown route", {})

    def _send_headers(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self._send_headers(status, {**headers, "Content-Length": str(len(body))})
        self.wfile.write(body)

    def _redirect(self, status: int, location: str) -> None:
        self._send(status, b"", {"Location": location})

    def _huge(self) -> None:
        """64 MiB with no Content-Length (HTTP/1.0, ends at close): only a streaming cap can stop it."""
        self._send_headers(200, {"Content-Type": "image/png"})
        chunk, sent = b"\0" * 65536, 0
        try:
            while sent < HUGE_TOTAL:
                self.wfile.write(chunk)
                sent += len(chunk)
        except OSError:
            pass
        finally:
            self.server.huge_sent = sent
            self.server.huge_done.set()

    def _drip(self) -> None:
        """A byte every 50 ms: each read is quick, the whole never ends."""
        self._send_headers(200, {})
        try:
            for _ in range(60):
                if self.server.release.is_set():
                    return
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass


class _ImageServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[tuple[str, str | None]] = []
        self.release = threading.Event()
        self.huge_done = threading.Event()
        self.huge_sent = 0
        self.sni: list[str | None] = []

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients that hang up early (timeouts, caps) are what several tests are about


def _serve(server: _ImageServer) -> Iterator[_ImageServer]:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture(scope="module")
def server() -> Iterator[_ImageServer]:
    yield from _serve(_ImageServer())


@pytest.fixture()
def port(server: _ImageServer) -> int:
    server.seen.clear()
    return server.server_address[1]


class _Guard:
    """Records every outgoing connect; lets through only 127.0.0.1 ports the test owns."""

    def __init__(self) -> None:
        self.connects: list[tuple[object, ...]] = []
        self.allowed_ports: set[int] = set()


@pytest.fixture()
def guard(monkeypatch: pytest.MonkeyPatch, port: int) -> _Guard:
    guard = _Guard()
    guard.allowed_ports.add(port)
    real_connect = socket.socket.connect

    def connect(sock: socket.socket, address: tuple[object, ...]) -> None:
        guard.connects.append(tuple(address))
        if address[0] != "127.0.0.1" or address[1] not in guard.allowed_ports:
            raise AssertionError(f"test tried to connect to {address!r}")
        real_connect(sock, address)

    def create_connection(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"socket.create_connection{args!r} used: a second name lookup")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    return guard


class _FakeDNS:
    """``socket.getaddrinfo`` replacement: answers from a table, one answer per call in turn; records calls."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    def __call__(self, host: str, port: int, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        self.calls.append(host)
        if host not in self.answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        turn = min(self.calls.count(host), len(self.answers[host])) - 1
        address = self.answers[host][turn]
        if ":" in address:
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (address, port, 0, 0))]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]


def _fake_dns(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str]]) -> _FakeDNS:
    fake = _FakeDNS(answers)
    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return fake


# --- happy paths ----------------------------------------------------------------------------------------


def test_fetches_png_from_allowed_loopback(port: int, guard: _Guard, server: _ImageServer) -> None:
    assert fetch_image_bytes(f"http://127.0.0.1:{port}/img.png", LOOPBACK) == PNG
    assert guard.connects == [("127.0.0.1", port)]
    assert server.seen == [("/img.png", f"127.0.0.1:{port}")]


def test_follows_relative_redirect_chain_up_to_the_limit(port: int, guard: _Guard, server: _ImageServer) -> None:
    assert fetch_image_bytes(f"http://127.0.0.1:{port}/r/3", LOOPBACK) == PNG
    assert [path for path, _ in server.seen] == ["/r/3", "/r/2", "/r/1", "/img.png"]


def test_one_redirect_too_many_is_refused(port: int, guard: _Guard, server: _ImageServer) -> None:
    with pytest.raises(BadRequest, match="more than 3 redirects") as err:
        fetch_image_bytes(f"http://127.0.0.1:{port}/r/4", LOOPBACK, param="p")
    assert err.value.param == "p"
    assert len(server.seen) == 4  # the fourth redirect's target is never requested


def test_zero_redirects_allowed(port: int, guard: _Guard) -> None:
    policy = FetchPolicy(allowed_hosts=("127.0.0.1",), max_redirects=0)
    with pytest.raises(BadRequest, match="more than 0 redirects"):
        fetch_image_bytes(f"http://127.0.0.1:{port}/r/1", policy)


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_every_redirect_status_is_followed(status: int, port: int, guard: _Guard) -> None:
    assert fetch_image_bytes(f"http://127.0.0.1:{port}/status/{status}", LOOPBACK) == PNG


def test_absolute_redirect(port: int, guard: _Guard) -> None:
    assert fetch_image_bytes(f"http://127.0.0.1:{port}/abs", LOOPBACK) == PNG


def test_allow_listed_name_is_exempt(port: int, guard: _Guard, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_dns(monkeypatch, {"images.internal": ["127.0.0.1"]})
    policy = FetchPolicy(allowed_hosts=("Images.Internal",))
    assert fetch_image_bytes(f"http://images.internal:{port}/img.png", policy) == PNG


# --- refused before any connection ---------------------------------------------------------------------

HOSTILE = [
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://[::ffff:169.254.169.254]/", "link-local"),
    ("http://[::ffff:a9fe:a9fe]/", "link-local"),
    ("http://[::169.254.169.254]/", "link-local"),
    ("http://[64:ff9b::a9fe:a9fe]/", "link-local"),
    ("http://[2002:a9fe:a9fe::1]/", "link-local"),
    ("http://2852039166/", "link-local"),
    ("http://0xa9fea9fe/", "link-local"),
    ("http://0251.0376.0251.0376/", "link-local"),
    ("http://169.254.43518/", "link-local"),
    ("http://0xa9.0376.43518/", "link-local"),
    ("http://10.0.0.1/", "private"),
    ("http://172.16.0.1/", "private"),
    ("http://172.31.255.254/", "private"),
    ("http://192.168.1.1/", "private"),
    ("http://100.64.0.1/", "carrier-grade NAT"),
    ("http://[fe80::1]/", "link-local"),
    ("http://[fc00::1]/", "unique-local"),
    ("http://[fd12:3456::1]/", "unique-local"),
    ("http://[fec0::1]/", "site-local"),
    ("http://0.0.0.0/", "unspecified"),
    ("http://0/", "unspecified"),
    ("http://[::]/", "unspecified"),
    ("http://127.0.0.1/", "loopback"),
    ("http://127.1:8080/", "loopback"),
    ("http://[::1]/", "loopback"),
    ("http://[::ffff:127.0.0.1]/", "loopback"),
    ("http://localhost/", "loopback"),
    ("http://LOCALHOST:8080/", "loopback"),
    ("http://224.0.0.1/", "multicast"),
    ("http://[ff02::1]/", "multicast"),
    ("http://240.0.0.1/", "reserved"),
    ("https://169.254.169.254/", "link-local"),
    ("file:///etc/passwd", "scheme 'file'"),
    ("ftp://example.com/x.png", "scheme 'ftp'"),
    ("gopher://x/", "scheme 'gopher'"),
    ("data:image/png;base64,iVBORw0KGgo=", "scheme 'data'"),
    ("http://user:pw@example.com/x.png", "credentials"),
    ("http:///nohost", "no host"),
    ("http://exa mple.com/", "not a valid host name"),
]


@pytest.fixture()
def no_connect(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Any connection attempt is recorded and fails the test."""
    attempts: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise AssertionError(f"connection attempted: {args!r}")

    real_getaddrinfo = socket.getaddrinfo

    def hosts_file_only(host: str, *args: object, **kwargs: object) -> object:
        if host != "localhost":  # answered from /etc/hosts; nothing else may reach a real resolver
            raise AssertionError(f"real name lookup of {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", hosts_file_only)
    return attempts


@pytest.mark.parametrize(("url", "rule"), HOSTILE)
def test_hostile_url_refused_before_connecting(url: str, rule: str, no_connect: list[object]) -> None:
    with pytest.raises(BadRequest) as err:
        fetch_image_bytes(url, FetchPolicy(), param="messages[0].content[1].image_url.url")
    assert rule in err.value.message
    assert err.value.param == "messages[0].content[1].image_url.url"
    assert err.value.status_code == 400
    assert no_connect == []


def test_refusal_message_names_host_address_and_rule(no_connect: list[object]) -> None:
    with pytest.raises(BadRequest) as err:
        fetch_image_bytes("http://169.254.169.254/latest/meta-data/", FetchPolicy())
    assert err.value.message == (
        "image URL host '169.254.169.254' resolves to 169.254.169.254, a link-local address; refused"
    )
    with pytest.raises(BadRequest) as err:
        fetch_image_bytes("http://2852039166/", FetchPolicy())
    assert "host '2852039166' resolves to 169.254.169.254, a link-local address" in err.value.message
    with pytest.raises(BadRequest) as err:
        fetch_image_bytes("http://[::ffff:169.254.169.254]/", FetchPolicy())
    assert "(IPv4-mapped form of 169.254.169.254), a link-local address" in err.value.message


def test_hostile_urls_refused_with_loopback_allow_listed(no_connect: list[object]) -> None:
    """Allow-listing 127.0.0.1 exempts exactly that address, not its neighbours or other spellings' targets."""
    for url in ("http://127.0.0.2/", "http://169.254.169.254/", "http://[::1]/", "http://10.0.0.1/"):
        with pytest.raises(BadRequest, match="refused"):
            fetch_image_bytes(url, LOOPBACK)
    assert no_connect == []


def test_public_address_passes_the_check() -> None:
    """The rule must not refuse everything: a public address gets through to the connection step."""
    def no_lookup(host: str, port: int) -> list[tuple[object, ...]]:
        raise AssertionError(f"literal address looked up: {host!r}")

    target = policy_module.check_url("https://93.184.215.14/a%20b.png?x=1 2", FetchPolicy(), "url", no_lookup)
    assert target.addresses[0][3] == ("93.184.215.14", 443)
    assert target.path == "/a%20b.png?x=1%202"
    target = policy_module.check_url("http://[2606:4700::1111]:8080/", FetchPolicy(), "url", no_lookup)
    assert target.addresses[0][3] == ("2606:4700::1111", 8080, 0, 0)
    target = policy_module.check_url("http://[64:ff9b::808:808]/", FetchPolicy(), "url", no_lookup)  # NAT64 of 8.8.8.8
    assert target.host == "64:ff9b::808:808"


def test_name_resolving_to_private_address_refused(monkeypatch: pytest.MonkeyPatch, no_connect: list[object]) -> None:
    dns = _fake_dns(monkeypatch, {"rebind.test": ["10.1.2.3"]})
    with pytest.raises(BadRequest) as err:
        fetch_image_bytes("http://rebind.test/x.png", FetchPolicy(), param="img")
    assert err.value.message == "image URL host 'rebind.test' resolves to 10.1.2.3, a private address; refused"
    assert dns.calls == ["rebind.test"]
    assert no_connect == []


def test_name_with_any_private_address_refused(monkeypatch: pytest.MonkeyPatch, no_connect: list[object]) -> None:
    def two_answers(host: str, port: int, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", port)),
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::5", port, 0, 0)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", two_answers)
    with pytest.raises(BadRequest, match="fd00::5, a unique-local address"):
        fetch_image_bytes("http://mixed.test/", FetchPolicy())
    assert no_connect == []


def test_unresolvable_name_refused(monkeypatch: pytest.MonkeyPatch, no_connect: list[object]) -> None:
    _fake_dns(monkeypatch, {})
    with pytest.raises(BadRequest, match="could not resolve image URL host 'nowhere.test'"):
        fetch_image_bytes("http://nowhere.test/", FetchPolicy())


def test_disabled_policy_refuses_every_url(port: int, no_connect: list[object]) -> None:
    off = FetchPolicy(enabled=False, allowed_hosts=("127.0.0.1",))
    for url in (f"http://127.0.0.1:{port}/img.png", "https://example.com/cat.png", "http://169.254.169.254/"):
        with pytest.raises(BadRequest, match="image URL fetching is disabled") as err:
            fetch_image_bytes(url, off, param="u")
        assert err.value.param == "u"
    assert no_connect == []


# --- pinning: DNS rebinding ----------------------------------------------------------------------------


def test_dns_rebinding_connects_to_the_checked_address(
    port: int, guard: _Guard, server: _ImageServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    dns = _fake_dns(monkeypatch, {"rebind.test": ["127.0.0.1", "10.9.9.9"]})
    assert fetch_image_bytes(f"http://rebind.test:{port}/img.png", LOOPBACK) == PNG
    assert dns.calls == ["rebind.test"]
    assert guard.connects == [("127.0.0.1", port)]
    assert server.seen == [("/img.png", f"rebind.test:{port}")]  # the original Host header


def test_each_redirect_hop_resolved_once_and_pinned(
    port: int, guard: _Guard, server: _ImageServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    dns = _fake_dns(monkeypatch, {"first.test": ["127.0.0.1", "10.0.0.7"], "second.test": ["127.0.0.1", "10.0.0.8"]})
    assert fetch_image_bytes(f"http://first.test:{port}/to-second", LOOPBACK) == PNG
    assert dns.calls == ["first.test", "second.test"]
    assert guard.connects == [("127.0.0.1", port), ("127.0.0.1", port)]
    assert server.seen == [("/to-second", f"first.test:{port}"), ("/img.png", f"second.test:{port}")]


# --- redirects to forbidden places ---------------------------------------------------------------------


def test_redirect_to_metadata_refused_without_connecting(port: int, guard: _Guard) -> None:
    with pytest.raises(BadRequest, match="'169.254.169.254' resolves to 169.254.169.254, a link-local"):
        fetch_image_bytes(f"http://127.0.0.1:{port}/to-metadata", LOOPBACK)
    assert guard.connects == [("127.0.0.1", port)]


def test_redirect_to_private_name_refused(port: int, guard: _Guard, monkeypatch: pytest.MonkeyPatch) -> None:
    dns = _fake_dns(monkeypatch, {"internal.test": ["10.1.2.3"]})
    with pytest.raises(BadRequest, match="'internal.test' resolves to 10.1.2.3, a private address"):
        fetch_image_bytes(f"http://127.0.0.1:{port}/to-internal-name", LOOPBACK)
    assert dns.calls == ["internal.test"]
    assert guard.connects == [("127.0.0.1", port)]


def test_redirect_without_location_refused(port: int, guard: _Guard) -> None:
    with pytest.raises(BadRequest, match="redirect without a Location"):
        fetch_image_bytes(f"http://127.0.0.1:{port}/no-location", LOOPBACK)


# --- status, size, time --------------------------------------------------------------------------------


def test_404_refused_naming_host_and_status(port: int, guard: _Guard) -> None:
    with pytest.raises(BadRequest) as err:
        fetch_image_bytes(f"http://127.0.0.1:{port}/missing", LOOPBACK, param="q")
    assert "'127.0.0.1'" in err.value.message and "HTTP 404" in err.value.message
    assert err.value.param == "q"


def test_huge_body_refused_while_streaming(port: int, guard: _Guard, server: _ImageServer) -> None:
    server.huge_done.clear()
    policy = FetchPolicy(allowed_hosts=("127.0.0.1",), max_bytes=256 * 1024)
    with pytest.raises(BadRequest, match="over the limit of 262144 bytes"):
        fetch_image_bytes(f"http://127.0.0.1:{port}/huge", policy)
    assert server.huge_done.wait(10), "server still sending: the client did not hang up"
    # Socket buffers absorb a few MiB at most; reading everything would have let all 64 MiB through.
    assert server.huge_sent < HUGE_TOTAL // 2


def test_huge_content_length_refused_before_reading(port: int, guard: _Guard) -> None:
    policy = FetchPolicy(allowed_hosts=("127.0.0.1",), max_bytes=1024)
    with pytest.raises(BadRequest, match=r"1073741824 bytes \(Content-Length\), over the limit of 1024"):
        fetch_image_bytes(f"http://127.0.0.1:{port}/huge-declared", policy)


def test_body_at_exactly_the_cap_is_accepted(port: int, guard: _Guard) -> None:
    policy = FetchPolicy(allowed_hosts=("127.0.0.1",), max_bytes=len(PNG))
    assert fetch_image_bytes(f"http://127.0.0.1:{port}/img.png", policy) == PNG
    with pytest.raises(BadRequest, match="over the limit"):
        fetch_image_bytes(f"http://127.0.0.1:{port}/img.png", dataclasses.replace(policy, max_bytes=len(PNG) - 1))


def test_truncated_body_refused(port: int, guard: _Guard) -> None:
    with pytest.raises(BadRequest, match="could not fetch image from host '127.0.0.1'"):
        fetch_image_bytes(f"http://127.0.0.1:{port}/short", LOOPBACK)


@pytest.mark.parametrize("route", ["/slow", "/slow-body"])
def test_slow_server_times_out(route: str, port: int, guard: _Guard) -> None:
    policy = FetchPolicy(allowed_hosts=("127.0.0.1",), timeout_s=0.5)
    with pytest.raises(BadRequest, match="could not fetch image from host '127.0.0.1': timed out"):
        fetch_image_bytes(f"http://127.0.0.1:{port}{route}", policy)


def test_dripping_server_stopped_by_total_deadline(port: int, guard: _Guard) -> None:
    policy = FetchPolicy(allowed_hosts=("127.0.0.1",), timeout_s=1.0, total_timeout_s=0.5)
    with pytest.raises(BadRequest, match="total time limit of 0.5s exceeded"):
        fetch_image_bytes(f"http://127.0.0.1:{port}/drip", policy)


def test_connection_refused(guard: _Guard) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    guard.allowed_ports.add(closed_port)
    with pytest.raises(BadRequest, match="could not fetch image from host '127.0.0.1'"):
        fetch_image_bytes(f"http://127.0.0.1:{closed_port}/img.png", LOOPBACK)
    assert guard.connects == [("127.0.0.1", closed_port)]


# --- https: pinned address, SNI and certificate checked against the URL's name ------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[_ImageServer, str]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl command not available to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=img.test",
         "-addext", "subjectAltName=DNS:img.test"],
        check=True, capture_output=True, timeout=30,
    )
    server = _ImageServer()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda sock, name, ctx: server.sni.append(name)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    for running in _serve(server):
        yield running, str(cert)


def test_https_pins_address_and_verifies_the_url_host(
    tls_server: tuple[_ImageServer, str], guard: _Guard, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, cert = tls_server
    tls_port = server.server_address[1]
    guard.allowed_ports.add(tls_port)
    server.seen.clear()
    dns = _fake_dns(monkeypatch, {"img.test": ["127.0.0.1", "127.0.0.1", "10.0.0.1"], "other.test": ["127.0.0.1"]})
    policy = FetchPolicy(allowed_hosts=("127.0.0.1",), timeout_s=5.0)

    # The system trust store does not know the test certificate: verification is on.
    with pytest.raises(BadRequest, match="could not fetch image from host 'img.test'.*certificate verify failed"):
        fetch_image_bytes(f"https://img.test:{tls_port}/img.png", policy)

    monkeypatch.setattr(fetch_module, "_tls_context", lambda: ssl.create_default_context(cafile=cert))
    server.sni.clear()
    assert fetch_image_bytes(f"https://img.test:{tls_port}/img.png", policy) == PNG
    assert server.sni == ["img.test"]
    assert server.seen == [("/img.png", f"img.test:{tls_port}")]
    assert guard.connects[-1] == ("127.0.0.1", tls_port)

    # Same address, certificate for another name: refused.
    with pytest.raises(BadRequest, match="could not fetch image from host 'other.test'.*(mismatch|not valid)"):
        fetch_image_bytes(f"https://other.test:{tls_port}/img.png", policy)
    assert dns.calls.count("img.test") == 2  # once per fetch, never again while connecting
