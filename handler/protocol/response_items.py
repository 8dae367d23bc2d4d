"""Responses items: what a request sends as ``input`` (messages, function calls and their outputs, and the reasoning
and messages a response returned, sent back), validated; the form the store keeps them in; and their conversion
into the chat messages the model's template renders.

- The store's form (``kept_item``): every item has an ``id`` (the client's, else a new one: ``msg_``, ``fc_``,
  ``fco_``, ``rs_``) and a ``status``, a message's content is a list of parts (``input_text``, or ``output_text`` for
  the assistant), as ``input_items`` and the Conversations API list them. It renders exactly as the item it came from.
- Reasoning: a reasoning item before an assistant turn becomes that turn's ``reasoning_content`` (and ``thinking``,
  gpt-oss's name), which the model's template renders as it renders earlier reasoning (Qwen3's: for the turns after
  the last user message; gpt-oss's: before a tool call). Its text is what ``reasoning`` gives for it: the endpoint
  opens ``encrypted_content`` (``handler.store.sealing``), else the item's ``reasoning_text`` parts are taken; a
  summary-only item renders nothing.
- A ``function_call`` sent back with a ``namespace`` is rendered under the namespaced name the model was offered.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from handler.errors import BadRequest
from handler.protocol.response_tools import SEPARATOR

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
_ITEM_STATUS = Literal["in_progress", "completed", "incomplete"]


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
    namespace: str | None = None
    id: str | None = None
    status: _ITEM_STATUS | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Annotated[InputText | InputImage, Field(discriminator="type")]]
    id: str | None = None
    status: _ITEM_STATUS | None = None


class ReasoningPart(BaseModel):
    model_config = _STRICT
    type: Literal["reasoning_text", "summary_text", "text"]
    text: str


class ReasoningItem(BaseModel):
    """A reasoning item sent back: its text in ``content``, or sealed in ``encrypted_content`` (module doc)."""

    model_config = _STRICT
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None
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

# (a reasoning item, the field it came from) -> the text to render (None: nothing)
ReasoningText = Callable[[dict, str], str | None]
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def plain_reasoning(item: dict, field: str) -> str | None:
    """A reasoning item's own text: its ``reasoning_text`` parts (as this server returns them)."""
    parts = [part["text"] for part in item.get("content") or () if part.get("type") in ("reasoning_text", "text")]
    return "".join(parts) or None


def kept_item(item: dict) -> dict:
    """An input item in the store's form (module doc)."""
    kind = item.get("type", "message")
    kept = {"id": item.get("id") or f"{_ID_PREFIXES[kind]}_{uuid.uuid4().hex}", **item, "type": kind}
    kept.setdefault("status", "completed")
    if kind == "message" and isinstance(kept["content"], str):
        part = "output_text" if kept["role"] == "assistant" else "input_text"
        kept["content"] = [{"type": part, "text": kept["content"]}]
    if kind == "message":
        kept["content"] = [{**p, "annotations": p.get("annotations", [])} if p["type"] == "output_text" else p
                           for p in kept["content"]]
    return kept


def chat_messages(items: list[dict], fields: list[str], reasoning: ReasoningText) -> tuple[list[dict], list[str]]:
    """The chat messages for ``items`` and, for each, the field of the request it came from (``fields[i]`` names
    ``items[i]``)."""
    messages: list[dict] = []
    message_fields: list[str] = []
    for item, field in zip(items, fields, strict=True):
        _add_item(messages, message_fields, item, field, reasoning)
    return messages, message_fields


def _add_item(messages: list[dict], fields: list[str], item: dict, field: str, reasoning: ReasoningText) -> None:
    """One item as chat messages: consecutive function calls join the assistant turn before them, and an assistant
    turn starts with the reasoning before it."""
    kind = item.get("type", "message")
    last = messages[-1] if messages else None
    if kind == "reasoning":
        text = reasoning(item, field)
        if text:
            messages.append({"role": "assistant", "content": None, "reasoning_content": text})
            fields.append(field)
        return
    if kind == "function_call":
        name = item["name"] if not item.get("namespace") else f"{item['namespace']}{SEPARATOR}{item['name']}"
        call = {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": item["arguments"]}}
        if last is not None and last["role"] == "assistant":  # one turn: its reasoning, its text, then its calls
            last.setdefault("tool_calls", []).append(call)
            return
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _output_text(item["output"], f"{field}.output")})
    elif item["role"] == "assistant" and _is_open_turn(last):  # the answer after its reasoning
        last["content"] = _content(item["content"], field)
        return
    else:
        messages.append({"role": item["role"], "content": _content(item["content"], field)})
    fields.append(field)


def _is_open_turn(message: dict | None) -> bool:
    """An assistant turn that so far holds only its reasoning."""
    return (message is not None and message["role"] == "assistant" and message.get("reasoning_content") is not None
            and message["content"] is None and not message.get("tool_calls"))


def _content(content: str | list[dict], field: str) -> str | list[dict]:
    """A message's content as chat's: its text (parts joined, as chat joins them), or parts when it has images."""
    if isinstance(content, str):
        return content
    parts = [_part(part, f"{field}.content[{index}]") for index, part in enumerate(content)]
    return "".join(part["text"] for part in parts) if all(p["type"] == "text" for p in parts) else parts


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
