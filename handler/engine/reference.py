"""The reference path: the checkpoint's own transformers model, for every architecture the lean model does not
implement, behind the same step interface as ``runner.ModelRunner``.

Our engine still schedules, samples, constrains, detokenises, stops, streams and cancels; only the forward pass is
transformers' (``AutoModelForCausalLM``, the class the checkpoint's ``architectures`` names). Each cache slot holds
its sequence's own transformers cache (``DynamicCache`` built from the config, so sliding-window and hybrid layers
keep what their architecture keeps), and a step runs each sequence's rows through the model as a batch of one:
the numbers are transformers' own, whatever else is running (exact by construction, slower than the lean path).
Prefill is chunked as the scheduler plans it, through ``cache_position``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from handler.engine import prompt_logprobs
from handler.engine.runner import StepOutput, advance
from handler.engine.scheduler import StepPlan, Unbounded
from handler.engine.sequence import Sequence


class _OwnCaches(Unbounded):
    """The reference path's KV space: each running sequence's own transformers cache, unbounded."""

    def __init__(self) -> None:
        self.caches: dict[Sequence, object] = {}

    def free(self, owner: Sequence) -> None:
        self.caches.pop(owner, None)

    def copy(self, src: Sequence, dst: Sequence, length: int) -> None:
        """Give a forked choice its own copy of the prompt's cache."""
        self.caches[dst] = copy.deepcopy(self.caches[src])

    def release(self) -> None:
        self.caches.clear()


class ReferenceRunner:
    prefix_ids: tuple[int, ...] = ()  # no prefix cache: every prompt is computed whole

    def __init__(self, model) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.space = _OwnCaches()
        self._caches = self.space.caches  # sequence -> its transformers cache

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: torch.device) -> ReferenceRunner:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        return cls(model.to(device).eval())

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def match_prefix(self, sequence: Sequence) -> None:
        return None

    def clear_prefix_cache(self) -> None:
        return None

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        """Logits rows in ``ModelRunner``'s order: decoding sequences, then sequences whose prompt completes."""
        rows, sequences, scored = [], [], []
        for sequence in plan.decode:
            if not sequence.is_prefilling:  # a prefilling sequence's decode row only holds its slot's place
                rows.append(self._forward(sequence, [sequence.next_token], sequence.num_cached)[-1])
                sequences.append(sequence)
        for sequence, start, length in plan.prefill:
            if start == 0:
                self._caches[sequence] = self._new_cache()
            scoring = sequence.wants_prompt_logprobs
            wanted = len(prompt_logprobs.scored_rows(sequence, start, length, 0)) if scoring else 0
            logits = self._forward(sequence, sequence.tokens(start, start + length), start, 0 if wanted else 1)
            if wanted:  # the rows that score the prompt, from the same forward
                scored.append((sequence, start, logits[:wanted].float()))
            if start + length == sequence.prefill_target:
                rows.append(logits[-1])
                sequences.append(sequence)
        advance(plan)
        logits = torch.stack(rows).float().cpu() if rows else torch.empty(0, self.vocab_size)
        return StepOutput(sequences, logits, scored)

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(self, sequence: Sequence, token_ids: list[int], start: int, keep: int = 1) -> torch.Tensor:
        """The last ``keep`` positions' logits (0: every position's), ``[rows, vocab]``, after feeding ``token_ids``
        at positions ``start..`` into the slot's cache."""
        positions = torch.arange(start, start + len(token_ids), device=self.device)
        output = self.model(input_ids=torch.tensor([token_ids], device=self.device),
                            past_key_values=self._caches[sequence],
                            cache_position=positions, position_ids=positions[None], use_cache=True, logits_to_keep=keep)
        self._caches[sequence] = output.past_key_values
        return output.logits[0]
