"""A vision-language model on the transformers path (``VisionGenerations``), driven as transformers' own ``generate``
drives it, one sequence at a time, behind ``hf_runner.TransformersRunner`` (``vision=True``: loaded with
transformers' image-text-to-text auto class, ``load_vision_model``).

Its model kwargs are built as ``generate`` builds them (the processor's outputs the prompt layer computed,
``prompt_images.inputs``; position ids from ``_prepare_position_ids_for_generation``), every forward's inputs come
from ``model.prepare_inputs_for_generation`` and are carried on by ``_update_model_kwargs_for_generation``, so each
family's quirks (qwen2_vl's M-RoPE rope deltas, gemma3's token type ids, paligemma's prefix mask, ...) are
transformers' own. State a model keeps on itself between forwards (``rope_deltas``) is saved per sequence and put
back before each of its forwards. Image features cannot be split across chunks, so a VLM prompt (with images or
without) is prefilled in ONE forward: on its first planned chunk the whole prompt is computed; the plan's later
chunks only hand on rows already computed (prompt logprobs), and the last prompt position's logits are returned when
the plan's final chunk arrives (the runner's ``advance(plan)`` keeps its meaning: the sequence's cached count moves
chunk by chunk as planned).

Each sequence's generate state lives in the runner's ``own_caches.OwnCaches`` (its ``caches``), so the KV space
frees and copies it as it does a text model's cache. Imports: torch, transformers (lazily), ``core`` (the request,
prompt logprobs), ``runners.base`` and ``runners.own_caches``; never a backend, nor the runner it serves.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import torch

from handler.engine.core import prompt_logprobs
from handler.engine.core.request import Sequence
from handler.engine.runners.base import StepPlan
from handler.engine.runners.own_caches import OwnCaches, layer_bytes


class VisionGenerations:
    """Each VLM sequence's generate state (``_Generation``), started from its prompt and carried from forward to
    forward; ``stateful``: the model's modules that keep per-prompt state between forwards."""

    def __init__(self, model, device: torch.device, new_cache: Callable[[], object]) -> None:
        self.model, self.device, self._new_cache = model, device, new_cache
        # modules that keep per-prompt state between forwards (qwen2_vl's rope_deltas), saved per sequence
        self.stateful = [m for m in model.modules() if hasattr(m, "rope_deltas")]

    def run(self, plan: StepPlan, space: OwnCaches) -> tuple[list[Sequence], list[torch.Tensor], list]:
        """The step's logits rows in ``ModelRunner``'s order (decoding sequences, then sequences whose prompt
        completes), those sequences, and the rows that score prompts; the runner advances the plan."""
        rows, sequences, scored = [], [], []
        caches = space.caches
        for sequence in plan.decode:
            if not sequence.is_prefilling:
                state = caches[sequence]
                ids = torch.tensor([sequence.tokens(0, sequence.num_cached + 1)], device=self.device)
                rows.append(self._forward(state, ids, first=False, keep=1)[-1])
                sequences.append(sequence)
        for sequence, start, length in plan.prefill:
            if start == 0:  # the whole prompt, in one forward
                scoring = sequence.wants_prompt_logprobs
                caches[sequence] = state = self._start(sequence)
                ids = torch.tensor([sequence.tokens(0, sequence.prefill_target)], device=self.device)
                logits = self._forward(state, ids, first=True, keep=0 if scoring else 1)
                state.prompt_logits = logits if scoring else logits[-1:]
                # states the text-only count cannot see (mllama's cross-attention image keys) are reserved from here
                space.settle(sequence, sum(layer_bytes(state.kwargs["past_key_values"])), ids.shape[1])
            state = caches[sequence]
            if sequence.wants_prompt_logprobs:
                wanted = len(prompt_logprobs.scored_rows(sequence, start, length, 0))
                if wanted:
                    scored.append((sequence, start, state.prompt_logits[start:start + wanted].float()))
            if start + length == sequence.prefill_target:
                rows.append(state.prompt_logits[-1])
                sequences.append(sequence)
                state.prompt_logits = None
        return sequences, rows, scored

    def _start(self, sequence: Sequence) -> _Generation:
        """The model kwargs ``generate`` would start from for this sequence's prompt (a batch of one, no padding)."""
        from transformers.utils import ModelOutput

        request = sequence.request.request
        given = request.prompt_images
        kwargs: dict[str, object] = {}
        if given is not None:  # the prompt layer's processor outputs (ImageProcessor with keep_inputs)
            if given.inputs is None:
                raise ValueError("the request's images come without the processor's outputs this path runs on")
            kwargs = {name: value.to(self.device) if isinstance(value, torch.Tensor) else value
                      for name, value in given.inputs.items()}
            if "pixel_values" in kwargs and kwargs["pixel_values"].is_floating_point():
                kwargs["pixel_values"] = kwargs["pixel_values"].to(self.model.dtype)
        ids = torch.tensor([sequence.tokens(0, sequence.prefill_target)], device=self.device)
        # a resumed sequence: its output so far extended as generate extends it token by token (the family's own
        # rule: gemma3's token types 0, paligemma's 1 (the causal suffix), mllama's cross-attention mask rows)
        for _ in range(ids.shape[1] - len(request.prompt_ids)):
            kwargs = self.model._update_model_kwargs_for_generation(ModelOutput(), kwargs, is_encoder_decoder=False)
        kwargs["past_key_values"] = self._new_cache()
        kwargs["use_cache"] = True
        if "position_ids" in inspect.signature(self.model.forward).parameters:
            kwargs["position_ids"] = self.model._prepare_position_ids_for_generation(ids, {**kwargs, "input_ids": ids})
        saved = [m.rope_deltas for m in self.stateful]  # as the position ids left them
        return _Generation(kwargs, saved)

    def _forward(self, state: _Generation, ids: torch.Tensor, *, first: bool, keep: int) -> torch.Tensor:
        """One forward as ``generate`` runs it: ``ids`` is the sequence so far (the prompt at ``first``)."""
        for module, value in zip(self.stateful, state.saved, strict=True):
            module.rope_deltas = value
        if first:
            inputs = self.model.prepare_inputs_for_generation(ids, is_first_iteration=True, **state.kwargs)
        else:
            inputs = self.model.prepare_inputs_for_generation(ids, next_sequence_length=1, **state.kwargs)
        inputs["logits_to_keep"] = keep
        output = self.model(**inputs, return_dict=True)
        state.kwargs = self.model._update_model_kwargs_for_generation(output, state.kwargs,
                                                                      is_encoder_decoder=False)
        state.saved = [m.rope_deltas for m in self.stateful]
        return output.logits[0]


class _Generation:
    """One VLM sequence's generate state: its model kwargs (cache included) and the model's per-prompt state."""

    def __init__(self, kwargs: dict, saved: list) -> None:
        self.kwargs = kwargs
        self.saved = saved
        self.prompt_logits: torch.Tensor | None = None


def load_vision_model(model_dir: Path, dtype: torch.dtype):
    """A VLM checkpoint with transformers' image-text-to-text auto class (the class ``generate`` would use),
    else the older vision-to-sequence or causal-LM mapping when the family is registered there only."""
    import transformers

    errors = []
    for name in ("AutoModelForImageTextToText", "AutoModelForVision2Seq", "AutoModelForCausalLM"):
        auto = getattr(transformers, name, None)
        if auto is None:
            continue
        try:
            return auto.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        except ValueError as error:  # the family is not in this mapping
            errors.append(f"{name}: {error}")
    raise ValueError(f"{model_dir}: no transformers auto class loads this vision model ({'; '.join(errors)})")
