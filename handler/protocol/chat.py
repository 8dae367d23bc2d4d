"""The chat-completions request (OpenAI shape), validated, and its conversion to a ``GenerationRequest``.

Fields copy the OpenAI names. Fields this server cannot honour yet are not declared, so they are refused with a
400 naming them (``extra="forbid"``) rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from handler.engine.types import GenerationRequest, SamplingParams, StopConditions
from handler.errors import BadRequest
from handler.protocol.common import new_request_id, stop_list
from handler.tokenization import PromptRenderer

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = _STRICT
    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(BaseModel):
    model_config = _STRICT
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = _STRICT

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # --- extensions (vLLM / LMI names) ---
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10.0)
    ignore_eos: bool = False
    error_behavior: Literal["error", "truncate"] = "error"  # Databricks: a prompt too long for the context

    def to_generation_request(self, renderer: PromptRenderer, default_temperature: float) -> GenerationRequest:
        _check_stop(self.stop)
        _check_logit_bias(self.logit_bias)
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs requires logprobs: true", param="top_logprobs")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream: true", param="stream_options")
        prompt_ids = renderer.render_chat([_template_message(m, i) for i, m in enumerate(self.messages)])
        return GenerationRequest(
            request_id=new_request_id("chatcmpl"),
            prompt_ids=tuple(prompt_ids),
            sampling=self.sampling_params(default_temperature),
            stop=StopConditions(max_new_tokens=self.max_completion_tokens or self.max_tokens,
                                stop_strings=stop_list(self.stop), ignore_eos=self.ignore_eos),
            n=self.n,
            num_top_logprobs=self.top_logprobs or 0,
            truncate_prompt=self.error_behavior == "truncate",
        )

    def sampling_params(self, default_temperature: float) -> SamplingParams:
        # Without a temperature: the model's own default (generation_config.json), greedy when it has none (as
        # LMI and HF generate do; OpenAI's hosted default of 1.0 would make small models ramble).
        temperature = default_temperature if self.temperature is None else self.temperature
        return SamplingParams(
            temperature=temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=tuple(sorted((self.logit_bias or {}).items())),
            seed=self.seed,
        )


def _check_stop(stop: str | list[str] | None) -> None:
    if isinstance(stop, list) and len(stop) > 4:
        raise BadRequest(f"stop has {len(stop)} sequences; at most 4 are allowed", param="stop")
    if any(s == "" for s in stop_list(stop)):
        raise BadRequest("stop sequences must not be empty", param="stop")


def _check_logit_bias(bias: dict[int, float] | None) -> None:
    for token_id, value in (bias or {}).items():
        if not -100.0 <= value <= 100.0:
            raise BadRequest(f"logit_bias[{token_id}]={value} is outside -100..100", param="logit_bias")


def _template_message(message: ChatMessage, index: int) -> dict:
    """The message as chat templates expect it: text parts joined; images refused for a text-only model."""
    rendered: dict = {"role": message.role}
    if isinstance(message.content, list):
        for part_index, part in enumerate(message.content):
            if isinstance(part, ImagePart):
                raise BadRequest("this model is not a vision model: it cannot take image content",
                                    param=f"messages[{index}].content[{part_index}]")
        rendered["content"] = "".join(part.text for part in message.content)
    else:
        rendered["content"] = message.content or ""
    if message.tool_calls:
        rendered["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    for key in ("name", "tool_call_id"):
        if getattr(message, key) is not None:
            rendered[key] = getattr(message, key)
    return rendered
