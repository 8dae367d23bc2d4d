"""Tool calls in model output: the text formats of common chat templates, parsed whole or streamed.

Three formats (``FORMATS``), after vLLM's tool parsers of the same names:

- ``hermes`` (Hermes, Qwen2.5, SmolLM3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one
  block per call, text allowed around them.
- ``llama3_json`` (Llama 3.1 / 3.2): the whole message is ``{"name": ..., "parameters": {...}}``, maybe after
  ``<|python_tag|>``; several calls separated by ``;``. A message that does not start with ``{`` is text.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list ``[{"name": ..., "arguments": {...}}]`` (items may carry an
  ``"id"``, which is ignored: ids are always made here).

Each call unit (a hermes block, a JSON value) is decided alone when it closes: a valid call becomes a
``ToolCall``, anything else stays content, verbatim. So a streamed call is never taken back, and the stream
(``ToolCallStream``) and ``parse_tool_calls`` (the stream run once) agree at every split. Content is the text
outside calls, ends stripped. Also here: the system prompt for templates that ignore ``tools=``, and the
llguidance Lark grammar that forces a call (tool_choice "required" or a named function).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from handler.engine.core.grammars import HARMONY_MESSAGES
from handler.engine.core.json_rules import JSON_LAYOUT, apply_json_rules

HERMES, LLAMA3_JSON, MISTRAL = "hermes", "llama3_json", "mistral"
PYTHON_TAG = "<|python_tag|>"
_ALNUM = string.ascii_letters + string.digits
_JSON_CLOSERS = "]}"
_JINJA_TAG = re.compile(r"\{[{%](.*?)[%}]\}", re.DOTALL)
_MENTIONS_TOOLS = re.compile(r"\btools\b")


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # Python's json would take NaN / Infinity


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def openai_call_id() -> str:
    """``call_`` + 24 letters and digits, as OpenAI's ids look."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates raise on any other tool-call id in the history."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call read from the model's output."""

    name: str
    arguments: str  # JSON text of an object, compact
    id: str = field(default_factory=openai_call_id)

    def to_openai(self) -> dict:
        """The chat-completions ``tool_calls`` entry (streamed chunks add ``index``)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    """A whole completion, split into its text and its calls."""

    content: str | None  # None when empty and there are calls
    calls: list[ToolCall]


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """Streamed text that is no part of a call."""

    text: str


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A streamed call, whole; ``index`` counts the calls of the choice from 0."""

    index: int
    call: ToolCall


Delta = ContentDelta | CallDelta


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one format looks: its markers, the ids it needs, how to ask for it and how to force it."""

    opener: str  # hermes / mistral: starts a call unit; llama3_json: optional before the first call
    closer: str | None  # ends a hermes block; None: a call ends with its JSON value
    calls_at_start: bool  # llama3_json: calls only open the message, the first other text ends them
    arguments_key: str  # the key the model was trained to write (the parser takes either)
    new_id: Callable[[], str]
    instructions: str  # prompt text: how to answer with a call
    start_rule: Callable[[str, bool], str]  # (opener symbol, parallel) -> Lark rules around `call`


def _hermes_rules(opener: str, parallel: bool) -> str:
    more = ' ("\\n" block)*' if parallel else ""
    return f'start: block{more}\nblock: {opener} "\\n" call "\\n</tool_call>"'


def _llama_rules(opener: str, parallel: bool) -> str:
    more = ' ("; " call)*' if parallel else ""
    return f"start: {opener} call{more}" if opener else f"start: call{more}"


def _mistral_rules(opener: str, parallel: bool) -> str:
    return f'start: {opener} " "? call'  # `call` is the JSON list; its maxItems says whether parallel


FORMATS: dict[str, ToolFormat] = {
    HERMES: ToolFormat(
        opener="<tool_call>",
        closer="</tool_call>",
        calls_at_start=False,
        arguments_key="arguments",
        new_id=openai_call_id,
        start_rule=_hermes_rules,
        instructions="For each function call, answer with a JSON object holding the function's name and arguments "
        "inside <tool_call></tool_call> tags, one block per call:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    ),
    LLAMA3_JSON: ToolFormat(
        opener=PYTHON_TAG,
        closer=None,
        calls_at_start=True,
        arguments_key="parameters",
        new_id=openai_call_id,
        start_rule=_llama_rules,
        instructions="To call a function, answer with nothing but a JSON object in the format "
        '{"name": function name, "parameters": dictionary of argument name and its value}. '
        'Separate several calls with "; ". Do not use variables.',
    ),
    MISTRAL: ToolFormat(
        opener="[TOOL_CALLS]",
        closer=None,
        calls_at_start=False,
        arguments_key="arguments",
        new_id=mistral_call_id,
        start_rule=_mistral_rules,
        instructions="To call functions, answer with [TOOL_CALLS] followed by a JSON list of the calls:\n"
        '[TOOL_CALLS] [{"name": <function-name>, "arguments": <args-json-object>}]',
    ),
}

# Checked in this order: the first cue found in the chat template names the format.
_TEMPLATE_CUES = (
    ("<tool_call>", HERMES),
    ("[TOOL_CALLS]", MISTRAL),
    (PYTHON_TAG, LLAMA3_JSON),
    ("ipython", LLAMA3_JSON),
    ('"parameters": dictionary', LLAMA3_JSON),
)


def check_format(name: str) -> str:
    """``name`` if it is a known format, else ValueError listing the known ones."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; allowed: {', '.join(FORMATS)}")
    return name


def detect_format(chat_template: str | None, override: str | None = None) -> str:
    """The format a chat template teaches (``override``, a setting, wins); hermes when it teaches none."""
    if override:
        return check_format(override)
    template = chat_template or ""
    return next((name for cue, name in _TEMPLATE_CUES if cue in template), HERMES)


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the template's Jinja tags use ``tools`` (else we describe them in a system prompt)."""
    tags = _JINJA_TAG.findall(chat_template or "")
    return any(_MENTIONS_TOOLS.search(tag) for tag in tags)


def _function_of(tool: dict) -> dict:
    """The function of an OpenAI tool (``{"type": "function", "function": {...}}``) or a bare function."""
    return tool["function"] if "function" in tool else tool


def tools_system_prompt(tools: list[dict], fmt: str) -> str:
    """System-prompt text that lists the functions and the exact format of a call."""
    spec = FORMATS[check_format(fmt)]
    listing = "\n".join(
        json.dumps({"type": "function", "function": _function_of(t)}, ensure_ascii=False) for t in tools
    )
    return (
        "# Tools\n\nYou may call one or more functions to help with the user's request. "
        "Their signatures are inside <tools></tools> tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n{spec.instructions}"
    )


def render_calls(calls: list[dict], fmt: str) -> str:
    """Earlier tool calls of an assistant message (OpenAI ``tool_calls`` entries) as the model writes them, for
    chat templates that do not render ``tool_calls`` themselves."""
    spec = FORMATS[check_format(fmt)]
    units = []
    for call in calls:
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = function["arguments"]  # a client's own malformed history: shown as it was sent
        units.append(json.dumps({"name": function["name"], spec.arguments_key: arguments}, ensure_ascii=False))
    if fmt == HERMES:
        return "\n".join(f"<tool_call>\n{unit}\n</tool_call>" for unit in units)
    if fmt == MISTRAL:
        return f"[TOOL_CALLS] [{', '.join(units)}]"
    return "; ".join(units)


def _call_schema(function: dict, arguments_key: str) -> dict:
    # OpenAI: leaving out `parameters` declares a function without arguments.
    parameters = function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def call_grammar(tools: list[dict], fmt: str, *, parallel: bool, marker_token_id: int | None = None) -> str:
    """A Lark grammar (llguidance dialect) for one call, or one or more with ``parallel``, to the given tools.

    ``marker_token_id``: where the tokenizer has the format's opener as a special token (Mistral's
    ``[TOOL_CALLS]``), its id, so the grammar asks for that token rather than the marker spelled out in text.
    llguidance cannot name it as ``<[TOOL_CALLS]>`` (``<[...]>`` is its token-id syntax). For llama3_json the
    python tag is left out unless its id is given.
    """
    spec = FORMATS[check_format(fmt)]
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    schemas = [_call_schema(_function_of(t), spec.arguments_key) for t in tools]
    call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if fmt == MISTRAL:
        call = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    # the server's JSON rules (engine.json_rules): one line, bounded numbers; llguidance reads the layout from
    # x-guidance
    call = {**apply_json_rules(call), "x-guidance": JSON_LAYOUT}
    if marker_token_id is not None:
        opener = f"<[{int(marker_token_id)}]>"
    else:
        opener = "" if spec.calls_at_start else json.dumps(spec.opener)
    return f"{spec.start_rule(opener, parallel)}\ncall: %json {json.dumps(call)}\n"


def harmony_call_grammar(tools: list[dict]) -> str:
    """A Lark grammar for gpt-oss's forced call, in harmony's own form (openai/harmony ``docs/format.md``, "Receiving
    tool calls"): any whole analysis / commentary messages first (``grammars.HARMONY_MESSAGES``, as the reasoning
    gate leaves them free), then one message ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>``
    whose body is arguments valid against the function's schema, ended by ``<|call|>``. ``<|call|>`` is a stop token
    (gpt-oss's generation config), so a harmony turn holds one call: ``parallel_tool_calls`` cannot add more."""
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    functions = [_function_of(t) for t in tools]
    rules = [f"start: message* ({' | '.join(f'call_{i}' for i in range(len(functions)))})"]
    for index, function in enumerate(functions):
        parameters = function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
        arguments = {**apply_json_rules(parameters), "x-guidance": JSON_LAYOUT}
        header = json.dumps(f"commentary to=functions.{function['name']} ")
        rules.append(f"call_{index}: <|channel|> {header} <|constrain|> \"json\" <|message|> "
                     f"%json {json.dumps(arguments)} <|call|>")
    return "\n".join(rules) + "\n" + HARMONY_MESSAGES


def _decode(text: str) -> object:
    """The JSON value of ``text``, or None where it is not JSON (deep nesting included)."""
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError):
        return None


def _call_from_object(obj: object, new_id: Callable[[], str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters"))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        arguments = _decode(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":")), new_id())


def _calls_from_value(value: object, new_id: Callable[[], str]) -> list[ToolCall] | None:
    """The calls of one JSON value (an object, or a list of them), or None unless every item is a call."""
    items = value if isinstance(value, list) else [value]
    calls = [call for call in (_call_from_object(item, new_id) for item in items) if call is not None]
    return calls if calls and len(calls) == len(items) else None


def _partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ToolCallStream:
    """Incremental tool-call parser: text deltas in, content deltas and whole calls out.

    Content is released as soon as it cannot start a call (a tail like ``<tool_`` waits until decided);
    whitespace is held until text follows it, so the joined content comes out stripped, as
    ``parse_tool_calls`` gives it. A call is released when its unit closes (``</tool_call>``, the end of the
    JSON value) or at ``finish()``, where whatever is undecided becomes content: nothing is lost.

    ``calls_only``: the output was forced to be calls (tool_choice required or named), so nothing is content;
    what is left at ``finish()`` is a call that ``max_tokens`` cut off, and it is dropped rather than shown as
    markup (``finish_reason`` is ``length`` then).
    """

    def __init__(self, fmt: str, *, calls_only: bool = False) -> None:
        self._format = FORMATS[check_format(fmt)]
        self._calls_only = calls_only
        self._buffer = ""  # text not yet released
        self._prefix = ""  # text consumed before the current unit; content again if the unit is no call
        self._scanned = 0  # JSON units: no complete value in the buffer up to here
        self._state: Callable[[bool], bool] = self._at_start if self._format.calls_at_start else self._in_text
        self._out: list[Delta] = []
        self._num_calls = 0
        self._has_content = False
        self._held_space = ""

    def push(self, text: str) -> list[Delta]:
        """Add generated text; return what it releases."""
        self._buffer += text
        while self._state(False):
            pass
        return self._drain()

    def finish(self) -> list[Delta]:
        """The generation ended: decide everything held back and return it."""
        while self._state(True):
            pass
        return self._drain()

    # Each state handles the buffer and returns whether it moved on to another state (then it runs again).

    def _in_text(self, final: bool) -> bool:
        opener = self._format.opener
        at = -1 if self._format.calls_at_start else self._buffer.find(opener)
        if at < 0:
            keep = 0 if final or self._format.calls_at_start else _partial_marker_length(self._buffer, opener)
            cut = len(self._buffer) - keep
            self._content(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
            return False
        self._content(self._buffer[:at])
        self._prefix, self._buffer = opener, self._buffer[at + len(opener) :]
        self._state = self._in_block if self._format.closer else self._in_json
        return True

    def _in_block(self, final: bool) -> bool:
        closer = self._format.closer or ""
        end = self._buffer.find(closer)
        if end < 0 and not final:
            return False
        body, self._buffer = (self._buffer, "") if end < 0 else (self._buffer[:end], self._buffer[end + len(closer) :])
        # An unclosed block at the end still counts when it holds a whole call (generation stopped at the tag).
        self._unit(_decode(body.strip()), self._prefix + body + (closer if end >= 0 else ""))
        self._state = self._in_text
        return True

    def _in_json(self, final: bool) -> bool:
        decoded = self._decode_unit(final)
        if decoded is None:
            return False
        value, end = decoded
        raw, self._buffer = self._prefix + self._buffer[:end], self._buffer[end:]
        self._scanned = 0
        is_call = self._unit(value, raw)
        self._state = self._after_call if is_call and self._format.calls_at_start else self._in_text
        return True

    def _decode_unit(self, final: bool) -> tuple[object, int] | None:
        """(value, end) of the JSON value that opens the buffer, (None, end) if there is none, None to wait."""
        text = self._buffer
        start = len(text) - len(text.lstrip())
        if start == len(text):
            return (None, start) if final else None
        if text[start] not in "[{":
            return None, 0
        # A container value can only end on ] or }: wait for one before decoding again.
        if not final and not any(c in _JSON_CLOSERS for c in text[self._scanned :]):
            return None
        try:
            return _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):
            self._scanned = len(text)
            return (None, len(text)) if final else None

    def _at_start(self, final: bool) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(head) and not final:
            return False  # nothing yet, or a part of the tag: undecided
        if not head and not final:
            return False
        if head.startswith("{"):
            self._prefix, self._buffer = self._buffer[: len(self._buffer) - len(head)], head
            self._state = self._in_json
        else:
            self._state = self._in_text
        return True

    def _after_call(self, final: bool) -> bool:
        rest = self._buffer.lstrip().removeprefix(";").lstrip()
        if not rest:
            if final:
                self._buffer = ""  # a dangling separator is no content
            return False
        if rest.startswith("{"):
            self._prefix, self._buffer = self._buffer[: len(self._buffer) - len(rest)], rest
            self._state = self._in_json
        else:
            self._state = self._in_text
        return True

    def _unit(self, value: object, raw: str) -> bool:
        """Release one closed unit: its calls, or its raw text as content. Returns whether it was calls."""
        calls = _calls_from_value(value, self._format.new_id)
        if calls is None:
            self._content(raw)
            return False
        for call in calls:
            self._out.append(CallDelta(self._num_calls, call))
            self._num_calls += 1
        return True

    def _content(self, text: str) -> None:
        if self._calls_only:
            return
        text = self._held_space + text if self._has_content else text.lstrip()
        body = text.rstrip()
        self._held_space = text[len(body) :]
        if body:
            self._out.append(ContentDelta(body))
            self._has_content = True

    def _drain(self) -> list[Delta]:
        merged: list[Delta] = []
        for delta in self._out:
            if merged and isinstance(delta, ContentDelta) and isinstance(merged[-1], ContentDelta):
                merged[-1] = ContentDelta(merged[-1].text + delta.text)
            else:
                merged.append(delta)
        self._out = []
        return merged


def parse_tool_calls(text: str, fmt: str, *, calls_only: bool = False) -> ParsedMessage:
    """Split a whole completion into content and calls; never raises on model output (ValueError on ``fmt``)."""
    stream = ToolCallStream(fmt, calls_only=calls_only)
    deltas = stream.push(text) + stream.finish()
    calls = [d.call for d in deltas if isinstance(d, CallDelta)]
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    return ParsedMessage(content or (None if calls or calls_only else ""), calls)
