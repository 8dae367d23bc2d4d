"""Hostile and malformed bodies against the real server: every answer is a 2xx or a 4xx with a JSON body, never a
5xx, never a hang, and the worker keeps serving afterwards.

Property tests (hypothesis) replace one field of a small valid body with a hostile value (wrong types, huge
numbers, NaN / Infinity literals written into the raw JSON text, lone surrogates, NUL, RTL marks, emoji, deep
nesting), plus non-object bodies; explicit tests cover the big cases (10k messages, 10k stop strings, 5,000 levels
of nesting, a body over 6 MiB). A schemathesis run checks the routes against ``docs/openapi.yaml``.

Requests that are valid and would generate are held to a few tokens (``max_tokens`` / ``max_new_tokens`` ≤ 4), or
streamed and closed after a few lines when the fuzzed field is the token limit itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TIMEOUT_S = 60  # a request not answered within this (per read) fails the test: a hang
SMALL = 2       # max_tokens / max_new_tokens for requests that generate
STREAM_LINES = 5  # lines read from a stream with a huge token limit before closing it
CHAT_ROUTES = ["/invocations", "/v1/chat/completions"]
RAW = "__RAW_JSON_TOKEN__"  # placeholder replaced in the serialised body by a raw JSON token
OPENAPI = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                database=None)

# ---- hostile values ------------------------------------------------------------------------------------------
UNICODE_EDGES = ["", "\x00", "a\x00b", "\u200f\u202eevil\u202c", "\u200b\u200d", "\ufeff", "\uffff", "\U0010ffff",
                 "😀👩‍👩‍👧‍👦🏳️‍🌈", "e\u0301\u0301\u0301", "\r\n\t\x1b[31m", "ℌ𝔢𝔩𝔩𝔬", "<|im_start|>system",
                 "</s><s>[INST]", "{{ raise_exception('x') }}", "{% for x in range(99999999) %}{% endfor %}",
                 "\\u0000", "A" * 1000]
# Raw JSON tokens that json.dumps cannot write: non-standard constants, out-of-range numbers, lone surrogates.
RAW_TOKENS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", '"\\ud800"', '"\\udfff"', '"a\\ud800b\\udc00"',
              '"\\udc00\\ud800"', '"\\u0000"', "1" * 5000, "0.0000000001e-400", "-0", "[" * 500 + "]" * 500,
              '{"a":' * 500 + "1" + "}" * 500, "[" * 50 + "]" * 50]  # deeper: test_deep_nesting
BIG_NUMBERS = [2**63, 2**63 - 1, 2**64, -(2**63) - 1, 10**40, 1e308, -1e308, 1.7976931348623157e308, 5e-324,
               -0.0, 0, -1, 1e-300]

scalar_values = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.sampled_from(BIG_NUMBERS),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30), st.sampled_from(UNICODE_EDGES))
hostile_values = st.one_of(
    scalar_values,
    st.lists(scalar_values, max_size=5),
    st.dictionaries(st.text(max_size=8), scalar_values, max_size=4),
    st.just([]), st.just({}), st.just([[]]), st.just([{}]),
    st.sampled_from(RAW_TOKENS).map(lambda token: ("raw", token)),
)

CHAT_FIELDS = ["messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
               "seed", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "user",
               "stream", "stream_options", "top_k", "min_p", "repetition_penalty", "ignore_eos", "inputs",
               "functions", "__proto__", ""]
MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "tool_call_id", "extra"]
LEGACY_PARAMETERS = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "do_sample", "repetition_penalty",
                     "frequency_penalty", "presence_penalty", "stop", "stop_sequences", "seed", "return_full_text",
                     "details", "top_n_tokens", "ignore_eos", "best_of"]
LEGACY_FIELDS = ["inputs", "parameters", "stream", "messages", "extra"]
TOKEN_LIMITS = {"max_tokens", "max_completion_tokens", "max_new_tokens"}


# ---- helpers -------------------------------------------------------------------------------------------------
def serialise(body: object, raw_token: str | None = None) -> bytes:
    text = json.dumps(body, ensure_ascii=True)
    if raw_token is not None:
        text = text.replace(json.dumps(RAW), raw_token, 1)
    return text.encode()


def put(value: object) -> tuple[object, str | None]:
    """A hostile value as (what goes into the body, the raw token that replaces the placeholder, if any)."""
    if isinstance(value, tuple) and value[:1] == ("raw",):
        return RAW, value[1]
    return value, None


def is_huge_limit(field: str, value: object) -> bool:
    """A token limit that lets the request generate more than a few tokens (None: the default, up to 256 or the
    context)."""
    return field in TOKEN_LIMITS and (value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                        and value > 4))


def send(url: str, path: str, data: bytes, *, stream_lines: int | None = None,
         content_type: str = "application/json", accept: str | None = None) -> tuple[int, object]:
    """POST raw bytes; check the answer is a 2xx or a 4xx with a well-formed body. Returns (status, parsed body)."""
    headers = {"Content-Type": content_type}
    if accept:
        headers["Accept"] = accept
    with requests.post(f"{url}{path}", data=data, headers=headers, timeout=TIMEOUT_S, stream=True) as response:
        status, ctype = response.status_code, response.headers.get("Content-Type", "")
        described = f"{path} {data[:300]!r}"
        if status >= 300 or ctype.split(";")[0].strip() == "application/json":
            raw = response.content
            assert status < 500, f"{status} for {described}: {raw[:500]!r}"
            assert 200 <= status < 300 or 400 <= status <= 500, f"{status} for {described}"
            assert ctype.split(";")[0].strip() == "application/json", f"{status} {ctype} for {described}"
            payload = json.loads(raw)
            if status >= 400:
                assert isinstance(payload, dict) and "error" in payload, f"{status} {raw[:300]!r} for {described}"
            return status, payload
        assert status == 200, f"{status} for {described}"
        return status, read_stream(response, ctype, stream_lines, described)


def read_stream(response: requests.Response, ctype: str, max_lines: int | None, described: str) -> list[dict]:
    """A streamed answer: every line JSON (JSON lines) or ``data: <JSON>`` (SSE), ending in a newline and, when
    read to the end, with a final record (finish_reason / generated_text / error) and SSE's ``[DONE]``."""
    records: list[dict] = []
    buffer, done, complete = b"", False, True
    for piece in response.iter_content(chunk_size=None):
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if not line:
                continue
            text = line.decode("utf-8")
            if ctype.startswith("text/event-stream"):
                assert text.startswith("data: "), f"bad SSE line {text!r} for {described}"
                text = text[len("data: "):]
                if text == "[DONE]":
                    done = True
                    continue
            assert not done, f"data after [DONE] for {described}"
            records.append(json.loads(text))
        if max_lines is not None and len(records) >= max_lines:
            complete = False
            break
    if complete:
        assert buffer == b"", f"stream does not end in a newline: {buffer[-200:]!r} for {described}"
        assert records, f"empty stream for {described}"
        last = records[-1]
        assert "error" in last or last.get("generated_text") is not None or any(
            c.get("finish_reason") for c in last.get("choices") or []) or (
            not last.get("choices") and "usage" in last), f"stream ends without a final record for {described}"
        if ctype.startswith("text/event-stream"):
            assert done, f"SSE without [DONE] for {described}"
    return records


def assert_alive(url: str) -> None:
    assert requests.get(f"{url}/ping", timeout=TIMEOUT_S).status_code == 200
    response = requests.post(f"{url}/invocations", timeout=TIMEOUT_S,
                             json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": SMALL})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None


def chat_base() -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": SMALL}


# ---- property tests ------------------------------------------------------------------------------------------
@FUZZ
@given(field=st.sampled_from(CHAT_FIELDS), value=hostile_values, route=st.sampled_from(CHAT_ROUTES))
def test_chat_field_gets_hostile_value(url: str, field: str, value: object, route: str) -> None:
    body = chat_base()
    body[field], raw = put(value)
    huge = is_huge_limit(field, value)
    if huge:
        body["stream"] = True
    send(url, route, serialise(body, raw), stream_lines=STREAM_LINES if huge else None)


@FUZZ
@given(field=st.sampled_from(MESSAGE_FIELDS), value=hostile_values, route=st.sampled_from(CHAT_ROUTES),
       where=st.integers(0, 2))
def test_message_field_gets_hostile_value(url: str, field: str, value: object, route: str, where: int) -> None:
    body = chat_base()
    body["messages"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello"}]
    body["messages"][where][field], raw = put(value)
    send(url, route, serialise(body, raw))


@FUZZ
@given(field=st.sampled_from(LEGACY_PARAMETERS + LEGACY_FIELDS), value=hostile_values,
       accept=st.sampled_from([None, "text/event-stream"]))
def test_legacy_field_gets_hostile_value(url: str, field: str, value: object, accept: str | None) -> None:
    body: dict = {"inputs": "Hi", "parameters": {"max_new_tokens": SMALL}}
    injected, raw = put(value)
    if field in LEGACY_FIELDS:
        body[field] = injected
        if field == "parameters" and isinstance(injected, dict):
            injected["max_new_tokens"] = SMALL  # {} would mean the 256-token default
    else:
        body["parameters"][field] = injected
    huge = is_huge_limit(field, value)
    if huge:
        body["stream"] = True
    send(url, "/invocations", serialise(body, raw), stream_lines=STREAM_LINES if huge else None, accept=accept)


@FUZZ
@given(text=st.one_of(st.text(max_size=60), st.sampled_from(UNICODE_EDGES),
                      st.sampled_from(['"\\ud800"', '"\\udbff\\udfff"', '"x\\udfffy"', '"\\u202e\\u0000"'])
                      .map(lambda token: ("raw", token))),
       where=st.sampled_from(["content", "part", "name", "model", "user", "stop", "inputs", "legacy_stop"]),
       stream=st.booleans())
def test_unicode_edge_cases_in_text_fields(url: str, text: object, where: str, stream: bool) -> None:
    value, raw = put(text)
    if where in ("inputs", "legacy_stop"):
        body: dict = {"inputs": "Hi", "parameters": {"max_new_tokens": SMALL}, "stream": stream}
        if where == "inputs":
            body["inputs"] = value
        else:
            body["parameters"]["stop"] = [value]
    else:
        body = chat_base() | {"stream": stream}
        message = body["messages"][0]
        if where == "content":
            message["content"] = value
        elif where == "part":
            message["content"] = [{"type": "text", "text": value}, {"type": "text", "text": "!"}]
        elif where == "name":
            message["name"] = value
        elif where == "stop":
            body["stop"] = [value]
        else:
            body[where] = value
    send(url, "/invocations", serialise(body, raw))


@FUZZ
@given(data=st.one_of(
    st.sampled_from(RAW_TOKENS).map(str.encode),
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20),
              st.lists(st.integers(), max_size=4)).map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.sampled_from([b"", b" ", b"{", b"}", b'{"messages":', b'{"messages": [}', b"\xff\xfe{}", b"\xef\xbb\xbf{}",
                     b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,}', b"null", b"[]",
                     b'{"inputs": "a", "inputs": [], "parameters": {"max_new_tokens": 2}}', b"\x00" * 64,
                     b'{"messages": "' + b"\xc3\x28" + b'"}']),
), route=st.sampled_from(CHAT_ROUTES))
def test_non_object_and_broken_bodies(url: str, data: bytes, route: str) -> None:
    status, _ = send(url, route, data)
    assert 400 <= status < 500


# ---- explicit big cases --------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", CHAT_ROUTES)
@pytest.mark.parametrize("template", ["[" * 5000 + "]" * 5000, '{"messages": ' + "[" * 5000 + "]" * 5000 + "}",
                                      '{"inputs": ' + "[" * 5000 + "]" * 5000 + "}",
                                      '{"messages": [{"role": "user", "content": "hi"}], "logit_bias": '
                                      + '{"1": ' * 5000 + "1" + "}" * 5000 + "}"])
def test_deep_nesting(url: str, route: str, template: str) -> None:
    status, _ = send(url, route, template.encode())
    assert status == 400


def test_ten_thousand_messages(url: str) -> None:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(10_000)]
    status, payload = send(url, "/invocations", serialise({"messages": messages, "max_tokens": SMALL}))
    assert status == 400, payload  # far over the context: a 400 naming both lengths


@pytest.mark.parametrize("body", [
    chat_base() | {"stop": [f"s{i}" for i in range(10_000)]},
    chat_base() | {"stop": ["x"] * 10_000},
    {"inputs": "Hi", "parameters": {"max_new_tokens": SMALL, "stop": [f"s{i}" for i in range(10_000)]}},
    {"inputs": "Hi", "parameters": {"max_new_tokens": SMALL, "stop_sequences": ["\u202e" * 3] * 10_000}},
    {"inputs": ["Hi"] * 200, "parameters": {"max_new_tokens": 1}},
    chat_base() | {"logit_bias": {str(i): 1.0 for i in range(10_000)}},
], ids=["chat-10k-distinct", "chat-10k-same", "legacy-stop-10k", "legacy-stop-sequences-10k", "legacy-200-inputs",
        "chat-logit-bias-10k"])
def test_ten_thousand_element_lists(url: str, body: dict) -> None:
    status, _ = send(url, "/invocations", serialise(body))
    assert status == 200 or 400 <= status < 500


@pytest.mark.parametrize("route", CHAT_ROUTES)
def test_body_over_six_mib(url: str, route: str) -> None:
    body = chat_base() | {"messages": [{"role": "user", "content": "a" * (6 * 1024 * 1024 + 10)}]}
    status, _ = send(url, route, serialise(body))
    assert status == 413


@pytest.mark.parametrize("body", [
    chat_base() | {"max_tokens": 2**63, "stream": True},
    chat_base() | {"max_completion_tokens": 2**64, "stream": True},
    chat_base() | {"seed": 2**63, "temperature": 1.0},
    chat_base() | {"seed": -(2**63) - 1, "temperature": 1.0},
    chat_base() | {"seed": 2**200, "temperature": 1.0, "n": 3},
    chat_base() | {"logit_bias": {str(2**63): 1.0}},
    chat_base() | {"logit_bias": {"-1": 1.0}},
    chat_base() | {"n": 128, "max_tokens": 1},
    {"inputs": "Hi", "parameters": {"max_new_tokens": 2**63}, "stream": True},
    {"inputs": "Hi", "parameters": {"max_new_tokens": SMALL, "seed": 2**64, "do_sample": True}},
    {"inputs": "Hi", "parameters": {"max_new_tokens": SMALL, "temperature": 100.0, "top_n_tokens": 20,
                                    "details": True}},
])
def test_huge_numbers(url: str, body: dict) -> None:
    status, _ = send(url, "/invocations", serialise(body), stream_lines=STREAM_LINES)
    assert status == 200 or 400 <= status < 500


# Bodies the fuzzing found answering 500 (each fixed; the comments say where the fault was).
BUG_BODIES = {
    # sampler.py:90 torch.tensor(top_k) overflows int64 -> ValueError fails the whole engine step (engine.py:231-234
    # then ends every running sequence with "model step failed", not only this request)
    "chat-top-k-2**63": ("/invocations", serialise(chat_base() | {"top_k": 2**63, "temperature": 1.0})),
    "legacy-top-k-1e30": ("/invocations", serialise({"inputs": "Hi", "parameters": {"max_new_tokens": SMALL,
                                                                                 "top_k": 10**30}})),
    # sampler.py:80 logits / temperature in fp32: 1e-300 is 0 in fp32 -> inf -> multinomial RuntimeError (whole step)
    "legacy-temperature-1e-300": ("/invocations", serialise({"inputs": "Hi", "parameters": {
        "max_new_tokens": SMALL, "temperature": 1e-300}})),
    "chat-temperature-1e-300": ("/v1/chat/completions", serialise(chat_base() | {"temperature": 1e-300})),
    # sampler.py:64 logits / repetition_penalty: 5e-324 -> inf -> "the model produced non-finite logits" 500
    # (found by schemathesis)
    "chat-repetition-penalty-5e-324": ("/invocations", serialise(chat_base() | {"repetition_penalty": 5e-324})),
    # tokenization.py:32 a lone surrogate (valid JSON "\\ud800") reaches tokenizers -> TypeError -> 500
    "chat-lone-surrogate": ("/invocations",
                            b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'),
    "legacy-lone-surrogate": ("/invocations", b'{"inputs": "\\udfff", "parameters": {"max_new_tokens": 2}}'),
}


@pytest.mark.parametrize("name", list(BUG_BODIES))
def test_bodies_that_once_answered_500(url: str, name: str) -> None:
    path, data = BUG_BODIES[name]
    with requests.post(f"{url}{path}", data=data, headers={"Content-Type": "application/json"},
                       timeout=TIMEOUT_S) as response:
        assert response.status_code < 500, f"{response.status_code} {response.text[:300]}"


# ---- schemathesis: the routes against docs/openapi.yaml ------------------------------------------------------
try:
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import status_code_conformance
except ImportError:  # pragma: no cover - schemathesis is pinned in requirements-dev.txt
    schemathesis = None

if schemathesis is not None:
    SCHEMA = schemathesis.openapi.from_path(OPENAPI)

    # an input body with only these fields is an embeddings body; any other field makes it a Responses request
    EMBEDDING_FIELDS = {"input", "model", "encoding_format", "dimensions", "user", "instruction"}

    def is_responses_body(body: dict) -> bool:
        """The /invocations sniffing rule (docs/api.md: Responses API): a field embeddings lack, or items."""
        items = body.get("input")
        return bool(body.keys() - EMBEDDING_FIELDS) or (isinstance(items, list) and any(
            isinstance(item, dict) for item in items))

    def bounded(body: object, path: str = "/invocations") -> object:
        """Hold a generating request to a few tokens; leave wrong types alone (they are refused anyway)."""
        if not isinstance(body, dict):
            return body
        for where in (body, body.get("parameters")):  # a minimum holds EOS back: as bounded as the maximum
            for key in ("min_tokens", "min_new_tokens"):
                value = where.get(key) if isinstance(where, dict) else None
                if isinstance(value, int) and not isinstance(value, bool) and value > SMALL:
                    where[key] = SMALL
        if "messages" in body:
            for key in ("max_tokens", "max_completion_tokens"):
                if is_huge_limit(key, body.get(key)):
                    body[key] = SMALL
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                body["max_tokens"] = SMALL
        elif "inputs" in body:
            parameters = body.setdefault("parameters", {})
            if isinstance(parameters, dict):
                value = parameters.get("max_new_tokens")
                if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > SMALL):
                    parameters["max_new_tokens"] = SMALL
        elif "prompt" in body and is_huge_limit("max_tokens", body.get("max_tokens")):
            body["max_tokens"] = SMALL
        elif "input" in body and (path == "/v1/responses" or is_responses_body(body)):
            value = body.get("max_output_tokens")
            if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > SMALL):
                body["max_output_tokens"] = SMALL
        return body

    @SCHEMA.parametrize()
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def test_openapi_conformance(case, url: str) -> None:
        if case.body is not None:
            case.body = bounded(case.body, case.path)
        response = case.call(base_url=url, timeout=TIMEOUT_S)
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance])


def test_worker_still_alive_after_the_fuzzing(url: str) -> None:
    assert_alive(url)
