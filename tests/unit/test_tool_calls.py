"""Tool calls: format detection, whole-text and streamed parsing (split everywhere), prompts, llguidance grammars."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from handler.engine.core.json_rules import apply_json_rules
from handler.parsing.dialects import FORMATS, HERMES, LLAMA3_JSON, MISTRAL, ToolCall, detect_format
from handler.parsing.grammars import call_grammar
from handler.parsing.tool_stream import CallDelta, ContentDelta, ToolCallStream, parse_tool_calls
from handler.prompt.tools import render_calls, template_renders_tools, tools_system_prompt

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_store" / "smollm2-135m-instruct"

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET", "utc": false}}'
WEATHER_CALL = ("get_weather", '{"city":"Paris"}')
TIME_CALL = ("get_time", '{"zone":"CET","utc":false}')
L_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'

# (format, model output, content, [(name, arguments)])
CASES = [
    (HERMES, "", "", []),
    (HERMES, "Hello there.", "Hello there.", []),
    (HERMES, "  Hello\n\nthere.\n", "Hello\n\nthere.", []),
    (HERMES, f"<tool_call>\n{WEATHER}\n</tool_call>", None, [WEATHER_CALL]),
    (HERMES, f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n", "Let me check.", [WEATHER_CALL]),
    (
        HERMES,
        f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
        None,
        [WEATHER_CALL, TIME_CALL],
    ),
    (HERMES, f"A <tool_call>{WEATHER}</tool_call> B", "A  B", [WEATHER_CALL]),
    (HERMES, '<tool_call>\n{"name": "f", "parameters": {"x": [1, 2.5]}}\n</tool_call>', None, [("f", '{"x":[1,2.5]}')]),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", '{"x":1}')]),
    (
        HERMES,
        '<tool_call>{"name": "f", "arguments": {"city": "Zürich ☃"}}</tool_call>',
        None,
        [("f", '{"city":"Zürich ☃"}')],
    ),
    (HERMES, f"<tool_call>\n{WEATHER}\n", None, [WEATHER_CALL]),  # stopped before the closing tag
    # Not calls: stay content, verbatim.
    (
        HERMES,
        '<tool_call>\n{"name": "f", "arguments": {\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {\n</tool_call>',
        [],
    ),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"x": 1}', '<tool_call>{"name": "f", "arguments": {"x": 1}', []),
    (HERMES, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (HERMES, '<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
    (
        HERMES,
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        [],
    ),
    (
        HERMES,
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        [],
    ),
    (HERMES, "<tool_call>" + "[" * 5000, "<tool_call>" + "[" * 5000, []),
    (HERMES, "Use <tool_", "Use <tool_", []),
    (HERMES, "Text <tool_call>", "Text <tool_call>", []),
    (
        HERMES,
        f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\nnope\n</tool_call>",
        "<tool_call>\nnope\n</tool_call>",
        [WEATHER_CALL],
    ),
    (HERMES, f"[TOOL_CALLS] [{WEATHER}]", f"[TOOL_CALLS] [{WEATHER}]", []),
    (LLAMA3_JSON, "", "", []),
    (LLAMA3_JSON, "Paris is sunny.", "Paris is sunny.", []),
    (LLAMA3_JSON, L_WEATHER, None, [WEATHER_CALL]),
    (LLAMA3_JSON, f"  \n{WEATHER}\n", None, [WEATHER_CALL]),
    (LLAMA3_JSON, f"<|python_tag|>{L_WEATHER}", None, [WEATHER_CALL]),
    (LLAMA3_JSON, f"<|python_tag|> {L_WEATHER}; {TIME}", None, [WEATHER_CALL, TIME_CALL]),
    (LLAMA3_JSON, f"{L_WEATHER};", None, [WEATHER_CALL]),
    (LLAMA3_JSON, f"{L_WEATHER}\n{TIME}", None, [WEATHER_CALL, TIME_CALL]),
    (LLAMA3_JSON, f"{L_WEATHER} I called it.", "I called it.", [WEATHER_CALL]),
    (LLAMA3_JSON, f"{L_WEATHER}; {{bad", "; {bad", [WEATHER_CALL]),
    (LLAMA3_JSON, f'{L_WEATHER}; {{"a": 1}} {TIME}', f'; {{"a": 1}} {TIME}', [WEATHER_CALL]),
    (LLAMA3_JSON, f"Call: {L_WEATHER}", f"Call: {L_WEATHER}", []),
    (LLAMA3_JSON, '{"a": 1, "b": [2]}', '{"a": 1, "b": [2]}', []),
    (
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "Par',
        '{"name": "get_weather", "parameters": {"city": "Par',
        [],
    ),
    (LLAMA3_JSON, '<|python_tag|>{"name": 3}', '<|python_tag|>{"name": 3}', []),
    (LLAMA3_JSON, '<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    (LLAMA3_JSON, "<|python_tag|>", "<|python_tag|>", []),
    (LLAMA3_JSON, "<|pyth", "<|pyth", []),
    (MISTRAL, "", "", []),
    (MISTRAL, "It is sunny.", "It is sunny.", []),
    (MISTRAL, f"[TOOL_CALLS] [{WEATHER}]", None, [WEATHER_CALL]),
    (MISTRAL, f"[TOOL_CALLS][{WEATHER}, {TIME}]", None, [WEATHER_CALL, TIME_CALL]),
    (MISTRAL, f"Sure. [TOOL_CALLS] [{WEATHER}]\n", "Sure.", [WEATHER_CALL]),
    (
        MISTRAL,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]',
        None,
        [WEATHER_CALL],
    ),
    (MISTRAL, f"[TOOL_CALLS] {WEATHER}", None, [WEATHER_CALL]),
    (MISTRAL, f"[TOOL_CALLS] [{WEATHER}] then [TOOL_CALLS] [{TIME}]", "then", [WEATHER_CALL, TIME_CALL]),
    (MISTRAL, f"[TOOL_CALLS] [{WEATHER}, 7]", f"[TOOL_CALLS] [{WEATHER}, 7]", []),
    (MISTRAL, "[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
    (MISTRAL, f"[TOOL_CALLS] [{WEATHER}", f"[TOOL_CALLS] [{WEATHER}", []),
    (MISTRAL, "[TOOL_CALLS] [{bad}]", "[TOOL_CALLS] [{bad}]", []),
    (MISTRAL, "[TOOL_CALLS] hello", "[TOOL_CALLS] hello", []),
    (MISTRAL, "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    (MISTRAL, "Look: [TOOL_", "Look: [TOOL_", []),
]
CASE_IDS = [f"{fmt}-{i}" for i, (fmt, *_) in enumerate(CASES)]


def summary(content: str | None, calls: list[ToolCall]) -> tuple[str | None, list[tuple[str, str]]]:
    return content, [(c.name, c.arguments) for c in calls]


def run_stream(fmt: str, pieces: list[str]) -> list:
    stream = ToolCallStream(fmt)
    deltas = [d for piece in pieces for d in stream.push(piece)]
    return deltas + stream.finish()


def joined(deltas: list) -> tuple[str | None, list[tuple[str, str]]]:
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls = [d.call for d in deltas if isinstance(d, CallDelta)]
    assert [d.index for d in deltas if isinstance(d, CallDelta)] == list(range(len(calls)))
    return summary(content or (None if calls else ""), calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_parse_tool_calls(fmt: str, text: str, content: str | None, calls: list) -> None:
    parsed = parse_tool_calls(text, fmt)
    assert summary(parsed.content, parsed.calls) == (content, calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_stream_equals_parse_at_every_split(fmt: str, text: str, content: str | None, calls: list) -> None:
    text = text[:400]  # the deep-nesting case: the first 400 characters are plenty
    expected = summary(parse_tool_calls(text, fmt).content, parse_tool_calls(text, fmt).calls)
    for cut in range(len(text) + 1):
        assert joined(run_stream(fmt, [text[:cut], text[cut:]])) == expected, cut
    for cut in range(1, len(text)):
        assert joined(run_stream(fmt, [text[:cut], text[cut : cut + 3], text[cut + 3 :]])) == expected, cut
    assert joined(run_stream(fmt, list(text))) == expected


def C(text: str) -> ContentDelta:
    return ContentDelta(text)


# (format, pieces pushed, what each push releases, what finish() releases); calls shown as (index, name).
RELEASES = [
    (
        HERMES,
        ["Hel", "lo <tool_", "call>\n" + WEATHER, "\n</tool", "_call>", "\n"],
        [[C("Hel")], [C("lo")], [], [], [(0, "get_weather")], []],
        [],
    ),
    (HERMES, ["Hi\n\n", "there", " <", "b>"], [[C("Hi")], [C("\n\nthere")], [], [C(" <b>")]], []),
    (
        HERMES,
        [f"<tool_call>{WEATHER}</tool_call>A<tool_call>{TIME}</tool_call>"],
        [[(0, "get_weather"), C("A"), (1, "get_time")]],
        [],
    ),
    (HERMES, ['<tool_call>\n{"name": "f", '], [[]], [C('<tool_call>\n{"name": "f",')]),
    (LLAMA3_JSON, ["  ", "\n", "{", L_WEATHER[1:]], [[], [], [], [(0, "get_weather")]], []),
    (LLAMA3_JSON, [" ", "It", " is"], [[], [C("It")], [C(" is")]], []),
    (
        LLAMA3_JSON,
        ["<|python", "_tag|>", " ", L_WEATHER, "; ", "{"],
        [[], [], [], [(0, "get_weather")], [], []],
        [C("; {")],
    ),
    (LLAMA3_JSON, ["<|python", "_tag|>x"], [[], [C("<|python_tag|>x")]], []),
    (MISTRAL, ["[TOOL", "_CALLS] [", WEATHER, "]"], [[], [], [], [(0, "get_weather")]], []),
    (MISTRAL, ["OK [", "x"], [[C("OK")], [C(" [x")]], []),
]


def shown(deltas: list) -> list:
    return [(d.index, d.call.name) if isinstance(d, CallDelta) else d for d in deltas]


@pytest.mark.parametrize(("fmt", "pieces", "released", "at_finish"), RELEASES)
def test_stream_releases_as_soon_as_decided(fmt: str, pieces: list[str], released: list, at_finish: list) -> None:
    stream = ToolCallStream(fmt)
    assert [shown(stream.push(piece)) for piece in pieces] == released
    assert shown(stream.finish()) == at_finish


@pytest.mark.parametrize(
    ("fmt", "pattern"),
    [(HERMES, r"call_[A-Za-z0-9]{24}"), (LLAMA3_JSON, r"call_[A-Za-z0-9]{24}"), (MISTRAL, r"[A-Za-z0-9]{9}")],
)
def test_call_ids_are_fresh_and_shaped_for_the_format(fmt: str, pattern: str) -> None:
    text = {
        HERMES: f"<tool_call>{WEATHER}</tool_call>" * 3,
        LLAMA3_JSON: f"{L_WEATHER}; " * 3,
        MISTRAL: f"[TOOL_CALLS] [{WEATHER}, {WEATHER}, {WEATHER}]",
    }[fmt]
    ids = [c.id for c in parse_tool_calls(text, fmt).calls]
    assert len(set(ids)) == 3
    assert all(re.fullmatch(pattern, i) for i in ids)


def test_tool_call_to_openai() -> None:
    call = ToolCall("get_weather", '{"city":"Paris"}', "call_x")
    assert call.to_openai() == {
        "id": "call_x",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
    }


@pytest.mark.parametrize(
    "entry",
    [
        lambda fmt: parse_tool_calls("x", fmt),
        ToolCallStream,
        lambda fmt: tools_system_prompt([], fmt),
        lambda fmt: detect_format(None, fmt),
    ],
)
def test_unknown_format_names_the_allowed_ones(entry) -> None:
    with pytest.raises(ValueError, match="'qwen'.*hermes, llama3_json, mistral"):
        entry("qwen")


QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{ tool | tojson }}"
    "{%- endfor %}{{- '</tools>\\n<tool_call>\\n{\"name\": <function-name>}\\n</tool_call>' }}{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{%- if message.tool_calls %}{{- '[TOOL_CALLS] [' }}{%- endif %}{%- if tools %}[AVAILABLE_TOOLS]{% endif %}"
)
LLAMA31_TEMPLATE = "{%- if builtin_tools %}{{- '<|python_tag|>' }}{%- endif %}{{- 'ipython' }}"
LLAMA32_TEMPLATE = (
    "{{- '<|start_header_id|>ipython<|end_header_id|>' }}{{- 'Respond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.\' }}'
)


@pytest.mark.parametrize(
    ("template", "override", "fmt"),
    [
        (None, None, HERMES),
        ("", None, HERMES),
        (MODEL_DIR.joinpath("chat_template.jinja").read_text() if MODEL_DIR.exists() else "", None, HERMES),
        (QWEN_TEMPLATE, None, HERMES),
        (MISTRAL_TEMPLATE, None, MISTRAL),
        (LLAMA31_TEMPLATE, None, LLAMA3_JSON),
        (LLAMA32_TEMPLATE, None, LLAMA3_JSON),
        ('{{ \'Respond in the format {"name": function name, "parameters": dictionary of ...}\' }}', None, LLAMA3_JSON),
        (QWEN_TEMPLATE, MISTRAL, MISTRAL),
        (None, LLAMA3_JSON, LLAMA3_JSON),
        (MISTRAL_TEMPLATE, "", MISTRAL),
    ],
)
def test_detect_format(template: str | None, override: str | None, fmt: str) -> None:
    assert detect_format(template, override) == fmt


@pytest.mark.parametrize(
    ("template", "renders"),
    [
        (None, False),
        ("", False),
        ("{% for message in messages %}{{ message['content'] }}{% endfor %}", False),
        ("You have tools. {{ messages[0]['content'] }}", False),
        ("{{ toolset }}{% if my_tools_x %}{% endif %}", False),
        (QWEN_TEMPLATE, True),
        ("{%- if tools is not none %}x{% endif %}", True),
        ("{{- tools | tojson(indent=4) }}", True),
        ("{%- for t in\n  tools %}{{ t }}{% endfor %}", True),
    ],
)
def test_template_renders_tools(template: str | None, renders: bool) -> None:
    assert template_renders_tools(template) is renders


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Weather in a city. Braces } # // " and ünïcode.',
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "name": "get_time",
    "description": "Time now.",
    "parameters": {  # a bare function is taken too
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
        "required": ["zone"],
    },
}
NOARGS_TOOL = {"type": "function", "function": {"name": "ping"}}


@pytest.mark.parametrize(
    ("fmt", "marker"),
    [
        (HERMES, '<tool_call>\n{"name": <function-name>'),
        (LLAMA3_JSON, '"parameters": dictionary'),
        (MISTRAL, "[TOOL_CALLS] [{"),
    ],
)
def test_tools_system_prompt(fmt: str, marker: str) -> None:
    prompt = tools_system_prompt([WEATHER_TOOL, TIME_TOOL], fmt)
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in prompt
    assert json.dumps({"type": "function", "function": TIME_TOOL}, ensure_ascii=False) in prompt
    assert marker in prompt
    assert prompt.startswith("# Tools\n")


def test_a_template_without_tools_gets_them_in_the_system_prompt_and_earlier_calls_in_the_text() -> None:
    """The renderer's path for templates that ignore ``tools=`` (the embedded SmolLM2's): the functions described in
    a system message, an earlier call written into the assistant's text in the model's dialect."""
    if not MODEL_DIR.joinpath("tokenizer.json").exists():
        pytest.skip("the embedded model is not assembled")
    from handler.engine.core.tokenizer import load_tokenizer
    from handler.prompt.renderer import PromptRenderer

    renderer = PromptRenderer(load_tokenizer(MODEL_DIR))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = renderer.chat_text(messages, [WEATHER_TOOL])
    assert tools_system_prompt([WEATHER_TOOL], renderer.tool_format) in text
    assert render_calls([call], renderer.tool_format) in text


# --- grammars ---------------------------------------------------------------------------------------------------

GRAMMAR_TOOLSETS = [[WEATHER_TOOL], [WEATHER_TOOL, TIME_TOOL, NOARGS_TOOL]]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("tools", GRAMMAR_TOOLSETS, ids=["one", "three"])
def test_call_grammar_is_valid_llguidance(fmt: str, parallel: bool, tools: list[dict]) -> None:
    llguidance = pytest.importorskip("llguidance")
    grammar = call_grammar(tools, fmt, parallel=parallel)
    assert llguidance.LLMatcher.validate_grammar_with_warnings(grammar) == (False, [])


def test_call_grammar_shape() -> None:
    grammar = call_grammar([WEATHER_TOOL], HERMES, parallel=True)
    start, block, call = grammar.splitlines()
    assert (start, block) == ('start: block ("\\n" block)*', 'block: "<tool_call>" "\\n" call "\\n</tool_call>"')
    assert json.loads(call.removeprefix("call: %json ")) == {
        "type": "object",
        "properties": {"name": {"const": "get_weather"},
                       "arguments": apply_json_rules(WEATHER_TOOL["function"]["parameters"])},  # the JSON rules
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "},
    }


@pytest.mark.parametrize(("tools", "fmt"), [([], HERMES), ([WEATHER_TOOL], "qwen")])
def test_call_grammar_rejects(tools: list[dict], fmt: str) -> None:
    with pytest.raises(ValueError):
        call_grammar(tools, fmt, parallel=False)


@pytest.fixture(scope="module")
def ll_tokenizer():
    llguidance_hf = pytest.importorskip("llguidance.hf")
    transformers = pytest.importorskip("transformers")
    if not MODEL_DIR.joinpath("tokenizer.json").exists():
        pytest.skip("the embedded model is not assembled")
    return llguidance_hf.from_tokenizer(transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR)))


def matches(tokenizer, grammar: str, text: str, prefix_ids: tuple[int, ...] = ()) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens([*prefix_ids, *tokenizer.tokenize_str(text)])
    return ok and matcher.is_accepting() and not matcher.is_error()


H_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
H_T = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
H_P = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
LL_W = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
LL_T = '{"name": "get_time", "parameters": {"zone": "CET"}}'
M_W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
M_T = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
ALL3 = [WEATHER_TOOL, TIME_TOOL, NOARGS_TOOL]

# (tools, format, parallel, text, accepted)
GRAMMAR_CASES = [
    ([WEATHER_TOOL], HERMES, False, H_W, True),
    ([WEATHER_TOOL], HERMES, False, H_W.replace('"Paris"}', '"Paris", "days": 2}'), True),
    ([WEATHER_TOOL], HERMES, False, H_W.replace('"Paris"', "3"), False),  # wrong argument type
    ([WEATHER_TOOL], HERMES, False, H_W.replace('{"city": "Paris"}', "{}"), False),  # required argument missing
    ([WEATHER_TOOL], HERMES, False, H_W.replace('"Paris"}', '"Paris", "x": 1}'), False),  # additionalProperties
    ([WEATHER_TOOL], HERMES, False, H_W.replace("}}", '}, "id": "1"}'), False),  # extra key in the call
    ([WEATHER_TOOL], HERMES, False, H_W.replace("get_weather", "get_time"), False),  # unknown function
    ([WEATHER_TOOL], HERMES, False, H_W.replace('"name": "get_weather", ', ""), False),
    ([WEATHER_TOOL], HERMES, False, "Sure! " + H_W, False),
    ([WEATHER_TOOL], HERMES, False, H_W[:-1], False),  # not finished
    ([WEATHER_TOOL], HERMES, False, f"{H_W}\n{H_W}", False),  # two calls, parallel off
    ([WEATHER_TOOL], HERMES, True, f"{H_W}\n{H_W}", True),
    (ALL3, HERMES, False, H_T, True),
    (ALL3, HERMES, False, H_P, True),
    (ALL3, HERMES, False, H_P.replace("{}", '{"a": 1}'), False),  # ping takes no arguments
    (ALL3, HERMES, False, H_T.replace("UTC", "PST"), False),  # enum
    (ALL3, HERMES, False, H_T.replace('": ', '":'), False),  # one layout: json.dumps' separators
    (ALL3, HERMES, False, H_T.replace('{"zone"', '{\n  "zone"'), False),  # no indentation
    (ALL3, HERMES, True, f"{H_W}\n{H_T}\n{H_P}", True),
    (ALL3, LLAMA3_JSON, False, LL_W, True),
    (ALL3, LLAMA3_JSON, False, LL_W.replace("parameters", "arguments"), False),
    (ALL3, LLAMA3_JSON, False, f"{LL_W}; {LL_T}", False),
    (ALL3, LLAMA3_JSON, True, f"{LL_W}; {LL_T}", True),
    (ALL3, LLAMA3_JSON, True, f"<|python_tag|>{LL_W}", False),
    (ALL3, MISTRAL, False, f"[TOOL_CALLS] [{M_W}]", True),
    (ALL3, MISTRAL, False, f"[TOOL_CALLS][{M_T}]", True),
    (ALL3, MISTRAL, False, f"[TOOL_CALLS] [{M_W}, {M_T}]", False),
    (ALL3, MISTRAL, True, f"[TOOL_CALLS] [{M_W}, {M_T}]", True),
    (ALL3, MISTRAL, True, "[TOOL_CALLS] []", False),
    (ALL3, MISTRAL, True, f"[{M_W}]", False),
]


@pytest.mark.parametrize(("tools", "fmt", "parallel", "text", "accepted"), GRAMMAR_CASES)
def test_call_grammar_matches(
    ll_tokenizer, tools: list[dict], fmt: str, parallel: bool, text: str, accepted: bool
) -> None:
    grammar = call_grammar(tools, fmt, parallel=parallel)
    assert matches(ll_tokenizer, grammar, text) is accepted
    if accepted:  # what the grammar lets through, the parser reads as calls
        parsed = parse_tool_calls(text, fmt)
        assert parsed.content is None and parsed.calls


def test_call_grammar_with_the_marker_as_a_special_token(ll_tokenizer) -> None:
    import llguidance

    special_id = 1  # <|im_start|> stands in for Mistral's [TOOL_CALLS] control token
    grammar = call_grammar([WEATHER_TOOL], MISTRAL, parallel=False, marker_token_id=special_id)
    assert grammar.startswith('start: <[1]> " "? call')
    assert llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""
    assert matches(ll_tokenizer, grammar, f" [{M_W}]", prefix_ids=(special_id,))
    assert not matches(ll_tokenizer, grammar, f"[TOOL_CALLS] [{M_W}]")
    llama = call_grammar([WEATHER_TOOL], LLAMA3_JSON, parallel=True, marker_token_id=special_id)
    assert matches(ll_tokenizer, llama, LL_W, prefix_ids=(special_id,))


def test_schemas_llguidance_cannot_compile_show_up_in_validation() -> None:
    llguidance = pytest.importorskip("llguidance")
    tool = {"name": "f", "parameters": {"type": "object", "properties": {"s": {"type": "string", "pattern": "(?=a)b"}}}}
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        call_grammar([tool], HERMES, parallel=False)
    )
    assert is_error and "look-around" in messages[0]  # the caller validates and answers 400


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_rendered_history_calls_parse_back(fmt: str) -> None:
    weather = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    history = [{"id": "call_1", "type": "function", "function": weather},
               {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    parsed = parse_tool_calls(render_calls(history, fmt), fmt)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Oslo"}),
                                                                         ("get_time", {})]


@pytest.mark.parametrize("cut", ["", '<tool_call>\n{"name":', "<tool_", '\n<tool_call>\n{"name": "get_weather", "a'])
def test_forced_output_drops_a_call_cut_by_max_tokens(cut: str) -> None:
    """Forced output is calls only: what max_tokens cut off is dropped, never shown as markup in content."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' + cut
    parsed = parse_tool_calls(text, HERMES, calls_only=True)
    assert parsed.content is None and [c.name for c in parsed.calls] == ["get_weather"]
    assert parse_tool_calls(cut, HERMES, calls_only=True).content is None
    stream = ToolCallStream(HERMES, calls_only=True)
    deltas = [d for piece in text for d in stream.push(piece)] + stream.finish()
    assert all(isinstance(d, CallDelta) for d in deltas) and len(deltas) == 1
