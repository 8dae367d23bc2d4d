"""OpenAI's Responses API and TGI's client, through the real server and the real clients, unchanged: the openai
SDK's ``responses.create`` (plain and streamed), ``responses.stream`` with its helper events, ``responses.parse``
into a pydantic model, a function-tool round trip, ``previous_response_id``, GET / DELETE and the 404s; a Responses
body on ``/invocations`` beside the embeddings body it must not take; and ``huggingface_hub.InferenceClient``'s
``text_generation`` streaming against ``/invocations`` and TGI's own routes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
import requests
from huggingface_hub import InferenceClient
from pydantic import BaseModel

from tests.e2e.conftest import RunningServer, local_runtime, post, runtime_client, start_server, stop_server

QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": True}


class Capital(BaseModel):
    city: Literal["Paris", "Berlin", "Rome"]
    is_capital: bool


@pytest.fixture(scope="module")
def responses_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("responses"))
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def base(responses_server: RunningServer) -> str:
    return responses_server.url


@pytest.fixture(scope="module")
def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)


def test_create_answers_as_chat_does(sdk: openai.OpenAI) -> None:
    """One request type inside: the same prompt and budget give the chat route's text, token for token."""
    response = sdk.responses.create(model="m", input=QUESTION, max_output_tokens=6, temperature=0)
    chat = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=6,
                                       temperature=0)
    assert response.output_text == chat.choices[0].message.content and "Paris" in response.output_text
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output[0].content[0].type == "output_text"


def test_a_stream_is_typed_events_that_add_up_to_the_response(sdk: openai.OpenAI) -> None:
    events = list(sdk.responses.create(model="m", input=QUESTION, max_output_tokens=6, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
    plain = sdk.responses.create(model="m", input=QUESTION, max_output_tokens=6, temperature=0, store=False)
    assert text == plain.output_text


def test_parse_fills_a_pydantic_model_under_the_schema_grammar(sdk: openai.OpenAI) -> None:
    response = sdk.responses.parse(model="m", input=QUESTION + " Answer in JSON.", text_format=Capital,
                                   max_output_tokens=40, temperature=0)
    assert response.status == "completed" and isinstance(response.output_parsed, Capital)


def test_the_stream_helper_gives_its_events_and_the_parsed_final_response(sdk: openai.OpenAI) -> None:
    with sdk.responses.stream(model="m", input=QUESTION + " Answer in JSON.", text_format=Capital,
                              max_output_tokens=40, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert isinstance(final.output_parsed, Capital)


def test_a_function_tool_round_trip(sdk: openai.OpenAI) -> None:
    """A forced call, then its output sent back two ways: through previous_response_id, and as the whole input.
    Both render the same conversation, so the greedy answers are equal."""
    first = sdk.responses.create(model="m", input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                 max_output_tokens=60)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments).keys() == {"city"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    continued = sdk.responses.create(model="m", previous_response_id=first.id, input=[result], tools=[WEATHER],
                                     max_output_tokens=5, temperature=0)
    whole = sdk.responses.create(model="m", input=[{"role": "user", "content": "What is the weather in Paris?"},
                                                   call.model_dump(exclude_none=True), result],
                                 tools=[WEATHER], max_output_tokens=5, temperature=0)
    assert continued.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert [item.model_dump(exclude={"id"}) for item in continued.output] == [
        item.model_dump(exclude={"id"}) for item in whole.output]


def test_previous_response_id_continues_the_conversation(sdk: openai.OpenAI) -> None:
    first = sdk.responses.create(model="m", input="My name is Ada.", max_output_tokens=4, temperature=0,
                                 instructions="Answer briefly.")
    second = sdk.responses.create(model="m", input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=4, temperature=0)
    spelled_out = sdk.responses.create(model="m", max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "My name is Ada."}, first.output[0].model_dump(exclude_none=True),
        {"role": "user", "content": "What is my name?"}])
    assert second.previous_response_id == first.id
    assert second.output_text == spelled_out.output_text  # instructions are not carried over, as OpenAI does
    assert second.usage.input_tokens == spelled_out.usage.input_tokens


def test_get_and_delete_and_the_404s(sdk: openai.OpenAI, base: str) -> None:
    response = sdk.responses.create(model="m", input="Hi", max_output_tokens=2, temperature=0,
                                    metadata={"ticket": "42"}, user="u1")
    fetched = sdk.responses.retrieve(response.id)
    assert fetched.model_dump() == response.model_dump() and fetched.metadata == {"ticket": "42"}
    sdk.responses.delete(response.id)
    for call in (lambda: sdk.responses.retrieve(response.id), lambda: sdk.responses.delete(response.id)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["param"] == "response_id" and response.id in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        sdk.responses.create(model="m", input="Hi", previous_response_id="resp_unknown", max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id" and "resp_unknown" in info.value.body["message"]
    unstored = sdk.responses.create(model="m", input="Hi", max_output_tokens=2, temperature=0, store=False)
    assert requests.get(f"{base}/v1/responses/{unstored.id}", timeout=30).status_code == 404


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "Hi", "reasoning": {"effort": "minimal"}}, "reasoning.effort"),
    ({"input": "Hi", "tools": [{"type": "web_serch"}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice.type"),
    ({"input": "Hi", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": "Hi", "seed": 3}, "seed"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format.schema"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(base: str, body: dict, param: str) -> None:
    response = post(base, body, "/v1/responses")
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_invocations_sniffs_a_responses_body_and_keeps_the_embeddings_body(base: str) -> None:
    """``input`` with a field only Responses has is a Responses request; ``input`` alone stays embeddings."""
    answer = post(base, {"input": QUESTION, "max_output_tokens": 3, "temperature": 0}).json()
    assert answer["object"] == "response" and answer["output"][0]["type"] == "message"
    assert post(base, {"input": QUESTION}).json()["object"] == "list"  # embeddings, as before
    lines = post(base, {"input": QUESTION, "max_output_tokens": 3, "stream": True})
    assert lines.headers["Content-Type"].startswith("application/jsonlines")
    records = [json.loads(line) for line in lines.text.splitlines()]
    assert records[0]["type"] == "response.created" and records[-1]["type"] == "response.incomplete"
    sse = post(base, {"input": QUESTION, "max_output_tokens": 3, "stream": True},
               headers={"Accept": "text/event-stream"})
    assert sse.text.startswith("event: response.created\ndata: {")


def test_a_responses_stream_through_sagemaker_is_json_lines_of_events(base: str) -> None:
    """boto3's invoke_endpoint_with_response_stream, through the local runtime's 16-byte PayloadParts."""
    body = {"input": QUESTION, "max_output_tokens": 6, "temperature": 0, "stream": True, "store": False}
    for runtime_url in local_runtime(base):
        runtime = runtime_client(runtime_url)
        answer = runtime.invoke_endpoint_with_response_stream(EndpointName="local", ContentType="application/json",
                                                              Body=json.dumps(body))
        buffer = b"".join(event["PayloadPart"]["Bytes"] for event in answer["Body"])
    records = [json.loads(line) for line in buffer.decode().splitlines()]
    assert records[0]["type"] == "response.created" and records[-1]["type"] == "response.incomplete"
    text = "".join(r["delta"] for r in records if r["type"] == "response.output_text.delta")
    assert text == records[-1]["response"]["output"][0]["content"][0]["text"] and "Paris" in text


# ---- TGI's client ------------------------------------------------------------------------------------------------

def tgi_stream(url: str) -> list:
    client = InferenceClient(base_url=url)  # kept alive while its stream is read
    return list(client.text_generation("The capital of France is", stream=True, details=True, max_new_tokens=5))


@pytest.mark.parametrize("route", ["/invocations", "/generate_stream"])
def test_inference_client_streams_every_token_and_the_details(base: str, route: str) -> None:
    outputs = tgi_stream(base + route)
    final = outputs[-1]
    assert final.details.generated_tokens == 5 == len(outputs) and final.details.finish_reason == "length"
    assert final.details.input_length > 0
    assert final.generated_text == "".join(output.token.text for output in outputs)
    assert all(isinstance(output.token.logprob, float) for output in outputs)
    plain = InferenceClient(base_url=f"{base}/generate").text_generation("The capital of France is",
                                                                         details=True, max_new_tokens=5)
    assert plain.generated_text == final.generated_text
    assert [t.id for t in plain.details.tokens] == [o.token.id for o in outputs]


def test_json_lines_callers_still_get_json_lines(base: str) -> None:
    """python-requests sends ``Accept: */*`` as InferenceClient does; only its User-Agent tells them apart."""
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 2}, "stream": True}
    response = post(base, body)
    assert response.headers["Content-Type"].startswith("application/jsonlines")
    assert [json.loads(line)["token"]["log_prob"] is not None for line in response.text.splitlines()] == [True] * 2
