"""The chat-completions request (OpenAI shape), validated, and its conversion to a ``GenerationRequest``:
``prepare`` checks it across fields, has the model's renderer render its messages (chat template, tools, images)
and converts it, in one pass. The Responses API is served by converting into this request (``protocol.responses``),
so both endpoints prepare through here.

Fields copy the OpenAI names. Fields this server cannot honour yet are not declared, so they are refused with a
400 naming them (``extra="forbid"``) rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from handler.engine.types import GenerationRequest, SamplingParams
from handler.errors import BadRequest
from handler.prompt.renderer import ImageRef, PromptRenderer, RenderedPrompt
from handler.protocol.attributes import PRIORITY_BOUND
from handler.protocol.common import (
    BeamFields,
    SpeculationFields,
    StopAndTextFields,
    check_best_of,
    check_logit_bias,
    check_min_tokens,
    check_stop,
    new_request_id,
    openai_sampling_params,
    plan_beams,
    stop_list,
)
from handler.protocol.constraints import ConstraintFields
from handler.protocol.structured import OutputPlan, ResponseFormat, Tool, ToolChoice, plan_output

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
# apply_chat_template's own arguments, which chat_template_kwargs must not override
_RENDERER_ARGUMENTS = frozenset({"conversation", "messages", "tools", "add_generation_prompt", "tokenize",
                                 "continue_final_message", "return_dict", "documents", "chat_template"})


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
    image_url: ImageUrl | str     # the object is OpenAI's shape; a bare string is accepted as its url

    @property
    def ref(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url

    @property
    def detail(self) -> str:
        return "auto" if isinstance(self.image_url, str) else self.image_url.detail


class AzureImagePart(BaseModel):
    """Azure ML's image part: ``{"type": "image", "content": <URL or base64>, "detail": ...}``."""

    model_config = _STRICT
    type: Literal["image"]
    content: str
    detail: Literal["auto", "low", "high"] = "auto"

    @property
    def ref(self) -> str:
        return self.content


ContentPart = Annotated[TextPart | ImagePart | AzureImagePart, Field(discriminator="type")]


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
    # an assistant turn's reasoning, as this server's answers spell it (vLLM takes both names): given to the template,
    # which renders it where it renders earlier reasoning (Qwen3's reasoning_content, gpt-oss's thinking)
    reasoning_content: str | None = None
    reasoning: str | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ChatCompletionRequest(StopAndTextFields, BeamFields, SpeculationFields, ConstraintFields):
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
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # --- extensions (vLLM / LMI names) ---
    best_of: int | None = Field(None, ge=1, le=128)  # vLLM: best_of candidates, the n most likely returned
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10.0)
    ignore_eos: bool = False
    error_behavior: Literal["error", "truncate"] = "error"  # Databricks: a prompt too long for the context
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: variables for the chat template (enable_thinking)
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # OpenAI: the template's reasoning_effort
    # vLLM: the order of admission and prefill, lower first (x-priority in the custom attributes, when absent)
    priority: int | None = Field(None, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND)
    _plan: OutputPlan | None = PrivateAttr(None)

    def output_plan(self, renderer: PromptRenderer) -> OutputPlan:
        """The grammar the engine enforces and the tool-call format the formatter parses (computed once)."""
        if self._plan is None:
            self._plan = plan_output(self.response_format, self.tools, self.tool_choice, self.parallel_tool_calls,
                                     renderer.tool_format, renderer.tool_marker_id, self.constraint(),
                                     harmony=renderer.speaks_harmony)
        return self._plan

    def check(self) -> None:
        """The rules across fields that the field types cannot say."""
        check_stop(self.stop)
        check_logit_bias(self.logit_bias)
        check_best_of(self.best_of, self.n, self.stream)
        check_min_tokens(self.min_tokens, self.max_completion_tokens or self.max_tokens,
                         max_param="max_completion_tokens" if self.max_completion_tokens else "max_tokens")
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs requires logprobs: true", param="top_logprobs")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream: true", param="stream_options")

    def template_kwargs(self) -> dict:
        """The chat template's extra variables: ``chat_template_kwargs`` and ``reasoning_effort`` (gpt-oss's
        template writes it into its system header as ``Reasoning: low|medium|high``; templates without the
        variable ignore it, as jinja does)."""
        kwargs = dict(self.chat_template_kwargs or {})
        for key in sorted(set(kwargs) & _RENDERER_ARGUMENTS):
            raise BadRequest(f"chat_template_kwargs cannot set {key!r}: the server sets it",
                             param=f"chat_template_kwargs.{key}")
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs

    def prompt_messages(self) -> tuple[list[dict], list[ImageRef]]:
        """The messages as chat templates take them, and the images they reference, in order."""
        images: list[ImageRef] = []
        return [_template_message(m, i, images) for i, m in enumerate(self.messages)], images

    def prepare(self, renderer: PromptRenderer, default_temperature: float, arrived_at: float) -> PreparedChat:
        """Checked, rendered and converted: the engine's request and what its answer's formatter needs from the
        prompt side. ``arrived_at`` (``time.monotonic()``) is when the request arrived: its deadline and its image
        budget count from then, so rendering and fetching images are part of it."""
        self.check()
        plan = self.output_plan(renderer)
        messages, images = self.prompt_messages()
        prompt = renderer.render_prompt(messages, tools=list(plan.tools), images=images, arrived_at=arrived_at,
                                        template_kwargs=self.template_kwargs())
        generation = _with_reasoning(self.to_generation_request(prompt, plan, default_temperature), renderer, plan)
        opened = renderer.reasoning_parser is not None and renderer.opens_reasoning(generation.prompt_ids)
        return PreparedChat(dataclasses.replace(generation, arrived_at=arrived_at), plan, renderer.reasoning_parser,
                            opened)

    def to_generation_request(self, prompt: RenderedPrompt, plan: OutputPlan,
                              default_temperature: float) -> GenerationRequest:
        """The engine request for the rendered prompt."""
        # beam search without a temperature is greedy, whatever the model's sampling default
        sampling = self.sampling_params(0.0 if self.use_beam_search else default_temperature)
        beam = plan_beams(self.beam_ask(self.best_of, self.n), sampling, self.n, stream=self.stream,
                          stop=stop_list(self.stop), grammar=plan.grammar,
                          top_logprobs=self.top_logprobs or 0, top_param="top_logprobs")
        return GenerationRequest(
            request_id=new_request_id("chatcmpl"),
            prompt_ids=prompt.prompt_ids,
            prompt_embeds=prompt.embeds,
            prompt_images=prompt.images,
            sampling=sampling,
            stop=self.stop_conditions(self.max_completion_tokens or self.max_tokens, stop_list(self.stop),
                                      self.ignore_eos),
            text=self.text_options(),
            n=self.n if beam else self.best_of or self.n,
            beam=beam,
            speculation=self.speculation_params(),
            num_top_logprobs=self.top_logprobs or 0,
            truncate_prompt=self.error_behavior == "truncate",
            grammar=plan.grammar,
            keep_special_ids=(plan.marker_id,) if plan.marker_id is not None else (),
            prompt_param="messages",
            priority=self.priority,
        )

    def sampling_params(self, default_temperature: float) -> SamplingParams:
        return openai_sampling_params(self, default_temperature)


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat request ready for the engine, and what its answer's formatter needs from the prompt side."""

    generation: GenerationRequest
    plan: OutputPlan                  # the grammar the engine enforces, the tool-call format the answer is read in
    reasoning_parser: str | None      # the model's reasoning format (None: its answer is all content)
    reasoning_opened: bool            # the prompt opened the reasoning: the answer starts inside it


def _with_reasoning(generation: GenerationRequest, renderer: PromptRenderer, plan: OutputPlan) -> GenerationRequest:
    """For a reasoning model: its markers' special tokens kept in the text (the formatter splits on them), and
    an output grammar that starts once the reasoning has ended (unless it spans the reasoning itself: gpt-oss's
    forced calls)."""
    if renderer.reasoning_parser is None:
        return generation
    grammar, gate = generation.grammar, renderer.reasoning_gate(generation.prompt_ids)
    if grammar is not None and gate is not None and not plan.spans_reasoning:
        grammar = dataclasses.replace(grammar, after_reasoning=gate)
    keep = generation.keep_special_ids + renderer.reasoning_keep_ids
    return dataclasses.replace(generation, grammar=grammar, keep_special_ids=keep)


def _template_message(message: ChatMessage, index: int, images: list[ImageRef]) -> dict:
    """The message as chat templates expect it. Text parts are joined into one string; a message with images
    keeps a list of ``{"type": "image"}`` and ``{"type": "text"}`` parts (the form vision models' templates
    take), and each image's reference is collected in order into ``images``."""
    rendered: dict = {"role": message.role}
    if isinstance(message.content, list):
        if any(not isinstance(part, TextPart) for part in message.content):
            rendered["content"] = [_template_part(part, index, j, images) for j, part in enumerate(message.content)]
        else:
            rendered["content"] = "".join(part.text for part in message.content)
    else:
        rendered["content"] = message.content or ""
    if message.tool_calls:
        rendered["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    for key in ("name", "tool_call_id"):
        if getattr(message, key) is not None:
            rendered[key] = getattr(message, key)
    thinking = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if thinking is not None and message.role == "assistant":
        rendered["reasoning_content"] = rendered["thinking"] = thinking
    return rendered


def _template_part(part: ContentPart, index: int, part_index: int, images: list[ImageRef]) -> dict:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    images.append(ImageRef(part.ref, f"messages[{index}].content[{part_index}]", part.detail))
    return {"type": "image"}
