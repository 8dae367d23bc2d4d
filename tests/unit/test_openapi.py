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
    conversations,
    embeddings,
    legacy,
    rerank,
    response_items,
    response_tools,
    responses,
    sessions,
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
    ("SessionRequest",): sessions.SessionRequest,
    **{(model.__name__,): model for model in (
        response_items.InputText, response_items.InputImage, response_items.OutputText, response_items.Refusal,
        response_items.MessageItem, response_items.FunctionCallItem, response_items.FunctionCallOutputItem,
        response_items.ReasoningPart, response_items.ReasoningItem, response_tools.FunctionTool,
        response_tools.NamespaceTool, response_tools.UnofferedTool, response_tools.ToolChoiceFunction,
        response_tools.ToolChoiceOther, responses.ConversationRef, responses.TextFormat, responses.TextConfig,
        responses.Reasoning, responses.ResponsesRequest, conversations.ConversationCreate,
        conversations.ConversationUpdate, conversations.ItemsCreate, conversations.ListQuery)},
}
# Fields shared by several request models, written in each of theirs (as common.py's mixins are).
MIXINS = {constraints.ConstraintFields}
# Models that keep what they do not declare: a tool or tool choice this server cannot offer (repeated as sent), and a
# list's query string (which carries more than its paging fields)
OPEN_MODELS = {response_tools.UnofferedTool, response_tools.ToolChoiceOther, conversations.ListQuery}
MODULES = (chat, completions, constraints, conversations, embeddings, legacy, rerank, response_items, response_tools,
           responses, sessions, structured, tokenize)


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
    assert schema.get("additionalProperties") is (model in OPEN_MODELS)  # the others forbid extra fields


def test_every_request_model_is_in_the_yaml() -> None:
    defined = {
        value
        for module in MODULES
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == module.__name__
    }
    assert defined - MIXINS == set(MODELS.values())
