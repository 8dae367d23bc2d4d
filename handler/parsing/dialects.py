"""Tool-call dialects: how each family of chat templates writes a call, and which one a template teaches.

Three dialects (``FORMATS``), after vLLM's tool parsers of the same names:

- ``hermes`` (Hermes, Qwen2.5, SmolLM3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one
  block per call, text allowed around them.
- ``llama3_json`` (Llama 3.1 / 3.2): the whole message is ``{"name": ..., "parameters": {...}}``, maybe after
  ``<|python_tag|>``; several calls separated by ``;``. A message that does not start with ``{`` is text.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list ``[{"name": ..., "arguments": {...}}]`` (items may carry an
  ``"id"``, which is ignored: ids are always made here).

Each ``ToolFormat`` says what the stream parser (``tool_stream``) looks for, what the forced-call grammar
(``grammars``) writes, and how the prompt layer (``prompt.tools``) asks a model for a call.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field

HERMES, LLAMA3_JSON, MISTRAL = "hermes", "llama3_json", "mistral"
PYTHON_TAG = "<|python_tag|>"
_ALNUM = string.ascii_letters + string.digits


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


def function_of(tool: dict) -> dict:
    """The function of an OpenAI tool (``{"type": "function", "function": {...}}``) or a bare function."""
    return tool["function"] if "function" in tool else tool
