"""The reasoning split (parsing.reasoning) over text deltas: any cut of the text gives the whole text's split, tags
cut across deltas included; the template detection; the grammar gate's Lark."""

from __future__ import annotations

import json

import pytest

from handler.engine.core.grammars import gated_grammar
from handler.engine.types import GrammarSpec, ReasoningGate
from handler.parsing.reasoning import (
    CONTENT,
    REASONING,
    TOOL_CALL,
    HarmonySplitter,
    Piece,
    ThinkSplitter,
    detect_parser,
    prompt_opens_reasoning,
)

HARMONY_CALL = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
HARMONY_ANSWER = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Paris."


def split(splitter, text: str, size: int) -> tuple[list[Piece], bool]:
    """The pieces for ``text`` pushed ``size`` characters at a time, consecutive ones of a kind joined."""
    pieces = []
    for start in range(0, len(text), size):
        pieces += splitter.push(text[start:start + size])
    pieces += splitter.finish()
    joined: list[Piece] = []
    for piece in pieces:
        if joined and joined[-1].kind == piece.kind != TOOL_CALL:
            joined[-1] = Piece(piece.kind, joined[-1].text + piece.text)
        else:
            joined.append(piece)
    return joined, splitter.in_reasoning


@pytest.mark.parametrize("size", [1, 2, 3, 5, 1000])
@pytest.mark.parametrize(("opened", "text", "pieces", "inside"), [
    (False, "<think>\nLet me see </thin.\n</think>\n\nParis.", [Piece(REASONING, "\nLet me see </thin.\n"),
                                                                 Piece(CONTENT, "Paris.")], False),
    (True, "Hmm.</think>Paris.", [Piece(REASONING, "Hmm."), Piece(CONTENT, "Paris.")], False),
    (False, "Paris, no <think> here.", [Piece(CONTENT, "Paris, no <think> here.")], False),
    (False, "\n<think>cut off </th", [Piece(REASONING, "cut off </th")], True),
    (True, "", [], True),
    (False, "<think></think>\n\n", [], False),
])
def test_think_split_is_the_same_for_any_cut(size: int, opened: bool, text: str, pieces: list, inside: bool) -> None:
    assert split(ThinkSplitter(opened), text, size) == (pieces, inside)


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_harmony_channels_become_reasoning_content_and_calls(size: int) -> None:
    assert split(HarmonySplitter(), HARMONY_ANSWER, size) == (
        [Piece(REASONING, "Easy."), Piece(CONTENT, "Paris.")], False)
    assert split(HarmonySplitter(), HARMONY_CALL, size) == (
        [Piece(REASONING, "Need weather."), Piece(TOOL_CALL, '{"city": "Paris"}', "get_weather")], False)


def test_harmony_cut_inside_analysis_stays_reasoning() -> None:
    assert split(HarmonySplitter(), "<|channel|>analysis<|message|>Thinking ab", 3) == (
        [Piece(REASONING, "Thinking ab")], True)


def test_plain_text_through_the_harmony_splitter_is_content() -> None:
    assert split(HarmonySplitter(), "Just text.", 2) == ([Piece(CONTENT, "Just text.")], False)


@pytest.mark.parametrize(("template", "setting", "parser"), [
    ("{{ '<think>' }}...{{ '</think>' }}", "auto", "qwen3"),
    ("<|start|>{{ m }}<|channel|>final<|message|>", "auto", "gpt_oss"),
    ("{{ messages }}", "auto", None),
    (None, "auto", None),
    ("{{ '</think>' }}", "none", None),
    ("{{ messages }}", "deepseek_r1", "deepseek_r1"),
])
def test_the_format_is_detected_from_the_template_unless_set(template, setting: str, parser) -> None:
    assert detect_parser(template, setting) == parser


@pytest.mark.parametrize(("parser", "tail", "opened"), [
    ("qwen3", "<|im_start|>assistant\n<think>\n", True),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),   # enable_thinking: false
    ("qwen3", "<|im_start|>assistant\n", False),
    ("deepseek_r1", "<｜Assistant｜>", True),
])
def test_the_prompt_tail_says_whether_reasoning_is_open(parser: str, tail: str, opened: bool) -> None:
    assert prompt_opens_reasoning(parser, tail) is opened


@pytest.mark.parametrize("opened", [True, False])
def test_a_gated_grammar_lets_reasoning_run_free_then_applies_the_answer_grammar(opened: bool) -> None:
    spec = GrammarSpec("regex", "[0-9]+", "guided_regex", ReasoningGate("<think>", "</think>", opened))
    grammars = json.loads(gated_grammar(spec))["grammars"]
    top = grammars[0]["lark_grammar"]
    assert 'think[stop="</think>"]' in top and "@answer" in top
    assert ('("<think>" think)?' in top) is not opened
    assert grammars[1] == {"name": "answer", "lark_grammar": "start: /[0-9]+/"}
