"""The Responses API as agents use it, through the real server and the unchanged openai SDK: output logprobs with
their top alternatives, background responses (polled, cancelled, their stream resumed from an event),
``input_items``, the Conversations API, ``truncation: "auto"`` on a conversation longer than the context, hosted
tools left out of what the model sees (and refused when forced), namespaced functions called and sent back, and the
fields Codex CLI sends.

The module's server differs from the shipped settings in one, and why: ``option.max_model_len=512``, so that a
conversation longer than the context is a few short turns (the embedded model's 8192 would take minutes to fill on
this CPU). Also run against vLLM by ``tests/vllm/test_contract.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import openai
import pytest
import requests

from tests.e2e.conftest import RunningServer, metric, start_server, stop_server

QUESTION = "What is the capital of France?"  # answered in more than 4 tokens: max_output_tokens=4 cuts it
CONTEXT = 512
SPAWN = {"type": "function", "name": "spawn_agent", "description": "Start a helper agent on a task", "strict": True,
         "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"],
                        "additionalProperties": False}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Helper agents", "tools": [SPAWN]}


@pytest.fixture(scope="module")
def state_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("responses-state"), {"OPTION_MAX_MODEL_LEN": str(CONTEXT)})
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def sdk(state_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{state_server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def wait_until_done(sdk: openai.OpenAI, response_id: str, seconds: float = 300):
    deadline = time.monotonic() + seconds
    while True:
        response = sdk.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.2)


def test_output_logprobs_come_with_their_top_alternatives_as_chat_gives_them(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(model="m", input=QUESTION, max_output_tokens=5, temperature=0,
                                    include=["message.output_text.logprobs"], top_logprobs=2)
    part = response.output[0].content[0]
    assert "".join(lp.token for lp in part.logprobs) == part.text and len(part.logprobs) == 5
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token for lp in part.logprobs)
    chat = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    expected = chat.choices[0].logprobs.content
    assert [lp.token for lp in part.logprobs] == [lp.token for lp in expected]
    assert [lp.logprob for lp in part.logprobs] == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    events = list(sdk.responses.create(model="m", input=QUESTION, max_output_tokens=5, temperature=0, stream=True,
                                       include=["message.output_text.logprobs"], top_logprobs=2))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    assert not sdk.responses.create(model="m", input=QUESTION, max_output_tokens=2).output[0].content[0].logprobs


def test_a_background_response_is_queued_then_polled_to_the_foreground_answer(sdk: openai.OpenAI) -> None:
    foreground = sdk.responses.create(model="m", input=QUESTION, max_output_tokens=4, temperature=0)
    queued = sdk.responses.create(model="m", input=QUESTION, max_output_tokens=4, temperature=0, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = wait_until_done(sdk, queued.id)
    assert done.status == "incomplete" and done.output_text == foreground.output_text
    assert done.usage.output_tokens == foreground.usage.output_tokens == 4
    assert sdk.responses.cancel(queued.id).status == "incomplete"  # over already: cancelling changes nothing


def test_cancel_stops_a_background_generation_and_frees_its_slot(sdk: openai.OpenAI,
                                                                  state_server: RunningServer) -> None:
    queued = sdk.responses.create(model="m", input="Write a very long story about a dragon.", temperature=0,
                                  max_output_tokens=CONTEXT - 64, background=True)
    cancelled = sdk.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    deadline = time.monotonic() + 60

    def run_log() -> list[dict]:  # the run's own line, written when it ends (the POST's line comes at once)
        return [record for record in (json.loads(line) for line in state_server.log().splitlines()
                                      if queued.id in line and '"event"' in line)
                if record.get("route", "").endswith("(background)")]

    while (not run_log() or metric(state_server.url, "llm_running_requests")
           or metric(state_server.url, "llm_waiting_requests")):
        assert time.monotonic() < deadline, "the cancelled generation still holds its slot"
        time.sleep(0.2)
    assert sdk.responses.retrieve(queued.id).status == "cancelled"  # its end did not overwrite the cancel
    assert [record.get("finish_reason") for record in run_log()] == ["abort"]  # the run's own log line says why


def test_a_background_stream_resumes_after_the_last_event_read(sdk: openai.OpenAI) -> None:
    first: list = []
    stream = sdk.responses.create(model="m", input=QUESTION, max_output_tokens=4, temperature=0, background=True,
                                  stream=True)
    for event in stream:
        first.append(event)
        if len(first) == 5:
            break
    stream.close()  # the client hangs up; the background run goes on
    response_id = first[0].response.id
    rest = list(sdk.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == wait_until_done(sdk, response_id).output_text
    replayed = list(sdk.responses.retrieve(response_id, stream=True))  # from the start, once it is over
    assert [e.type for e in replayed] == [e.type for e in events]


def test_input_items_list_the_conversation_a_response_answered(sdk: openai.OpenAI) -> None:
    first = sdk.responses.create(model="m", input="My name is Ada.", max_output_tokens=3, temperature=0)
    second = sdk.responses.create(model="m", input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=3, temperature=0)
    items = list(sdk.responses.input_items.list(second.id, limit=1, order="asc"))  # a page at a time
    assert [(item.type, item.role) for item in items] == [("message", "user"), ("message", "assistant"),
                                                          ("message", "user")]
    assert items[1].id == first.output[0].id and items[2].content[0].text == "What is my name?"
    newest = sdk.responses.input_items.list(second.id, limit=1)
    assert [item.id for item in newest.data] == [items[2].id] and newest.has_more


def test_a_conversation_holds_each_responses_input_and_output(sdk: openai.OpenAI) -> None:
    conversation = sdk.conversations.create(items=[{"role": "user", "content": "My name is Ada."}],
                                            metadata={"topic": "names"})
    assert conversation.metadata == {"topic": "names"}
    answer = sdk.responses.create(model="m", input="What is my name?", conversation=conversation.id,
                                  max_output_tokens=4, temperature=0)
    assert answer.conversation.id == conversation.id
    items = list(sdk.conversations.items.list(conversation.id, order="asc"))
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "user"), ("message", "assistant")]
    assert items[2].id == answer.output[0].id
    spelled_out = sdk.responses.create(model="m", max_output_tokens=4, temperature=0, store=False, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "user", "content": "What is my name?"}])
    assert answer.output_text == spelled_out.output_text
    assert answer.usage.input_tokens == spelled_out.usage.input_tokens
    assert sdk.conversations.items.retrieve(items[0].id, conversation_id=conversation.id).id == items[0].id
    assert sdk.conversations.items.delete(items[0].id, conversation_id=conversation.id).id == conversation.id
    assert len(list(sdk.conversations.items.list(conversation.id))) == 2
    assert sdk.conversations.update(conversation.id, metadata={"topic": "x"}).metadata == {"topic": "x"}
    assert sdk.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve(conversation.id)


def long_conversation() -> list[dict]:
    """Six turns of about 100 tokens each: longer than the context together, each short enough alone."""
    turns = []
    for n in range(6):
        turns.append({"role": "user", "content": f"Note {n}: " + "the quick brown fox jumps over the lazy dog " * 9})
        turns.append({"role": "assistant", "content": f"Noted {n}."})
    return turns + [{"role": "user", "content": "How many notes did I give you?"}]


def test_truncation_auto_drops_the_oldest_items_of_a_conversation_longer_than_the_context(sdk: openai.OpenAI) -> None:
    items, budget = long_conversation(), 16
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model="m", input=items, max_output_tokens=budget, temperature=0)
    assert info.value.body["param"] == "input"
    truncated = sdk.responses.create(model="m", input=items, max_output_tokens=budget, temperature=0,
                                     truncation="auto")
    assert truncated.truncation == "auto" and truncated.usage.input_tokens + budget <= CONTEXT
    for dropped in range(1, len(items)):  # the fewest oldest items whose dropping lets it fit, as OpenAI drops them
        try:
            tail = sdk.responses.create(model="m", input=items[dropped:], max_output_tokens=budget, temperature=0)
        except openai.BadRequestError:
            continue
        if tail.usage.input_tokens + budget <= CONTEXT:
            break
    assert dropped > 1 and truncated.usage.input_tokens == tail.usage.input_tokens
    assert truncated.output_text == tail.output_text


def test_tools_the_server_cannot_run_are_left_out_unless_forced(sdk: openai.OpenAI) -> None:
    hosted = [{"type": "web_search", "external_web_access": True}, {"type": "file_search", "vector_store_ids": ["v"]},
              {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "computer_use_preview",
                                                                             "display_width": 1, "display_height": 1,
                                                                             "environment": "linux"}]
    offered = sdk.responses.create(model="m", input=QUESTION, tools=[SPAWN, *hosted], max_output_tokens=4,
                                   temperature=0)
    plain = sdk.responses.create(model="m", input=QUESTION, tools=[SPAWN], max_output_tokens=4, temperature=0)
    assert offered.usage.input_tokens == plain.usage.input_tokens  # the model saw the function only
    assert [tool.type for tool in offered.tools] == ["function", "web_search", "file_search", "code_interpreter",
                                                     "computer_use_preview"]
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model="m", input=QUESTION, tools=hosted, tool_choice={"type": "web_search_preview"})
    assert info.value.body["param"] == "tool_choice.type"


def test_a_namespaced_function_is_called_by_its_own_name_and_sent_back(sdk: openai.OpenAI) -> None:
    first = sdk.responses.create(model="m", input="Start a helper to check the tests.", tools=[NAMESPACE],
                                 tool_choice={"type": "function", "name": "spawn_agent"}, max_output_tokens=60,
                                 temperature=0)
    (call,) = first.output
    assert (call.type, call.name, call.namespace) == ("function_call", "spawn_agent", "multi_agent_v1")
    assert json.loads(call.arguments).keys() == {"task"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "started"}
    continued = sdk.responses.create(model="m", previous_response_id=first.id, input=[result], tools=[NAMESPACE],
                                     max_output_tokens=4, temperature=0)
    stateless = sdk.responses.create(model="m", tools=[NAMESPACE], max_output_tokens=4, temperature=0, store=False,
                                     input=[{"role": "user", "content": "Start a helper to check the tests."},
                                            call.model_dump(exclude_none=True), result])
    assert continued.usage.input_tokens == stateless.usage.input_tokens
    assert continued.output_text == stateless.output_text


def test_the_fields_codex_sends_are_taken(state_server: RunningServer) -> None:
    """Codex CLI's first request's shape (its fields, a developer message, a namespace tool, web_search): answered,
    and its developer message rendered as the system message this template knows."""
    body = {"model": "m", "stream": False, "store": False, "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "s1",
            "client_metadata": {"session_id": "s1", "turn_id": "t1"}, "max_output_tokens": 3, "temperature": 0,
            "tools": [NAMESPACE, {"type": "web_search", "external_web_access": True}],
            "input": [{"type": "message", "id": "msg_1", "role": "developer",
                       "content": [{"type": "input_text", "text": "You are terse."}]},
                      {"type": "message", "id": "msg_2", "role": "user",
                       "content": [{"type": "input_text", "text": QUESTION}]}]}
    answer = requests.post(f"{state_server.url}/v1/responses", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    as_system = {**body, "input": [{**body["input"][0], "role": "system"}, body["input"][1]]}
    system = requests.post(f"{state_server.url}/v1/responses", json=as_system, timeout=600).json()
    assert answer.json()["usage"]["input_tokens"] == system["usage"]["input_tokens"]
    assert answer.json()["reasoning"]["summary"] == "auto" and answer.json()["prompt_cache_key"] == "s1"
