"""Tools in a prompt: for chat templates that do not render ``tools=`` themselves, the functions described in the
system prompt and earlier calls written into the assistant's text, in the dialect the output is parsed in
(``parsing.dialects``)."""

from __future__ import annotations

import json
import re

from handler.parsing.dialects import FORMATS, HERMES, MISTRAL, check_format, function_of

_JINJA_TAG = re.compile(r"\{[{%](.*?)[%}]\}", re.DOTALL)
_MENTIONS_TOOLS = re.compile(r"\btools\b")


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the template's Jinja tags use ``tools`` (else we describe them in a system prompt)."""
    tags = _JINJA_TAG.findall(chat_template or "")
    return any(_MENTIONS_TOOLS.search(tag) for tag in tags)


def tools_system_prompt(tools: list[dict], fmt: str) -> str:
    """System-prompt text that lists the functions and the exact format of a call."""
    spec = FORMATS[check_format(fmt)]
    listing = "\n".join(
        json.dumps({"type": "function", "function": function_of(t)}, ensure_ascii=False) for t in tools
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
