"""The answers a worker gives before any route runs: a complete error response in the server's JSON shapes
(OpenAI's on ``/v1/*``, the legacy one elsewhere: ``ErrorShape.for_path``), and which of gunicorn's exceptions are
the client's mistakes (``describe``), with gunicorn's own statuses.

May import: ``handler.errors`` and gunicorn (nothing of the app).
"""

from __future__ import annotations

import json
import uuid

from gunicorn.http import errors as http_errors

from handler.errors import ErrorShape, ServingError, error_record


class ReadTimeout(TimeoutError):
    """The request was not fully received within ``option.request_read_timeout``."""

def error_response(status: int, reason: str, message: str, code: str, path: str) -> bytes:
    """A complete ``Connection: close`` response in the error shape of ``path`` (``ErrorShape.for_path``)."""
    error = ServingError(message, code=code)
    error.status_code = status
    error.error_type = "invalid_request_error" if status < 500 else "internal_error"
    body = json.dumps(error_record(error, ErrorShape.for_path(path))).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Request-Id: req-{uuid.uuid4().hex}\r\n\r\n")
    return head.encode("latin-1") + body


_e = http_errors
# gunicorn's client errors, first match wins: (exception classes, status, reason, message prefix, code); the
# statuses are gunicorn's own (base.Worker.handle_error). Status None: not the client's mistake (a 500).
CLIENT_ERRORS = [
    ((ReadTimeout,), 408, "Request Timeout", "", "request_timeout"),
    ((_e.InvalidResponseHeader, _e.InvalidResponseHeaderName, _e.ConfigurationProblem), None, "", "", ""),
    ((_e.LimitRequestLine,), 414, "URI Too Long", "the request line is too long: ", "request_line_too_long"),
    ((_e.LimitRequestHeaders,), 431, "Request Header Fields Too Large", "request headers too large: ",
     "headers_too_large"),
    ((_e.UnsupportedTransferCoding,), 501, "Not Implemented", "", "unsupported_transfer_coding"),
    ((_e.ExpectationFailed,), 417, "Expectation Failed", "", "expectation_failed"),
    ((_e.ForbiddenProxyRequest,), 403, "Forbidden", "request forbidden: ", "forbidden"),
    ((_e.InvalidChunkSize, _e.ChunkMissingTerminator, _e.InvalidChunkExtension), 400, "Bad Request",
     "malformed chunked body: ", "bad_request"),
    ((_e.ParseException,), 400, "Bad Request", "malformed request: ", "bad_request"),
]


def describe(exc: BaseException) -> tuple[int, str, str, str] | None:
    """A client error as (status, reason, message, code); None for anything else (a server fault: a header the
    application wrote, a configuration problem, a bug)."""
    for classes, status, reason, prefix, code in CLIENT_ERRORS:
        if isinstance(exc, classes):
            if status is None:
                return None
            detail = str(exc) if isinstance(exc, ReadTimeout) else f"{type(exc).__name__}: {exc}"
            return status, reason, prefix + detail, code
    return None


