"""The Responses request (OpenAI's ``POST /v1/responses``), validated, and its conversion into the chat request the
chat path already serves (rendering, tools, images, grammars), so a Responses request reaches the engine as the
same ``GenerationRequest`` and comes back as the same token events.

Fields copy OpenAI's names (the openai SDK's ``types/responses`` are the reference). What this server cannot honour
is not declared (a 400 naming it, or the ``extra-parameters`` policy) or refused naming the field: ``file_id``
images, reasoning efforts other than low / medium / high, ``include`` values other than
``reasoning.encrypted_content`` and ``message.output_text.logprobs``, a forced tool the model is not offered.
``reasoning.effort`` becomes the chat request's ``reasoning_effort``; ``reasoning.summary`` is accepted (no summary
is written: a reasoning item's ``summary`` is empty). Items and tools are ``response_items``' and
``response_tools``'. The conversation a request answers (stored turns, then its own input) is given to ``to_chat``
as items, each with the field it came from, so the fields of the chat request errors name are translated back
(``responses_param``); ``fitted`` drops the oldest items when ``truncation: "auto"`` asks and the prompt would not
fit the context.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from handler.errors import BadRequest, ServingError
from handler.protocol.chat import ChatCompletionRequest, PreparedChat
from handler.protocol.common import parse_model
from handler.protocol.response_items import InputItem, ReasoningText, chat_messages, kept_item, plain_reasoning
from handler.protocol.response_tools import (
    Tool,
    ToolChoice,
    ToolSet,
    chat_tool_choice,
    offered_tools,
)

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
EFFORTS = ("low", "medium", "high")  # reasoning.effort levels served: the chat request's reasoning_effort
ENCRYPTED_REASONING = "reasoning.encrypted_content"
OUTPUT_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (ENCRYPTED_REASONING, OUTPUT_LOGPROBS)
Summary = Literal["auto", "concise", "detailed"]


class TextFormat(BaseModel):
    """``text.format``: text, json_object, or json_schema (its ``name`` and ``schema`` beside ``type``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(BaseModel):
    model_config = _STRICT
    effort: str | None = None
    summary: Summary | None = None
    generate_summary: Summary | None = None   # the older name of summary


class ConversationRef(BaseModel):
    model_config = _STRICT
    id: str


class ResponsesRequest(BaseModel):
    model_config = _STRICT

    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    conversation: str | ConversationRef | None = None
    stream: bool = False
    background: bool = False
    reasoning: Reasoning | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    service_tier: str | None = None
    # a key OpenAI routes to its caches by; accepted and repeated (prefix caching here keys blocks by their tokens)
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None  # Codex's own (its turn and session ids): accepted, not used
    _tools: ToolSet | None = PrivateAttr(None)

    def check(self) -> None:
        """What the field types cannot say, and the parts this server cannot honour (400 naming each)."""
        if self.reasoning is not None and self.reasoning.effort not in (None, "none", *EFFORTS):
            raise BadRequest(f"reasoning effort {self.reasoning.effort!r} is not served; use one of "
                             f"{', '.join(EFFORTS)} (gpt-oss's levels, given to the chat template)",
                             param="reasoning.effort")
        for index, value in enumerate(self.include or ()):
            if value not in INCLUDABLE:
                raise BadRequest(f"include {value!r} is not served; this server can include "
                                 f"{' and '.join(INCLUDABLE)}", param=f"include[{index}]")
        refusals = [(self.background and not self.store, "background", "a background response is stored: it needs "
                     "store: true"),
                    (self.conversation is not None and self.previous_response_id is not None, "conversation",
                     "give conversation or previous_response_id, not both"),
                    (self.text is not None and self.text.verbosity not in (None, "medium"), "text.verbosity",
                     "verbosity other than 'medium' is not supported")]
        for refused, field, message in refusals:
            if refused:
                raise BadRequest(message, param=field)
        if self.metadata is not None and len(self.metadata) > 16:
            raise BadRequest(f"metadata has {len(self.metadata)} keys; at most 16 are allowed", param="metadata")
        continues = self.previous_response_id is not None or self.conversation is not None
        if isinstance(self.input, list) and not self.input and not continues:
            raise BadRequest("input is an empty list", param="input")

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    @property
    def seals_reasoning(self) -> bool:
        return ENCRYPTED_REASONING in (self.include or ())

    @property
    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ())

    @property
    def tool_set(self) -> ToolSet:
        """The tools as the model is offered them (computed once)."""
        if self._tools is None:
            self._tools = offered_tools(self.tools or [])
        return self._tools

    def input_items(self) -> list[dict]:
        """This request's input as items in the store's form (a string is one user message)."""
        if isinstance(self.input, str):
            return [kept_item({"type": "message", "role": "user", "content": self.input})]
        return [kept_item(item.model_dump(exclude_none=True, by_alias=True)) for item in self.input]

    def to_chat(self, items: list[dict], fields: list[str] | None = None,
                reasoning: ReasoningText = plain_reasoning) -> tuple[ChatCompletionRequest, list[str]]:
        """The chat request for the conversation ``items`` (each from the field ``fields[i]``; by default the last
        ones this request's input, the others stored) and, for each of its messages, the field it came from."""
        if fields is None:
            num_own = len(self.input_items())
            fields = ["previous_response_id"] * (len(items) - num_own) + [f"input[{i}]" for i in range(num_own)]
        messages, message_fields = chat_messages(items, fields, reasoning)
        if self.instructions:  # OpenAI: a previous response's instructions are not carried over
            messages.insert(0, {"role": "system", "content": self.instructions})
            message_fields.insert(0, "instructions")
        if not messages:
            raise BadRequest("the conversation is empty: give input", param="input")
        tools = self.tool_set
        body = {"messages": messages, "model": self.model, "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "user": self.user,
                "parallel_tool_calls": self.parallel_tool_calls, "response_format": self._response_format(),
                "tools": tools.chat_tools or None, "tool_choice": chat_tool_choice(self.tool_choice, tools),
                "reasoning_effort": self._effort(), "logprobs": self.wants_logprobs or None,
                "top_logprobs": self.top_logprobs if self.wants_logprobs else None}
        body = {key: value for key, value in body.items() if value is not None}
        try:
            return parse_model(ChatCompletionRequest, body), message_fields
        except ServingError as error:
            raise responses_error(error, message_fields, tools.fields) from None

    def fitted(self, items: list[dict], fields: list[str], reasoning: ReasoningText,
               prepare: Callable[[ChatCompletionRequest, list[str]], PreparedChat],
               context_len: int) -> tuple[PreparedChat, list[str], int]:
        """The prepared chat request, its messages' fields, and how many of the oldest items were dropped: with
        ``truncation: "auto"`` as few as let the prompt fit the context with room for ``max_output_tokens`` (one
        token when it is not given), as OpenAI drops them; never a function call's output without its call, never
        the last item (what still does not fit is refused as without truncation)."""
        def attempt(dropped: int) -> tuple[PreparedChat, list[str], int]:
            chat, message_fields = self.to_chat(items[dropped:], fields[dropped:], reasoning)
            return prepare(chat, message_fields), message_fields, dropped

        def fits(prepared: PreparedChat) -> bool:
            return len(prepared.generation.prompt_ids) + (self.max_output_tokens or 1) <= context_len

        whole = attempt(0)
        if self.truncation != "auto" or fits(whole[0]):
            return whole
        cuts = [k for k in range(1, len(items)) if items[k].get("type") != "function_call_output"]
        found, low, high = None, 0, len(cuts) - 1
        while low <= high:  # the fewest dropped that fit: dropping more never makes the prompt longer
            middle = (low + high) // 2
            tried = attempt(cuts[middle])
            if fits(tried[0]):
                found, high = tried, middle - 1
            else:
                low = middle + 1
        return found or (attempt(cuts[-1]) if cuts else whole)

    def _response_format(self) -> dict | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return None if fmt is None else {"type": fmt.type}
        if fmt.name is None:
            raise BadRequest("text.format type json_schema needs a name", param="text.format.name")
        schema = {"name": fmt.name, "schema": fmt.schema_ or {}, "description": fmt.description, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}

    def _effort(self) -> str | None:
        """``reasoning.effort`` as the chat request's ``reasoning_effort`` (the template's variable)."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        return effort if effort in EFFORTS else None

    def echo(self) -> dict:
        """The request fields the response object repeats (OpenAI's defaults where absent)."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")
        summary = self.reasoning.summary or self.reasoning.generate_summary if self.reasoning is not None else None
        conversation = self.conversation_id
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "conversation": {"id": conversation} if conversation is not None else None,
            "reasoning": {"effort": self._effort(), "summary": summary},
            "store": self.store, "background": self.background, "temperature": self.temperature,
            "top_p": self.top_p, "top_logprobs": self.top_logprobs, "prompt_cache_key": self.prompt_cache_key,
            "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True)},
            "tool_choice": self.tool_choice.model_dump(exclude_none=True)
            if isinstance(self.tool_choice, BaseModel) else self.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True, by_alias=True) for tool in self.tools or ()],
            "truncation": self.truncation or "disabled", "user": self.user,
        }


def new_response_id() -> str:
    """OpenAI's style (``resp_`` and hex): the id a response is stored, fetched and continued by."""
    return f"resp_{uuid.uuid4().hex}"


# the chat request's fields, as the Responses request names them
_RENAMES = (
    (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
    (re.compile(r"^response_format\.json_schema"), "text.format"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
)
_MESSAGE = re.compile(r"^messages\[(\d+)\](\.content\[\d+\])?")


_TOOL = re.compile(r"^tools\[(\d+)\](\.function)?")


def responses_param(param: str | None, fields: list[str], tool_fields: list[str] | None = None) -> str | None:
    """The Responses field for a field of the chat request it was converted into (``messages[2].content[1]`` ->
    ``input[1].content[1]``; ``tools[1].function.name`` -> ``tools[4].tools[1].name`` for the second tool offered,
    when ``tool_fields`` says where each offered tool came from)."""
    if param is None:
        return None
    if param == "messages":
        return "input"
    tool = _TOOL.match(param)
    if tool is not None:
        index = int(tool.group(1))
        field = tool_fields[index] if tool_fields is not None and index < len(tool_fields) else f"tools[{index}]"
        return field + param[tool.end():]
    match = _MESSAGE.match(param)
    if match is not None and int(match.group(1)) < len(fields):
        field = fields[int(match.group(1))]
        return field + (match.group(2) or "") if field.startswith("input[") else field
    for pattern, replacement in _RENAMES:
        if pattern.match(param):
            return pattern.sub(replacement, param, count=1)
    return param


def responses_error(error: ServingError, fields: list[str], tool_fields: list[str] | None = None) -> ServingError:
    """``error`` naming the Responses field instead of the chat field (in its message too)."""
    renamed = responses_param(error.param, fields, tool_fields)
    if renamed != error.param and error.param is not None:
        error.message = error.message.replace(error.param, renamed)
        error.args = (error.message,)
        error.param = renamed
    return error
