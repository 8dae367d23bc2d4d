"""Completions (parse, convert, format), best_of selection, and the ``extra-parameters`` policy."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from handler.endpoints.invocations import sniff_schema
from handler.engine.types import (
    FinishReason,
    GenerationRequest,
    PromptLogprob,
    SamplingParams,
    StopConditions,
    TokenEvent,
    TopLogprob,
)
from handler.errors import BadRequest, ServingError, Unprocessable
from handler.formatting import chat as chat_format
from handler.formatting import completions
from handler.formatting.chat import ChatContext
from handler.formatting.completions import CompletionsContext
from handler.formatting.context import ChoiceResult, FormatContext, best_choices, cumulative_logprob
from handler.protocol.attributes import parse_custom_attributes
from handler.protocol.chat import ChatCompletionRequest
from handler.protocol.common import ExtraParameters, Extras, PassThrough, parse_model, parse_request
from handler.protocol.completions import CompletionRequest
from handler.protocol.legacy import LegacyRequest

VOCAB = {2: "<|im_end|>", 5: "Hel", 6: "lo", 7: " wor", 8: "ld", 9: "é"}
EOS, STOP, LENGTH = FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH


class FakeRenderer:
    """Stands in for ``PromptRenderer``: records what it was asked and returns recognisable ids."""

    def __init__(self, has_chat_template: bool = True) -> None:
        self.has_chat_template = has_chat_template
        self.chats: list[list[dict]] = []
        self.encoded: list[tuple[str, bool]] = []

    def render_chat(self, messages: list[dict]) -> list[int]:
        self.chats.append(messages)
        return [100, 101, 102]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        self.encoded.append((text, add_special_tokens))
        return [ord(c) for c in text]

    vocab_size = 500

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)


def request(**fields) -> CompletionRequest:
    return parse_model(CompletionRequest, {"prompt": "hi", **fields})


def convert(renderer: FakeRenderer | None = None, default_temperature: float = 0.0, **fields) -> list:
    return request(**fields).prepare(renderer or FakeRenderer(), default_temperature, arrived_at=0.0)


def token_text(token_id: int) -> str:
    return VOCAB.get(token_id, f"<{token_id}>")


def ctx(kind: type[FormatContext] = CompletionsContext, **options) -> FormatContext:
    return kind(
        request_id="cmpl-abc",
        model="tiny",
        created=1700000000,
        token_text=token_text,
        token_bytes=lambda t: token_text(t).encode(),
        **options,
    )


def ev(index: int, token_id: int | None, text: str, logprob: float | None = None, **kwargs) -> TokenEvent:
    return TokenEvent(index=index, token_id=token_id, text=text, logprob=logprob, **kwargs)


def end(index: int, token_id: int, text: str, logprob: float, reason: FinishReason, prompt: int, generated: int):
    return ev(
        index,
        token_id,
        text,
        logprob,
        finish_reason=reason,
        is_special=token_id == 2,
        num_prompt_tokens=prompt,
        num_generated_tokens=generated,
    )


def hello(index: int = 0, prompt: int = 4) -> list[TokenEvent]:
    """'Hello world', then EOS (special, no text): 5 tokens."""
    body = [ev(index, 5, "Hel", -0.1), ev(index, 6, "lo", -0.2), ev(index, 7, " wor", -0.3), ev(index, 8, "ld", -0.4)]
    return [*body, end(index, 2, "", -0.01, EOS, prompt, 5)]


# ---- parsing ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": 3}, "prompt"),
        ({"prompt": [1, -2]}, "prompt[1]"),             # token ids are integers from 0
        ({"prompt": [[1], [2, True]]}, "prompt[1][1]"),
        ({"prompt": [1, 2.0]}, "prompt[1]"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"best_of": 0}, "best_of"),
        ({"best_of": 129}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"echo": "maybe"}, "echo"),
        ({"suffix": 3}, "suffix"),
        ({"use_raw_prompt": "maybe"}, "use_raw_prompt"),
        ({"error_behavior": "drop"}, "error_behavior"),
        ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_bad_field_is_a_400_naming_it(fields: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        request(**fields)
    assert info.value.param == param


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": ["a", "b"], "stream": True}, 400, "prompt"),
        ({"prompt": [[]]}, 400, "prompt"),
        ({"prompt": [[1], []]}, 400, "prompt[1]"),
        ({"prompt": [5, 999]}, 400, "prompt"),              # outside the tokenizer's vocabulary
        ({"prompt": [[5], [6, 999]]}, 400, "prompt[1]"),
        ({"prompt": [5], "use_raw_prompt": False}, 400, "use_raw_prompt"),
        ({"max_tokens": 0}, 400, "max_tokens"),             # 0 only with echo
        ({"prompt_logprobs": 0, "stream": True}, 400, "prompt_logprobs"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"n": 3, "best_of": 2}, 400, "best_of"),
        ({"best_of": 2, "stream": True}, 400, "best_of"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"stop": [""]}, 400, "stop"),
        ({"logit_bias": {"5": 101}}, 400, "logit_bias"),
    ],
)
def test_cross_field_rules_on_conversion(fields: dict, status: int, param: str) -> None:
    with pytest.raises(ServingError) as info:
        convert(**fields)
    assert (info.value.status_code, info.value.param) == (status, param)


def test_no_chat_template_with_use_raw_prompt_false_is_a_422() -> None:
    with pytest.raises(Unprocessable) as info:
        convert(FakeRenderer(has_chat_template=False), use_raw_prompt=False)
    assert info.value.param == "use_raw_prompt"


# ---- conversion ------------------------------------------------------------------------------------------------


def test_defaults() -> None:
    renderer = FakeRenderer()
    [generation] = convert(renderer, default_temperature=0.7)
    assert generation.request_id.startswith("cmpl-")
    assert generation.prompt_ids == (ord("h"), ord("i"))
    assert renderer.encoded == [("hi", True)]  # raw: the tokenizer's own special tokens, no template
    assert generation.sampling == SamplingParams(temperature=0.7)
    assert generation.stop == StopConditions(max_new_tokens=None)  # up to the context limit
    assert (generation.n, generation.num_top_logprobs, generation.truncate_prompt) == (1, 0, False)


def test_all_fields() -> None:
    fields = {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.1,
        "n": 2,
        "best_of": 3,
        "stop": "x",
        "seed": 11,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.2,
        "logit_bias": {"9": -100},
        "logprobs": 3,
        "ignore_eos": True,
        "error_behavior": "truncate",
        "suffix": "!",
        "user": "u",
        "model": "m",
    }
    [generation] = convert(**fields)
    assert generation.sampling == SamplingParams(
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.1,
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        logit_bias=((9, -100.0),),
        seed=11,
    )
    assert generation.stop == StopConditions(max_new_tokens=7, stop_strings=("x",), ignore_eos=True)
    assert (generation.n, generation.num_top_logprobs, generation.truncate_prompt) == (3, 3, True)


def test_one_request_per_prompt() -> None:
    generations = convert(prompt=["ab", "c"], n=2)
    assert [g.prompt_ids for g in generations] == [(97, 98), (99,)]
    assert [g.n for g in generations] == [2, 2]
    assert len({g.request_id for g in generations}) == 2


def test_token_prompts_go_as_they_are() -> None:
    renderer = FakeRenderer()
    generations = convert(renderer, prompt=[[1, 2], [3]])
    assert [g.prompt_ids for g in generations] == [(1, 2), (3,)]
    assert [g.prompt_param for g in generations] == ["prompt[0]", "prompt[1]"]
    assert renderer.encoded == []
    [one] = convert(renderer, prompt=[104, 105])  # one prompt of token ids
    assert (one.prompt_ids, one.prompt_param) == ((104, 105), "prompt")


@pytest.mark.parametrize(
    ("fields", "scored"),
    [
        ({}, None),
        ({"logprobs": 2}, None),                               # the completion's logprobs only
        ({"echo": True}, None),
        ({"echo": True, "logprobs": 0}, 0),                    # the echoed prompt's: its tokens' logprobs
        ({"echo": True, "logprobs": 3}, 3),
        ({"prompt_logprobs": 0}, 0),                           # vLLM's field
        ({"echo": True, "logprobs": 1, "prompt_logprobs": 5}, 5),  # the larger; each formatter keeps its own
    ],
)
def test_prompt_logprobs_asked_of_the_engine(fields: dict, scored: int | None) -> None:
    [generation] = convert(**fields)
    assert generation.prompt_logprobs == scored


def test_echo_only_generates_one_token_to_drop() -> None:
    [generation] = convert(echo=True, max_tokens=0, logprobs=1)
    assert generation.stop.max_new_tokens == 1 and generation.prompt_logprobs == 1
    assert request(echo=True, max_tokens=0).is_echo_only and not request(echo=True, max_tokens=1).is_echo_only


def test_echo_texts_are_the_prompts_as_sent_or_decoded() -> None:
    renderer = FakeRenderer()
    assert request(prompt=["ab", "c"], echo=True).echo_texts(renderer) == ("ab", "c")
    assert request(prompt=[[104, 105], [33]], echo=True).echo_texts(renderer) == ("hi", "!")
    assert request(prompt=[104, 105]).echo_texts(renderer) == ()  # no echo, nothing decoded


def test_single_item_list_may_stream() -> None:
    assert len(convert(prompt=["a"], stream=True)) == 1


@pytest.mark.parametrize(("use_raw_prompt", "templated"), [(None, False), (True, False), (False, True)])
def test_use_raw_prompt(use_raw_prompt: bool | None, templated: bool) -> None:
    renderer = FakeRenderer()
    fields = {} if use_raw_prompt is None else {"use_raw_prompt": use_raw_prompt}
    [generation] = convert(renderer, **fields)
    if templated:
        assert renderer.chats == [[{"role": "user", "content": "hi"}]] and generation.prompt_ids == (100, 101, 102)
    else:
        assert renderer.chats == [] and renderer.encoded == [("hi", True)]


def test_chat_best_of_generates_best_of_choices() -> None:
    from handler.config import DEFAULT_MODEL_DIR
    from handler.engine.core.tokenizer import load_tokenizer
    from handler.prompt.renderer import PromptRenderer

    renderer = PromptRenderer(load_tokenizer(Path(DEFAULT_MODEL_DIR)))  # chat's conversion needs the real one
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "temperature": 0.7}
    assert parse_model(ChatCompletionRequest, body).prepare(renderer, 0.0, arrived_at=0.0).generation.n == 2
    body["best_of"] = 4
    sampled = parse_model(ChatCompletionRequest, body).prepare(renderer, 0.0, arrived_at=0.0).generation
    assert (sampled.n, sampled.beam) == (4, None)  # sampling on: best_of candidates, the n best kept
    del body["temperature"]  # sampling off (the model's default here): best_of is the beam width
    beams = parse_model(ChatCompletionRequest, body).prepare(renderer, 0.0, arrived_at=0.0).generation
    assert (beams.n, beams.beam.width, beams.beam.param) == (2, 4, "best_of")


@pytest.mark.parametrize(("fields", "param"), [({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 0}, "best_of")])
def test_chat_best_of_checks(fields: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        body = {"messages": [{"role": "user", "content": "hi"}], **fields}
        parse_model(ChatCompletionRequest, body).prepare(FakeRenderer(), 0.0, arrived_at=0.0)
    assert info.value.param == param


# ---- best_of ---------------------------------------------------------------------------------------------------


def choice(index: int, *logprobs: float) -> ChoiceResult:
    return ChoiceResult(index, text=str(index), events=[ev(index, 5, "x", lp) for lp in logprobs])


@pytest.mark.parametrize(
    ("scores", "n", "picked"),
    [
        ([[-1.0], [-0.5], [-2.0]], 1, [1]),
        ([[-1.0], [-0.5], [-2.0]], 2, [1, 0]),
        ([[-1.0], [-0.5], [-2.0]], 3, [1, 0, 2]),
        ([[-0.1, -0.1, -0.1], [-0.25]], 1, [1]),  # the sum, not the mean: shorter can win
        ([[-1.0], [-1.0], [-3.0]], 2, [0, 1]),  # ties keep their order
    ],
)
def test_best_choices_ranks_by_cumulative_logprob(scores: list, n: int, picked: list[int]) -> None:
    chosen = best_choices([choice(i, *s) for i, s in enumerate(scores)], n)
    assert [c.text for c in chosen] == [str(i) for i in picked]
    assert [c.index for c in chosen] == list(range(n))


def test_cumulative_logprob_skips_events_without_a_token() -> None:
    result = ChoiceResult(0, events=[ev(0, 5, "a", -0.5), ev(0, None, "", None, finish_reason=STOP)])
    assert cumulative_logprob(result) == -0.5


def test_chat_completion_keeps_the_best_and_bills_every_candidate() -> None:
    events = [
        end(0, 5, "Hel", -2.0, LENGTH, 3, 1),
        end(1, 6, "lo", -0.5, LENGTH, 3, 1),
        end(2, 7, " wor", -1.0, LENGTH, 3, 1),
    ]
    record = chat_format.chat_completion(events, 3, ctx(ChatContext, keep_best=2))
    assert [(c["index"], c["message"]["content"]) for c in record["choices"]] == [(0, "lo"), (1, " wor")]
    assert record["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


# ---- formatting ------------------------------------------------------------------------------------------------


def base() -> dict:
    return {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 1700000000,
        "model": "tiny",
        "system_fingerprint": chat_format.SYSTEM_FINGERPRINT,
    }


def test_completion_exact_shape() -> None:
    record = completions.completion([hello()], 1, ctx())
    assert record == {
        **base(),
        "choices": [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9},
    }


@pytest.mark.parametrize(("reason", "wire"), [(EOS, "stop"), (STOP, "stop"), (LENGTH, "length")])
def test_finish_reason_mapping(reason: FinishReason, wire: str) -> None:
    record = completions.completion([[end(0, 5, "Hel", -0.1, reason, 1, 1)]], 1, ctx())
    assert record["choices"][0]["finish_reason"] == wire


def test_several_prompts_are_prompt_major_and_usage_sums() -> None:
    first = [end(1, 6, "b", -0.1, LENGTH, 3, 1), end(0, 5, "a", -0.1, LENGTH, 3, 1)]
    second = [end(0, 7, "c", -0.1, LENGTH, 5, 1), end(1, 8, "d", -0.1, LENGTH, 5, 1)]
    record = completions.completion([first, second], 2, ctx())
    assert [(c["index"], c["text"]) for c in record["choices"]] == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert record["usage"] == {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12}


@pytest.mark.parametrize(
    ("options", "text"),
    [
        ({}, "Hello world"),
        ({"suffix": " [end]"}, "Hello world [end]"),
        ({"return_full_text": True, "prompt_texts": ("Say: ",)}, "Say: Hello world"),
        ({"return_full_text": True, "prompt_texts": ("Say: ",), "suffix": "!"}, "Say: Hello world!"),
        ({"prompt_texts": ("Say: ",)}, "Hello world"),  # prompt texts alone do not echo
    ],
)
def test_echo_and_suffix(options: dict, text: str) -> None:
    assert completions.completion([hello()], 1, ctx(**options))["choices"][0]["text"] == text


def test_logprobs_legacy_shape_one_entry_per_token() -> None:
    events = [
        ev(0, 5, "Hel", -0.1, top_logprobs=(TopLogprob(5, -0.1), TopLogprob(9, -2.5))),
        ev(0, 9, "é", -1.5, top_logprobs=(TopLogprob(5, -0.3),)),  # chosen token not among the top: added
        end(0, 2, "", -0.05, EOS, 1, 3),
    ]
    record = completions.completion([events], 1, ctx(want_logprobs=True))
    assert record["choices"][0]["logprobs"] == {
        "tokens": ["Hel", "é", "<|im_end|>"],
        "token_logprobs": [-0.1, -1.5, -0.05],
        "top_logprobs": [{"Hel": -0.1, "é": -2.5}, {"Hel": -0.3, "é": -1.5}, {"<|im_end|>": -0.05}],
        "text_offset": [0, 3, 4],
    }
    assert len(record["choices"][0]["logprobs"]["tokens"]) == record["usage"]["completion_tokens"]


# the prompt "Hello" + a special token, as the engine scores it (its first token has no logprob)
PROMPT_LOGPROBS = (
    PromptLogprob(5, None),
    PromptLogprob(6, -1.0, 2, (TopLogprob(7, -0.5), TopLogprob(6, -1.0))),
    PromptLogprob(2, -3.0, 9, (TopLogprob(8, -0.1), TopLogprob(7, -0.2)), is_special=True),
)


def hello_after_prompt(index: int = 0) -> list[TokenEvent]:
    first, *rest = hello(index, prompt=3)
    return [dataclasses.replace(first, prompt_logprobs=PROMPT_LOGPROBS), *rest]


ECHO = {"return_full_text": True, "prompt_texts": ("Hello",)}


def test_echo_with_logprobs_covers_the_prompt_then_the_completion() -> None:
    record = completions.completion([hello_after_prompt()], 1, ctx(want_logprobs=True, num_logprobs=1, **ECHO))
    choice = record["choices"][0]
    assert choice["text"] == "HelloHello world"
    assert choice["logprobs"] == {
        "tokens": ["Hel", "lo", "<|im_end|>", "Hel", "lo", " wor", "ld", "<|im_end|>"],
        "token_logprobs": [None, -1.0, -3.0, -0.1, -0.2, -0.3, -0.4, -0.01],
        "top_logprobs": [None, {" wor": -0.5, "lo": -1.0}, {"ld": -0.1, "<|im_end|>": -3.0},
                         {"Hel": -0.1}, {"lo": -0.2}, {" wor": -0.3}, {"ld": -0.4}, {"<|im_end|>": -0.01}],
        "text_offset": [0, 3, 5, 5, 8, 10, 14, 16],
    }
    assert "prompt_logprobs" not in choice  # vLLM's field only when asked
    assert record["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_vllm_prompt_logprobs_shape() -> None:
    record = completions.completion([hello_after_prompt()], 1, ctx(num_prompt_logprobs=1))
    assert record["choices"][0]["prompt_logprobs"] == [
        None,
        {"6": {"logprob": -1.0, "rank": 2, "decoded_token": "lo"},
         "7": {"logprob": -0.5, "rank": 1, "decoded_token": " wor"}},
        {"2": {"logprob": -3.0, "rank": 9, "decoded_token": "<|im_end|>"},
         "8": {"logprob": -0.1, "rank": 1, "decoded_token": "ld"}},
    ]
    assert record["choices"][0]["logprobs"] is None


def test_echo_only_is_the_prompt_alone() -> None:
    events = [dataclasses.replace(end(0, 2, "", -0.1, EOS, 3, 1), prompt_logprobs=PROMPT_LOGPROBS)]  # cut anyway
    options = {"want_logprobs": True, "is_echo_only": True, **ECHO}
    record = completions.completion([events], 1, ctx(**options))
    choice = record["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("Hello", "length")
    assert choice["logprobs"]["tokens"] == ["Hel", "lo", "<|im_end|>"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -3.0]
    assert record["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    chunks = list(completions.completion_chunks(events, 1, ctx(include_usage=True, **options)))
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]] == [
        ("Hello", None), ("", "length")]
    assert chunks[-2]["choices"][0]["logprobs"] is None
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}


def test_chunks_echo_with_logprobs_waits_for_the_prompts_logprobs() -> None:
    chunks = list(completions.completion_chunks(hello_after_prompt(), 1, ctx(want_logprobs=True, **ECHO)))
    assert chunks[0]["choices"][0]["text"] == "Hello"
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0, -3.0]
    assert chunks[0]["choices"][0]["logprobs"]["top_logprobs"] == [None, {"lo": -1.0}, {"<|im_end|>": -3.0}]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[1:]] == [[5], [8], [10], [14], [16]]


def test_best_of_keeps_the_most_likely_per_prompt() -> None:
    first = [end(0, 5, "a", -3.0, LENGTH, 2, 1), end(1, 6, "b", -0.2, LENGTH, 2, 1), end(2, 7, "c", -1.0, LENGTH, 2, 1)]
    second = [
        end(0, 8, "d", -0.1, LENGTH, 2, 1),
        end(1, 9, "e", -0.9, LENGTH, 2, 1),
        end(2, 5, "f", -2.0, LENGTH, 2, 1),
    ]
    record = completions.completion([first, second], 3, ctx(keep_best=1))
    assert [(c["index"], c["text"]) for c in record["choices"]] == [(0, "b"), (1, "d")]
    assert record["usage"]["completion_tokens"] == 6  # every candidate is billed


def test_failed_choice_raises() -> None:
    with pytest.raises(ServingError):
        completions.completion([[ev(0, None, "", finish_reason=FinishReason.ERROR, error="boom")]], 1, ctx())


# ---- streaming -------------------------------------------------------------------------------------------------


def chunk(text: str, finish: str | None = None, index: int = 0, logprobs: dict | None = None, **extra) -> dict:
    choices = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]
    return {**base(), "choices": choices, **extra}


def test_chunks_exact_with_suffix_on_the_last() -> None:
    chunks = list(completions.completion_chunks(hello(), 1, ctx(suffix="!")))
    assert chunks == [chunk("Hel"), chunk("lo"), chunk(" wor"), chunk("ld"), chunk("!", "stop")]


def test_chunks_echo_first_and_usage_last() -> None:
    options = {"return_full_text": True, "prompt_texts": ("Say: ",), "include_usage": True}
    chunks = list(completions.completion_chunks(hello(), 1, ctx(**options)))
    assert chunks[0] == chunk("Say: ", usage=None)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Say: Hello world"
    assert chunks[-1] == {
        **base(),
        "choices": [],
        "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9},
    }


def test_chunks_logprobs_offsets_run_on_per_choice() -> None:
    events = [ev(0, 5, "Hel", -0.1), ev(1, 7, " wor", -0.3), ev(0, 6, "lo", -0.2), end(0, 2, "", -0.05, EOS, 1, 3)]
    chunks = list(completions.completion_chunks(events + [end(1, 2, "", -0.1, EOS, 1, 2)], 2, ctx(want_logprobs=True)))
    offsets = [(c["choices"][0]["index"], c["choices"][0]["logprobs"]["text_offset"]) for c in chunks]
    assert offsets == [(0, [0]), (1, [0]), (0, [3]), (0, [5]), (1, [4])]
    assert chunks[1]["choices"][0]["logprobs"] == {
        "tokens": [" wor"],
        "token_logprobs": [-0.3],
        "top_logprobs": [{" wor": -0.3}],
        "text_offset": [0],
    }


def test_chunks_error_is_the_last_record() -> None:
    events = [ev(0, 5, "Hel", -0.1), ev(0, None, "", finish_reason=FinishReason.ERROR, error="boom")]
    chunks = list(completions.completion_chunks(events, 1, ctx(include_usage=True)))
    assert chunks[-1] == {
        "error": {"message": "generation failed: boom", "type": "internal_error", "param": None, "code": None}
    }


# ---- extra-parameters ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "policy"),
    [
        (None, ExtraParameters.ERROR),
        ("error", ExtraParameters.ERROR),
        ("ignore", ExtraParameters.IGNORE),
        ("drop", ExtraParameters.IGNORE),
        (" Pass-Through ", ExtraParameters.PASS_THROUGH),
    ],
)
def test_policy_from_header(header: str | None, policy: ExtraParameters) -> None:
    assert ExtraParameters.from_header(header) is policy


@pytest.mark.parametrize(("header", "attributes", "default", "policy"), [
    (None, None, "error", ExtraParameters.ERROR),
    (None, None, "ignore", ExtraParameters.IGNORE),                          # option.extra_parameters
    (None, "extra-parameters=ignore", "error", ExtraParameters.IGNORE),      # SageMaker custom attributes
    (None, "trace=1; Extra-Parameters = pass-through ;x", "error", ExtraParameters.PASS_THROUGH),
    (None, "trace=1; other=ignore", "error", ExtraParameters.ERROR),         # unknown attributes are not errors
    ("error", "extra-parameters=ignore", "ignore", ExtraParameters.ERROR),   # the header wins
])
def test_policy_for_a_request(header, attributes, default, policy) -> None:
    attribute = parse_custom_attributes(attributes).extra_parameters
    assert ExtraParameters.for_request(header, attribute, default) is policy


def test_bad_policy_in_custom_attributes_names_that_header() -> None:
    with pytest.raises(BadRequest) as info:
        ExtraParameters.for_request(None, parse_custom_attributes("extra-parameters=maybe").extra_parameters, "error")
    assert info.value.param == "X-Amzn-SageMaker-Custom-Attributes"


@pytest.mark.parametrize("header", ["", "passthrough", "allow"])
def test_bad_policy_names_the_header(header: str) -> None:
    with pytest.raises(BadRequest) as info:
        ExtraParameters.from_header(header)
    assert info.value.param == "extra-parameters"


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_error_policy_refuses_an_unknown_field() -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(ChatCompletionRequest, {**CHAT, "frobnicate": 1}, ExtraParameters.ERROR)
    assert info.value.param == "frobnicate"


@pytest.mark.parametrize(
    ("model", "body", "ignored"),
    [
        (ChatCompletionRequest, {**CHAT, "b": 1, "a": {"x": 1}}, ("b", "a")),
        (CompletionRequest, {"prompt": "x", "max_new_tokens": 2}, ("max_new_tokens",)),
        (
            LegacyRequest,
            {"inputs": "x", "z": 1, "parameters": {"foo": 1, "max_new_tokens": 2}},
            ("z", "parameters.foo"),
        ),
        (ChatCompletionRequest, CHAT, ()),
    ],
)
def test_ignore_policy_drops_and_names(model: type, body: dict, ignored: tuple[str, ...]) -> None:
    parsed, extras = parse_request(model, body, ExtraParameters.IGNORE)
    assert extras == Extras(ignored=ignored)
    assert isinstance(parsed, model)


def test_ignore_policy_still_checks_declared_fields_and_nested_objects() -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(ChatCompletionRequest, {**CHAT, "n": 0, "x": 1}, ExtraParameters.IGNORE)
    assert info.value.param == "n"
    with pytest.raises(BadRequest) as info:
        body = {"messages": [{"role": "user", "content": "hi", "x": 1}]}
        parse_request(ChatCompletionRequest, body, ExtraParameters.IGNORE)
    assert info.value.param == "messages[0].x"


@pytest.mark.parametrize(
    ("model", "body", "passed"),
    [
        (
            ChatCompletionRequest,
            {**CHAT, "max_new_tokens": 3, "do_sample": False, "stop_sequences": ["x"]},
            PassThrough(max_new_tokens=3, do_sample=False, stop_sequences=["x"]),
        ),
        (CompletionRequest, {"prompt": "x", "do_sample": True}, PassThrough(do_sample=True)),
        (ChatCompletionRequest, CHAT, PassThrough()),
    ],
)
def test_pass_through_policy_collects_engine_parameters(model: type, body: dict, passed: PassThrough) -> None:
    _, extras = parse_request(model, body, ExtraParameters.PASS_THROUGH)
    assert extras.passed == passed and extras.ignored == ()


@pytest.mark.parametrize(
    ("model", "body", "status", "param"),
    [
        (ChatCompletionRequest, {**CHAT, "logits_processors": []}, 422, "logits_processors"),
        (ChatCompletionRequest, {**CHAT, "details": True}, 422, "details"),
        (LegacyRequest, {"inputs": "x", "parameters": {"guidance_scale": 2}}, 422, "parameters.guidance_scale"),
        (ChatCompletionRequest, {**CHAT, "max_new_tokens": 0}, 400, "max_new_tokens"),
        (ChatCompletionRequest, {**CHAT, "stop_sequences": [""]}, 400, "stop_sequences"),
        (ChatCompletionRequest, {**CHAT, "stop_token_ids": [-1]}, 400, "stop_token_ids[0]"),
        (LegacyRequest, {"inputs": "x", "parameters": {"stop_token_ids": "2"}}, 400, "parameters.stop_token_ids"),
    ],
)
def test_pass_through_refuses_what_the_engine_cannot_take(model: type, body: dict, status: int, param: str) -> None:
    with pytest.raises(ServingError) as info:
        parse_request(model, body, ExtraParameters.PASS_THROUGH)
    assert (info.value.status_code, info.value.param) == (status, param)
    if status == 422:
        assert "cannot serve" in info.value.message


BASE = GenerationRequest(
    request_id="r",
    prompt_ids=(1,),
    sampling=SamplingParams(temperature=0.7),
    stop=StopConditions(max_new_tokens=16, stop_strings=("a",), stop_token_ids=(3,)),
)


@pytest.mark.parametrize(
    ("passed", "temperature", "stop"),
    [
        (PassThrough(), 0.7, BASE.stop),
        (PassThrough(max_new_tokens=3), 0.7, StopConditions(3, ("a",), (3,))),
        (PassThrough(stop_sequences=["b"]), 0.7, StopConditions(16, ("a", "b"), (3,))),
        (PassThrough(do_sample=False), 0.0, BASE.stop),
        (PassThrough(do_sample=True), 0.7, BASE.stop),
    ],
)
def test_pass_through_applies_to_the_generation(passed: PassThrough, temperature: float, stop: StopConditions) -> None:
    applied = Extras(passed=passed).apply(BASE)
    assert applied.sampling.temperature == temperature and applied.stop == stop


def test_do_sample_true_on_a_greedy_request_samples_at_one() -> None:
    greedy = GenerationRequest(request_id="r", prompt_ids=(1,))
    assert Extras(passed=PassThrough(do_sample=True)).apply(greedy).sampling.temperature == 1.0


# ---- /invocations sniffing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "schema"),
    [
        ({"messages": [], "inputs": "x", "prompt": "x"}, "chat"),
        ({"inputs": "x", "prompt": "x"}, "legacy"),
        ({"prompt": "x"}, "completions"),
    ],
)
def test_sniff_schema(body: dict, schema: str) -> None:
    assert sniff_schema(body) == schema


def test_sniff_schema_names_the_three_fields() -> None:
    with pytest.raises(BadRequest) as info:
        sniff_schema({"text": "x"})
    assert all(f"'{field}'" in info.value.message for field in ("messages", "inputs", "prompt"))
