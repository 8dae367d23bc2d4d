"""Which URLs and addresses an image fetch may go to (the SSRF rules), and the fetch's limits (``FetchPolicy``).

Why this exists: a model server runs inside someone's cloud network, and an ``image_url`` is a URL the
client chooses. Fetched naively it could point at ``http://169.254.169.254/`` (the instance-metadata service,
which inside AWS hands out the instance role's temporary credentials), at internal services on 10.x/172.16.x/
192.168.x, or at admin ports on localhost, and the server would read them on the client's behalf.

So ``check_url`` takes every hop (the first URL and each redirect) through these rules:

1. only ``http`` and ``https``, with a host, without credentials;
2. the host is resolved once, and the fetch is refused if any address is not public: loopback, private,
   link-local, unique-local, CGNAT, multicast, unspecified, reserved, or an IPv6 form that embeds such an IPv4
   address (``::ffff:169.254.169.254``, NAT64, 6to4, ...). Odd spellings (``2852039166``, ``0xa9fea9fe``,
   ``0251.0376.0251.0376``, ``169.254.43518``) are parsed as the IPv4 address they mean. Hosts in
   ``FetchPolicy.allowed_hosts`` (a deployment's own servers) are exempt.

The ``Target`` it returns holds the addresses that passed: ``handler.images.fetch`` connects to exactly those (a
second lookup could be answered differently: DNS rebinding). Every refusal is a ``BadRequest`` naming the URL's host
and the rule it broke; a URL refused by a rule or that could not be read is an ``ImageFetchError``, whose ``reason``
says which kind (the metric label, the error code).
"""

from __future__ import annotations

import enum
import ipaddress
import re
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, quote, urlsplit

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
# A name lookup: (host, port) -> socket.getaddrinfo's (family, type, proto, canonname, sockaddr) answers.
Resolve = Callable[[str, int], Sequence[tuple[Any, ...]]]

SCHEMES = {"http": 80, "https": 443}
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
class Target:
    """One checked hop: where to connect (``addresses``) and what to ask for."""

    scheme: str
    host: str  # as in the URL (lower-case, no brackets, IDNA-encoded): Host header, SNI, certificate name
    port: int
    path: str
    addresses: tuple[AddrInfo, ...]


def check_url(url: str, policy: FetchPolicy, param: str, resolve: Resolve) -> Target:
    """Apply every rule to one hop; the returned target holds the addresses that passed. ``resolve(host, port)`` looks
    a name up (``socket.getaddrinfo``'s answers); a ``TimeoutError`` from it passes through to the caller."""
    parts = split(url, param)
    host = parts.hostname or ""
    if not policy.enabled:
        raise ImageFetchError(
            f"image URL fetching is disabled; refused URL for host '{host}'", param=param, reason=FetchFailure.DISABLED
        )
    if parts.scheme not in SCHEMES:
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
    addresses = _resolve(host, port, param, resolve)
    _check_addresses(host, addresses, policy, param)
    return Target(parts.scheme, host, port, _request_path(parts), addresses)


def split(url: str, param: str) -> SplitResult:
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
    return port if port is not None else SCHEMES[parts.scheme]


def _request_path(parts: SplitResult) -> str:
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return quote(path, safe=_PATH_SAFE)


def _resolve(host: str, port: int, param: str, resolve: Resolve) -> tuple[AddrInfo, ...]:
    """The host's addresses: a literal (in any inet_aton spelling) as is, a name through ONE lookup."""
    literal = _literal_ip(host)
    if literal is not None:
        if literal.version == 4:
            return ((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, (str(literal), port)),)
        return ((socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, (str(literal), port, 0, 0)),)
    try:
        infos = resolve(host, port)
    except TimeoutError:
        raise  # the fetch's clock says which limit ran out
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
