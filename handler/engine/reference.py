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

from handler.engine.runner import StepOutput, advance
from handler.engine.scheduler import SlotMove, StepPlan


class ReferenceRunner:
    prefix_ids: tuple[int, ...] = ()  # no shared-prefix cache: every prompt is computed whole

    def __init__(self, model) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self._caches: dict[int, object] = {}  # slot -> that sequence's transformers cache

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: torch.device) -> ReferenceRunner:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        return cls(model.to(device).eval())

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def cached_prefix_length(self, prompt_ids: list[int]) -> int:
        return 0

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        """Logits rows in ``ModelRunner``'s order: decoding sequences, then sequences whose prompt completes."""
        rows, sequences = [], []
        for sequence in plan.decode:
            if not sequence.is_prefilling:  # a prefilling sequence's decode row only holds its slot's place
                rows.append(self._forward(sequence.slot, [sequence.next_token], sequence.num_cached))
                sequences.append(sequence)
        for sequence, start, length in plan.prefill:
            if start == 0:
                self._caches[sequence.slot] = self._new_cache()
            logits = self._forward(sequence.slot, sequence.prompt_ids[start:start + length], start)
            if start + length == sequence.num_prompt_tokens:
                rows.append(logits)
                sequences.append(sequence)
        advance(plan)
        logits = torch.stack(rows).float().cpu() if rows else torch.empty(0, self.vocab_size)
        return StepOutput(sequences, logits)

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(self, slot: int, token_ids: list[int], start: int) -> torch.Tensor:
        """The last position's logits after feeding ``token_ids`` at positions ``start..`` into the slot's cache."""
        positions = torch.arange(start, start + len(token_ids), device=self.device)
        output = self.model(input_ids=torch.tensor([token_ids], device=self.device), past_key_values=self._caches[slot],
                            cache_position=positions, position_ids=positions[None], use_cache=True, logits_to_keep=1)
        self._caches[slot] = output.past_key_values
        return output.logits[0, -1]

    def move(self, move: SlotMove) -> None:
        self._caches[move.dst] = self._caches.pop(move.src)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Give a forked choice its own copy of the prompt's cache."""
        self._caches[dst] = copy.deepcopy(self._caches[src])

    def release(self) -> None:
        self._caches.clear()

