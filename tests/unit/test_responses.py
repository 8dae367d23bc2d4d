"""The Responses API on the wire: the request parser (items -> the chat request, fields errors name), the formatter
(events -> the response object and typed stream events, each validated against the openai SDK's own pydantic
models, which clients parse into), the typed SSE framing, and the /invocations sniffing rule. The shared store, the
seal and background runs are tests/unit/test_response_store.py's.
"""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from handler.endpoints.invocations import sniff_schema
from handler.engine.types import FinishReason, GenerationRequest, TopLogprob
from handler.errors import BadRequest
from handler.formatting import legacy
from handler.formatting import responses as fmt
from handler.formatting.framing import typed_sse
from handler.formatting.legacy import LegacyContext
from handler.formatting.responses import ResponsesContext
from handler.protocol.chat import PreparedChat
from handler.protocol.common import ExtraParameters, parse_model, parse_request
from handler.protocol.conversations import ListQuery
from handler.protocol.responses import ResponsesRequest, responses_param
from handler.store.sealing import ReasoningSeal, new_key
from tests.unit.test_formatting import ctx, ev, hello_events, token_text

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
        {"role": "assistant", "content": "Calling", "tool_calls": [
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
    ({"input": "x", "reasoning": {"summary": "short"}}, "reasoning.summary"),
    ({"input": "x", "include": ["reasoning.encrypted_content", "file_search_call.results"]}, "include[1]"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
    ({"input": [{"type": "reasoning_summary"}]}, "input[0]"),
    ({"input": "x", "tools": [{"type": "web_serch"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice.type"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
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
    assert echo["tools"] == [WEATHER] and echo["truncation"] == "disabled" and echo["background"] is False
    assert echo["reasoning"] == {"effort": None, "summary": None} and echo["conversation"] is None
    summary = parse({"input": "x", "reasoning": {"summary": "auto"}, "conversation": "conv_1"}).echo()
    assert summary["reasoning"]["summary"] == "auto" and summary["conversation"] == {"id": "conv_1"}


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


def test_effort_reaches_the_chat_request_and_reasoning_items_sent_back_open_their_assistant_turn() -> None:
    items = [{"role": "user", "content": "Hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
             {"type": "message", "role": "assistant", "content": "Hello"},
             {"role": "user", "content": "Bye"}]
    chat, fields = chat_of({"input": items, "reasoning": {"effort": "high"}})
    assert chat["reasoning_effort"] == "high" and fields == ["input[0]", "input[1]", "input[3]"]
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "user"]
    assert chat["messages"][1]["reasoning_content"] == "x" and chat["messages"][1]["content"] == "Hello"
    assert parse({"input": "x", "reasoning": {"effort": "low"}}).echo()["reasoning"]["effort"] == "low"


# ---- what agents send: namespaces, tools this server cannot run, include, truncation ---------------------------

SPAWN = {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent", "strict": False,
         "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents", "tools": [SPAWN]}
CODEX_LIKE = {"input": "x", "tools": [WEATHER, NAMESPACE, {"type": "web_search", "external_web_access": True}],
              "tool_choice": "auto", "parallel_tool_calls": True, "store": False, "prompt_cache_key": "k",
              "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"},
              "client_metadata": {"session_id": "s"}}


def test_namespaced_functions_are_offered_under_their_namespaced_names_and_hosted_tools_left_out() -> None:
    request = parse(CODEX_LIKE)
    chat, _ = chat_of(CODEX_LIKE)
    assert [tool["function"]["name"] for tool in chat["tools"]] == ["get_weather", "multi_agent_v1__spawn_agent"]
    assert request.tool_set.left_out == [("tools[2]", "web_search")]
    assert request.tool_set.namespaced == {"multi_agent_v1__spawn_agent": ("multi_agent_v1", "spawn_agent")}
    assert request.echo()["tools"][2] == {"type": "web_search", "external_web_access": True}  # repeated as sent
    assert request.echo()["prompt_cache_key"] == "k"


def test_a_namespaced_function_is_forced_by_its_own_name_and_errors_name_where_it_came_from() -> None:
    chat, _ = chat_of({**CODEX_LIKE, "tool_choice": {"type": "function", "name": "spawn_agent"}})
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "multi_agent_v1__spawn_agent"}}
    tool_fields = parse({"input": "x", "tools": [{"type": "file_search"}, NAMESPACE]}).tool_set.fields
    assert responses_param("tools[0].function.name", [], tool_fields) == "tools[1].tools[0].name"


def test_a_call_to_a_namespaced_function_comes_back_with_its_namespace_and_renders_as_offered() -> None:
    offered = {"multi_agent_v1__spawn_agent": ("multi_agent_v1", "spawn_agent")}
    text = '<tool_call>\n{"name": "multi_agent_v1__spawn_agent", "arguments": {"task": "t"}}\n</tool_call>'
    events = [ev(0, 5, text), ev(0, 2, "", finish=FinishReason.EOS, prompt=3, generated=2, special=True)]
    record = fmt.response(events, rctx(tool_format="hermes", namespaced=offered))
    (call,) = Response.model_validate(record).output
    assert (call.name, call.namespace) == ("spawn_agent", "multi_agent_v1")
    streamed = stream(events, tool_format="hermes", namespaced=offered)[-1]["response"]["output"][0]
    assert (streamed["name"], streamed["namespace"]) == ("spawn_agent", "multi_agent_v1")
    sent_back = [{"role": "user", "content": "x"}, call.model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}]
    chat, _ = chat_of({"input": sent_back, "tools": [NAMESPACE]})
    assert chat["messages"][1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"


def test_output_logprobs_are_the_answers_tokens_folded_and_streamed_alike() -> None:
    events = [ev(0, 10, "<think>", -0.1), ev(0, 11, "Hm", -0.2), ev(0, 12, "</think>", -0.3),
              ev(0, 13, "Par", -0.4, top=(TopLogprob(13, -0.4), TopLogprob(14, -1.5))), ev(0, 15, "is", -0.5),
              ev(0, 2, "", -0.01, finish=FinishReason.EOS, prompt=3, generated=6, special=True)]
    folded = fmt.response(events, rctx(reasoning_parser="qwen3", want_logprobs=True))
    logprobs = Response.model_validate(folded).output[1].content[0].logprobs
    assert [(lp.token, lp.logprob) for lp in logprobs] == [(token_text(13), -0.4), (token_text(15), -0.5)]
    assert [top.logprob for top in logprobs[0].top_logprobs] == [-0.4, -1.5]
    records = stream(events, reasoning_parser="qwen3", want_logprobs=True)
    deltas = [lp for r in records if r["type"] == "response.output_text.delta" for lp in r["logprobs"]]
    done = next(r for r in records if r["type"] == "response.output_text.done")
    assert deltas == done["logprobs"] == folded["output"][1]["content"][0]["logprobs"]
    assert fmt.response(events, rctx(reasoning_parser="qwen3"))["output"][1]["content"][0]["logprobs"] == []


def test_reasoning_is_sealed_when_included_and_a_background_response_starts_queued() -> None:
    seal = ReasoningSeal(new_key())
    folded = fmt.response(think_events(), rctx(reasoning_parser="qwen3", seal=seal.seal))
    assert seal.open(folded["output"][0]["encrypted_content"]) == "Let me see."
    assert "encrypted_content" not in fmt.response(think_events(), rctx(reasoning_parser="qwen3"))["output"][0]
    records = stream(think_events(), reasoning_parser="qwen3", seal=seal.seal, queued=True)
    assert [r["type"] for r in records][:3] == ["response.created", "response.in_progress",
                                                "response.output_item.added"]
    assert records[0]["response"]["status"] == "queued"
    done = [r["item"] for r in records if r["type"] == "response.output_item.done"][0]
    assert seal.open(done["encrypted_content"]) == "Let me see."


def test_reasoning_items_sent_back_open_the_turn_their_text_sealed_or_plain() -> None:
    items = [{"role": "user", "content": "Q"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "sealed"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    request = parse({"input": items, "tools": [WEATHER]})
    chat, fields = request.to_chat(request.input_items(), reasoning=lambda item, field: f"opened {field}")
    assistant = chat.model_dump(exclude_none=True)["messages"][1]
    assert assistant["reasoning_content"] == "opened input[1]" and assistant["tool_calls"][0]["id"] == "c1"
    assert fields == ["input[0]", "input[1]", "input[3]"]
    summary_only = [{"role": "user", "content": "Q"}, {"type": "reasoning", "summary": [
        {"type": "summary_text", "text": "s"}]}, {"role": "assistant", "content": "A"}]
    chat, _ = chat_of({"input": summary_only})
    assert "reasoning_content" not in chat["messages"][1]  # nothing to render


def test_items_are_kept_with_ids_and_content_parts_and_listed_a_page_at_a_time() -> None:
    kept = parse({"input": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
                 ).input_items()
    assert [item["id"][:4] for item in kept] == ["msg_", "msg_"] and kept[0]["status"] == "completed"
    assert kept[0]["content"] == [{"type": "input_text", "text": "Hi"}]
    assert kept[1]["content"] == [{"type": "output_text", "text": "Hello", "annotations": []}]
    items = [{"id": f"i{n}"} for n in range(5)]
    page, more = parse_model(ListQuery, {"limit": "2"}).page(items)
    assert [i["id"] for i in page] == ["i4", "i3"] and more
    page, more = parse_model(ListQuery, {"limit": 2, "order": "asc", "after": "i2"}).page(items)
    assert [i["id"] for i in page] == ["i3", "i4"] and not more
    with pytest.raises(BadRequest) as info:
        parse_model(ListQuery, {"after": "nope"}).page(items)
    assert info.value.param == "after"


def fake_prepare(chat, fields) -> PreparedChat:
    """A prompt of one token per character of its messages' text."""
    length = sum(len(m.content or "") for m in chat.messages)
    return PreparedChat(GenerationRequest("r", tuple(range(length))), None, None, False)


@pytest.mark.parametrize(("truncation", "context", "dropped"), [
    ("auto", 100, 0),       # it fits: nothing is dropped
    ("auto", 60, 2),        # the two oldest items go (40 + 10 + 1 of room <= 60 only without them)
    ("auto", 25, 3),        # from the call on
    ("auto", 15, 5),        # the last item alone: a function call's output is never left without its call
    ("disabled", 25, 0),    # refused later by the engine, as before
])
def test_truncation_auto_drops_the_oldest_items_until_the_prompt_fits(truncation: str, context: int,
                                                                      dropped: int) -> None:
    items = [{"role": "user", "content": "u" * 20}, {"role": "assistant", "content": "a" * 20},
             {"role": "user", "content": "u" * 20},
             {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c", "output": "o" * 10},
             {"role": "user", "content": "u" * 10}]
    request = parse({"input": items, "truncation": truncation, "tools": [WEATHER]})
    own = request.input_items()
    fields = [f"input[{i}]" for i in range(len(own))]
    prepared, message_fields, gone = request.fitted(own, fields, lambda item, field: None, fake_prepare, context)
    assert gone == dropped and message_fields[0] == f"input[{dropped}]"
