"""The completions request (OpenAI's ``/v1/completions``, as Databricks serves it), validated, and its conversion to
one ``GenerationRequest`` per prompt.

``prompt`` is a string or a list of strings (normalised here to a list); each prompt is completed ``n`` times, or
``best_of`` times when given, of which the formatter keeps the ``n`` most likely.

How a prompt becomes tokens, ``use_raw_prompt`` (a Databricks field):

- absent or true (the default, as OpenAI and vLLM do): the text is tokenised as it is, with the tokenizer's own
  special tokens (a BOS where the tokenizer adds one) and no chat template;
- false (Databricks' behaviour for chat models): the text is sent as one user message through the model's chat
  template, and the completion is the assistant's answer.

Defaults and rules: ``max_tokens`` null or absent is up to the context limit (Databricks; OpenAI's hosted default is
16); ``temperature`` absent is the model's default, as for chat. ``echo`` prepends the prompt text as sent (not the
rendered template); with ``logprobs`` it would need the prompt's logprobs, which the engine does not compute, so the
pair is a 422. ``suffix`` (Databricks) is appended to the end of every completion. Streaming takes one prompt.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from handler.engine.types import GenerationRequest, StopConditions
from handler.errors import BadRequest, Unprocessable
from handler.protocol.chat import StreamOptions
from handler.protocol.common import (
    check_best_of,
    check_logit_bias,
    check_stop,
    new_request_id,
    openai_sampling_params,
    stop_list,
)

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class CompletionRequest(BaseModel):
    model_config = _STRICT

    prompt: str | list[str]
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    best_of: int | None = Field(None, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # --- extensions (vLLM / LMI / Databricks names) ---
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10.0)
    ignore_eos: bool = False
    use_raw_prompt: bool | None = None  # Databricks: false wraps the prompt in the chat template (see above)
    error_behavior: Literal["error", "truncate"] = "error"  # Databricks: a prompt too long for the context

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    @property
    def num_choices(self) -> int:
        """Choices generated per prompt: best_of candidates when given, else n."""
        return self.best_of or self.n

    def to_generation_requests(self, prompt_ids: list[list[int]],
                               default_temperature: float) -> list[GenerationRequest]:
        """One engine request per prompt, from each prompt's token ids (``intake.completion_requests`` renders
        them)."""
        sampling = openai_sampling_params(self, default_temperature)
        stop = StopConditions(
            max_new_tokens=self.max_tokens, stop_strings=stop_list(self.stop), ignore_eos=self.ignore_eos
        )
        return [
            GenerationRequest(
                request_id=new_request_id("cmpl"),
                prompt_ids=tuple(ids),
                sampling=sampling,
                stop=stop,
                n=self.num_choices,
                num_top_logprobs=self.logprobs or 0,
                truncate_prompt=self.error_behavior == "truncate",
                prompt_param="prompt",
            )
            for ids in prompt_ids
        ]

    def check(self) -> None:
        """The rules across fields that the field types cannot say."""
        if not self.prompts:
            raise BadRequest("prompt is an empty list", param="prompt")
        if self.stream and len(self.prompts) > 1:
            raise BadRequest("streaming takes one prompt; send a string, not a list", param="prompt")
        if self.echo and self.logprobs is not None:
            raise Unprocessable(
                "echo with logprobs needs the prompt's logprobs, which this server does not compute", param="echo"
            )
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream: true", param="stream_options")
        check_stop(self.stop)
        check_logit_bias(self.logit_bias)
        check_best_of(self.best_of, self.n, self.stream)
