"""Constraint languages besides ``response_format``: the fields other servers' clients send to constrain output.

Each becomes the ``GrammarSpec`` the engine enforces (``engine.core.grammars`` turns every language into one
llguidance Lark grammar), so they batch with free rows exactly as JSON schemas do. The field that asked is the
spec's ``param``: a grammar that does not compile is a 400 naming it.

- vLLM's ``structured_outputs: {json | regex | choice | grammar | json_object}`` and its older top-level names
  ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (chat and completions);
- llama.cpp's ``grammar`` (GBNF; Lark is read too) and ``json_schema`` (chat and completions);
- TGI's ``parameters.grammar: {"type": "json" | "json_object" | "regex" | "json_schema", "value": ...}`` (the
  legacy schema, ``LegacyGrammar``).

``grammar`` is Lark when it has a ``start:`` rule or a ``%llguidance`` line, else GBNF (``root ::= ...``),
llguidance's own rule. One request takes one constraint: two (``response_format`` and ``guided_regex``, say) are a
400 naming the second.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from handler.engine.types import GrammarSpec
from handler.errors import BadRequest
from handler.protocol.common import parse_model

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
Schema = dict[str, Any] | str  # a JSON schema, or its JSON text (vLLM takes both)


class StructuredOutputs(BaseModel):
    """vLLM's ``StructuredOutputsParams`` fields that choose a language (its backend knobs are not taken)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    json_: Schema | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


class ConstraintFields(BaseModel):
    """The constraint fields chat and completions share (see the module docstring)."""

    # --- extensions (vLLM names) ---
    structured_outputs: StructuredOutputs | None = None
    guided_json: Schema | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    # --- extensions (llama.cpp names) ---
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None

    def constraint(self) -> GrammarSpec | None:
        """The one grammar these fields ask for (None: none), a 400 naming the second when two are given."""
        return only_one(self.constraint_specs())

    def constraint_specs(self) -> list[GrammarSpec]:
        """A spec for each constraint field given, in the order above."""
        specs = structured_specs(self.structured_outputs)
        specs += [spec for spec in (
            schema_spec(self.guided_json, "guided_json"),
            text_spec("regex", self.guided_regex, "guided_regex"),
            choice_spec(self.guided_choice, "guided_choice"),
            text_spec("grammar", self.guided_grammar, "guided_grammar"),
            text_spec("grammar", self.grammar, "grammar"),
            schema_spec(self.json_schema, "json_schema"),
        ) if spec is not None]
        return specs


class TgiJsonSchema(BaseModel):
    """The value of TGI's ``json_schema`` grammar type (its router's ``JsonSchemaConfig``): the schema, with an
    optional name and strict flag that do not change what is enforced (the schema is always followed exactly)."""

    model_config = _STRICT
    name: str | None = None
    strict: bool | None = None
    schema_: dict[str, Any] = Field(alias="schema")


class LegacyGrammar(BaseModel):
    """TGI's ``parameters.grammar`` (its router's ``GrammarType``, ``{"type", "value"}``): ``json`` (alias
    ``json_object``) takes a JSON schema (an object or its JSON text), ``regex`` a regular expression, and
    ``json_schema`` (TGI 3.x) ``{"name"?, "strict"?, "schema"}``."""

    model_config = _STRICT
    type: Literal["json", "json_object", "regex", "json_schema"]
    value: Schema

    def spec(self, prefix: str = "parameters.grammar") -> GrammarSpec:
        param = f"{prefix}.value"
        if self.type in ("json", "json_object"):
            return schema_spec(self.value, param)
        if self.type == "json_schema":
            config = _tgi_json_schema(self.value, param)
            return schema_spec(config.schema_, f"{param}.schema")
        if not isinstance(self.value, str):
            raise BadRequest("a regex grammar's value is a string", param=param)
        return GrammarSpec("regex", self.value, param)


def _tgi_json_schema(value: Schema, param: str) -> TgiJsonSchema:
    if not isinstance(value, dict):
        raise BadRequest('a json_schema grammar\'s value is an object {"name", "strict", "schema"}', param=param)
    return parse_model(TgiJsonSchema, value, prefix=f"{param}.")


def structured_specs(outputs: StructuredOutputs | None) -> list[GrammarSpec]:
    if outputs is None:
        return []
    object_spec = schema_spec({"type": "object"}, "structured_outputs.json_object") if outputs.json_object else None
    specs = (
        schema_spec(outputs.json_, "structured_outputs.json"),
        text_spec("regex", outputs.regex, "structured_outputs.regex"),
        choice_spec(outputs.choice, "structured_outputs.choice"),
        text_spec("grammar", outputs.grammar, "structured_outputs.grammar"),
        object_spec,
    )
    return [spec for spec in specs if spec is not None]


def only_one(specs: list[GrammarSpec]) -> GrammarSpec | None:
    if len(specs) > 1:
        raise BadRequest(f"{specs[0].param} and {specs[1].param} both constrain the output; send one",
                         param=specs[1].param)
    return specs[0] if specs else None


def schema_spec(schema: Schema | None, param: str) -> GrammarSpec | None:
    """A JSON schema (or its JSON text) as a spec; text that is not a JSON object is a 400 naming the field."""
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise BadRequest(f"{param} is not valid JSON", param=param) from None
        if not isinstance(schema, dict):
            raise BadRequest(f"{param} must be a JSON schema object", param=param)
    return GrammarSpec("json_schema", json.dumps(schema), param)


def text_spec(kind: str, source: str | None, param: str) -> GrammarSpec | None:
    if source is None:
        return None
    if not source.strip():
        raise BadRequest(f"{param} is empty", param=param)
    return GrammarSpec(kind, source, param)


def choice_spec(choices: list[str] | None, param: str) -> GrammarSpec | None:
    return None if choices is None else GrammarSpec("choice", json.dumps(choices), param)
