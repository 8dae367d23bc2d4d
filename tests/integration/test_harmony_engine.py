"""gpt-oss end to end on the lean engine: a tiny random gpt_oss checkpoint with harmony's special tokens and the
real gpt-oss chat template, served by the Flask app over the real engine (loader, scheduler, sampler, llguidance,
detokeniser) and the real chat formatter.

Tiny random checkpoints cannot write harmony, so a test wrapper around the model's forward scripts it: for the
row whose next position is the prompt's length + k, the script's k-th token gets +1000 on its logit. Everything
after the logits is the engine's own: the sampler picks, a grammar's mask still applies (a scripted token the
grammar forbids is masked, and the output leaves the script), the special tokens' text is kept for the split.
"""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
import torch

from handler import server
from handler.config import Settings
from handler.engine.backend import EngineLimits
from handler.engine.lean.engine import Engine, wait_until_ready
from handler.parsing.reasoning import HARMONY_TOKENS
from handler.prompt.renderer import PromptRenderer
from handler.service import RequestDefaults
from tests.integration.conftest import post
from tests.support.tiny_checkpoints import SMOLLM2_DIR, TINY

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "templates" / "openai-gpt-oss-120b.jinja"
GPT_OSS = {"head_dim": 16, "sliding_window": 48, "num_local_experts": 4, "num_experts_per_tok": 2,
           "intermediate_size": 32}
ANALYSIS = "<|channel|>analysis<|message|>The user wants Tokyo's weather.<|end|><|start|>assistant"
ANSWER = ANALYSIS + "<|channel|>final<|message|>It is sunny.<|return|>"
CALL = (ANALYSIS + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Tokyo"}'
        "<|call|>")
QUESTION = [{"role": "user", "content": "Weather in Tokyo?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}


def build_tiny_gpt_oss(path: Path) -> Path:
    """A tiny random gpt_oss with the embedded tokenizer plus harmony's special tokens (ends: ``<|return|>``,
    ``<|call|>``, as gpt-oss's generation config) and gpt-oss's real chat template."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_TOKENS)})
    tokenizer.chat_template = TEMPLATE.read_text()
    ends = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    config = AutoConfig.for_model("gpt_oss", **{**TINY, **GPT_OSS, "vocab_size": len(tokenizer),
                                                "eos_token_id": ends[0], "pad_token_id": tokenizer.pad_token_id})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(path)
    GenerationConfig(eos_token_id=ends, pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    shutil.copy(TEMPLATE, path / "chat_template.jinja")
    return path


class Script:
    """The wrapper's script: which token comes at each position after the prompt (``{position: token id}``)."""

    def __init__(self) -> None:
        self.by_position: dict[int, int] = {}

    def wrap(self, model) -> None:
        forward = model.forward

        def scripted(tokens, positions, layout, cache, logit_rows, *args, **kwargs):
            logits = forward(tokens, positions, layout, cache, logit_rows, *args, **kwargs)
            if kwargs.get("hidden"):
                return logits
            bias = torch.zeros_like(logits)
            for row, position in enumerate(positions[logit_rows].tolist()):
                token = self.by_position.get(position + 1)
                if token is not None:
                    bias[row, token] = 1000.0
            return logits + bias

        model.forward = scripted


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory):
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip("the embedded model is not assembled (make model)")
    from handler.engine.core.tokenizer import load_tokenizer
    from handler.engine.lean.load import load
    from handler.engine.lean.options import LoadOptions

    folder = build_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))
    options = LoadOptions(folder, "float32", False, "cpu", max_running=4, max_model_len=512)
    loaded, parts = load(options, lambda: load_tokenizer(folder))
    script = Script()
    script.wrap(loaded.runner.model)
    engine = Engine(lambda: loaded, EngineLimits(max_running=4, max_model_len=512, max_step_tokens=512))
    engine.start()
    wait_until_ready(engine, timeout=120)
    renderer = PromptRenderer(parts.tokenizer)
    service = types.SimpleNamespace(settings=Settings(), model_name="m", defaults=RequestDefaults(0.0, 256),
                                    serves_builtin=True, renderer=renderer, engine=engine, user_handler=None,
                                    is_ready=True, load_error=None, adapters=None)
    yield server.create_app(service).test_client(), renderer, script
    engine.stop()


def scripted(harmony, body: dict, transcript: str) -> None:
    """Script ``transcript`` after the prompt the server will render for ``body``."""
    _, renderer, script = harmony
    tools = body.get("tools")
    kwargs = {"reasoning_effort": body["reasoning_effort"]} if "reasoning_effort" in body else None
    prompt = renderer.render_chat(body["messages"], tools, template_kwargs=kwargs)
    ids = renderer.encode(transcript)
    script.by_position = {len(prompt) + k: token for k, token in enumerate(ids)}


def chat(harmony, body: dict, transcript: str):
    scripted(harmony, body, transcript)
    return post(harmony[0], "/v1/chat/completions", {"max_tokens": 64, **body})


def test_the_model_is_gpt_oss_with_harmony_detected(harmony) -> None:
    renderer = harmony[1]
    assert renderer.reasoning_parser == "gpt_oss"
    assert len(renderer.reasoning_keep_ids) == len(HARMONY_TOKENS)


def test_analysis_is_reasoning_and_final_is_content(harmony) -> None:
    body = chat(harmony, {"messages": QUESTION}, ANSWER).get_json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "It is sunny."
    assert choice["message"]["reasoning"] == choice["message"]["reasoning_content"] == \
           "The user wants Tokyo's weather."
    assert choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_streamed_chunk_by_chunk_the_split_is_the_same(harmony) -> None:
    response = chat(harmony, {"messages": QUESTION, "stream": True}, ANSWER)
    frames = [json.loads(f.removeprefix("data: ")) for f in response.get_data(as_text=True).split("\n\n")[:-2]]
    deltas = [f["choices"][0]["delta"] for f in frames if f["choices"]]
    reasoning = [d["reasoning"] for d in deltas if "reasoning" in d]
    content = [d["content"] for d in deltas if d.get("content")]
    assert len(reasoning) > 3 and len(content) > 1  # token by token, not one block
    assert "".join(reasoning) == "The user wants Tokyo's weather." and "".join(content) == "It is sunny."
    assert not any("<|" in json.dumps(d) for d in deltas)  # no harmony marker leaks into a delta


def test_a_commentary_call_to_functions_becomes_a_tool_call(harmony) -> None:
    body = chat(harmony, {"messages": QUESTION, "tools": [WEATHER]}, CALL).get_json()
    choice = body["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"location":"Tokyo"}'}
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    assert choice["message"]["reasoning"] == "The user wants Tokyo's weather."
    response = chat(harmony, {"messages": QUESTION, "tools": [WEATHER], "stream": True}, CALL)
    frames = [json.loads(f.removeprefix("data: ")) for f in response.get_data(as_text=True).split("\n\n")[:-2]]
    calls = [d["tool_calls"] for f in frames if f["choices"] for d in [f["choices"][0]["delta"]] if "tool_calls" in d]
    assert [c[0]["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"location":"Tokyo"}'}]
    assert frames[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_schema_starts_at_the_final_message_after_free_analysis(harmony) -> None:
    """The script writes analysis then a final message of JSON the schema accepts (in the server's JSON layout,
    ``json_rules.JSON_LAYOUT``): all of it goes through, so the analysis was left free and the grammar applied at
    the final channel."""
    schema = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"],
              "additionalProperties": False}
    body = {"messages": QUESTION, "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "w", "schema": schema}}}
    answer = chat(harmony, body, ANALYSIS + '<|channel|>final<|message|>{"sunny": true}<|return|>').get_json()
    message = answer["choices"][0]["message"]
    assert message["reasoning"] == "The user wants Tokyo's weather." and json.loads(message["content"]) == {
        "sunny": True}


def test_the_grammar_holds_the_final_message_when_the_script_leaves_it(harmony) -> None:
    """The script's final message is prose the schema forbids: the engine masks it, so the content is the schema's
    JSON all the same (an ungated or ignored grammar would return the prose, or forbid the analysis)."""
    schema = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"],
              "additionalProperties": False}
    body = {"messages": QUESTION, "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}
    answer = chat(harmony, body, ANSWER).get_json()
    message = answer["choices"][0]["message"]
    assert message["reasoning"] == "The user wants Tokyo's weather."
    assert set(json.loads(message["content"])) == {"sunny"}


UNIT = {"type": "function", "function": {"name": "set_unit", "description": "Temperature unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}}}
# the forced call in harmony's form, its arguments in the server's JSON layout (json_rules.JSON_LAYOUT)
FORCED = (ANALYSIS + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "Tokyo"}'
          "<|call|>")


def test_a_forced_call_is_harmonys_commentary_message_after_free_analysis(harmony) -> None:
    """tool_choice required: the scripted analysis and harmony call go through the grammar whole (the hermes
    grammar would mask the first ``<|channel|>``: no reasoning, a ``<tool_call>`` block instead), and come back as
    tool_calls, streamed too."""
    body = {"messages": QUESTION, "tools": [WEATHER], "tool_choice": "required"}
    choice = chat(harmony, body, FORCED).get_json()["choices"][0]
    assert choice["message"]["reasoning"] == "The user wants Tokyo's weather."
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"location": "Tokyo"}'}]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    response = chat(harmony, {**body, "stream": True}, FORCED)
    frames = [json.loads(f.removeprefix("data: ")) for f in response.get_data(as_text=True).split("\n\n")[:-2]]
    deltas = [f["choices"][0]["delta"] for f in frames if f["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == "The user wants Tokyo's weather."
    assert [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d] == [
        {"name": "get_weather", "arguments": '{"location": "Tokyo"}'}]
    assert not any(d.get("content") for d in deltas)
    assert frames[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_named_forced_call_holds_the_function_and_its_schema(harmony) -> None:
    """The script calls get_weather; tool_choice names set_unit. The grammar masks the scripted name and arguments,
    so the call is set_unit's with a unit its schema allows, after the same free analysis."""
    body = {"messages": QUESTION, "tools": [WEATHER, UNIT], "max_tokens": 48,
            "tool_choice": {"type": "function", "function": {"name": "set_unit"}}}
    choice = chat(harmony, body, FORCED).get_json()["choices"][0]
    assert choice["message"]["reasoning"] == "The user wants Tokyo's weather."
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "set_unit"
    assert json.loads(call["function"]["arguments"]) in ({"unit": "celsius"}, {"unit": "fahrenheit"})
    assert choice["finish_reason"] == "tool_calls"


def test_a_tool_without_description_is_served_and_called(harmony) -> None:
    """gpt-oss's template failed on a tool without ``description`` (400 naming messages); it is rendered with an
    empty one, and a forced call to it (no ``parameters``: arguments ``{}``) comes back."""
    clock = {"type": "function", "function": {"name": "get_time"}}
    body = {"messages": QUESTION, "tools": [clock], "tool_choice": "required"}
    transcript = ANALYSIS + "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>"
    response = chat(harmony, body, transcript)
    assert response.status_code == 200, response.get_json()
    choice = response.get_json()["choices"][0]
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "get_time", "arguments": "{}"}]
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_the_responses_api_returns_a_reasoning_item_then_a_function_call(harmony, stream: bool) -> None:
    """``/v1/responses`` over the same harmony transcript (a forced call): the analysis becomes a reasoning item, the
    commentary call a function_call item, and there is no message item."""
    function = WEATHER["function"]
    scripted(harmony, {"messages": QUESTION, "tools": [WEATHER]}, FORCED)
    body = {"input": QUESTION[0]["content"], "max_output_tokens": 64, "tool_choice": "required", "stream": stream,
            "tools": [{"type": "function", "name": function["name"], "description": function["description"],
                       "parameters": function["parameters"]}]}
    response = post(harmony[0], "/v1/responses", body)
    if stream:
        records = [json.loads(frame.split("\n")[1].removeprefix("data: "))
                   for frame in response.get_data(as_text=True).split("\n\n")[:-1]]
        deltas = [r["delta"] for r in records if r["type"] == "response.reasoning_text.delta"]
        assert len(deltas) > 3 and "".join(deltas) == "The user wants Tokyo's weather."  # token by token
        assert records[-1]["type"] == "response.completed"
        output = records[-1]["response"]["output"]
    else:
        output = response.get_json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "function_call"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "The user wants Tokyo's weather."}]
    assert (output[1]["name"], output[1]["arguments"]) == ("get_weather", '{"location": "Tokyo"}')
    assert output[1]["call_id"].startswith("call_") and output[1]["status"] == "completed"
