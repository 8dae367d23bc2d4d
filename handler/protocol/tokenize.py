"""vLLM's tokenizer routes: ``POST /tokenize`` and ``POST /detokenize``.

``/tokenize`` takes a ``prompt`` (encoded as the completions route encodes it: the tokenizer's own special tokens
added unless ``add_special_tokens`` is false) or ``messages`` (rendered by the chat template as the chat route
renders them, tools included; ``add_generation_prompt`` as in vLLM) and answers the ids, their ``count``, the
server's ``max_model_len`` and, with ``return_token_strs``, each id's token string. ``/detokenize`` takes
``tokens`` and answers the text (``prompt``). Both run on the request's thread with the tokenizer alone: they never
wait for, or take time from, the engine.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from handler.errors import BadRequest
from handler.prompt.renderer import PromptRenderer
from handler.protocol.chat import ChatCompletionRequest, ChatMessage
from handler.protocol.common import parse_model
from handler.protocol.completions import check_token_ids
from handler.protocol.structured import Tool

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class TokenizePrompt(BaseModel):
    model_config = _STRICT

    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(BaseModel):
    model_config = _STRICT

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes the special tokens itself
    return_token_strs: bool = False


class Detokenize(BaseModel):
    model_config = _STRICT

    tokens: list[Annotated[int, Field(strict=True, ge=0)]]
    model: str | None = None


def tokenize(body: dict, renderer: PromptRenderer, max_model_len: int) -> dict:
    """The ``/tokenize`` answer: a body with ``messages`` goes through the chat template, else ``prompt``."""
    if "messages" in body:
        parsed = parse_model(TokenizeChat, body)
        ids = _chat_ids(parsed, renderer)
    else:
        parsed = parse_model(TokenizePrompt, body)
        ids = renderer.encode(parsed.prompt, add_special_tokens=parsed.add_special_tokens)
    strs = renderer.token_pieces(ids) if parsed.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: dict, renderer: PromptRenderer) -> dict:
    parsed = parse_model(Detokenize, body)
    check_token_ids(parsed.tokens, renderer.vocab_size, "tokens")
    return {"prompt": renderer.decode(parsed.tokens)}


def _chat_ids(parsed: TokenizeChat, renderer: PromptRenderer) -> list[int]:
    """The prompt the chat route would send for these messages (its tools described as it describes them)."""
    request = ChatCompletionRequest(messages=parsed.messages, tools=parsed.tools)
    messages, images = request.prompt_messages()
    if images:
        raise BadRequest("/tokenize counts text; an image's tokens depend on the model's processor and are counted "
                         "only when the image is sent to the chat route", param=images[0].param)
    plan = request.output_plan(renderer)
    text = renderer.chat_text(messages, list(plan.tools), add_generation_prompt=parsed.add_generation_prompt)
    return renderer.encode(text, add_special_tokens=parsed.add_special_tokens)
