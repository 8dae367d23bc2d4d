"""Grammars that force a tool call: the llguidance Lark grammar for tool_choice "required" or a named function,
in the dialect the model writes (``dialects``), or in gpt-oss's harmony form.

The JSON inside a call follows the engine's JSON rules (``engine.core.json_rules``: one line, bounded numbers), so a
forced call is laid out as any other constrained JSON output; harmony's free messages before the call are the
engine's own (``engine.core.grammars.HARMONY_MESSAGES``, as its reasoning gate leaves them).
"""

from __future__ import annotations

import json

from handler.engine.core.grammars import HARMONY_MESSAGES
from handler.engine.core.json_rules import JSON_LAYOUT, apply_json_rules
from handler.parsing.dialects import FORMATS, MISTRAL, check_format, function_of


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
    schemas = [_call_schema(function_of(t), spec.arguments_key) for t in tools]
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
    functions = [function_of(t) for t in tools]
    rules = [f"start: message* ({' | '.join(f'call_{i}' for i in range(len(functions)))})"]
    for index, function in enumerate(functions):
        parameters = function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
        arguments = {**apply_json_rules(parameters), "x-guidance": JSON_LAYOUT}
        header = json.dumps(f"commentary to=functions.{function['name']} ")
        rules.append(f"call_{index}: <|channel|> {header} <|constrain|> \"json\" <|message|> "
                     f"%json {json.dumps(arguments)} <|call|>")
    return "\n".join(rules) + "\n" + HARMONY_MESSAGES
