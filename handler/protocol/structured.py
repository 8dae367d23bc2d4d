"""``response_format``, ``tools`` and ``tool_choice`` of the chat schema, and what they ask of the engine.

The output plan has two halves: a ``GrammarSpec`` the engine enforces while decoding (a JSON object, a JSON
schema, or a forced tool call), and whether the formatter looks for tool calls in the text.

- ``response_format`` ``json_object`` / ``json_schema``: the content is constrained to JSON / to the schema.
- ``tools`` with ``tool_choice`` ``auto`` (the default when tools are given): tools are shown to the model and
  its text is parsed for calls; it may answer in plain text.
- ``required`` / a named function: decoding is constrained to one call (several with ``parallel_tool_calls``) of
  a declared function whose arguments validate against its ``parameters`` schema. On a harmony model (gpt-oss) the
  call is harmony's own commentary message after free analysis messages, one per turn
  (``parsing.grammars.harmony_call_grammar``); elsewhere it is the text format's (hermes, llama3_json, mistral).
- ``none``: tools are not shown to the model and nothing is parsed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from handler.engine.types import GrammarSpec
from handler.errors import BadRequest
from handler.parsing import grammars
from handler.protocol.constraints import only_one

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # accepted; the schema is always enforced


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True, slots=True)
class OutputPlan:
    grammar: GrammarSpec | None = None
    tools: tuple[dict, ...] = ()  # the tool definitions shown to the model (OpenAI shape)
    tool_format: str | None = None  # parse tool calls out of the text in this format (None: do not parse)
    marker_id: int | None = None  # the format's opener as one special token: kept in the output text
    calls_only: bool = False  # a forced call: the output is calls and nothing else (a cut-off call is dropped)
    spans_reasoning: bool = False  # the grammar models the reasoning too (harmony calls): no reasoning gate around it


def plan_output(
    response_format: ResponseFormat | None,
    tools: list[Tool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    tool_format: str,
    marker_id: int | None = None,
    constraint: GrammarSpec | None = None,
    harmony: bool = False,
) -> OutputPlan:
    """What the engine enforces and the formatter parses, after checking the fields agree. ``constraint`` is the
    grammar another constraint field asked for (``protocol.constraints``): one of it and ``response_format``.
    ``harmony``: the model writes harmony (gpt-oss, with its special tokens), so a forced call is harmony's."""
    grammar = only_one([spec for spec in (_response_grammar(response_format), constraint) if spec is not None])
    if not tools:
        if tool_choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        return OutputPlan(grammar=grammar)
    _check_tools(tools)
    choice = tool_choice or "auto"
    if choice == "none":
        return OutputPlan(grammar=grammar)
    definitions = tuple(t.model_dump(exclude_none=True) for t in tools)
    if choice == "auto":
        return OutputPlan(grammar=grammar, tools=definitions, tool_format=tool_format, marker_id=marker_id)
    if grammar is not None:
        field = "response_format" if grammar.param.startswith("response_format") else grammar.param
        raise BadRequest(f"{field} cannot be combined with a forced tool call (tool_choice {_choice_name(choice)})",
                         param=field)
    # OpenAI: "required" calls one or more functions; a named function is called exactly once
    forced = definitions if choice == "required" else [_named(definitions, choice.function.name)]
    parallel = choice == "required" and parallel_tool_calls is not False
    if harmony:
        source = grammars.harmony_call_grammar(list(forced))
    else:
        source = grammars.call_grammar(list(forced), tool_format, parallel=parallel, marker_token_id=marker_id)
    grammar = GrammarSpec("lark", source, "tool_choice")
    return OutputPlan(grammar=grammar, tools=definitions, tool_format=tool_format, marker_id=marker_id,
                      calls_only=True, spans_reasoning=harmony)


def _response_grammar(response_format: ResponseFormat | None) -> GrammarSpec | None:
    if response_format is None or response_format.type == "text":
        if response_format is not None and response_format.json_schema is not None:
            raise BadRequest("response_format.json_schema needs type json_schema", param="response_format.type")
        return None
    if response_format.type == "json_object":
        return GrammarSpec("json_schema", json.dumps({"type": "object"}), "response_format")
    if response_format.json_schema is None:
        raise BadRequest(
            "response_format type json_schema needs a json_schema object", param="response_format.json_schema"
        )
    schema = response_format.json_schema.schema_ or {"type": "object"}
    return GrammarSpec("json_schema", json.dumps(schema), "response_format.json_schema.schema")


def _check_tools(tools: list[Tool]) -> None:
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        name = tool.function.name
        if not _FUNCTION_NAME.match(name):
            raise BadRequest(
                f"tool name {name!r} must be 1-64 letters, digits, '_' or '-'", param=f"tools[{index}].function.name"
            )
        if name in seen:
            raise BadRequest(f"tool name {name!r} is declared twice", param=f"tools[{index}].function.name")
        seen.add(name)
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            raise BadRequest(
                "a function's parameters must be a JSON schema of type object",
                param=f"tools[{index}].function.parameters",
            )


def _named(definitions: tuple[dict, ...], name: str) -> dict:
    for definition in definitions:
        if definition["function"]["name"] == name:
            return definition
    raise BadRequest(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice.function.name")


def _choice_name(choice: ToolChoice) -> str:
    return choice if isinstance(choice, str) else f"function {choice.function.name!r}"
