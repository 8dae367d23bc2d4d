"""``docs/openapi.yaml`` against the pydantic request models: the same property names, the same required ones."""

from __future__ import annotations

from functools import reduce
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from handler.protocol import (
    chat,
    completions,
    constraints,
    embeddings,
    legacy,
    rerank,
    responses,
    structured,
    tokenize,
)

OPENAPI = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
SCHEMAS = yaml.safe_load(OPENAPI.read_text())["components"]["schemas"]

# Where each model is written in the yaml: a component name, then keys down to an inline object schema.
RESPONSE_FORMAT = ("ChatCompletionRequest", "properties", "response_format")
TOOLS = ("ChatCompletionRequest", "properties", "tools", "items")
TOOL_CHOICE = ("ChatCompletionRequest", "properties", "tool_choice", "oneOf", 1)
MODELS: dict[tuple, type[BaseModel]] = {
    ("TextPart",): chat.TextPart,
    ("ImageUrl",): chat.ImageUrl,
    ("ImagePart",): chat.ImagePart,
    ("AzureImagePart",): chat.AzureImagePart,
    ("FunctionCall",): chat.FunctionCall,
    ("ToolCall",): chat.ToolCall,
    ("ChatMessage",): chat.ChatMessage,
    ("StreamOptions",): chat.StreamOptions,
    ("ChatCompletionRequest",): chat.ChatCompletionRequest,
    RESPONSE_FORMAT: structured.ResponseFormat,
    (*RESPONSE_FORMAT, "properties", "json_schema"): structured.JsonSchemaFormat,
    TOOLS: structured.Tool,
    (*TOOLS, "properties", "function"): structured.FunctionDefinition,
    TOOL_CHOICE: structured.NamedToolChoice,
    (*TOOL_CHOICE, "properties", "function"): structured.FunctionName,
    ("CompletionRequest",): completions.CompletionRequest,
    ("LegacyRequest",): legacy.LegacyRequest,
    ("LegacyParameters",): legacy.LegacyParameters,
    ("TokenizePrompt",): tokenize.TokenizePrompt,
    ("TokenizeChat",): tokenize.TokenizeChat,
    ("Detokenize",): tokenize.Detokenize,
    ("EmbeddingRequestBody",): embeddings.EmbeddingRequestBody,
    ("TeiRerankRequest",): rerank.TeiRerankRequest,
    ("RerankDocument",): rerank.RerankDocument,
    ("RerankRequest",): rerank.RerankRequest,
    ("ScoreRequestBody",): rerank.ScoreRequestBody,
    ("StructuredOutputs",): constraints.StructuredOutputs,
    ("LegacyGrammar",): constraints.LegacyGrammar,
    ("TgiJsonSchema",): constraints.TgiJsonSchema,
    **{(model.__name__,): model for model in (
        responses.InputText, responses.InputImage, responses.OutputText, responses.Refusal, responses.MessageItem,
        responses.FunctionCallItem, responses.FunctionCallOutputItem, responses.ReasoningItem, responses.FunctionTool,
        responses.ToolChoiceFunction, responses.TextFormat, responses.TextConfig, responses.Reasoning,
        responses.ResponsesRequest)},
}
# Fields shared by several request models, written in each of theirs (as common.py's mixins are).
MIXINS = {constraints.ConstraintFields}


def _names(model: type[BaseModel], required_only: bool = False) -> set[str]:
    """The JSON names of a model's fields (aliases where given), or of its required ones."""
    return {
        field.alias or name for name, field in model.model_fields.items() if field.is_required() or not required_only
    }


@pytest.mark.parametrize("path", MODELS, ids=lambda path: ".".join(map(str, path)))
def test_yaml_properties_and_required_match_the_model(path: tuple) -> None:
    schema, model = reduce(lambda node, key: node[key], path, SCHEMAS), MODELS[path]
    assert set(schema["properties"]) == _names(model)
    assert set(schema.get("required", [])) == _names(model, required_only=True)
    assert schema.get("additionalProperties") is False  # every request model forbids extra fields


def test_every_request_model_is_in_the_yaml() -> None:
    defined = {
        value
        for module in (chat, completions, constraints, embeddings, legacy, rerank, responses, structured, tokenize)
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == module.__name__
    }
    assert defined - MIXINS == set(MODELS.values())
