"""The real gpt-oss and Qwen3 chat templates through our renderer, and gpt-oss's harmony gate as llguidance runs it.

The templates are vendored in ``tests/fixtures/templates`` (see the README there for where from). The tokenizer is
the embedded SmolLM2's with harmony's special tokens added (as gpt-oss's own tokenizer has them), so the special
tokens are single tokens as in the real model. Expected strings are written out by hand from harmony's format
(openai/harmony ``docs/format.md``) and the templates' own code, not produced by rendering.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from handler.config import DEFAULT_MODEL_DIR
from handler.engine.core.grammars import gated_grammar
from handler.engine.types import GrammarSpec, ReasoningGate
from handler.parsing.grammars import harmony_call_grammar
from handler.parsing.reasoning import HARMONY_TOKENS
from handler.prompt.renderer import PromptRenderer

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Gets the weather",
    "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "The city"}},
                   "required": ["location"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location":"Tokyo"}'}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Tokyo?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true}'},
]


def renderer_with(template_file: str) -> PromptRenderer:
    if not (DEFAULT_MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip("the embedded model is not assembled (make model)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_TOKENS)})
    tokenizer.chat_template = (TEMPLATES / template_file).read_text()
    return PromptRenderer(tokenizer)


@pytest.fixture(scope="module")
def gpt_oss() -> PromptRenderer:
    return renderer_with("openai-gpt-oss-120b.jinja")


@pytest.fixture(scope="module")
def qwen3() -> PromptRenderer:
    return renderer_with("Qwen-Qwen3-0.6B.jinja")


def harmony_system(effort: str, tools: bool) -> str:
    """gpt-oss's system message as its template writes it (the date is the template's strftime_now)."""
    today = datetime.datetime.now().strftime("%Y-%m-%d")
    calls = "\nCalls to these tools must go to the commentary channel: 'functions'." if tools else ""
    return ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
            f"Knowledge cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: {effort}\n\n"
            f"# Valid channels: analysis, commentary, final. Channel must be included for every message.{calls}<|end|>")


def test_the_templates_are_detected_as_their_reasoning_formats(gpt_oss: PromptRenderer,
                                                                qwen3: PromptRenderer) -> None:
    assert gpt_oss.reasoning_parser == "gpt_oss" and qwen3.reasoning_parser == "qwen3"
    assert len(gpt_oss.reasoning_keep_ids) == len(HARMONY_TOKENS)  # every marker kept in the output text
    assert gpt_oss.reasoning_gate((1, 2)) == ReasoningGate("", "", True, style="harmony")


def test_gpt_oss_renders_tools_calls_and_results_in_harmony(gpt_oss: PromptRenderer) -> None:
    """Harmony's tool definitions (a TypeScript namespace in the developer message), the earlier call addressed
    ``to=functions.NAME`` on the commentary channel ending ``<|call|>``, the result from ``functions.NAME
    to=assistant``, then the generation prompt. The arguments arrive as OpenAI's JSON text and reach the template
    as an object (its ``arguments|tojson`` would otherwise quote the text). The template writes the tool's output
    with ``|tojson`` too, so a JSON-text result is quoted: that is the published template's doing (harmony's own
    renderer writes it bare) and is what vLLM's template path gives as well."""
    text = gpt_oss.chat_text(CONVERSATION, [WEATHER], template_kwargs={"reasoning_effort": "high"})
    assert text == (
        harmony_system("high", tools=True)
        + "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
          "namespace functions {\n\n// Gets the weather\ntype get_weather = (_: {\n// The city\nlocation: string,\n"
          "}) => any;\n\n} // namespace functions<|end|>"
        + "<|start|>user<|message|>Weather in Tokyo?<|end|>"
        + '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Tokyo"}'
          "<|call|>"
        + '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"sunny\\": true}"<|end|>'
        + "<|start|>assistant")


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_reasoning_effort_reaches_the_harmony_system_message(gpt_oss: PromptRenderer, effort: str) -> None:
    text = gpt_oss.chat_text([{"role": "user", "content": "Hi"}], template_kwargs={"reasoning_effort": effort})
    assert text == harmony_system(effort, tools=False) + "<|start|>user<|message|>Hi<|end|><|start|>assistant"


def test_without_reasoning_effort_the_template_says_medium(gpt_oss: PromptRenderer) -> None:
    assert "Reasoning: medium\n" in gpt_oss.chat_text([{"role": "user", "content": "Hi"}])


def test_a_tool_call_history_without_tools_still_renders_in_harmony(gpt_oss: PromptRenderer) -> None:
    """``tool_choice: none`` sends no tools; the earlier call must still be harmony, not another format's text."""
    text = gpt_oss.chat_text(CONVERSATION[1:])
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Tokyo"}' \
           "<|call|>" in text and "<tool_call>" not in text


def test_qwen3_renders_tools_calls_and_results(qwen3: PromptRenderer) -> None:
    tool_json = json.dumps(WEATHER)
    assert qwen3.chat_text(CONVERSATION, [WEATHER]) == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{tool_json}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Tokyo?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Tokyo"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"sunny": true}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n")


@pytest.mark.parametrize(("kwargs", "tail", "opened"), [
    ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ({}, "<|im_start|>assistant\n", False),
])
def test_qwen3_enable_thinking_false_closes_an_empty_think_block(qwen3: PromptRenderer, kwargs: dict, tail: str,
                                                                 opened: bool) -> None:
    text = qwen3.chat_text([{"role": "user", "content": "Hi"}], template_kwargs=kwargs)
    assert text == "<|im_start|>user\nHi<|im_end|>\n" + tail
    assert qwen3.opens_reasoning(tuple(qwen3.encode(text))) is opened


# ---- the harmony gate, run by llguidance on harmony's special tokens -----------------------------------------

def matcher_run(renderer: PromptRenderer, spec: GrammarSpec, text: str) -> tuple[bool, bool]:
    """(every token of ``text`` accepted, grammar complete) for the gated spec."""
    import llguidance
    import llguidance.hf

    tokenizer = renderer.tokenizer
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer),
                                      eos_token=tokenizer.convert_tokens_to_ids("<|return|>"))
    matcher = llguidance.LLMatcher(ll, gated_grammar(spec))
    accepted = all(matcher.consume_token(t) for t in renderer.encode(text))
    return accepted, accepted and matcher.is_accepting()


PHONE = GrammarSpec("regex", r"\d{3}-\d{4}", "guided_regex", ReasoningGate("", "", True, style="harmony"))


@pytest.mark.parametrize(("text", "accepted", "complete"), [
    ("<|channel|>analysis<|message|>Think <it> over.\n<|end|><|start|>assistant<|channel|>final<|message|>555-1234",
     True, True),
    ("<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant<|channel|>analysis<|message|>ok"
     "<|end|><|start|>assistant<|channel|>final<|message|>555-1234", True, True),
    ("<|channel|>final<|message|>555-1234", True, True),                    # no reasoning at all
    ("<|channel|>final<|message|>Paris", False, False),                     # the answer is held to the grammar
    ("<|channel|>analysis<|message|>free text 123", True, False),           # still inside the reasoning
    ("555-1234", False, False),                                             # the answer only in the final channel
])
def test_the_harmony_gate_frees_analysis_and_holds_the_final_message(gpt_oss: PromptRenderer, text: str,
                                                                      accepted: bool, complete: bool) -> None:
    assert matcher_run(gpt_oss, PHONE, text) == (accepted, complete)


UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}}}
HEADER = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"


@pytest.mark.parametrize(("text", "complete"), [
    # harmony's call (docs/format.md, "Receiving tool calls") after analysis, and after a commentary preamble
    ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant" + HEADER.format("get_weather")
     + '{"location": "Tokyo"}<|call|>', True),
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + HEADER.format("set_unit")
     + '{"unit": "celsius"}<|call|>', True),
    (HEADER.format("set_unit") + '{"unit": "kelvin"}<|call|>', False),          # arguments outside the schema
    (HEADER.format("get_time") + "{}<|call|>", False),                           # a function not in tools
    ('<tool_call>\n{"name": "set_unit", "arguments": {"unit": "celsius"}}\n</tool_call>', False),  # hermes' form
    ("<|channel|>final<|message|>It is sunny.<|return|>", False),               # an answer instead of a call
    ("<|channel|>analysis<|message|>Thinking", False),                           # still in the reasoning
])
def test_a_forced_harmony_call_is_one_commentary_message_to_a_declared_function(gpt_oss: PromptRenderer, text: str,
                                                                                 complete: bool) -> None:
    import llguidance
    import llguidance.hf

    tokenizer = gpt_oss.tokenizer
    ends = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=ends)
    grammar = llguidance.LLMatcher.grammar_from_lark(harmony_call_grammar([WEATHER, UNIT]))
    matcher = llguidance.LLMatcher(ll, grammar)
    accepted = all(matcher.consume_token(t) for t in gpt_oss.encode(text))
    assert (accepted and matcher.is_stopped()) == complete


def test_a_tool_without_description_renders_with_an_empty_one(gpt_oss: PromptRenderer) -> None:
    """OpenAI makes ``description`` optional; gpt-oss's template writes ``"// " + tool.description`` and failed on its
    absence (a 400 naming messages). An empty description renders as the template's bare comment marker (harmony's
    own renderer writes no comment line for it), and the tool is declared as harmony declares one."""
    tool = {"type": "function", "function": {"name": "get_time"}}
    text = gpt_oss.chat_text([{"role": "user", "content": "Time?"}], [tool])
    assert "namespace functions {\n\n// \ntype get_time = () => any;\n\n} // namespace functions<|end|>" in text
    described = gpt_oss.chat_text([{"role": "user", "content": "Time?"}],
                                  [{"type": "function", "function": {"name": "get_time", "description": "Now"}}])
    assert "// Now\ntype get_time = () => any;" in described  # a description given is written as it is
