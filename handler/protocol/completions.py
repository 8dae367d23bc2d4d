"""The completions request (OpenAI's ``/v1/completions``, as Databricks serves it), validated, and its conversion to
one ``GenerationRequest`` per prompt.

``prompt`` is a string, a list of strings, a list of token ids or a list of such lists (OpenAI's four forms,
normalised here to a list of prompts); each prompt is completed ``n`` times, or ``best_of`` times when given, of which
the formatter keeps the ``n`` most likely. Token ids go to the model as they are (no special tokens added); an id
outside the tokenizer's vocabulary is a 400 naming the prompt.

How a prompt becomes tokens, ``use_raw_prompt`` (a Databricks field):

- absent or true (the default, as OpenAI and vLLM do): the text is tokenised as it is, with the tokenizer's own
  special tokens (a BOS where the tokenizer adds one) and no chat template;
- false (Databricks' behaviour for chat models): the text is sent as one user message through the model's chat
  template, and the completion is the assistant's answer.

Defaults and rules: ``max_tokens`` null or absent is up to the context limit (Databricks; OpenAI's hosted default is
16); ``temperature`` absent is the model's default, as for chat. ``echo`` prepends the prompt text as sent (not the
rendered template; a token prompt's decoded text); with ``logprobs`` the logprobs cover the prompt's tokens too, the
first one's null (OpenAI's legacy shape), computed in the prompt's prefill. ``max_tokens: 0`` with ``echo`` returns
the prompt alone (vLLM; one token is generated and dropped). ``prompt_logprobs`` (vLLM) adds each choice's
``prompt_logprobs``: per prompt token null (the first) or ``{token id: {logprob, rank, decoded_token}}``; it cannot
stream. ``suffix`` (Databricks) is appended to the end of every completion. Streaming takes one prompt.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from handler.engine.types import GenerationRequest
from handler.errors import BadRequest, Unprocessable
from handler.prompt.renderer import PromptRenderer
from handler.protocol.attributes import PRIORITY_BOUND
from handler.protocol.chat import StreamOptions
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

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
TokenIds = list[Annotated[int, Field(strict=True, ge=0)]]
MAX_LOGPROBS = 20  # vLLM's default max_logprobs (OpenAI's own limit is 5; lm-evaluation-harness has sent 10)


class CompletionRequest(StopAndTextFields, BeamFields, SpeculationFields, ConstraintFields):
    model_config = _STRICT

    prompt: str | TokenIds | list[TokenIds] | list[str]  # this order: a bad token id is named as one
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo only, the prompt alone
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    best_of: int | None = Field(None, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
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
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM: score the prompt, with k alternatives
    # vLLM: the order of admission and prefill, lower first (x-priority in the custom attributes, when absent)
    priority: int | None = Field(None, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND)

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: its text, or its token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def is_echo_only(self) -> bool:
        """``max_tokens: 0`` with echo: the answer is the prompt (and its logprobs) alone."""
        return self.echo and self.max_tokens == 0

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The alternatives to score at each prompt position (echo with logprobs shows the prompt's, prompt_logprobs
        asks vLLM's; the formatters keep each its own count); None when neither asks."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None

    def prompt_param(self, index: int) -> str:
        return "prompt" if len(self.prompts) == 1 else f"prompt[{index}]"

    @property
    def num_choices(self) -> int:
        """Choices generated per prompt: best_of candidates when given, else n."""
        return self.best_of or self.n

    def prepare(self, renderer: PromptRenderer, default_temperature: float,
                arrived_at: float) -> list[GenerationRequest]:
        """Checked, each prompt rendered (``use_raw_prompt`` absent or true: tokenised as it is; false, Databricks:
        sent as one user message through the chat template; a token prompt goes as it is) and converted;
        ``arrived_at`` (``time.monotonic()``): when the request arrived, which its deadline counts from."""
        self.check()
        prompt_ids = [self._prompt_ids(renderer, prompt, index) for index, prompt in enumerate(self.prompts)]
        generations = self.to_generation_requests(prompt_ids, default_temperature)
        return [dataclasses.replace(generation, arrived_at=arrived_at) for generation in generations]

    def echo_texts(self, renderer: PromptRenderer) -> tuple[str, ...]:
        """What echo prepends to each prompt's completions: the text as sent, a token prompt's decoded text
        (vLLM)."""
        if not self.echo:
            return ()
        return tuple(prompt if isinstance(prompt, str) else renderer.decode(prompt) for prompt in self.prompts)

    def _prompt_ids(self, renderer: PromptRenderer, prompt: str | list[int], index: int) -> list[int]:
        if isinstance(prompt, list):
            if self.use_raw_prompt is False:
                raise BadRequest("use_raw_prompt: false sends a text prompt through the chat template; a token "
                                 "prompt goes to the model as it is", param="use_raw_prompt")
            check_token_ids(prompt, renderer.vocab_size, self.prompt_param(index))
            return list(prompt)
        if self.use_raw_prompt is not False:
            return renderer.encode(prompt, add_special_tokens=True)
        if not renderer.has_chat_template:
            raise Unprocessable("use_raw_prompt: false needs a chat template, and this model has none",
                                param="use_raw_prompt")
        return renderer.render_chat([{"role": "user", "content": prompt}])

    def to_generation_requests(self, prompt_ids: list[list[int]],
                               default_temperature: float) -> list[GenerationRequest]:
        """One engine request per prompt, from each prompt's token ids."""
        # beam search without a temperature is greedy, whatever the model's sampling default
        sampling = openai_sampling_params(self, 0.0 if self.use_beam_search else default_temperature)
        grammar = self.constraint()
        beam = plan_beams(self.beam_ask(self.best_of, self.n), sampling, self.n, stream=self.stream,
                          stop=stop_list(self.stop), grammar=grammar, top_logprobs=self.logprobs or 0,
                          top_param="logprobs")
        # echo only: one token is generated (the engine always samples one) and dropped
        stop = self.stop_conditions(1 if self.is_echo_only else self.max_tokens, stop_list(self.stop),
                                    self.ignore_eos)
        return [
            GenerationRequest(
                request_id=new_request_id("cmpl"),
                prompt_ids=tuple(ids),
                sampling=sampling,
                stop=stop,
                text=self.text_options(),
                n=self.n if beam else self.num_choices,
                beam=beam,
                speculation=self.speculation_params(),
                num_top_logprobs=self.logprobs or 0,
                prompt_logprobs=self.num_prompt_logprobs,
                truncate_prompt=self.error_behavior == "truncate",
                grammar=grammar,
                prompt_param=self.prompt_param(index),
                priority=self.priority,
            )
            for index, ids in enumerate(prompt_ids)
        ]

    def check(self) -> None:
        """The rules across fields that the field types cannot say."""
        if not self.prompts:
            raise BadRequest("prompt is an empty list", param="prompt")
        if self.stream and len(self.prompts) > 1:
            raise BadRequest("streaming takes one prompt; send a string, not a list", param="prompt")
        for index, prompt in enumerate(self.prompts):
            if not prompt and isinstance(prompt, list):
                raise BadRequest(f"{self.prompt_param(index)} is an empty list of token ids",
                                 param=self.prompt_param(index))
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens 0 returns only the prompt, so it needs echo: true", param="max_tokens")
        if self.stream and self.prompt_logprobs is not None:
            raise BadRequest("prompt_logprobs are not available with stream: true", param="prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream: true", param="stream_options")
        check_stop(self.stop)
        check_logit_bias(self.logit_bias)
        check_best_of(self.best_of, self.n, self.stream)
        if not self.is_echo_only:
            check_min_tokens(self.min_tokens, self.max_tokens)


def check_token_ids(prompt_ids: list[int], vocab_size: int, param: str) -> None:
    """A token prompt's ids must be the tokenizer's (vLLM checks the same bound)."""
    outside = next((t for t in prompt_ids if t >= vocab_size), None)
    if outside is not None:
        raise BadRequest(f"{param} holds token id {outside}, outside the vocabulary (0..{vocab_size - 1})", param=param)
