"""Encoder for the AWS event-stream binary format (``application/vnd.amazon.eventstream``).

Written from the published wire format, used by :mod:`devtools.local_runtime` to emulate SageMaker's
``InvokeEndpointWithResponseStream`` and ``InvokeEndpointWithBidirectionalStream``. One message is::

    prelude:  total length (uint32 BE) | headers length (uint32 BE) | CRC32 of those 8 bytes (uint32 BE)
    headers:  repeated  name length (uint8) | name (UTF-8) | value type (uint8) | value ...
    payload:  raw bytes
    trailer:  CRC32 of everything above (uint32 BE)

Only the string header type (7: value length uint16 BE + UTF-8 bytes) is produced: it is the only type
the SageMaker runtime sends. Decoding is left to botocore (``botocore.eventstream``); the tests check
that botocore's own parser reads what this module writes.
"""

from __future__ import annotations

import json
import struct
import zlib

_PRELUDE = struct.Struct(">II")
_CRC = struct.Struct(">I")
_PRELUDE_LENGTH = _PRELUDE.size + _CRC.size
_STRING_TYPE = 7
MAX_HEADER_NAME_BYTES = 255
MAX_STRING_VALUE_BYTES = 2**15 - 1
MAX_HEADERS_BYTES = 128 * 1024
MAX_PAYLOAD_BYTES = 16 * 1024 * 1024


def _crc32(data: bytes) -> int:
    """The unsigned CRC-32 (IEEE) the format uses for the prelude and the whole message."""
    return zlib.crc32(data) & 0xFFFFFFFF


def encode_header(name: str, value: str) -> bytes:
    """One string-typed header: name length, name, type 7, value length (u16 BE), value."""
    name_bytes = name.encode("utf-8")
    value_bytes = value.encode("utf-8")
    if not 0 < len(name_bytes) <= MAX_HEADER_NAME_BYTES:
        raise ValueError(f"header name must be 1..{MAX_HEADER_NAME_BYTES} bytes: {name!r}")
    if len(value_bytes) > MAX_STRING_VALUE_BYTES:
        raise ValueError(f"header {name!r} value is over {MAX_STRING_VALUE_BYTES} bytes")
    return (
        struct.pack(">B", len(name_bytes))
        + name_bytes
        + struct.pack(">BH", _STRING_TYPE, len(value_bytes))
        + value_bytes
    )


def encode_message(headers: dict[str, str], payload: bytes) -> bytes:
    """A complete event-stream message with ``headers`` (all strings) and ``payload``."""
    header_bytes = b"".join(encode_header(name, value) for name, value in headers.items())
    if len(header_bytes) > MAX_HEADERS_BYTES:
        raise ValueError(f"headers are {len(header_bytes)} bytes, over {MAX_HEADERS_BYTES}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload is {len(payload)} bytes, over {MAX_PAYLOAD_BYTES}")
    total_length = _PRELUDE_LENGTH + len(header_bytes) + len(payload) + _CRC.size
    prelude = _PRELUDE.pack(total_length, len(header_bytes))
    message = prelude + _CRC.pack(_crc32(prelude)) + header_bytes + bytes(payload)
    return message + _CRC.pack(_crc32(message))


def payload_part(data: bytes, data_type: str | None = None, completion_state: str | None = None) -> bytes:
    """A SageMaker ``PayloadPart`` event: the payload is the raw ``Bytes`` blob (``eventpayload``); a bidirectional
    stream's parts also say ``DataType`` (``UTF8`` / ``BINARY``) and ``CompletionState`` (``PARTIAL`` /
    ``COMPLETE``) in event headers."""
    headers = {
        ":event-type": "PayloadPart",
        ":content-type": "application/octet-stream",
        ":message-type": "event",
    }
    if data_type is not None:
        headers["DataType"] = data_type
    if completion_state is not None:
        headers["CompletionState"] = completion_state
    return encode_message(headers, data)


def exception_event(exception_type: str, message: str, error_code: str | None = None) -> bytes:
    """A modeled exception event (e.g. ``ModelStreamError``) with a JSON ``{"Message", "ErrorCode"}`` body.

    botocore turns it into ``botocore.exceptions.EventStreamError`` whose ``response["Error"]["Code"]``
    is ``exception_type``.
    """
    body: dict[str, str] = {"Message": message}
    if error_code is not None:
        body["ErrorCode"] = error_code
    headers = {
        ":exception-type": exception_type,
        ":content-type": "application/json",
        ":message-type": "exception",
    }
    return encode_message(headers, json.dumps(body).encode("utf-8"))
