"""Fetch an image URL from a chat request without turning the server into an SSRF proxy.

Why this exists: a model server runs inside someone's cloud network, and an ``image_url`` is a URL the
client chooses. Fetched naively it could point at ``http://169.254.169.254/`` (the instance-metadata service,
which inside AWS hands out the instance role's temporary credentials), at internal services on 10.x/172.16.x/
192.168.x, or at admin ports on localhost, and the server would read them on the client's behalf.

So, for every hop (the first URL and each redirect):

1. only ``http`` and ``https``;
2. the host is resolved once, and the fetch is refused if any address is not public: loopback, private,
   link-local, unique-local, CGNAT, multicast, unspecified, reserved, or an IPv6 form that embeds such an IPv4
   address (``::ffff:169.254.169.254``, NAT64, 6to4, ...). Odd spellings (``2852039166``, ``0xa9fea9fe``,
   ``0251.0376.0251.0376``, ``169.254.43518``) are parsed as the IPv4 address they mean. Hosts in
   ``FetchPolicy.allowed_hosts`` (a deployment's own servers) are exempt;
3. the connection goes to exactly the address that was checked: a second lookup could be answered differently
   (DNS rebinding). The request still carries the URL's ``Host`` header, and https still sends SNI and verifies
   the certificate against the URL's host name;
4. redirects, time (per operation and overall) and bytes (while streaming) are capped; a caller's ``Deadline`` (the
   request's budget for all its fetches, ``handler.images.loader``) bounds every connect and read as well.

Every refusal is a ``BadRequest`` naming the URL's host and the rule it broke; a URL refused by a rule or that
could not be read is an ``ImageFetchError``, whose ``reason`` says which kind (the metric label, the error code).
"""

from __future__ import annotations

import enum
import functools
import http.client
import io
import ipaddress
import re
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, quote, urljoin, urlsplit

from handler.errors import BadRequest


class FetchFailure(enum.Enum):
    """Why an image URL was not fetched; the value is the error's ``code`` and the metric's ``reason`` label."""

    DISABLED = "fetch_disabled"
    SCHEME = "scheme"
    DNS = "dns"
    BLOCKED_ADDRESS = "blocked_address"
    TOO_MANY_REDIRECTS = "too_many_redirects"
    HTTP_STATUS = "http_status"
    TIMEOUT = "timeout"
    CONNECTION = "connection"
    TOO_LARGE = "too_large"
    BUDGET = "fetch_budget"  # the request's time for all its image fetches ran out (option.image_fetch_budget)


class ImageFetchError(BadRequest):
    """An image URL refused by a fetch rule or that could not be read (a 400 naming the content part)."""

    def __init__(self, message: str, *, param: str, reason: FetchFailure) -> None:
        super().__init__(message, param=param, code=reason.value)
        self.reason = reason


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# (family, type, proto, sockaddr) as socket.getaddrinfo gives them.
AddrInfo = tuple[int, int, int, tuple[Any, ...]]

_SCHEMES = {"http": 80, "https": 443}
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 * 1024
_USER_AGENT = "model-serving-image-fetcher/1.0"
# Characters left as they are when a path is re-quoted (everything else, spaces and control characters
# included, is percent-encoded; existing %XX escapes survive because '%' is safe).
_PATH_SAFE = "!#$%&'()*+,/:;=?@[]~"

_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")
_UNIQUE_LOCAL = ipaddress.IPv6Network("fc00::/7")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
_IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")
_NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")
# Letters, digits, '.', '-', '_' for names; ':' and '%' (zone) for IPv6 literals.
_HOST_CHARS = re.compile(r"[a-z0-9._:%\-]+")
# One inet_aton(3) component: hex (0x...), octal (leading 0) or decimal.
_ATON_PART = re.compile(r"0[xX][0-9a-fA-F]*|0[0-7]*|[1-9][0-9]*")


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    """What the fetcher may do. ``allowed_hosts`` are exempt from the non-public-address rule only."""

    enabled: bool = True
    allowed_hosts: tuple[str, ...] = ()
    timeout_s: float = 10.0
    max_bytes: int = 20 * 1024 * 1024
    max_redirects: int = 3
    # Whole fetch, all hops: stops a server that drips one byte just inside timeout_s forever.
    total_timeout_s: float = 60.0


@dataclass(frozen=True, slots=True)
class _Target:
    """One checked hop: where to connect (``addresses``) and what to ask for."""

    scheme: str
    host: str  # as in the URL (lower-case, no brackets, IDNA-encoded): Host header, SNI, certificate name
    port: int
    path: str
    addresses: tuple[AddrInfo, ...]


class _BudgetSpent(TimeoutError):
    """The caller's deadline (the request's fetch budget), not this fetch's own limit, ran out."""


@dataclass(frozen=True, slots=True)
class Deadline:
    """A ``time.monotonic()`` value a fetch must end by, and what to call it in the error (the setting)."""

    at: float
    name: str = "the request's image fetch budget"

    def remaining(self) -> float:
        return self.at - time.monotonic()


class _Clock:
    """Per-operation timeout bounded by the deadline of the whole fetch and by the caller's ``Deadline``."""

    def __init__(self, policy: FetchPolicy, budget: Deadline | None = None) -> None:
        self.timeout_s = policy.timeout_s
        self.total_s = policy.total_timeout_s
        self.deadline = time.monotonic() + policy.total_timeout_s
        self.budget = budget
        self._bound = "operation"  # which limit set the last timeout: operation, total or budget

    def check(self, *, timed_out: bool = False) -> None:
        """Raise the overall-limit error if the fetch's deadline or the caller's has passed; after a socket timeout
        (``timed_out``), also when that timeout was the one either deadline set (a wake-up can come a hair early)."""
        now = time.monotonic()
        if self.budget is not None and (now >= self.budget.at or (timed_out and self._bound == "budget")):
            raise _BudgetSpent(f"{self.budget.name} ran out")
        if now >= self.deadline or (timed_out and self._bound == "total"):
            raise TimeoutError(f"total time limit of {self.total_s:g}s exceeded")

    def next_timeout(self) -> float:
        self.check()
        now = time.monotonic()
        bounds = [(self.timeout_s, "operation"), (self.deadline - now, "total")]
        if self.budget is not None:
            bounds.append((self.budget.at - now, "budget"))
        timeout, self._bound = min(bounds, key=lambda bound: bound[0])
        return max(timeout, 1e-3)  # a deadline reached since check() ends at the next timeout, not in settimeout


def fetch_image_bytes(url: str, policy: FetchPolicy, *, param: str = "url", deadline: Deadline | None = None) -> bytes:
    """The body of ``url`` after the checks above, following at most ``policy.max_redirects`` redirects; every
    connect and read ends by ``deadline`` too (the request's budget for all its fetches), when one is given."""
    clock = _Clock(policy, deadline)
    url = url.strip() if isinstance(url, str) else url
    for _ in range(policy.max_redirects + 1):
        target = _check_url(url, policy, param)
        location, body = _fetch_one(target, policy, clock, param)
        if location is None:
            return body
        url = urljoin(url, location)
    host = _split(url, param).hostname or ""
    raise ImageFetchError(
        f"image URL host '{host}': more than {policy.max_redirects} redirects; refused",
        param=param,
        reason=FetchFailure.TOO_MANY_REDIRECTS,
    )


# --- checking a URL -------------------------------------------------------------------------------------


def _check_url(url: str, policy: FetchPolicy, param: str) -> _Target:
    """Apply every rule to one hop; the returned target holds the addresses that passed."""
    parts = _split(url, param)
    host = parts.hostname or ""
    if not policy.enabled:
        raise ImageFetchError(
            f"image URL fetching is disabled; refused URL for host '{host}'", param=param, reason=FetchFailure.DISABLED
        )
    if parts.scheme not in _SCHEMES:
        raise ImageFetchError(
            f"image URL host '{host}': scheme '{parts.scheme}' is not allowed (only http and https); refused",
            param=param,
            reason=FetchFailure.SCHEME,
        )
    if not host:
        raise BadRequest("image URL has no host; refused", param=param)
    if parts.username is not None or parts.password is not None:
        raise BadRequest(f"image URL host '{host}': URLs with credentials are not allowed; refused", param=param)
    host = _ascii_host(host, param)
    port = _port(parts, host, param)
    addresses = _resolve(host, port, param)
    _check_addresses(host, addresses, policy, param)
    return _Target(parts.scheme, host, port, _request_path(parts), addresses)


def _split(url: str, param: str) -> SplitResult:
    try:
        return urlsplit(url)
    except (ValueError, TypeError, AttributeError) as exc:
        raise BadRequest(f"image URL is not a valid URL: {exc}", param=param) from exc


def _ascii_host(host: str, param: str) -> str:
    """The host in ASCII (IDNA for international names), holding only characters a host can hold."""
    try:
        ascii_host = host if host.isascii() else host.encode("idna").decode("ascii")
    except UnicodeError:
        ascii_host = ""
    if not _HOST_CHARS.fullmatch(ascii_host):
        raise BadRequest(f"image URL host {host!r} is not a valid host name; refused", param=param)
    return ascii_host


def _port(parts: SplitResult, host: str, param: str) -> int:
    try:
        port = parts.port
    except ValueError as exc:
        raise BadRequest(f"image URL host '{host}' has an invalid port; refused", param=param) from exc
    if port == 0:
        raise BadRequest(f"image URL host '{host}' has an invalid port; refused", param=param)
    return port if port is not None else _SCHEMES[parts.scheme]


def _request_path(parts: SplitResult) -> str:
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return quote(path, safe=_PATH_SAFE)


def _resolve(host: str, port: int, param: str) -> tuple[AddrInfo, ...]:
    """The host's addresses: a literal (in any inet_aton spelling) as is, a name through ONE getaddrinfo."""
    literal = _literal_ip(host)
    if literal is not None:
        if literal.version == 4:
            return ((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, (str(literal), port)),)
        return ((socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, (str(literal), port, 0, 0)),)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:
        raise ImageFetchError(
            f"could not resolve image URL host '{host}': {exc}", param=param, reason=FetchFailure.DNS
        ) from exc
    if not infos:
        raise ImageFetchError(
            f"could not resolve image URL host '{host}': no addresses", param=param, reason=FetchFailure.DNS
        )
    return tuple((family, type_, proto, sockaddr) for family, type_, proto, _, sockaddr in infos)


def _literal_ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return _inet_aton(host)


def _inet_aton(host: str) -> ipaddress.IPv4Address | None:
    """What inet_aton(3) (and so a C resolver) makes of ``2852039166``, ``0xa9.0376.43518`` and the like."""
    parts = (host[:-1] if host.endswith(".") else host).split(".")
    if not 1 <= len(parts) <= 4 or not all(_ATON_PART.fullmatch(part) for part in parts):
        return None
    values = [
        int(part[2:] or "0", 16) if part[:2].lower() == "0x" else int(part, 8 if part.startswith("0") else 10)
        for part in parts
    ]
    *head, last = values
    if any(value > 255 for value in head) or last >= 256 ** (5 - len(values)):
        return None
    number = last
    for index, value in enumerate(head):
        number |= value << (24 - 8 * index)
    return ipaddress.IPv4Address(number)


def _check_addresses(host: str, addresses: tuple[AddrInfo, ...], policy: FetchPolicy, param: str) -> None:
    """Refuse if any address is non-public, unless the host or that address is allow-listed."""
    allowed = {_host_key(entry) for entry in policy.allowed_hosts}
    if _host_key(host) in allowed:
        return
    for *_, sockaddr in addresses:
        try:
            ip = ipaddress.ip_address(sockaddr[0])
        except ValueError:
            message = f"image URL host '{host}' resolves to {sockaddr[0]!r}, not an IP address; refused"
            raise ImageFetchError(message, param=param, reason=FetchFailure.DNS) from None
        if _host_key(str(ip)) in allowed:
            continue
        problem = _address_problem(ip)
        if problem is not None:
            raise ImageFetchError(
                f"image URL host '{host}' resolves to {problem}; refused",
                param=param,
                reason=FetchFailure.BLOCKED_ADDRESS,
            )


def _host_key(entry: str) -> str:
    """A host name or IP literal in one canonical spelling, for comparing with ``allowed_hosts``."""
    key = entry.strip().lower().strip("[]").rstrip(".")
    literal = _literal_ip(key)
    return str(literal) if literal is not None else key


def _address_problem(ip: IPAddress) -> str | None:
    """Why ``ip`` may not be fetched from (for the error message), or None when it is public."""
    embedded = _embedded_ipv4(ip)
    if embedded is not None:
        form, inner, wrapper_only = embedded
        problem = _classify(inner)
        if problem is not None:
            return f"{ip} ({form} form of {inner}), {problem}"
        if wrapper_only:
            return None
    problem = _classify(ip)
    return None if problem is None else f"{ip}, {problem}"


def _embedded_ipv4(ip: IPAddress) -> tuple[str, ipaddress.IPv4Address, bool] | None:
    """The IPv4 address an IPv6 address carries: (form, address, whether the IPv6 wrapper means nothing else)."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    low32 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.ipv4_mapped is not None:
        return "IPv4-mapped", ip.ipv4_mapped, True
    if ip in _IPV4_TRANSLATED:
        return "IPv4-translated", low32, True
    if ip in _NAT64_WELL_KNOWN:
        return "NAT64", low32, True
    if ip in _IPV4_COMPATIBLE and int(ip) > 1:  # :: and ::1 are themselves
        return "IPv4-compatible", low32, True
    if ip.sixtofour is not None:
        return "6to4", ip.sixtofour, False
    if ip.teredo is not None:
        return "Teredo", ip.teredo[1], False
    return None


def _classify(ip: IPAddress) -> str | None:  # noqa: C901 (one flat rule per address class reads best)
    """The kind of non-public address ``ip`` is, or None. Order picks the most telling name."""
    if ip.is_unspecified:
        return "the unspecified address"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast:
        return "a multicast address"
    if isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT:
        return "a carrier-grade NAT (100.64.0.0/10) address"
    if isinstance(ip, ipaddress.IPv6Address) and ip in _UNIQUE_LOCAL:
        return "a unique-local address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "a site-local address"
    if ip.is_reserved:
        return "a reserved address"
    if ip.is_private:
        return "a private address"
    if not ip.is_global:
        return "a non-public address"
    return None


# --- fetching one hop -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    """Certificate and host-name verification on, system trust store."""
    return ssl.create_default_context()


class _DeadlineReader(io.RawIOBase):
    """The socket's reader, with the per-read timeout re-armed from the fetch's clock before every read."""

    def __init__(self, raw: io.RawIOBase, sock: socket.socket, clock: _Clock) -> None:
        super().__init__()
        self._raw, self._sock, self._clock = raw, sock, clock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        self._sock.settimeout(self._clock.next_timeout())
        try:
            return self._raw.readinto(buffer)
        except TimeoutError:
            self._clock.check(timed_out=True)  # say so when it was an overall limit that ran out
            raise

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineResponse(http.client.HTTPResponse):
    """An ``HTTPResponse`` whose every socket read (status line, headers, body) obeys the clock."""

    def __init__(self, sock: socket.socket, *args: Any, clock: _Clock, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        self.fp = io.BufferedReader(_DeadlineReader(self.fp.detach(), sock, clock))


class _PinnedConnection(http.client.HTTPConnection):
    """HTTP or HTTPS to the checked addresses only, speaking to (Host, SNI, certificate) the URL's host."""

    def __init__(self, target: _Target, clock: _Clock) -> None:
        super().__init__(target.host, target.port, timeout=clock.timeout_s)
        self.default_port = _SCHEMES[target.scheme]  # so the Host header omits the scheme's own port
        self.response_class = functools.partial(_DeadlineResponse, clock=clock)
        self._target = target
        self._clock = clock

    def connect(self) -> None:
        sock = _open_socket(self._target.addresses, self._clock)
        if self._target.scheme == "https":
            try:
                sock = _tls_context().wrap_socket(sock, server_hostname=self._target.host)
            except BaseException:
                sock.close()
                raise
        self.sock = sock


def _open_socket(addresses: tuple[AddrInfo, ...], clock: _Clock) -> socket.socket:
    """A TCP connection to the first of ``addresses`` that answers; never a fresh name lookup."""
    last_error: OSError = OSError("no address to connect to")
    for family, type_, proto, sockaddr in addresses:
        sock = socket.socket(family, type_, proto)
        connected = False
        try:
            sock.settimeout(clock.next_timeout())
            sock.connect(sockaddr)
            connected = True
            return sock
        except TimeoutError as exc:
            clock.check(timed_out=True)  # an overall limit, if that is what ran out, ends the attempts
            last_error = exc
        except OSError as exc:
            last_error = exc
        finally:
            if not connected:
                sock.close()
    raise last_error


def _fetch_one(target: _Target, policy: FetchPolicy, clock: _Clock, param: str) -> tuple[str | None, bytes]:
    """One GET: ``(location, b"")`` for a redirect, ``(None, body)`` for a 2xx; anything else refused."""
    conn: _PinnedConnection | None = None
    try:
        conn = _PinnedConnection(target, clock)
        conn.request("GET", target.path, headers={"User-Agent": _USER_AGENT, "Accept": "image/*"})
        with conn.getresponse() as resp:
            if resp.status in _REDIRECT_STATUSES:
                return _location(resp, target.host, param), b""
            if not 200 <= resp.status < 300:
                raise ImageFetchError(
                    f"image URL host '{target.host}' answered HTTP {resp.status} {resp.reason}; "
                    "could not fetch the image",
                    param=param,
                    reason=FetchFailure.HTTP_STATUS,
                )
            return None, _read_body(resp, policy, target.host, param)
    except (OSError, http.client.HTTPException) as exc:
        reason = FetchFailure.TIMEOUT if isinstance(exc, TimeoutError) else FetchFailure.CONNECTION
        if isinstance(exc, _BudgetSpent):
            reason = FetchFailure.BUDGET
        raise ImageFetchError(
            f"could not fetch image from host '{target.host}': {_describe(exc)}", param=param, reason=reason
        ) from exc
    finally:
        if conn is not None:
            conn.close()


def _location(resp: http.client.HTTPResponse, host: str, param: str) -> str:
    location = resp.getheader("Location")
    if not location:
        raise BadRequest(f"image URL host '{host}' answered a redirect without a Location; refused", param=param)
    return location


def _read_body(resp: http.client.HTTPResponse, policy: FetchPolicy, host: str, param: str) -> bytes:
    """The body, read in chunks and refused as soon as it passes ``policy.max_bytes``."""
    if resp.length is not None and resp.length > policy.max_bytes:
        raise ImageFetchError(
            f"image from host '{host}' is {resp.length} bytes (Content-Length), over the limit of "
            f"{policy.max_bytes} bytes; refused",
            param=param,
            reason=FetchFailure.TOO_LARGE,
        )
    body = bytearray()
    while chunk := resp.read1(min(_CHUNK, policy.max_bytes + 1 - len(body))):
        body += chunk
        if len(body) > policy.max_bytes:
            raise ImageFetchError(
                f"image from host '{host}' is over the limit of {policy.max_bytes} bytes; refused",
                param=param,
                reason=FetchFailure.TOO_LARGE,
            )
    if resp.length:  # the server closed before sending all it announced
        raise http.client.IncompleteRead(bytes(body), resp.length)
    return bytes(body)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) and not str(exc):
        return "timed out"
    return str(exc) or type(exc).__name__
