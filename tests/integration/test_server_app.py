"""The Flask app through ``app.test_client()``, with the real renderer and a fake engine that replays scripted events.

Asserts routes, schema sniffing, error shapes and status codes, and the exact bytes of JSON, JSON lines and SSE.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from handler import server
from handler.config import DEFAULT_MODEL_DIR, Settings
from handler.endpoints import base as endpoint_base
from handler.engine.backend import EngineLimits
from handler.engine.types import FinishReason, GenerationRequest, TokenEvent, TopLogprob
from handler.errors import EngineError, NotReady, Overloaded
from handler.prompt.renderer import PromptRenderer
from handler.service import RequestDefaults
from tests.integration.conftest import post

MODEL_NAME = "smollm2-135m-instruct"
HELLO, WORLD, EOS = 19556, 905, 2           # "Hello", " world", "<|im_end|>" in the embedded tokenizer
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
CREATED = 1700000000


class FakeHandle:
    """Replays a script; an exception in the script is raised at that point of the iteration."""

    def __init__(self, request: GenerationRequest, script: list) -> None:
        self.request = request
        self.script = script
        self.cancelled = 0
        self.num_yielded = 0

    def cancel(self) -> None:
        self.cancelled += 1

    def __iter__(self) -> Iterator[TokenEvent]:
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            self.num_yielded += 1
            yield item


def hello_script(request: GenerationRequest) -> list:
    """Every choice says "Hello world" and ends with EOS; choices interleave token by token."""
    num_prompt = len(request.prompt_ids)
    events = []
    for token, text, logprob in [(HELLO, "Hello", -0.5), (WORLD, " world", -0.25)]:
        for index in range(request.n):
            top = (TopLogprob(token, logprob),) if request.num_top_logprobs else ()
            events.append(TokenEvent(index, token, text, logprob, top_logprobs=top))
    for index in range(request.n):
        events.append(TokenEvent(index, EOS, "", -0.125, is_special=True, finish_reason=FinishReason.EOS,
                                 num_prompt_tokens=num_prompt, num_generated_tokens=3))
    return events


class FakeEngine:
    embeds_only = False
    limits = EngineLimits(max_running=8, max_model_len=8192, max_step_tokens=512)
    score_type = None

    def __init__(self, script: Callable[[GenerationRequest], list] = hello_script) -> None:
        self.is_ready = True
        self.load_error: str | None = None
        self.script = script
        self.submit_error: Exception | None = None
        self.handles: list[FakeHandle] = []

    def submit(self, request: GenerationRequest) -> FakeHandle:
        if self.submit_error is not None:
            raise self.submit_error
        handle = FakeHandle(request, self.script(request))
        self.handles.append(handle)
        return handle


@pytest.fixture(scope="module")
def renderer() -> PromptRenderer:
    if not (DEFAULT_MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip("the embedded model is not assembled (make model)")
    from handler.engine.core.tokenizer import load_tokenizer

    return PromptRenderer(load_tokenizer(Path(DEFAULT_MODEL_DIR)))


class FakeService(types.SimpleNamespace):
    """What create_app reads from ModelService, around a scripted engine."""

    engine_path = "lean"
    serves_builtin = True
    adapters = None

    @property
    def is_ready(self) -> bool:
        return self.engine.is_ready

    @property
    def load_error(self) -> str | None:
        return self.engine.load_error


@pytest.fixture()
def service(renderer: PromptRenderer) -> FakeService:
    return FakeService(settings=Settings(), model_name=MODEL_NAME, defaults=RequestDefaults(0.0, 256),
                       renderer=renderer, engine=FakeEngine(), user_handler=None)


@pytest.fixture()
def client(service, monkeypatch):
    monkeypatch.setattr(endpoint_base, "time", types.SimpleNamespace(time=lambda: CREATED + 0.75))
    monkeypatch.setattr("handler.protocol.chat.new_request_id", lambda prefix: f"{prefix}-test")
    monkeypatch.setattr("handler.protocol.legacy.new_request_id", lambda prefix: f"{prefix}-test")
    app = server.create_app(service)
    return app.test_client()


# ---- /ping ----------------------------------------------------------------------------------------------------

def test_ping_503_before_ready_then_200_empty(client, service) -> None:
    service.engine.is_ready = False
    response = client.get("/ping")
    assert response.status_code == 503
    assert response.get_json() == {"status": "loading"}
    service.engine.is_ready = True
    response = client.get("/ping")
    assert response.status_code == 200
    assert response.data == b""


def test_ping_reports_load_error(client, service) -> None:
    service.engine.is_ready = False
    service.engine.load_error = "OSError: no weights"
    response = client.get("/ping")
    assert response.status_code == 503
    assert response.get_json() == {"status": "OSError: no weights"}


def test_ping_503_while_draining(service, renderer) -> None:
    app = server.create_app(service, is_draining=lambda: True)
    response = app.test_client().get("/ping")
    assert response.status_code == 503
    assert response.get_json() == {"status": "stopping"}


def test_invocations_before_ready_is_503(client, service) -> None:
    service.engine.is_ready = False
    response = post(client, "/invocations", CHAT)
    assert response.status_code == 503
    assert response.get_json()["error"]["type"] == "service_unavailable"
    assert service.engine.handles == []


# ---- sniffing and non-streaming bodies ------------------------------------------------------------------------

def test_chat_completion_exact_json(client, service) -> None:
    response = post(client, "/invocations", CHAT)
    assert response.status_code == 200
    assert response.mimetype == "application/json"
    (handle,) = service.engine.handles
    num_prompt = len(handle.request.prompt_ids)
    assert response.data == (
        '{"id":"chatcmpl-test","object":"chat.completion","created":1700000000,"model":"smollm2-135m-instruct",'
        '"system_fingerprint":"fp_sagemaker_llm_container","choices":[{"index":0,"message":{"role":"assistant",'
        '"content":"Hello world"},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":'
        + str(num_prompt) + ',"completion_tokens":3,"total_tokens":' + str(num_prompt + 3) + "}}").encode()
    assert response.headers["X-Request-Id"] == "chatcmpl-test"
    assert handle.cancelled >= 1
    # the real renderer applied the chat template
    assert handle.request.prompt_ids == tuple(service.renderer.render_chat([{"role": "user", "content": "hi"}]))


def test_chat_completion_n_and_logprobs(client, service) -> None:
    response = post(client, "/v1/chat/completions", {**CHAT, "n": 2, "logprobs": True, "top_logprobs": 1,
                                                     "model": "mine"})
    body = response.get_json()
    assert response.status_code == 200
    assert body["model"] == "mine"
    assert [c["message"]["content"] for c in body["choices"]] == ["Hello world", "Hello world"]
    assert body["usage"]["completion_tokens"] == 6
    assert body["choices"][1]["logprobs"]["content"] == [
        {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"),
         "top_logprobs": [{"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")}]},
        {"token": " world", "logprob": -0.25, "bytes": list(b" world"),
         "top_logprobs": [{"token": " world", "logprob": -0.25, "bytes": list(b" world")}]}]


def test_messages_win_over_inputs(client, service) -> None:
    response = post(client, "/invocations", {**CHAT, "inputs": "legacy?"})
    assert response.status_code == 200
    assert response.get_json()["object"] == "chat.completion"
    assert response.get_json()["choices"][0]["message"]["content"] == "Hello world"
    (handle,) = service.engine.handles
    assert handle.request.request_id == "chatcmpl-test"


def test_inputs_is_legacy(client, service) -> None:
    response = post(client, "/invocations", {"inputs": "Say hi"})
    assert response.status_code == 200
    assert response.data == b'{"generated_text":"Hello world"}'
    assert response.headers["X-Request-Id"] == "gen-test"
    (handle,) = service.engine.handles
    assert handle.request.prompt_ids == tuple(service.renderer.encode("Say hi", add_special_tokens=True))
    assert handle.request.stop.max_new_tokens == service.settings.default_max_new_tokens


def test_legacy_list_details_and_full_text(client, service) -> None:
    response = post(client, "/invocations", {"inputs": ["A:", "B:"], "parameters": {
        "details": True, "return_full_text": True, "max_new_tokens": 3}})
    assert response.status_code == 200
    token = {"id": HELLO, "text": "Hello", "log_prob": -0.5, "special": False}
    assert response.get_json() == [{"generated_text": f"{p}Hello world", "details": {
        "finish_reason": "eos_token", "generated_tokens": 3, "inputs": p,
        "tokens": [token, {"id": WORLD, "text": " world", "log_prob": -0.25, "special": False},
                   {"id": EOS, "text": "<|im_end|>", "log_prob": -0.125, "special": True}]}} for p in ("A:", "B:")]
    assert len(service.engine.handles) == 2


def test_neither_field_is_400_naming_both(client) -> None:
    response = post(client, "/invocations", {"text": "hello"})
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert "'messages'" in error["message"] and "'inputs'" in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("data", [b"{not json", b"", b"\xff\xfe", b'{"inputs": "x",}'])
def test_bad_json_is_400(client, data: bytes) -> None:
    response = client.post("/invocations", data=data, content_type="application/json")
    assert response.status_code == 400
    assert "not valid JSON" in response.get_json()["error"]["message"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_literal_is_400(client, service, literal: str) -> None:
    data = '{"inputs": "x", "parameters": {"temperature": ' + literal + "}}"
    response = client.post("/invocations", data=data, content_type="application/json")
    assert response.status_code == 400
    assert literal in response.get_json()["error"]["message"]
    assert service.engine.handles == []


@pytest.mark.parametrize("body", [[CHAT], "hello", 3])
def test_non_object_body_is_400(client, body) -> None:
    response = post(client, "/invocations", body)
    assert response.status_code == 400
    assert response.get_json()["error"]["message"] == "the request body must be a JSON object"


def test_body_over_6_mib_is_413_json(client, service) -> None:
    data = b'{"inputs": "' + b"a" * (6 * 1024 * 1024) + b'"}'
    response = client.post("/invocations", data=data, content_type="application/json")
    assert response.status_code == 413
    assert response.mimetype == "application/json"
    error = response.get_json()["error"]
    assert error["type"] == "invalid_request_error"
    assert str(6 * 1024 * 1024) in error["message"]
    assert service.engine.handles == []


def test_chat_error_openai_shape(client) -> None:
    response = post(client, "/invocations", {**CHAT, "temperature": 3})
    assert response.status_code == 400
    assert response.get_json() == {"error": {
        "message": "invalid 'temperature': Input should be less than or equal to 2",
        "type": "invalid_request_error", "param": "temperature", "code": None}}


def test_chat_route_error_openai_shape(client) -> None:
    response = post(client, "/v1/chat/completions", {"inputs": "x"})
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "messages"


def test_image_to_text_model_is_400_naming_the_part(client) -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}
    response = post(client, "/invocations", body)
    assert response.status_code == 400
    assert response.get_json()["error"]["param"] == "messages[0].content[1]"


def test_legacy_error_legacy_shape(client) -> None:
    response = post(client, "/invocations", {"inputs": "x", "parameters": {"temperature": -1}})
    assert response.status_code == 400
    assert response.get_json() == {"error": "invalid 'parameters.temperature': Input should be greater than or "
                                            "equal to 0", "error_type": "invalid_request_error",
                                   "param": "parameters.temperature", "code": 400}


def test_legacy_stream_with_list_is_400(client) -> None:
    response = post(client, "/invocations", {"inputs": ["a", "b"], "stream": True})
    assert response.status_code == 400
    assert response.get_json()["param"] == "inputs"


@pytest.mark.parametrize(("error", "status", "error_type"), [
    (NotReady("the server is stopping"), 503, "service_unavailable"),
    (Overloaded("queue full"), 429, "rate_limit_error"),
])
def test_submit_errors_keep_their_status(client, service, error, status: int, error_type: str) -> None:
    service.engine.submit_error = error
    response = post(client, "/invocations", CHAT)
    assert response.status_code == status
    assert response.get_json() == {"error": {"message": error.message, "type": error_type, "param": None,
                                             "code": None}}
    response = post(client, "/invocations", {"inputs": "x"})
    assert response.status_code == status
    assert response.get_json()["error"] == error.message


def test_engine_fault_non_streaming_is_500_without_traceback(client, service) -> None:
    service.engine.script = lambda r: [TokenEvent(0, HELLO, "Hello", -0.5),
                                       TokenEvent(0, None, "", finish_reason=FinishReason.ERROR, error="step failed")]
    response = post(client, "/invocations", CHAT)
    assert response.status_code == 500
    assert response.get_json() == {"error": {"message": "generation failed: step failed", "type": "internal_error",
                                             "param": None, "code": None}}


def test_unexpected_exception_is_500_without_traceback(client, service) -> None:
    service.engine.script = lambda r: [ZeroDivisionError("secret detail")]
    response = post(client, "/invocations", {"inputs": "x"})
    assert response.status_code == 500
    body = response.get_json()
    assert body["error"] == "internal error (ZeroDivisionError); see the server log"
    assert "secret" not in response.get_data(as_text=True)
    assert "Traceback" not in response.get_data(as_text=True)


def test_unknown_route_and_method(client) -> None:
    """JSON naming the route: OpenAI's shape on /v1/*, the legacy shape elsewhere; never Flask's HTML."""
    response = client.get("/nope")
    assert response.status_code == 404 and response.get_json() == {
        "error": "GET /nope: no such route", "error_type": "invalid_request_error", "param": None, "code": 404}
    response = client.get("/invocations")
    assert response.status_code == 405 and response.headers["Allow"] == "OPTIONS, POST"
    assert response.get_json()["error"] == "method GET is not allowed on /invocations"
    response = client.post("/v1/nope", json={})
    assert response.status_code == 404 and response.get_json()["error"] == {
        "message": "POST /v1/nope: no such route", "type": "invalid_request_error", "param": None, "code": "not_found"}
    response = client.get("/v1/responses/resp_nope")  # the Responses API is served: an unknown id, not a route
    assert response.status_code == 404 and response.get_json()["error"]["param"] == "response_id"
    assert "resp_nope" in response.get_json()["error"]["message"]
    response = client.delete("/v1/chat/completions")
    assert response.status_code == 405 and response.get_json()["error"]["code"] == "method_not_allowed"


# ---- streaming ------------------------------------------------------------------------------------------------

CHUNK_BASE = ('{"id":"chatcmpl-test","object":"chat.completion.chunk","created":1700000000,'
              '"model":"smollm2-135m-instruct","system_fingerprint":"fp_sagemaker_llm_container",')
CHAT_RECORDS = [
    CHUNK_BASE + '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                 '"finish_reason":null}]}',
    CHUNK_BASE + '"choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}]}',
    CHUNK_BASE + '"choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null}]}',
    CHUNK_BASE + '"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}',
]
LEGACY_LINES = [
    '{"token":{"id":19556,"text":"Hello","log_prob":-0.5,"special":false},"generated_text":null,"details":null}',
    '{"token":{"id":905,"text":" world","log_prob":-0.25,"special":false},"generated_text":null,"details":null}',
    '{"token":{"id":2,"text":"","log_prob":-0.125,"special":true},"generated_text":"Hello world","details":null}',
]


def test_invocations_chat_stream_defaults_to_json_lines(client) -> None:
    response = post(client, "/invocations", {**CHAT, "stream": True})
    assert response.status_code == 200
    assert response.mimetype == "application/jsonlines"
    assert response.data == "".join(r + "\n" for r in CHAT_RECORDS).encode()
    assert response.headers["X-Request-Id"] == "chatcmpl-test"


def test_invocations_accept_event_stream_gives_sse(client) -> None:
    response = post(client, "/invocations", {**CHAT, "stream": True}, headers={"Accept": "text/event-stream"})
    assert response.status_code == 200
    assert response.mimetype == "text/event-stream"
    assert response.data == ("".join(f"data: {r}\n\n" for r in CHAT_RECORDS) + "data: [DONE]\n\n").encode()
    assert response.headers["Cache-Control"] == "no-cache"


def test_chat_route_is_always_sse(client) -> None:
    for accept in (None, "application/jsonlines", "application/json"):
        headers = {"Accept": accept} if accept else {}
        response = post(client, "/v1/chat/completions", {**CHAT, "stream": True}, headers=headers)
        assert response.mimetype == "text/event-stream"
        assert response.data == ("".join(f"data: {r}\n\n" for r in CHAT_RECORDS) + "data: [DONE]\n\n").encode()


def test_legacy_response_tgi_answers_a_string_input_with_a_list(service) -> None:
    """option.legacy_response=tgi: TGI's and the HF LLM DLC's shape, which langchain-aws' SagemakerEndpoint
    handlers read as ``[0]["generated_text"]``; lmi (the default) keeps one object."""
    service.settings = Settings(legacy_response="tgi")
    client = server.create_app(service).test_client()
    assert post(client, "/invocations", {"inputs": "x"}).get_json() == [{"generated_text": "Hello world"}]
    batch = post(client, "/invocations", {"inputs": ["x", "y"]}).get_json()
    assert batch == [{"generated_text": "Hello world"}] * 2


TGI_FRAMES = (
    'data: {"index":1,"token":{"id":19556,"text":"Hello","logprob":-0.5,"special":false},"generated_text":null,'
    '"details":null}\n\n'
    'data: {"index":2,"token":{"id":905,"text":" world","logprob":-0.25,"special":false},"generated_text":null,'
    '"details":null}\n\n'
    'data: {"index":3,"token":{"id":2,"text":"","logprob":-0.125,"special":true},"generated_text":"Hello world",'
    '"details":null}\n\n')


def test_legacy_response_tgi_streams_tgis_sse(service) -> None:
    """option.legacy_response=tgi streams as TGI does (its SSE, no [DONE], its names), whatever Accept says."""
    service.settings = Settings(legacy_response="tgi")
    client = server.create_app(service).test_client()
    for headers in ({}, {"Accept": "application/jsonlines"}, {"Accept": "text/event-stream"}):
        response = post(client, "/invocations", {"inputs": "x", "stream": True}, headers=headers)
        assert response.mimetype == "text/event-stream" and response.data == TGI_FRAMES.encode()


def test_tgi_routes_and_tgis_client_get_tgis_shape_on_default_settings(client) -> None:
    assert post(client, "/generate_stream", {"inputs": "x"}).data == TGI_FRAMES.encode()
    assert post(client, "/", {"inputs": "x", "stream": True}).data == TGI_FRAMES.encode()
    assert post(client, "/generate", {"inputs": "x"}).get_json() == {"generated_text": "Hello world"}
    assert post(client, "/", {"inputs": "x"}).get_json() == {"generated_text": "Hello world"}
    refused = post(client, "/generate", {"inputs": ["x", "y"]})
    assert refused.status_code == 400 and refused.get_json()["param"] == "inputs"
    agent = {"User-Agent": "unknown/None; hf_hub/2.4.0; python/3.11.7"}  # huggingface_hub's InferenceClient
    streamed = post(client, "/invocations", {"inputs": "x", "stream": True}, headers={"Accept": "*/*", **agent})
    assert streamed.data == TGI_FRAMES.encode()
    lines = post(client, "/invocations", {"inputs": "x", "stream": True}, headers={"Accept": "*/*"})
    assert lines.mimetype == "application/jsonlines"  # python-requests sends the same Accept


def test_output_formatter_setting_picks_the_default_framing(service, renderer) -> None:
    service.settings = Settings(output_formatter="sse")
    client = server.create_app(service).test_client()
    response = post(client, "/invocations", {**CHAT, "stream": True})
    assert response.mimetype == "text/event-stream"
    assert response.data.endswith(b"data: [DONE]\n\n")


def test_legacy_stream_json_lines_exact(client) -> None:
    response = post(client, "/invocations", {"inputs": "Say hi", "stream": True})
    assert response.status_code == 200
    assert response.mimetype == "application/jsonlines"
    assert response.data == "".join(line + "\n" for line in LEGACY_LINES).encode()


def test_legacy_stream_sse(client) -> None:
    response = post(client, "/invocations", {"inputs": "Say hi", "stream": True},
                    headers={"Accept": "text/event-stream"})
    assert response.mimetype == "text/event-stream"
    assert response.data == ("".join(f"data: {line}\n\n" for line in LEGACY_LINES) + "data: [DONE]\n\n").encode()


def test_chat_stream_include_usage(client, service) -> None:
    response = post(client, "/invocations", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    records = [json.loads(line) for line in response.data.decode().splitlines()]
    num_prompt = len(service.engine.handles[0].request.prompt_ids)
    assert all(r["usage"] is None for r in records[:-1])
    assert records[-1]["choices"] == []
    assert records[-1]["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 3,
                                    "total_tokens": num_prompt + 3}


def _failing_script(error: BaseException) -> Callable[[GenerationRequest], list]:
    return lambda request: [TokenEvent(0, HELLO, "Hello", -0.5), error]


@pytest.mark.parametrize(("error", "message"), [
    (RuntimeError("secret"), "internal error (RuntimeError); see the server log"),
    (EngineError("the model step failed"), "the model step failed"),
])
def test_chat_stream_raising_mid_stream_ends_with_error_record(client, service, error, message: str) -> None:
    service.engine.script = _failing_script(error)
    response = post(client, "/invocations", {**CHAT, "stream": True})
    assert response.status_code == 200
    lines = response.data.decode().split("\n")
    assert lines[-1] == ""
    assert json.loads(lines[1])["choices"][0]["delta"] == {"content": "Hello"}
    assert json.loads(lines[-2]) == {"error": {"message": message, "type": "internal_error", "param": None,
                                               "code": None}}
    assert len(lines) == 4
    assert service.engine.handles[0].cancelled >= 1


def test_chat_sse_raising_mid_stream_still_ends_with_done(client, service) -> None:
    service.engine.script = _failing_script(RuntimeError("x"))
    response = post(client, "/v1/chat/completions", {**CHAT, "stream": True})
    assert response.status_code == 200
    frames = response.data.decode().split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    assert json.loads(frames[-3][len("data: "):])["error"]["type"] == "internal_error"


def test_chat_stream_engine_error_event(client, service) -> None:
    service.engine.script = lambda r: [TokenEvent(0, HELLO, "Hello", -0.5),
                                       TokenEvent(0, None, "", finish_reason=FinishReason.ERROR, error="non-finite")]
    response = post(client, "/invocations", {**CHAT, "stream": True})
    assert response.status_code == 200
    last = json.loads(response.data.decode().splitlines()[-1])
    assert last == {"error": {"message": "generation failed: non-finite", "type": "internal_error", "param": None,
                              "code": None}}


def test_legacy_stream_raising_mid_stream_ends_with_error_line(client, service) -> None:
    service.engine.script = _failing_script(RuntimeError("secret"))
    response = post(client, "/invocations", {"inputs": "x", "stream": True})
    assert response.status_code == 200
    lines = response.data.decode().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0])["token"]["text"] == "Hello"
    assert json.loads(lines[1]) == {
        "token": {"id": -1, "text": "", "log_prob": None, "special": True}, "generated_text": None,
        "details": {"finish_reason": "error", "generated_tokens": 0},
        "error": "internal error (RuntimeError); see the server log"}
    assert "secret" not in response.data.decode()


def test_legacy_stream_engine_error_event(client, service) -> None:
    service.engine.script = lambda r: [
        TokenEvent(0, HELLO, "Hello", -0.5),
        TokenEvent(0, None, "", finish_reason=FinishReason.ERROR, error="boom", num_generated_tokens=1)]
    response = post(client, "/invocations", {"inputs": "x", "stream": True})
    assert response.status_code == 200
    last = json.loads(response.data.decode().splitlines()[-1])
    assert last["token"]["id"] == -1
    assert last["details"] == {"finish_reason": "error", "generated_tokens": 1}
    assert last["error"] == "boom"


def _endless(request: GenerationRequest) -> Iterator[TokenEvent]:
    for _ in range(10_000):
        yield TokenEvent(0, HELLO, "Hello", -0.5)


@pytest.mark.parametrize(("path", "body"), [
    ("/invocations", {**CHAT, "stream": True}),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/invocations", {"inputs": "x", "stream": True}),
])
def test_closing_a_stream_early_cancels_the_handle(client, service, path: str, body: dict) -> None:
    service.engine.script = _endless
    response = post(client, path, body, buffered=False)
    assert response.status_code == 200
    chunks = iter(response.response)
    for _ in range(3):
        assert next(chunks)
    (handle,) = service.engine.handles
    assert handle.cancelled == 0
    response.close()
    assert handle.cancelled >= 1
    assert handle.num_yielded < 100


def test_legacy_batch_success_does_not_need_cancel(client, service) -> None:
    response = post(client, "/invocations", {"inputs": ["a", "b", "c"]})
    assert response.status_code == 200
    assert response.get_json() == [{"generated_text": "Hello world"}] * 3
    assert [h.num_yielded for h in service.engine.handles] == [3, 3, 3]


def test_legacy_batch_failure_cancels_the_other_prompts(client, service) -> None:
    scripts = iter([[TokenEvent(0, None, "", finish_reason=FinishReason.ERROR, error="boom")],
                    hello_script, hello_script])
    service.engine.script = lambda request: (lambda s: s if isinstance(s, list) else s(request))(next(scripts))
    response = post(client, "/invocations", {"inputs": ["a", "b", "c"]})
    assert response.status_code == 500
    assert response.get_json()["error"] == "generation failed: boom"
    assert all(h.cancelled >= 1 for h in service.engine.handles)


# ---- the Responses API ------------------------------------------------------------------------------------------

RESPONSES = {"input": "hi", "max_output_tokens": 5}


def frames(response) -> list[tuple[str, dict]]:
    """(event name, record) of each typed SSE frame; every frame is ``event:`` + ``data:`` + a blank line."""
    raw = response.data.decode().split("\n\n")
    assert raw[-1] == ""
    pairs = []
    for frame in raw[:-1]:
        event, data = frame.split("\n")
        pairs.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return pairs


def test_responses_stream_is_typed_sse_in_order(client, monkeypatch) -> None:
    monkeypatch.setattr("handler.endpoints.responses.new_response_id", lambda: "resp_test")
    monkeypatch.setattr("handler.formatting.responses.new_item_id", lambda prefix: f"{prefix}_test")
    response = post(client, "/v1/responses", {**RESPONSES, "stream": True})
    assert response.mimetype == "text/event-stream" and response.headers["X-Request-Id"] == "resp_test"
    pairs = frames(response)
    assert all(name == record["type"] for name, record in pairs)
    assert [name for name, _ in pairs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert pairs[4][1] == {"type": "response.output_text.delta", "sequence_number": 4, "output_index": 0,
                           "item_id": "msg_test", "content_index": 0, "delta": "Hello", "logprobs": []}
    done = pairs[-1][1]["response"]
    assert done["id"] == "resp_test" and done["created_at"] == CREATED and done["model"] == MODEL_NAME
    assert done["output"] == [{"id": "msg_test", "type": "message", "role": "assistant", "status": "completed",
                               "content": [{"type": "output_text", "text": "Hello world", "annotations": [],
                                            "logprobs": []}]}]
    assert client.get("/v1/responses/resp_test").get_json() == done  # stored as it was answered


def test_responses_stream_failing_mid_stream_ends_with_response_failed(client, service) -> None:
    service.engine.script = _failing_script(EngineError("the model step failed"))
    pairs = frames(post(client, "/v1/responses", {**RESPONSES, "stream": True}))
    assert pairs[-1][0] == "response.failed" and pairs[-1][1]["response"]["status"] == "failed"
    assert pairs[-1][1]["response"]["error"] == {"code": "server_error", "message": "the model step failed"}
    assert service.engine.handles[0].cancelled >= 1


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"}, {
        "type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"}]}]},
     "input[0].content[1]"),
    ({"input": "hi", "previous_response_id": "resp_gone"}, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name", "parameters": None, "strict": None}]},
     "tools[0].name"),
])
def test_responses_errors_name_the_responses_field(client, body: dict, param: str) -> None:
    response = post(client, "/v1/responses", body)
    assert response.status_code in (400, 404) and response.get_json()["error"]["param"] == param
