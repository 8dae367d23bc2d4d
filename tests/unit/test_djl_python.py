"""LMI's handler API, ``djl_python``: the names and meanings of djl-serving's ``djl_python/inputs.py``,
``outputs.py`` and ``encode_decode.py``, as LMI handlers use them."""

from __future__ import annotations

import io
import json

import numpy
import pytest

from djl_python import Input as LmiInput
from djl_python import Output as LmiOutput
from djl_python.encode_decode import decode, encode
from handler.djl import Input, Output, PairList


def request(body: bytes, content_type: str = "application/json", **headers: str) -> Input:
    """An Input as the server builds it: the body, the headers (Content-Type among them) and the settings."""
    return Input(body, content_type, {"Content-Type": content_type, **headers}, {"model_dir": "/m"})


def test_djl_python_names_are_the_servers_own_types() -> None:
    assert LmiInput is Input and issubclass(LmiOutput, Output)
    from djl_python.inputs import Input as FromInputs
    from djl_python.outputs import Output as FromOutputs
    from djl_python.pair_list import PairList as FromPairList
    assert (FromInputs, FromOutputs, FromPairList) == (Input, LmiOutput, PairList)


def test_input_reads_the_body_the_ways_lmi_handlers_do() -> None:
    inputs = request(b'{"inputs": "hi", "parameters": {"max_new_tokens": 3}}', **{"X-Amzn-Trace": "t1"})
    assert not inputs.is_empty() and inputs.get_as_json()["inputs"] == "hi"
    assert inputs.get_as_string().startswith('{"inputs"') and inputs.get_as_bytes().startswith(b"{")
    assert inputs.get_data() == inputs.get_as_json()                 # by content type: JSON
    assert inputs.contains_key("data") and not inputs.contains_key("other")
    assert inputs.get_content().get_keys() == ["data"]
    assert inputs.get_property("content-type") == "application/json"  # a header, in any case
    assert inputs.get_property("x-amzn-trace") == "t1" and inputs.get_property("MODEL_DIR") == "/m"
    assert inputs.get_properties()["model_dir"] == "/m"
    assert (inputs.is_batch(), inputs.get_batch_size(), inputs.get_batches()) == (False, 1, [inputs])
    with pytest.raises(KeyError, match="key:other"):
        inputs.get_as_bytes("other")


def test_the_initialisation_call_is_empty_and_holds_the_settings() -> None:
    inputs = Input(properties={"model_id": "/opt/ml/model"})
    assert inputs.is_empty() and inputs.get_as_bytes() == b"" and inputs.get_data() is None
    assert inputs.get_properties() == {"model_id": "/opt/ml/model"}


def test_get_data_by_content_type() -> None:
    assert request(b"hello", "text/plain").get_data() == "hello"
    assert request(b"\x00\x01", "application/octet-stream").get_data() == b"\x00\x01"
    buffer = io.BytesIO()
    numpy.savez(buffer, numpy.arange(3))
    [array] = request(buffer.getvalue(), "tensor/npz").get_data()
    assert array.tolist() == [0, 1, 2]


def test_a_batch_in_lmis_layout_splits_into_requests() -> None:
    """LMI's batched Input (``batch_NNN_`` names); this server sends one request a call, but handlers and their own
    tests build these."""
    batch = Input()
    batch.properties.update({"batch_size": "2", "batch_000_content-type": "text/plain", "batch_001_eula": "true"})
    batch.content.add("batch_000_data", b"first")
    batch.content.add("batch_001_data", b"second")
    first, second = batch.get_batches()
    assert (first.get_as_string(), second.get_as_string()) == ("first", "second")
    assert first.get_property("Content-Type") == "text/plain" and second.get_property("eula") == "true"


def test_output_builds_the_answer_the_ways_lmi_handlers_do() -> None:
    output = LmiOutput().add_as_json({"generated_text": "x", "score": numpy.float32(0.5), "ids": numpy.arange(2)})
    output.add_property("X-Custom", "1").set_code(201).set_message("Created")
    assert output.get_as_json() == {"generated_text": "x", "score": 0.5, "ids": [0, 1]}
    assert (output.code, output.message, output.get_property("x-custom")) == (201, "Created", "1")
    assert output.get_property("content-type") == "application/json"


def test_output_body_is_the_data_part_else_the_first() -> None:
    assert Output().add("first").add(b"second").get_as_bytes() == b"first"
    assert Output().add("first").add("chosen", key="data").get_as_bytes() == b"chosen"
    assert Output().add({"a": 1}).get_as_json() == {"a": 1}


def test_output_error_is_lmis_json_error_with_one_content_type_header() -> None:
    output = Output()
    output.add_property("content-type", "application/json")
    output.error("the model is cold")
    assert (output.code, output.message) == (424, "invoke handler failure")
    assert output.get_as_json() == {"code": 424, "message": "invoke handler failure", "error": "the model is cold"}
    assert [k for k in output.properties if k.lower() == "content-type"] == ["Content-Type"]


def test_stream_content_lmis_default_formatter_and_none() -> None:
    wrapped = LmiOutput().add_stream_content(iter(["a", "b"]))
    assert [json.loads(line) for line in b"".join(wrapped.iter_body()).splitlines()] == [{"outputs": "a"},
                                                                                         {"outputs": "b"}]
    raw = LmiOutput().add_stream_content(iter(["t-0\n", b"t-1\n"]), None)
    assert list(raw.iter_body()) == [b"t-0\n", b"t-1\n"]
    assert raw.get_property("Content-Type") == "application/jsonlines"
    ours = Output().add_stream_content(iter(["x\n"]))      # handler.djl's own default: chunks as they are
    assert ours.get_as_bytes() == b"x\n"


@pytest.mark.parametrize(("body", "content_type", "decoded"), [
    (b'{"inputs": "hi"}', "application/json", {"inputs": "hi"}),
    (b'{"inputs": "hi"}', "application/json; charset=utf-8", {"inputs": "hi"}),
    (b'{"inputs": "hi"}', None, {"inputs": "hi"}),
    (b"", None, {"inputs": ""}),
    (b"hello there", "text/plain", {"inputs": ["hello there"]}),
    (b"inputs\nfirst\nsecond\n", "text/csv", {"inputs": ["first", "second"]}),
    (b"question,context\nwho?,me\n", "text/csv", {"inputs": [{"question": "who?", "context": "me"}]}),
    (b"a=1&b=2", "application/x-www-form-urlencoded", {"inputs": "a=1&b=2"}),
    (b"RIFF....", "audio/wav", {"inputs": b"RIFF...."}),
    (b"\x00\x01", "application/octet-stream", {"inputs": b"\x00\x01"}),
])
def test_decode_by_content_type(body: bytes, content_type: str | None, decoded: object) -> None:
    assert decode(request(body, content_type or ""), content_type) == decoded


def test_decode_refuses_csv_without_a_known_header_in_one_line() -> None:
    with pytest.raises(ValueError, match="header row naming one of question, context, inputs"):
        decode(request(b"x,y\n1,2\n", "text/csv"), "text/csv")
    assert decode(request(b"1,2\n3,4\n", "text/csv"), "text/csv", require_csv_headers=False).tolist() == [[1, 2],
                                                                                                          [3, 4]]


@pytest.mark.parametrize(("prediction", "content_type", "body", "header"), [
    ({"generated_text": "x"}, "application/json", b'{"generated_text": "x"}', "application/json"),
    ([{"generated_text": "x"}], None, b'[{"generated_text": "x"}]', "application/json"),
    ({"a": 1}, "*/*", b'{"a": 1}', "application/json"),                 # an Accept header taking anything
    ([{"label": "a", "score": 1}], "text/csv", b"label,score\r\na,1\r\n", "text/csv"),
    ("plain words", "text/plain", b"plain words", "text/plain"),
])
def test_encode_by_content_type(prediction: object, content_type: str | None, body: bytes, header: str) -> None:
    output = Output()
    encode(output, prediction, content_type)
    assert output.get_as_bytes() == body and output.get_property("content-type") == header


def test_encode_refuses_what_it_cannot_write_in_one_line() -> None:
    with pytest.raises(ValueError, match="cannot encode a prediction as 'tensor/ndlist'"):
        encode(Output(), [numpy.zeros(2)], "tensor/ndlist")
