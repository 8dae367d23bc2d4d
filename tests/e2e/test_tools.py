"""Structured output (``response_format``) and tools (``tools``, ``tool_choice``, ``parallel_tool_calls``, tool
messages) through the real server with the openai SDK. The embedded model's chat template does not render tools,
so the server describes them in a system prompt in the Hermes ``<tool_call>`` format; forced calls and schemas are
enforced by constrained decoding. Each test fails if the server ignored its field: unconstrained, this model
answers these prompts in prose. Greedy unless a test samples; token limits stay small."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
ALICE = [{"role": "user", "content": "Tell me about a person named Alice."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False},
}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "description": "Get the current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
                   "additionalProperties": False},
}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# The model would call get_weather; naming get_time shows the name is enforced, not guessed.
FORCE_TIME = {"type": "function", "function": {"name": "get_time"}}
CALL_TOKENS = 40  # a whole Hermes call to one of TOOLS is about 30 tokens


def ask(client: openai.OpenAI, messages: list[dict], max_tokens: int, **fields) -> ChatCompletion:
    return client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, **fields)


def check_call(call, names: set[str]) -> dict:
    """One tool call's shape; its arguments, validated against the function's parameters."""
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.function.name])
    return arguments


# ---- response_format ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def person(client: openai.OpenAI) -> ChatCompletion:
    return ask(client, ALICE, 30, response_format=PERSON_FORMAT)


def test_json_schema_content_validates(person: ChatCompletion) -> None:
    choice = person.choices[0]
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.finish_reason == "stop"


def test_json_schema_streamed_content_validates_and_matches(client: openai.OpenAI, person: ChatCompletion) -> None:
    chunks = list(client.chat.completions.create(model="m", messages=ALICE, max_tokens=30,
                                                 response_format=PERSON_FORMAT, stream=True))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    jsonschema.validate(json.loads(text), PERSON)
    assert text == person.choices[0].message.content and chunks[-1].choices[0].finish_reason == "stop"


def test_json_schema_holds_for_every_sampled_choice(client: openai.OpenAI) -> None:
    completion = ask(client, ALICE, 30, response_format=PERSON_FORMAT, n=2, temperature=1.0, seed=3)
    assert [choice.index for choice in completion.choices] == [0, 1]
    for choice in completion.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_content_is_a_json_object(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe a person named Alice who is 30 years old as JSON."}]
    completion = ask(client, messages, 30, response_format={"type": "json_object"})
    assert isinstance(json.loads(completion.choices[0].message.content), dict)
    assert completion.choices[0].finish_reason == "stop"


def test_invalid_schema_is_400_naming_response_format(client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, ALICE, 4, response_format=bad)
    assert caught.value.body["param"].startswith("response_format")


# ---- forced tool calls -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def named_call(client: openai.OpenAI) -> ChatCompletion:
    return ask(client, WEATHER_QUESTION, CALL_TOKENS, tools=TOOLS, tool_choice=FORCE_TIME, parallel_tool_calls=False)


def test_named_tool_choice_calls_that_function(named_call: ChatCompletion) -> None:
    choice = named_call.choices[0]
    [call] = choice.message.tool_calls
    check_call(call, {"get_time"})
    assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_required_tool_choice_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    """One or more valid calls and no markup in content. Whether this model writes a second call before ending is
    up to its logits (it does on some CPUs); if max_tokens cuts that call, it is dropped and finish is length."""
    completion = ask(client, WEATHER_QUESTION, CALL_TOKENS, tools=TOOLS, tool_choice="required")
    choice = completion.choices[0]
    assert choice.message.tool_calls and choice.message.content is None
    for call in choice.message.tool_calls:
        check_call(call, set(PARAMETERS))
    cut = completion.usage.completion_tokens == CALL_TOKENS
    assert choice.finish_reason == ("length" if cut else "tool_calls")


def test_named_tool_choice_is_exactly_one_call_even_with_parallel_calls_allowed(client: openai.OpenAI) -> None:
    """OpenAI: a named function is called exactly once. With the end-of-turn token banned the model would go on
    writing calls; the grammar ends after the one."""
    ban_end = {"logit_bias": {"2": -100}}  # <|im_end|>
    completion = ask(client, WEATHER_QUESTION, 2 * CALL_TOKENS, tools=TOOLS, tool_choice=FORCE_TIME,
                     extra_body=ban_end)
    [call] = completion.choices[0].message.tool_calls
    check_call(call, {"get_time"})
    assert completion.choices[0].finish_reason == "tool_calls" and completion.choices[0].message.content is None


def test_parallel_tool_calls_false_stops_after_one_call(client: openai.OpenAI) -> None:
    """With the end-of-turn token banned, a model allowed several calls must write another one; with
    parallel_tool_calls false the grammar ends after the first whatever the logits say."""
    ban_end = {"logit_bias": {"2": -100}}  # <|im_end|>
    parallel = ask(client, WEATHER_QUESTION, 2 * CALL_TOKENS, tools=TOOLS, tool_choice="required",
                   extra_body=ban_end)
    assert len(parallel.choices[0].message.tool_calls) > 1 or parallel.choices[0].finish_reason == "length"
    assert parallel.choices[0].message.content is None  # a second call cut by max_tokens leaves no markup
    single = ask(client, WEATHER_QUESTION, 2 * CALL_TOKENS, tools=TOOLS, tool_choice="required",
                 parallel_tool_calls=False, extra_body=ban_end)
    assert single.choices[0].finish_reason == "tool_calls"
    assert len(single.choices[0].message.tool_calls) == 1


def test_streamed_forced_call_equals_the_whole_one(client: openai.OpenAI, named_call: ChatCompletion) -> None:
    chunks = list(client.chat.completions.create(model="m", messages=WEATHER_QUESTION, max_tokens=CALL_TOKENS,
                                                 tools=TOOLS, tool_choice=FORCE_TIME, parallel_tool_calls=False,
                                                 stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    [whole] = named_call.choices[0].message.tool_calls
    assert (calls[0]["name"], calls[0]["arguments"]) == (whole.function.name, whole.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)


def test_openai_stream_helper_fires_arguments_done_for_a_streamed_call(client: openai.OpenAI) -> None:
    """The SDK's stream helper closes a call when a later chunk arrives; the finish_reason chunk comes after the
    last tool-call delta (never merged with it), so ``tool_calls.function.arguments.done`` fires."""
    with client.chat.completions.stream(model="m", messages=WEATHER_QUESTION, max_tokens=CALL_TOKENS, tools=TOOLS,
                                        tool_choice=FORCE_TIME) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    [event] = done
    assert event.name == "get_time" and json.loads(event.arguments) == json.loads(
        final.choices[0].message.tool_calls[0].function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"


def test_a_tool_forcing_client_gets_a_parsed_call_and_no_markup(client: openai.OpenAI) -> None:
    """What LlamaIndex's structured_predict does through OpenAI-compatible servers: force one strict pydantic
    function and read its parsed arguments. Cut by max_tokens or not, content never carries call markup."""
    import pydantic

    class GetTime(pydantic.BaseModel):
        """Get the current time in a timezone"""

        timezone: str

    tool = openai.pydantic_function_tool(GetTime)
    completion = client.chat.completions.parse(model="m", messages=WEATHER_QUESTION, max_tokens=CALL_TOKENS,
                                               tools=[tool], tool_choice={"type": "function",
                                                                          "function": {"name": "GetTime"}})
    message = completion.choices[0].message
    assert message.content is None and completion.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetTime)
    cut = client.chat.completions.create(model="m", messages=WEATHER_QUESTION, max_tokens=6, tools=[tool],
                                         tool_choice={"type": "function", "function": {"name": "GetTime"}})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content is None


# ---- tools shown, tool messages ----------------------------------------------------------------------------------


def test_tools_are_shown_to_the_model_unless_tool_choice_is_none(client: openai.OpenAI) -> None:
    auto = ask(client, WEATHER_QUESTION, 4, tools=TOOLS, tool_choice="auto")
    none = ask(client, WEATHER_QUESTION, 4, tools=TOOLS, tool_choice="none")
    plain = ask(client, WEATHER_QUESTION, 4)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert auto.usage.prompt_tokens > none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert ask(client, WEATHER_QUESTION, 4, tools=TOOLS).usage.prompt_tokens == auto.usage.prompt_tokens  # default


def test_conversation_with_a_tool_result_is_answered(client: openai.OpenAI) -> None:
    arguments = json.dumps({"city": "Paris"})
    history = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature_c": 18, "sky": "sunny"})},
    ]
    completion = ask(client, history, 12, tools=[WEATHER])
    choice = completion.choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    # The call and its result are part of the prompt, not dropped.
    shorter = ask(client, [*history[:2], {**history[2], "content": "{}"}], 1, tools=[WEATHER])
    assert completion.usage.prompt_tokens > shorter.usage.prompt_tokens
    assert shorter.usage.prompt_tokens > ask(client, WEATHER_QUESTION, 1, tools=[WEATHER]).usage.prompt_tokens


# ---- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": FORCE_TIME}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": FORCE_TIME}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": PERSON_FORMAT}, "response_format"),
], ids=["required-without-tools", "named-without-tools", "named-not-in-tools", "required-with-response-format"])
def test_inconsistent_tool_fields_are_400(client: openai.OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, WEATHER_QUESTION, 2, **fields)
    assert caught.value.body["param"] == param
