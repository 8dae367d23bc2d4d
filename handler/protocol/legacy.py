"""The legacy schema (LMI / TGI style): ``{"inputs": str | [str], "parameters": {...}, "stream": bool}``.

One or many prompts are normalised here into a list of ``GenerationRequest``s, one per prompt (``prepare``: each
input tokenised as it is, with the tokenizer's own special tokens, as TGI and LMI do).
Sampling: ``do_sample`` false with no temperature/top_p/top_k means greedy (HF ``generate``'s default); any of
those, or ``do_sample: true``, samples (TGI's rule), with temperature 1.0 unless given. ``decoder_input_details``
(TGI) adds the prompt's tokens and logprobs as ``details.prefill`` (and, as in TGI, implies ``details``); it cannot
stream.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from handler.engine.types import GenerationRequest, SamplingParams
from handler.errors import BadRequest
from handler.prompt.renderer import PromptRenderer
from handler.protocol.common import (
    BEAM_ONLY,
    BeamAsk,
    StopAndTextFields,
    check_min_tokens,
    new_request_id,
    plan_beams,
    stop_list,
)
from handler.protocol.constraints import LegacyGrammar

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class LegacyParameters(StopAndTextFields):
    model_config = _STRICT

    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    do_sample: bool = False
    repetition_penalty: float | None = Field(None, ge=0.01, le=10.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    stop_sequences: list[str] | None = None
    seed: int | None = None
    return_full_text: bool = False
    details: bool = False
    decoder_input_details: bool = False           # TGI: the prompt's tokens and logprobs in details.prefill
    top_n_tokens: int | None = Field(None, ge=0, le=20)
    ignore_eos: bool = False
    min_new_tokens: int | None = Field(None, ge=0)  # HF generate's name for min_tokens
    num_beams: int | None = Field(None, ge=1, le=128)   # HF generate: beam search (greedy), the best beam returned
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)
    early_stopping: bool | Literal["never"] = False
    diversity_penalty: float | None = Field(None, ge=0.0, le=100.0)  # HF generate: diverse beam search
    num_beam_groups: int | None = Field(None, ge=1, le=128)
    truncate: int | None = Field(None, ge=1)      # TGI: keep only the last N tokens of the input
    error_behavior: Literal["error", "truncate"] = "error"  # Databricks: a prompt too long for the context
    grammar: LegacyGrammar | None = None          # TGI: a JSON schema or a regex the output follows
    # the LoRA adapter to generate with: LMI's adapters (one name, or one per input), TGI's adapter_id
    adapters: str | list[str] | None = None
    adapter_id: str | None = Field(None, min_length=1)

    def sampling_params(self) -> SamplingParams:
        sampled = self.do_sample or self.temperature not in (None, 0.0) or self.top_p is not None or (
            self.top_k not in (None, -1, 0))
        temperature = (1.0 if self.temperature is None else self.temperature) if sampled else 0.0
        return SamplingParams(
            temperature=temperature,
            top_p=self.top_p or 1.0,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            seed=self.seed,
        )

    @property
    def minimum(self) -> int:
        return self.min_tokens if self.min_new_tokens is None else self.min_new_tokens

    def stop_strings(self) -> tuple[str, ...]:
        strings = stop_list(self.stop) + tuple(self.stop_sequences or ())
        if any(s == "" for s in strings):
            raise BadRequest("stop sequences must not be empty", param="parameters.stop")
        return strings


class LegacyRequest(BaseModel):
    model_config = _STRICT
    extra_parameters_in: ClassVar[tuple[str, ...]] = ("parameters",)  # the extra-parameters policy looks here too

    inputs: str | list[str]
    parameters: LegacyParameters = Field(default_factory=LegacyParameters)
    stream: bool = False

    @property
    def prompts(self) -> list[str]:
        return [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)

    @property
    def is_batch(self) -> bool:
        return isinstance(self.inputs, list)

    def check(self) -> None:
        if not self.prompts:
            raise BadRequest("inputs is an empty list", param="inputs")
        if self.stream and self.is_batch:
            raise BadRequest("streaming takes one input; send a string, not a list", param="inputs")
        if self.stream and self.parameters.decoder_input_details:  # TGI refuses it too
            raise BadRequest("decoder_input_details is not available with stream: true",
                             param="parameters.decoder_input_details")
        p = self.parameters
        if isinstance(p.adapters, list) and len(p.adapters) != len(self.prompts):
            raise BadRequest(f"parameters.adapters names {len(p.adapters)} adapters for {len(self.prompts)} inputs; "
                             "give one name, or one per input", param="parameters.adapters")
        if p.adapters is not None and p.adapter_id is not None:
            raise BadRequest("parameters.adapters (LMI) and parameters.adapter_id (TGI) name the same thing; send one",
                             param="parameters.adapter_id")
        p.stop_strings()
        if p.min_new_tokens is not None and "min_tokens" in p.model_fields_set:
            raise BadRequest("min_new_tokens and min_tokens are the same setting; send one",
                             param="parameters.min_new_tokens")
        check_min_tokens(p.minimum, p.max_new_tokens, "parameters.min_new_tokens" if p.min_new_tokens is not None
                         else "parameters.min_tokens", "parameters.max_new_tokens")

    def adapter_names(self) -> list[tuple[str | None, str]]:
        """Each input's adapter (None: the base model) and the field that named it."""
        p = self.parameters
        if isinstance(p.adapters, list):
            return [(name or None, f"parameters.adapters[{i}]") for i, name in enumerate(p.adapters)]
        if p.adapters:
            return [(p.adapters, "parameters.adapters")] * len(self.prompts)
        return [(p.adapter_id, "parameters.adapter_id")] * len(self.prompts)

    def prepare(self, renderer: PromptRenderer, default_max_new_tokens: int,
                arrived_at: float) -> list[GenerationRequest]:
        """Checked, each input tokenised with the tokenizer's own special tokens, and converted; ``arrived_at``
        (``time.monotonic()``): when the request arrived, which its deadline counts from."""
        self.check()
        prompt_ids = [renderer.encode(prompt, add_special_tokens=True) for prompt in self.prompts]
        generations = self.to_generation_requests(prompt_ids, default_max_new_tokens)
        return [dataclasses.replace(generation, arrived_at=arrived_at) for generation in generations]

    def to_generation_requests(self, prompt_ids: list[list[int]],
                               default_max_new_tokens: int) -> list[GenerationRequest]:
        """One engine request per prompt, from each prompt's token ids."""
        p = self.parameters
        stop = p.stop_conditions(p.max_new_tokens or default_max_new_tokens, p.stop_strings(), p.ignore_eos,
                                 min_new_tokens=p.minimum)
        sampling = p.sampling_params()
        ask = BeamAsk((p.num_beams or 1) > 1, p.num_beams or 1, None, p.length_penalty, p.early_stopping,
                      frozenset(p.model_fields_set & BEAM_ONLY), "parameters.num_beams", p.diversity_penalty,
                      p.num_beam_groups)
        grammar = p.grammar.spec() if p.grammar is not None else None
        beam = plan_beams(ask, sampling, 1, stream=self.stream, stop=stop.stop_strings, grammar=grammar,
                          top_logprobs=p.top_n_tokens or 0, top_param="parameters.top_n_tokens", prefix="parameters.")
        keep = p.truncate  # TGI: only the last N tokens of the input
        return [GenerationRequest(request_id=new_request_id("gen"), prompt_ids=tuple(ids[-keep:] if keep else ids),
                                  sampling=sampling, stop=stop, text=p.text_options(), beam=beam,
                                  num_top_logprobs=p.top_n_tokens or 0,
                                  prompt_logprobs=0 if p.decoder_input_details else None,
                                  truncate_prompt=p.error_behavior == "truncate", grammar=grammar,
                                  prompt_param="inputs", adapter=adapter, adapter_param=adapter_param)
                for ids, (adapter, adapter_param) in zip(prompt_ids, self.adapter_names(), strict=True)]
