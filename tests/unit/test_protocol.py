"""Both request schemas: validation errors that name the field, and conversion to ``GenerationRequest``."""

from __future__ import annotations

import pytest

from handler.engine.types import GenerationRequest, SamplingParams, StopConditions
from handler.errors import BadRequest
from handler.prompt.renderer import PromptRenderer
from handler.protocol.chat import ChatCompletionRequest
from handler.protocol.common import parse_model
from handler.protocol.legacy import LegacyRequest

MESSAGES = [{"role": "user", "content": "hi"}]


class FakeRenderer(PromptRenderer):
    """Stands in for ``PromptRenderer`` (no tokenizer): records what it was asked and returns recognisable ids."""

    tool_format = "hermes"
    tool_marker_id = None
    reasoning_parser = None
    reasoning_keep_ids = ()

    def __init__(self) -> None:
        self.chats: list[list[dict]] = []
        self.tools: list[list[dict] | None] = []
        self.encoded: list[tuple[str, bool]] = []

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        self.chats.append(messages)
        self.tools.append(tools)
        return [100 + i for i in range(len(messages) * 3)]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        self.encoded.append((text, add_special_tokens))
        return [ord(c) for c in text]


def chat_request(parsed: ChatCompletionRequest, renderer: PromptRenderer, default_temperature: float):
    """The engine request a chat request prepares (``ChatCompletionRequest.prepare``)."""
    return parsed.prepare(renderer, default_temperature, arrived_at=0.0).generation


def legacy_requests(parsed: LegacyRequest, renderer: PromptRenderer, default_max_new_tokens: int) -> list:
    """The engine requests a legacy request prepares (``LegacyRequest.prepare``)."""
    return parsed.prepare(renderer, default_max_new_tokens, arrived_at=0.0)


def chat(**fields) -> ChatCompletionRequest:
    return parse_model(ChatCompletionRequest, {"messages": MESSAGES, **fields})


def chat_error(**fields) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        chat_request(chat(**fields), FakeRenderer(), 0.0)
    return info.value


def legacy(body: dict) -> LegacyRequest:
    return parse_model(LegacyRequest, body)


def legacy_error(body: dict) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        legacy_requests(legacy(body), FakeRenderer(), 16)
    return info.value


# ---- chat: validation -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": 3}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"top_k": -2}, "top_k"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"temperature": "hot"}, "temperature"),
    ({"n": 1.5}, "n"),
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [MESSAGES[0], {"content": "x"}]}, "messages[1].role"),
])
def test_chat_out_of_range_or_wrong_type_names_the_field(fields: dict, param: str) -> None:
    error = chat_error(**fields)
    assert error.param == param
    assert error.status_code == 400
    assert param in error.message


@pytest.mark.parametrize(("fields", "param"), [
    ({"foo": 1}, "foo"),
    ({"stream": True, "stream_options": {"include_usage": True, "bar": 1}}, "stream_options.bar"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
])
def test_chat_unknown_field(fields: dict, param: str) -> None:
    error = chat_error(**fields)
    assert error.param == param
    assert "unknown field" in error.message


@pytest.mark.parametrize(("fields", "param"), [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["a", ""]}, "stop"),
    ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"top_logprobs": 3}, "top_logprobs"),                          # without logprobs
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
])
def test_chat_cross_field_checks_on_conversion(fields: dict, param: str) -> None:
    error = chat_error(**fields)
    assert error.param == param
    assert error.status_code == 400


def test_chat_four_stops_and_bias_at_limits_are_fine() -> None:
    generation = chat_request(chat(stop=["a", "b", "c", "d"], logit_bias={"5": 100, "3": -100}),
                                     FakeRenderer(), 0.0)
    assert generation.stop.stop_strings == ("a", "b", "c", "d")
    assert generation.sampling.logit_bias == ((3, -100.0), (5, 100.0))


def test_parse_model_refuses_a_non_object() -> None:
    with pytest.raises(BadRequest, match="JSON object"):
        parse_model(ChatCompletionRequest, [MESSAGES])


def test_chat_content_of_wrong_type_names_the_content_field() -> None:
    error = chat_error(messages=[{"role": "user", "content": 5}])
    assert error.param == "messages[0].content"


def test_chat_content_of_wrong_type_is_a_400_about_content() -> None:
    error = chat_error(messages=[{"role": "user", "content": 5}])
    assert error.status_code == 400
    assert error.param.startswith("messages[0].content")


# ---- chat: conversion -----------------------------------------------------------------------------------------

def test_chat_conversion_defaults() -> None:
    renderer = FakeRenderer()
    generation = chat_request(chat(), renderer, 0.0)
    assert isinstance(generation, GenerationRequest)
    assert generation.request_id.startswith("chatcmpl-")
    assert generation.prompt_ids == (100, 101, 102)
    assert renderer.chats == [[{"role": "user", "content": "hi"}]]
    assert generation.sampling == SamplingParams()
    assert generation.stop == StopConditions()
    assert (generation.n, generation.num_top_logprobs) == (1, 0)


def test_chat_conversion_all_fields() -> None:
    renderer = FakeRenderer()
    generation = chat_request(chat(
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "content": "42", "tool_call_id": "c1"}],
        max_tokens=50, max_completion_tokens=20, temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05, n=3,
        stop="END", seed=11, frequency_penalty=0.5, presence_penalty=-0.5, logit_bias={"9": 1.5, "2": -3},
        logprobs=True, top_logprobs=4, repetition_penalty=1.2, ignore_eos=True,
    ), renderer, 0.0)
    assert generation.prompt_ids == tuple(range(100, 112))
    assert renderer.chats == [[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]]
    assert generation.sampling == SamplingParams(
        temperature=0.7, top_p=0.9, top_k=0, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.5,
        presence_penalty=-0.5, logit_bias=((2, -3.0), (9, 1.5)), seed=11)
    assert generation.stop == StopConditions(max_new_tokens=20, stop_strings=("END",), ignore_eos=True)
    assert (generation.n, generation.num_top_logprobs) == (3, 4)


def test_chat_max_tokens_used_without_max_completion_tokens() -> None:
    assert chat_request(chat(max_tokens=7), FakeRenderer(), 0.0).stop.max_new_tokens == 7


@pytest.mark.parametrize(("fields", "default", "expected"), [
    ({}, 0.0, 0.0),
    ({}, 0.6, 0.6),           # the model's own default (generation_config.json)
    ({"temperature": 0}, 0.6, 0.0),
    ({"temperature": 1.2}, 0.0, 1.2),
])
def test_chat_temperature_precedence(fields: dict, default: float, expected: float) -> None:
    assert chat_request(chat(**fields), FakeRenderer(), default).sampling.temperature == expected


def test_chat_top_k_positive_passes_through() -> None:
    assert chat_request(chat(top_k=5), FakeRenderer(), 0.0).sampling.top_k == 5


def test_chat_stop_list_kept_in_order() -> None:
    assert chat_request(chat(stop=["x", "y"]), FakeRenderer(), 0.0).stop.stop_strings == ("x", "y")


def test_chat_request_ids_are_unique() -> None:
    ids = {chat_request(chat(), FakeRenderer(), 0.0).request_id for _ in range(20)}
    assert len(ids) == 20


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}],
     "messages[0].content[0]"),
    ([{"role": "system", "content": "s"},
      {"role": "user", "content": [{"type": "text", "text": "look"},
                                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
     "messages[1].content[1]"),
])
def test_chat_image_to_text_only_model_names_the_part(messages: list[dict], param: str) -> None:
    renderer = FakeRenderer()
    with pytest.raises(BadRequest) as info:
        chat_request(chat(messages=messages), renderer, 0.0)
    assert info.value.param == param
    assert "vision" in info.value.message
    assert renderer.chats == []


def test_chat_image_detail_is_validated() -> None:
    error = chat_error(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x", "detail": "ultra"}}]}])
    assert error.param.startswith("messages[0].content")
    assert "detail" in error.param


# ---- legacy: validation ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "param"), [
    ({"inputs": "x", "parameters": {"temperature": -1}}, "parameters.temperature"),
    ({"inputs": "x", "parameters": {"top_p": 0}}, "parameters.top_p"),
    ({"inputs": "x", "parameters": {"top_p": float("nan")}}, "parameters.top_p"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ({"inputs": "x", "parameters": {"top_n_tokens": 21}}, "parameters.top_n_tokens"),
    ({"inputs": "x", "parameters": {"repetition_penalty": 11}}, "parameters.repetition_penalty"),
    ({"inputs": "x", "parameters": "greedy"}, "parameters"),
    ({"inputs": "x", "stream": [True]}, "stream"),
    ({"parameters": {}}, "inputs"),
])
def test_legacy_out_of_range_names_the_field(body: dict, param: str) -> None:
    error = legacy_error(body)
    assert error.param == param
    assert error.status_code == 400


@pytest.mark.parametrize(("body", "param"), [
    ({"inputs": "x", "foo": 1}, "foo"),
    ({"inputs": "x", "parameters": {"foo": 1}}, "parameters.foo"),
])
def test_legacy_unknown_field(body: dict, param: str) -> None:
    error = legacy_error(body)
    assert error.param == param
    assert "unknown field" in error.message


def test_legacy_inputs_of_wrong_type_names_inputs() -> None:
    assert legacy_error({"inputs": 5}).param == "inputs"


def test_legacy_stream_with_a_list_is_refused() -> None:
    error = legacy_error({"inputs": ["a", "b"], "stream": True})
    assert error.param == "inputs"
    assert error.status_code == 400


def test_legacy_decoder_input_details_cannot_stream() -> None:
    error = legacy_error({"inputs": "a", "stream": True, "parameters": {"decoder_input_details": True}})
    assert (error.status_code, error.param) == (400, "parameters.decoder_input_details")


def test_legacy_decoder_input_details_asks_for_the_prompts_logprobs() -> None:
    [plain] = legacy_requests(legacy({"inputs": "ab"}), FakeRenderer(), 16)
    [scored] = legacy_requests(legacy({"inputs": "ab", "parameters": {"decoder_input_details": True}}),
                                      FakeRenderer(), 16)
    assert (plain.prompt_logprobs, scored.prompt_logprobs) == (None, 0)  # TGI's prefill has no alternatives


def test_legacy_empty_list_is_refused() -> None:
    assert legacy_error({"inputs": []}).param == "inputs"


def test_legacy_empty_stop_is_refused() -> None:
    assert legacy_error({"inputs": "x", "parameters": {"stop_sequences": [""]}}).param == "parameters.stop"


# ---- legacy: conversion ---------------------------------------------------------------------------------------

def test_legacy_string_input_is_one_request() -> None:
    renderer = FakeRenderer()
    parsed = legacy({"inputs": "ab"})
    assert parsed.prompts == ["ab"] and not parsed.is_batch
    (generation,) = legacy_requests(parsed, renderer, 16)
    assert generation.request_id.startswith("gen-")
    assert generation.prompt_ids == (97, 98)
    assert renderer.encoded == [("ab", True)]
    assert generation.stop == StopConditions(max_new_tokens=16)
    assert generation.sampling == SamplingParams()
    assert (generation.n, generation.num_top_logprobs) == (1, 0)


def test_legacy_list_input_is_one_request_per_prompt() -> None:
    parsed = legacy({"inputs": ["a", "bc", "d"]})
    assert parsed.prompts == ["a", "bc", "d"] and parsed.is_batch
    generations = legacy_requests(parsed, FakeRenderer(), 16)
    assert [g.prompt_ids for g in generations] == [(97,), (98, 99), (100,)]
    assert len({g.request_id for g in generations}) == 3


def test_legacy_single_item_list_stays_a_batch() -> None:
    parsed = legacy({"inputs": ["a"]})
    assert parsed.is_batch
    assert len(legacy_requests(parsed, FakeRenderer(), 16)) == 1


@pytest.mark.parametrize(("parameters", "temperature"), [
    ({}, 0.0),
    ({"temperature": 0}, 0.0),
    ({"temperature": 0.7}, 0.7),
    ({"do_sample": True}, 1.0),
    ({"do_sample": True, "temperature": 0.3}, 0.3),
    ({"top_p": 0.9}, 1.0),
    ({"top_k": 40}, 1.0),
    ({"top_k": -1}, 0.0),
    ({"repetition_penalty": 1.3}, 0.0),
    ({"do_sample": False, "temperature": 0.5}, 0.5),   # TGI: a temperature means sampling
])
def test_legacy_do_sample_rules(parameters: dict, temperature: float) -> None:
    (generation,) = legacy_requests(legacy({"inputs": "x", "parameters": parameters}), FakeRenderer(), 16)
    assert generation.sampling.temperature == temperature


def test_legacy_parameters_map_onto_sampling_and_stop() -> None:
    body = {"inputs": "x", "parameters": {
        "max_new_tokens": 9, "temperature": 0.8, "top_p": 0.95, "top_k": 50, "min_p": 0.1,
        "repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.3, "seed": 5,
        "stop": "###", "stop_sequences": ["\n\n", "END"], "top_n_tokens": 2, "ignore_eos": True,
        "details": True, "return_full_text": True}}
    (generation,) = legacy_requests(legacy(body), FakeRenderer(), 16)
    assert generation.sampling == SamplingParams(
        temperature=0.8, top_p=0.95, top_k=50, min_p=0.1, repetition_penalty=1.1, frequency_penalty=0.2,
        presence_penalty=0.3, seed=5)
    assert generation.stop == StopConditions(max_new_tokens=9, stop_strings=("###", "\n\n", "END"), ignore_eos=True)
    assert generation.num_top_logprobs == 2


def test_legacy_stop_list_and_stop_sequences_merged() -> None:
    body = {"inputs": "x", "parameters": {"stop": ["a", "b"], "stop_sequences": ["c"]}}
    (generation,) = legacy_requests(legacy(body), FakeRenderer(), 16)
    assert generation.stop.stop_strings == ("a", "b", "c")


def test_legacy_max_new_tokens_default_from_argument() -> None:
    parsed = legacy({"inputs": "x"})
    assert legacy_requests(parsed, FakeRenderer(), 77)[0].stop.max_new_tokens == 77
    parsed = legacy({"inputs": "x", "parameters": {"max_new_tokens": 3}})
    assert legacy_requests(parsed, FakeRenderer(), 77)[0].stop.max_new_tokens == 3


def test_fit_prompt_keeps_the_tail_and_room_to_generate() -> None:
    from handler.engine.backend import EngineLimits
    from handler.engine.core.checks import fit_prompt

    limits = EngineLimits(max_running=4, max_model_len=100, max_step_tokens=64)
    request = GenerationRequest("r", tuple(range(500)), stop=StopConditions(max_new_tokens=10), truncate_prompt=True)
    fitted = fit_prompt(request, limits)
    assert fitted.prompt_ids == tuple(range(410, 500))
    untouched = GenerationRequest("r", tuple(range(500)), stop=StopConditions(max_new_tokens=10))
    assert fit_prompt(untouched, limits) is untouched
