"""The Responses API on the wire: the request parser (items -> the chat request, fields errors name), the formatter
(events -> the response object and typed stream events, each validated against the openai SDK's own pydantic
models, which clients parse into), the typed SSE framing, the per-worker store, and the /invocations sniffing rule.
"""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from handler.endpoints.invocations import sniff_schema
from handler.endpoints.responses import ResponseStore, StoredResponse
from handler.engine.types import FinishReason
from handler.errors import BadRequest
from handler.formatting import legacy
from handler.formatting import responses as fmt
from handler.formatting.framing import typed_sse
from handler.formatting.legacy import LegacyContext
from handler.formatting.responses import ResponsesContext
from handler.protocol.common import ExtraParameters, parse_model, parse_request
from handler.protocol.responses import ResponsesRequest, responses_param
from tests.unit.test_formatting import ctx, ev, hello_events

EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}, "strict": True}


def parse(body: dict) -> ResponsesRequest:
    request = parse_model(ResponsesRequest, body)
    request.check()
    return request


def chat_of(body: dict, history: list[dict] | None = None) -> tuple[dict, list[str]]:
    request = parse(body)
    chat, fields = request.to_chat((history or []) + request.input_items())
    return chat.model_dump(exclude_none=True, by_alias=True), fields


# ---- request -> chat request ------------------------------------------------------------------------------------

def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    chat, fields = chat_of({"input": "Hi", "instructions": "Be brief", "max_output_tokens": 5, "temperature": 0})
    assert chat["messages"] == [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    assert chat["max_completion_tokens"] == 5 and chat["temperature"] == 0
    assert fields == ["instructions", "input[0]"]


def test_items_become_chat_messages_calls_joining_their_assistant_turn() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Look"}, {
            "type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "low"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Calling", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    chat, fields = chat_of({"input": items, "tools": [WEATHER]})
    assert chat["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA",
                                                                         "detail": "low"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Calling"}], "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert fields == ["input[0]", "input[1]", "input[3]"]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER[
        "parameters"], "strict": True}}]


def test_a_stored_conversation_comes_first_and_errors_name_previous_response_id() -> None:
    history = [{"type": "message", "role": "user", "content": "Hi"},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]}]
    chat, fields = chat_of({"input": "More", "previous_response_id": "resp_1"}, history)
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "user"]
    assert fields == ["previous_response_id", "previous_response_id", "input[0]"]


def test_text_format_and_tool_choice_become_the_chat_fields() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat, _ = chat_of({"input": "x", "text": {"format": {"type": "json_schema", "name": "A", "schema": schema,
                                                         "strict": True}},
                       "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
                       "parallel_tool_calls": False})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "A", "schema": schema,
                                                                              "strict": True}}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert chat_of({"input": "x", "text": {"format": {"type": "json_object"}}})[0]["response_format"] == {
        "type": "json_object"}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "reasoning": {"effort": "minimal"}}, "reasoning.effort"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": [{"type": "reasoning_summary"}]}, "input[0]"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1", "detail": "auto"}]}]},
     "input[0].content[0].file_id"),
    ({"input": "x", "seed": 1}, "seed"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        request = parse(body)
        request.to_chat(request.input_items())
    assert info.value.param == param


def test_unknown_fields_follow_the_extra_parameters_policy() -> None:
    parsed, extras = parse_request(ResponsesRequest, {"input": "x", "seed": 1}, ExtraParameters.IGNORE)
    assert extras.ignored == ("seed",) and parsed.input == "x"


@pytest.mark.parametrize(("chat_param", "param"), [
    ("messages", "input"),
    ("messages[1].content[0]", "input[0].content[0]"),
    ("messages[0]", "instructions"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("tools[2].function.name", "tools[2].name"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("temperature", "temperature"),
])
def test_chat_fields_are_named_as_the_responses_request_names_them(chat_param: str, param: str) -> None:
    assert responses_param(chat_param, ["instructions", "input[0]"]) == param


def test_the_response_repeats_the_request_with_openais_defaults() -> None:
    echo = parse({"input": "x", "metadata": {"k": "v"}, "tools": [WEATHER]}).echo()
    assert echo["tool_choice"] == "auto" and echo["parallel_tool_calls"] is True and echo["store"] is True
    assert echo["text"] == {"format": {"type": "text"}} and echo["metadata"] == {"k": "v"}
    assert echo["tools"] == [{**WEATHER, "description": None}]


# ---- /invocations sniffing --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "embeds_only", "schema"), [
    ({"input": "a"}, False, "embeddings"),                      # the Databricks embeddings body, as before
    ({"input": ["a", "b"], "model": "m"}, False, "embeddings"),
    ({"input": "a", "max_output_tokens": 5}, False, "responses"),
    ({"input": "a", "stream": True}, False, "responses"),
    ({"input": [{"role": "user", "content": "a"}]}, False, "responses"),
    ({"input": "a", "instructions": "b"}, True, "embeddings"),  # an encoder only embeds
])
def test_an_input_body_is_responses_with_a_responses_field_or_items(body: dict, embeds_only: bool,
                                                                    schema: str) -> None:
    assert sniff_schema(body, embeds_only) == schema


# ---- events -> response object and stream events ----------------------------------------------------------------

def rctx(**options) -> ResponsesContext:
    echo = parse({"input": "x"}).echo()
    return ctx(ResponsesContext, echo=echo, **options)


def test_a_folded_response_is_the_sdks_response() -> None:
    record = fmt.response(hello_events(), rctx())
    parsed = Response.model_validate(record)
    assert parsed.output_text == "Hello world" and parsed.status == "completed"
    assert record["usage"] == {"input_tokens": 4, "output_tokens": 5, "total_tokens": 9,
                               "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                               "output_tokens_details": {"reasoning_tokens": 0}}
    assert record["incomplete_details"] is None and record["output"][0]["status"] == "completed"


def test_a_response_cut_by_max_output_tokens_is_incomplete() -> None:
    record = fmt.response(hello_events(FinishReason.LENGTH), rctx())
    assert record["status"] == "incomplete" and record["incomplete_details"] == {"reason": "max_output_tokens"}
    assert record["output"][0]["status"] == "incomplete"


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def call_events() -> list:
    return [ev(0, 5, "Sure. "), ev(0, 6, CALL_TEXT), ev(0, 2, "", finish=FinishReason.EOS, prompt=3, generated=3)]


def test_calls_become_function_call_items_after_the_text() -> None:
    record = fmt.response(call_events(), rctx(tool_format="hermes"))
    parsed = Response.model_validate(record)
    assert [item.type for item in parsed.output] == ["message", "function_call"]
    call = parsed.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")


def stream(events: list, **options) -> list[dict]:
    records = list(fmt.ResponseEvents(rctx(**options)).events(events))
    for record in records:
        EVENTS.validate_python(record)  # the SDK's discriminated union of stream events
    assert [r["sequence_number"] for r in records] == list(range(len(records)))
    return records


def test_text_streams_as_typed_events_in_order() -> None:
    records = stream(hello_events())
    assert [r["type"] for r in records] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 4, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert "".join(r["delta"] for r in records if r["type"] == "response.output_text.delta") == "Hello world"
    done = records[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == "Hello world" and done["usage"]["output_tokens"] == 5
    assert len({r.get("item_id") for r in records[3:-2]}) == 1  # one message item throughout
    assert records[0]["response"]["status"] == "in_progress" and records[0]["response"]["output"] == []


def test_a_call_closes_the_message_and_streams_its_arguments() -> None:
    records = stream(call_events(), tool_format="hermes")
    kinds = [r["type"] for r in records]
    assert kinds[kinds.index("response.output_item.done"):] == [
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    added = records[kinds.index("response.output_item.added", 3)]
    assert added["output_index"] == 1 and added["item"]["arguments"] == ""
    assert [item["type"] for item in records[-1]["response"]["output"]] == ["message", "function_call"]


def test_nothing_said_is_one_empty_message_as_folded() -> None:
    events = [ev(0, 2, "", finish=FinishReason.EOS, prompt=3, generated=1)]
    assert stream(events)[-1]["response"]["output"][0]["content"][0]["text"] == ""
    assert fmt.response(events, rctx())["output"][0]["content"][0]["text"] == ""


def test_an_engine_failure_ends_the_stream_with_response_failed() -> None:
    records = stream([ev(0, 5, "Hel"), ev(0, None, "", finish=FinishReason.ERROR, error="boom")])
    assert records[-1]["type"] == "response.failed"
    assert records[-1]["response"]["status"] == "failed"
    assert records[-1]["response"]["error"] == {"code": "server_error", "message": "generation failed: boom"}


def test_typed_sse_names_each_event_and_sends_no_done() -> None:
    frames = b"".join(typed_sse([{"type": "response.created", "sequence_number": 0}]))
    assert frames == b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'


# ---- the store --------------------------------------------------------------------------------------------------

def stored(response_id: str) -> StoredResponse:
    return StoredResponse({"id": response_id, "output": [{"type": "message"}]}, ({"role": "user"},))


def test_the_store_forgets_the_least_recently_used_first() -> None:
    store = ResponseStore(2)
    store.put(stored("a"))
    store.put(stored("b"))
    assert store.get("a") is not None  # a is now the most recent
    store.put(stored("c"))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.get("a").conversation == [{"role": "user"}, {"type": "message"}]
    assert store.delete("a") and not store.delete("a")
    empty = ResponseStore(0)
    empty.put(stored("a"))
    assert empty.get("a") is None


# ---- TGI's spelling of the legacy schema ------------------------------------------------------------------------

def test_tgi_stream_records_count_themselves_and_spell_logprob() -> None:
    lines = list(legacy.generated_lines(hello_events(), "Say", ctx(LegacyContext, want_logprobs=True, is_tgi=True)))
    assert [line["index"] for line in lines] == [1, 2, 3, 4, 5]
    assert lines[0]["token"] == {"id": 5, "text": "Hel", "logprob": -0.1, "special": False}
    assert lines[-1]["generated_text"] == "Hello world"
    assert lines[-1]["details"] == {"finish_reason": "eos_token", "generated_tokens": 5, "seed": None,
                                    "input_length": 4}


def test_tgi_details_have_prefill_and_seed_and_no_inputs() -> None:
    record = legacy.generated(hello_events(), "Say", ctx(LegacyContext, want_logprobs=True, is_tgi=True, seed=7))
    details = record["details"]
    assert details["seed"] == 7 and details["prefill"] == [] and "inputs" not in details
    assert details["tokens"][0] == {"id": 5, "text": "Hel", "logprob": -0.1, "special": False}


@pytest.mark.parametrize(("is_tgi", "key"), [(True, "logprob"), (False, "log_prob")])
def test_a_failed_legacy_stream_ends_with_a_line_in_its_own_spelling(is_tgi: bool, key: str) -> None:
    events = iter([ev(0, 5, "Hel", -0.1), ev(0, None, "", finish=FinishReason.ERROR, error="boom", generated=1)])
    lines = list(legacy.generated_lines(events, "Say", ctx(LegacyContext, is_tgi=is_tgi)))
    assert lines[-1] == {"token": {"id": -1, "text": "", key: None, "special": True}, "generated_text": None,
                         "details": {"finish_reason": "error", "generated_tokens": 1}, "error": "boom"}


# ---- reasoning models -------------------------------------------------------------------------------------------

def think_events(finish: FinishReason = FinishReason.EOS) -> list:
    """A <think> transcript; cut by max_output_tokens inside the reasoning when ``finish`` is LENGTH."""
    if finish is FinishReason.LENGTH:
        return [ev(0, 10, "<think>"), ev(0, 11, "Let me"), ev(0, 12, " see", finish=finish, prompt=3, generated=3)]
    return [ev(0, 10, "<think>"), ev(0, 11, "Let me see."), ev(0, 12, "</think>"), ev(0, 13, "\n\nParis."),
            ev(0, 2, "", finish=finish, prompt=3, generated=5, special=True)]


def test_a_reasoning_model_answers_with_a_reasoning_item_then_the_message() -> None:
    record = fmt.response(think_events(), rctx(reasoning_parser="qwen3"))
    parsed = Response.model_validate(record)
    assert [item.type for item in parsed.output] == ["reasoning", "message"]
    assert parsed.output[0].content[0].text == "Let me see." and parsed.output_text == "Paris."
    assert record["usage"]["output_tokens_details"]["reasoning_tokens"] == 2  # "Let me see." and "</think>"
    records = stream(think_events(), reasoning_parser="qwen3")
    kinds = [r["type"] for r in records]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta"]
    assert "".join(r["delta"] for r in records if r["type"] == "response.reasoning_text.delta") == "Let me see."
    assert "".join(r["delta"] for r in records if r["type"] == "response.output_text.delta") == "Paris."
    done = records[-1]["response"]
    assert [i["type"] for i in done["output"]] == ["reasoning", "message"]
    assert [i["content"] for i in done["output"]] == [i["content"] for i in record["output"]]
    assert done["usage"] == record["usage"]


def test_a_response_cut_inside_its_reasoning_has_only_the_partial_reasoning() -> None:
    record = fmt.response(think_events(FinishReason.LENGTH), rctx(reasoning_parser="qwen3"))
    Response.model_validate(record)
    assert record["status"] == "incomplete" and [i["type"] for i in record["output"]] == ["reasoning"]
    assert record["output"][0]["content"][0]["text"] == "Let me see" and record["output"][0]["status"] == "incomplete"
    done = stream(think_events(FinishReason.LENGTH), reasoning_parser="qwen3")[-1]
    assert done["type"] == "response.incomplete" and done["response"]["output"][0]["status"] == "incomplete"
    assert [i["type"] for i in done["response"]["output"]] == ["reasoning"]


def test_effort_reaches_the_chat_request_and_reasoning_items_sent_back_are_not_rendered() -> None:
    items = [{"role": "user", "content": "Hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
             {"type": "message", "role": "assistant", "content": "Hello"},
             {"role": "user", "content": "Bye"}]
    chat, fields = chat_of({"input": items, "reasoning": {"effort": "high"}})
    assert chat["reasoning_effort"] == "high" and fields == ["input[0]", "input[2]", "input[3]"]
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "user"]
    assert parse({"input": "x", "reasoning": {"effort": "low"}}).echo()["reasoning"]["effort"] == "low"
