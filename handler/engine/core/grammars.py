"""Every constraint language the server takes, as one llguidance Lark grammar.

Requests constrain their output in several languages (``GrammarSpec.kind``): a JSON schema, a regular expression,
a choice among strings, or a grammar in Lark (llguidance's dialect) or GBNF (llama.cpp's). llguidance compiles
Lark, and its Lark embeds the others (``%json``, ``/regex/``, string alternatives), so each becomes one Lark text
here: the lean engine compiles it, vLLM's ``guidance`` backend is given it, and a grammar that must follow a
model's reasoning is composed from it (``after_reasoning``). Pure text work; llguidance is imported only for its
converters.
"""

from __future__ import annotations

import json

from handler.engine.core.json_rules import JSON_LAYOUT, apply_json_rules
from handler.engine.types import GrammarSpec


def to_lark(spec: GrammarSpec) -> str:
    """The spec as a Lark grammar whose ``start`` rule is the constrained output; ``ValueError`` when the source
    cannot be read in its language (the compile that follows reports the rest)."""
    if spec.kind == "lark":
        return spec.source
    if spec.kind == "json_schema":
        return "start: " + json_lark(spec.source)
    if spec.kind == "regex":
        return "start: " + regex_lark(spec.source)
    if spec.kind == "choice":
        return "start: " + choice_lark(json.loads(spec.source))
    if spec.kind == "grammar":
        return grammar_lark(spec.source)
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


def json_lark(source: str) -> str:
    """A JSON schema as a Lark expression, with the server's JSON rules and layout (``json_rules``)."""
    schema = apply_json_rules(json.loads(source))
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(schema)


def regex_lark(regex: str) -> str:
    """A regular expression (Rust ``regex`` syntax, as vLLM's guidance backend reads it; ``\\d`` is an ASCII digit)
    as a Lark terminal matching the whole output."""
    import llguidance

    try:
        return "/" + llguidance.regex_to_lark(regex) + "/"
    except Exception as error:  # the converter raises its own error types
        raise ValueError(f"not a regular expression: {error}") from None


def choice_lark(choices: list[str]) -> str:
    """Exactly one of the strings (Lark string literals take JSON's escapes)."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("a choice is a non-empty list of strings")
    return " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def grammar_lark(source: str) -> str:
    """A Lark grammar as it is, or a GBNF one (``root ::= ...``) through llguidance's own converter (its rule for
    telling them apart: a ``start:`` rule or a ``%llguidance`` line is Lark)."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(source)
    except Exception as error:  # the converter raises bare exceptions on GBNF it cannot read
        raise ValueError(f"not a Lark or GBNF grammar: {error}") from None


# gpt-oss's harmony output after a prompt ending ``<|start|>assistant``: whole analysis (or commentary preamble)
# messages, each ``<|channel|>NAME<|message|>TEXT<|end|><|start|>assistant``, then the final channel's header and the
# answer, which ends the output (``<|return|>`` is the model's end-of-sequence token). The markers are special tokens,
# named as such (llguidance's ``<|...|>`` syntax); text lexemes never match a special token, so TEXT ends at
# ``<|end|>``. Measured with a tokenizer carrying harmony's tokens (tests/unit/test_harmony.py). The free messages are
# shared with gpt-oss's forced tool calls (``parsing.grammars.harmony_call_grammar``).
HARMONY_MESSAGES = """message: <|channel|> ("analysis" | "commentary") <|message|> TEXT <|end|> <|start|> "assistant"
TEXT: /(?s:.*)/
"""
HARMONY_GATE = 'start: message* <|channel|> "final" <|message|> @answer\n' + HARMONY_MESSAGES


def gated_grammar(spec: GrammarSpec) -> str:
    """llguidance's top-level grammar (JSON) for a spec that starts after the model's reasoning (harmony: see
    ``HARMONY_GATE``): free text up to the end marker (after the start marker, optional unless the prompt opened
    it), then the spec's own grammar as a named sub-grammar, so its rules cannot clash with the gate's. Measured with
    the embedded tokenizer: the end marker split over several tokens (``</``, ``think``, ``>``) is matched."""
    gate = spec.after_reasoning
    if gate is None:
        raise ValueError("the grammar has no reasoning gate")
    if gate.style == "harmony":
        top = HARMONY_GATE
    else:
        end = json.dumps(gate.end, ensure_ascii=False)
        opening = "think" if gate.opened else f"({json.dumps(gate.start, ensure_ascii=False)} think)?"
        top = f'start: {opening} /[ \\n]*/ @answer\nthink[stop={end}]: /(?s:.*)/'
    answer = {"name": "answer", "lark_grammar": to_lark(spec)}
    return json.dumps({"grammars": [{"lark_grammar": top}, answer]})
