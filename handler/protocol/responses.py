"""The Responses request (OpenAI's ``POST /v1/responses``), validated, and its conversion into the chat request the
chat path already serves (rendering, tools, images, grammars), so a Responses request reaches the engine as the
same ``GenerationRequest`` and comes back as the same token events.

Fields copy OpenAI's names (the openai SDK's ``types/responses`` are the reference). What this server cannot honour
is not declared (a 400 naming it, or the ``extra-parameters`` policy) or refused naming the field: hosted tools,
``file_id`` images, reasoning efforts other than low / medium / high, reasoning summaries, background mode.
``reasoning.effort`` becomes the chat request's ``reasoning_effort``; reasoning items sent back are accepted and
not rendered again. The conversation a request continues
(``previous_response_id``) is given to ``conversation`` as the items the server stored; the fields of the chat
request errors name are translated back (``responses_param``).
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from handler.errors import BadRequest, ServingError
from handler.protocol.chat import ChatCompletionRequest
from handler.protocol.common import parse_model

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
_ITEM_STATUS = Literal["in_progress", "completed", "incomplete"]
EFFORTS = ("low", "medium", "high")  # reasoning.effort levels served: the chat request's reasoning_effort


class InputText(BaseModel):
    model_config = _STRICT
    type: Literal["input_text"]
    text: str


class InputImage(BaseModel):
    model_config = _STRICT
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] = "auto"


class OutputText(BaseModel):
    """An assistant message's text, as this server (or OpenAI) returned it and a client sends it back."""

    model_config = _STRICT
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class Refusal(BaseModel):
    model_config = _STRICT
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | InputImage | OutputText | Refusal, Field(discriminator="type")]


class MessageItem(BaseModel):
    """A message: OpenAI's easy input message (content a string) or a full one (a list of parts)."""

    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: _ITEM_STATUS | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: _ITEM_STATUS | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Annotated[InputText | InputImage, Field(discriminator="type")]]
    id: str | None = None
    status: _ITEM_STATUS | None = None


class ReasoningItem(BaseModel):
    """A reasoning item a client sends back (the openai SDK and the Agents SDK do, continuing a conversation by
    hand): accepted, and not rendered again: thinking models' templates drop earlier turns' reasoning."""

    model_config = _STRICT
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: _ITEM_STATUS | None = None


def _item_type(value: object) -> str:
    """An item without ``type`` is a message (OpenAI's easy input message)."""
    found = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return found if isinstance(found, str) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


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
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(BaseModel):
    model_config = _STRICT

    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    reasoning: Reasoning | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None   # a routing hint for OpenAI's caches; prefix caching here needs none

    def check(self) -> None:
        """What the field types cannot say, and the parts this server cannot honour (400 naming each)."""
        if self.reasoning is not None and self.reasoning.effort not in (None, "none", *EFFORTS):
            raise BadRequest(f"reasoning effort {self.reasoning.effort!r} is not served; use one of "
                             f"{', '.join(EFFORTS)} (gpt-oss's levels, given to the chat template)",
                             param="reasoning.effort")
        if self.reasoning is not None and (self.reasoning.summary or self.reasoning.generate_summary):
            raise BadRequest("reasoning summaries are not supported by this server", param="reasoning.summary")
        refusals = [(bool(self.include), "include", "include adds output this server does not produce"),
                    (self.truncation == "auto", "truncation", "truncation 'auto' is not supported; a conversation "
                     "too long for the context is refused"),
                    (bool(self.background), "background", "background responses are not supported"),
                    (self.text is not None and self.text.verbosity not in (None, "medium"), "text.verbosity",
                     "verbosity other than 'medium' is not supported")]
        for refused, field, message in refusals:
            if refused:
                raise BadRequest(message, param=field)
        if self.metadata is not None and len(self.metadata) > 16:
            raise BadRequest(f"metadata has {len(self.metadata)} keys; at most 16 are allowed", param="metadata")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise BadRequest("input is an empty list", param="input")

    def input_items(self) -> list[dict]:
        """This request's input as items (a string is one user message), as the store keeps them."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(exclude_none=True, by_alias=True) for item in self.input]

    def to_chat(self, history: list[dict]) -> tuple[ChatCompletionRequest, list[str]]:
        """The chat request for ``history`` (stored items first, then this request's) and, for each of its
        messages, the field of this request it came from (for errors)."""
        messages, fields = [], []
        if self.instructions:  # OpenAI: a previous response's instructions are not carried over
            messages.append({"role": "system", "content": self.instructions})
            fields.append("instructions")
        first_own = len(history) - len(self.input_items())
        for index, item in enumerate(history):
            field = f"input[{index - first_own}]" if index >= first_own else "previous_response_id"
            _add_item(messages, fields, item, field)
        if not messages:
            raise BadRequest("the conversation is empty: give input", param="input")
        body = {"messages": messages, "model": self.model, "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "user": self.user,
                "parallel_tool_calls": self.parallel_tool_calls, "response_format": self._response_format(),
                "tools": [_chat_tool(tool) for tool in self.tools] if self.tools else None,
                "tool_choice": self._tool_choice(), "reasoning_effort": self._effort()}
        body = {key: value for key, value in body.items() if value is not None}
        try:
            return parse_model(ChatCompletionRequest, body), fields
        except ServingError as error:
            raise responses_error(error, fields) from None

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

    def _tool_choice(self) -> str | dict | None:
        if isinstance(self.tool_choice, ToolChoiceFunction):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

    def echo(self) -> dict:
        """The request fields the response object repeats (OpenAI's defaults where absent)."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id, "reasoning": {"effort": self._effort(), "summary": None},
            "store": self.store, "temperature": self.temperature, "top_p": self.top_p,
            "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True)},
            "tool_choice": self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel)
            else self.tool_choice or "auto",
            "tools": [tool.model_dump() for tool in self.tools or ()], "truncation": "disabled", "user": self.user,
        }


def new_response_id() -> str:
    """OpenAI's style (``resp_`` and hex): the id a response is stored, fetched and continued by."""
    return f"resp_{uuid.uuid4().hex}"


def _chat_tool(tool: FunctionTool) -> dict:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters,
                "strict": tool.strict}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _add_item(messages: list[dict], fields: list[str], item: dict, field: str) -> None:
    """One stored or given item as chat messages: consecutive function calls join the assistant turn before them."""
    kind = item.get("type", "message")
    if kind == "reasoning":  # a past turn's reasoning: not rendered again (ReasoningItem)
        return
    if kind == "function_call":
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if messages and messages[-1]["role"] == "assistant":  # one turn: its text, then its calls
            messages[-1].setdefault("tool_calls", []).append(call)
            return
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _output_text(item["output"], f"{field}.output")})
    else:
        messages.append({"role": item["role"], "content": _content(item["content"], field)})
    fields.append(field)


def _content(content: str | list[dict], field: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    return [_part(part, f"{field}.content[{index}]") for index, part in enumerate(content)]


def _part(part: dict, field: str) -> dict:
    if part["type"] == "input_image":
        if part.get("image_url") is None:
            raise BadRequest("images are given by image_url (an http(s) URL or a data URI); file ids are not served",
                             param=f"{field}.file_id" if part.get("file_id") else f"{field}.image_url")
        detail = {"original": "high"}.get(part.get("detail", "auto"), part.get("detail", "auto"))
        return {"type": "image_url", "image_url": {"url": part["image_url"], "detail": detail}}
    return {"type": "text", "text": part["refusal"] if part["type"] == "refusal" else part["text"]}


def _output_text(output: str | list[dict], field: str) -> str:
    if isinstance(output, str):
        return output
    for index, part in enumerate(output):
        if part["type"] != "input_text":
            raise BadRequest("a function call's output is text here", param=f"{field}[{index}]")
    return "".join(part["text"] for part in output)


# the chat request's fields, as the Responses request names them
_RENAMES = (
    (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
    (re.compile(r"^response_format\.json_schema"), "text.format"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
)
_MESSAGE = re.compile(r"^messages\[(\d+)\](\.content\[\d+\])?")


def responses_param(param: str | None, fields: list[str]) -> str | None:
    """The Responses field for a field of the chat request it was converted into (``messages[2].content[1]`` ->
    ``input[1].content[1]``)."""
    if param is None:
        return None
    if param == "messages":
        return "input"
    match = _MESSAGE.match(param)
    if match is not None and int(match.group(1)) < len(fields):
        field = fields[int(match.group(1))]
        return field + (match.group(2) or "") if field.startswith("input[") else field
    for pattern, replacement in _RENAMES:
        if pattern.match(param):
            return pattern.sub(replacement, param, count=1)
    return param


def responses_error(error: ServingError, fields: list[str]) -> ServingError:
    """``error`` naming the Responses field instead of the chat field (in its message too)."""
    renamed = responses_param(error.param, fields)
    if renamed != error.param and error.param is not None:
        error.message = error.message.replace(error.param, renamed)
        error.args = (error.message,)
        error.param = renamed
    return error
