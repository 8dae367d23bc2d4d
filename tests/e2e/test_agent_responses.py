"""A thinking model's reasoning carried by a stateless client, through the real server and the unchanged openai SDK:
``include: ["reasoning.encrypted_content"]`` seals each reasoning item, and a client that keeps nothing on the server
(``store: false``) sends the items back, the reasoning as only its sealed blob, as Codex CLI does; the server opens
it and renders it as the model's template renders earlier reasoning, so the answer and its prompt are the stored
path's (``previous_response_id``) exactly. The template renders reasoning within a tool-calling turn, so the
conversation is one: the model (``tests/support/agent_model.py``) reasons, calls ``exec_command``, and answers its
output.

Settings as shipped except ``option.model_id`` (the agent model, not the embedded one). Also run against vLLM by
``tests/vllm/test_contract.py`` (the model's heads are 64 wide, as vLLM's CPU attention needs).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.e2e.conftest import RunningServer, start_server, stop_server
from tests.support.agent_model import ANSWER, COMMAND, REASONING, build_agent_llama

EXEC = {"type": "function", "name": "exec_command", "description": "Run a shell command", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
TASK = "Say hi from the shell."
# heads 64 wide: vLLM's CPU attention has no kernel for heads under 32 (as tests/vllm/test_reasoning.py's model)
AGENT_SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 4096}


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = build_agent_llama(tmp_path_factory.mktemp("agent") / "model", **AGENT_SIZES)
    running = start_server(tmp_path_factory.mktemp("agent-server"), env={"OPTION_MODEL_ID": str(folder)})
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def agent_sdk(agent_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{agent_server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def test_sealed_reasoning_sent_back_statelessly_answers_as_the_stored_path(agent_sdk: openai.OpenAI) -> None:
    first = agent_sdk.responses.create(model="m", input=TASK, tools=[EXEC], temperature=0, max_output_tokens=64,
                                 include=["reasoning.encrypted_content"])
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING and reasoning.summary == []
    assert reasoning.encrypted_content and REASONING not in reasoning.encrypted_content
    assert (call.type, call.name, call.arguments) == ("function_call", "exec_command", f'{{"cmd":"{COMMAND}"}}')
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "hi"}
    stored = agent_sdk.responses.create(model="m", previous_response_id=first.id, input=[result], tools=[EXEC],
                                  temperature=0, max_output_tokens=16)
    sealed_only = {"type": "reasoning", "id": reasoning.id, "summary": [],
                   "encrypted_content": reasoning.encrypted_content}  # what a client that never read it sends
    stateless = agent_sdk.responses.create(model="m", tools=[EXEC], temperature=0, max_output_tokens=16, store=False,
                                     include=["reasoning.encrypted_content"],
                                     input=[{"role": "user", "content": TASK}, sealed_only,
                                            call.model_dump(exclude_none=True), result])
    assert stored.output_text == stateless.output_text == ANSWER
    assert stored.usage.input_tokens == stateless.usage.input_tokens
    without = agent_sdk.responses.create(model="m", tools=[EXEC], temperature=0, max_output_tokens=16, store=False,
                                   input=[{"role": "user", "content": TASK}, call.model_dump(exclude_none=True),
                                          result])
    assert without.usage.input_tokens < stateless.usage.input_tokens  # the reasoning was rendered


def test_sealed_reasoning_that_was_altered_is_refused_naming_it(agent_sdk: openai.OpenAI) -> None:
    first = agent_sdk.responses.create(model="m", input=TASK, tools=[EXEC], temperature=0, max_output_tokens=64,
                                 include=["reasoning.encrypted_content"], store=False)
    reasoning, call = first.output
    altered = {"type": "reasoning", "summary": [], "encrypted_content": reasoning.encrypted_content[:-8] + "A" * 8}
    with pytest.raises(openai.BadRequestError) as info:
        agent_sdk.responses.create(model="m", tools=[EXEC], max_output_tokens=4, store=False, input=[
            {"role": "user", "content": TASK}, altered, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "hi"}])
    assert info.value.body["param"] == "input[1].encrypted_content"


def test_a_streamed_turn_seals_its_reasoning_in_the_item_done_event(agent_sdk: openai.OpenAI) -> None:
    events = list(agent_sdk.responses.create(model="m", input=TASK, tools=[EXEC], temperature=0, max_output_tokens=64,
                                       include=["reasoning.encrypted_content"], store=False, stream=True,
                                       reasoning={"summary": "auto"}))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["reasoning", "function_call"]
    assert done[0].encrypted_content == events[-1].response.output[0].encrypted_content
    assert events[-1].response.reasoning.summary == "auto" and done[0].summary == []
