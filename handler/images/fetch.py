"""Fetch an image URL from a chat request: the pinned fetch, under every time limit, the name lookup included.

``handler.images.policy`` says which URLs and addresses may be fetched (the SSRF rules); this module does the fetch,
for every hop (the first URL and each redirect):

1. the host is looked up on the worker's shared lookup threads (``handler.images.resolve``), waiting no longer than
   the fetch's time limits allow: a resolver that never answers ends the fetch at its deadline, and the fetch slot
   goes back; then the policy checks the addresses;
2. the connection goes to exactly the address that was checked: a second lookup could be answered differently
   (DNS rebinding). The request still carries the URL's ``Host`` header, and https still sends SNI and verifies
   the certificate against the URL's host name;
3. redirects, time (per operation and overall) and bytes (while streaming) are capped; a caller's ``Deadline`` (the
   request's budget for all its fetches, ``handler.images.loader``) bounds the lookup and every connect and read as
   well.
"""

from __future__ import annotations

import functools
import http.client
import io
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

from handler.errors import BadRequest
from handler.images.policy import (
    SCHEMES,
    AddrInfo,
    FetchFailure,
    FetchPolicy,
    ImageFetchError,
    Target,
    check_url,
    split,
)
from handler.images.resolve import Resolver, shared_resolver

__all__ = ["Deadline", "FetchFailure", "FetchPolicy", "ImageFetchError", "fetch_image_bytes"]

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 * 1024
_USER_AGENT = "model-serving-image-fetcher/1.0"


class _BudgetSpent(TimeoutError):
    """The caller's deadline (the request's fetch budget), not this fetch's own limit, ran out."""


class _TotalSpent(TimeoutError):
    """The whole fetch's own limit (``FetchPolicy.total_timeout_s``) ran out."""


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
            raise _TotalSpent(f"total time limit of {self.total_s:g}s exceeded")

    def next_timeout(self) -> float:
        self.check()
        now = time.monotonic()
        bounds = [(self.timeout_s, "operation"), (self.deadline - now, "total")]
        if self.budget is not None:
            bounds.append((self.budget.at - now, "budget"))
        timeout, self._bound = min(bounds, key=lambda bound: bound[0])
        return max(timeout, 1e-3)  # a deadline reached since check() ends at the next timeout, not in settimeout


def fetch_image_bytes(url: str, policy: FetchPolicy, *, param: str = "url", deadline: Deadline | None = None,
                      resolver: Resolver | None = None) -> bytes:
    """The body of ``url`` after the policy's checks, following at most ``policy.max_redirects`` redirects; the
    lookup and every connect and read end by ``deadline`` too (the request's budget for all its fetches), when one is
    given. Names are looked up on ``resolver`` (default: the process's shared one)."""
    clock = _Clock(policy, deadline)
    lookups = resolver or shared_resolver()
    url = url.strip() if isinstance(url, str) else url
    for _ in range(policy.max_redirects + 1):
        target = _checked(url, policy, param, clock, lookups)
        location, body = _fetch_one(target, policy, clock, param)
        if location is None:
            return body
        url = urljoin(url, location)
    host = split(url, param).hostname or ""
    raise ImageFetchError(
        f"image URL host '{host}': more than {policy.max_redirects} redirects; refused",
        param=param,
        reason=FetchFailure.TOO_MANY_REDIRECTS,
    )


def _checked(url: str, policy: FetchPolicy, param: str, clock: _Clock, resolver: Resolver) -> Target:
    """One hop through the policy, its name looked up within the clock's limits."""

    def resolve(host: str, port: int) -> list[tuple[Any, ...]]:
        try:
            return resolver.resolve(host, port, clock.next_timeout())
        except TimeoutError:
            clock.check(timed_out=True)  # the fetch's deadline or the caller's, if that is what ran out
            raise TimeoutError(f"the name resolver did not answer within {clock.timeout_s:g} s") from None

    try:
        return check_url(url, policy, param, resolve)
    except TimeoutError as exc:
        host = split(url, param).hostname or ""
        reason = FetchFailure.DNS
        if isinstance(exc, _BudgetSpent):
            reason = FetchFailure.BUDGET
        elif isinstance(exc, _TotalSpent):
            reason = FetchFailure.TIMEOUT
        raise ImageFetchError(f"could not resolve image URL host '{host}': {exc}", param=param, reason=reason) from exc


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

    def __init__(self, target: Target, clock: _Clock) -> None:
        super().__init__(target.host, target.port, timeout=clock.timeout_s)
        self.default_port = SCHEMES[target.scheme]  # so the Host header omits the scheme's own port
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


def _fetch_one(target: Target, policy: FetchPolicy, clock: _Clock, param: str) -> tuple[str | None, bytes]:
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
