"""The event-stream encoder, checked against botocore's own decoder and SageMaker's service model."""

from __future__ import annotations

import json
import struct
import zlib

import botocore.session
import pytest
from botocore.eventstream import ChecksumMismatch, EventStream, EventStreamBuffer, EventStreamMessage
from botocore.exceptions import EventStreamError
from botocore.parsers import EventStreamJSONParser

from devtools import eventstream  # noqa: E402


def _decode_all(data: bytes, step: int | None = None) -> list[EventStreamMessage]:
    """Decode with botocore, feeding ``step`` bytes at a time (all at once when None)."""
    buffer = EventStreamBuffer()
    messages: list[EventStreamMessage] = []
    step = step or max(len(data), 1)
    for start in range(0, len(data), step):
        buffer.add_data(data[start : start + step])
        messages.extend(buffer)
    return messages


@pytest.mark.parametrize("size", [0, 1, 100 * 1024])
def test_payload_part_round_trips_through_botocore(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    assert len(payload) == size
    encoded = eventstream.payload_part(payload)
    (message,) = _decode_all(encoded)
    assert message.payload == payload
    assert message.headers == {
        ":event-type": "PayloadPart",
        ":content-type": "application/octet-stream",
        ":message-type": "event",
    }
    prelude = message.prelude
    assert prelude.total_length == len(encoded) == 12 + prelude.headers_length + size + 4
    assert prelude.crc == zlib.crc32(encoded[:8])
    assert message.crc == zlib.crc32(encoded[:-4]) == struct.unpack(">I", encoded[-4:])[0]


def test_prelude_and_header_layout() -> None:
    encoded = eventstream.encode_message({"ab": "xyz"}, b"P")
    header = b"\x02ab\x07\x00\x03xyz"
    assert encoded[:8] == struct.pack(">II", 12 + len(header) + 1 + 4, len(header))
    assert encoded[12 : 12 + len(header)] == header
    assert encoded[12 + len(header) : -4] == b"P"
    (message,) = _decode_all(encoded)
    assert message.headers == {"ab": "xyz"} and message.payload == b"P"


def test_several_messages_decode_incrementally_byte_by_byte() -> None:
    payloads = [b"", b"a", b'{"x": 1}\n' * 50, "é€😀".encode()]
    data = b"".join(eventstream.payload_part(p) for p in payloads)
    messages = _decode_all(data, step=1)
    assert [m.payload for m in messages] == payloads


def test_unicode_header_values_round_trip() -> None:
    (message,) = _decode_all(eventstream.encode_message({":custom": "héllo ✓", "x": ""}, b"z"))
    assert message.headers == {":custom": "héllo ✓", "x": ""}


@pytest.mark.parametrize("position", [1, 9, 20, -1])
def test_corrupted_message_fails_botocore_crc_checks(position: int) -> None:
    encoded = bytearray(eventstream.payload_part(b"some payload bytes"))
    encoded[position] ^= 0x01
    with pytest.raises(ChecksumMismatch):
        _decode_all(bytes(encoded))


def test_exception_event_headers_and_json_body() -> None:
    (message,) = _decode_all(eventstream.exception_event("ModelStreamError", "boom", "StreamBroken"))
    assert message.headers == {
        ":exception-type": "ModelStreamError",
        ":content-type": "application/json",
        ":message-type": "exception",
    }
    assert json.loads(message.payload) == {"Message": "boom", "ErrorCode": "StreamBroken"}
    assert message.to_response_dict()["status_code"] == 400


@pytest.mark.parametrize(
    ("headers", "payload"),
    [
        ({"": "x"}, b""),
        ({"n" * 256: "x"}, b""),
        ({"n": "v" * 32768}, b""),
        ({}, b"x" * (eventstream.MAX_PAYLOAD_BYTES + 1)),
    ],
)
def test_out_of_range_messages_are_rejected(headers: dict[str, str], payload: bytes) -> None:
    with pytest.raises(ValueError):
        eventstream.encode_message(headers, payload)


class _RawStream:
    """Stands in for the urllib3 response botocore reads an event stream from."""

    def __init__(self, data: bytes, chunk: int) -> None:
        self._data, self._chunk = data, chunk

    def stream(self):  # noqa: ANN201
        for start in range(0, len(self._data), self._chunk):
            yield self._data[start : start + self._chunk]

    def close(self) -> None:
        pass


def _sagemaker_event_stream(data: bytes) -> EventStream:
    """botocore's EventStream for InvokeEndpointWithResponseStream's ``Body`` over ``data``."""
    session = botocore.session.get_session()
    service_model = session.get_service_model("sagemaker-runtime")
    output = service_model.operation_model("InvokeEndpointWithResponseStream").output_shape
    body_shape = output.members["Body"]
    return EventStream(_RawStream(data, 5), body_shape, EventStreamJSONParser(), "InvokeEndpointWithResponseStream")


def test_botocore_parses_payload_parts_and_model_stream_error_with_the_sagemaker_model() -> None:
    data = eventstream.payload_part(b'{"a"') + eventstream.payload_part(b": 1}\n")
    data += eventstream.exception_event("ModelStreamError", "stream broke", "StreamBroken")
    events = iter(_sagemaker_event_stream(data))
    assert next(events) == {"PayloadPart": {"Bytes": b'{"a"'}}
    assert next(events) == {"PayloadPart": {"Bytes": b": 1}\n"}}
    with pytest.raises(EventStreamError) as caught:
        next(events)
    assert caught.value.response["Error"] == {"Code": "ModelStreamError", "Message": "stream broke"}
