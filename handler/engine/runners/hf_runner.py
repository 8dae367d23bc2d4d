"""The transformers path: the checkpoint's own transformers model, for every architecture the lean model does not
implement, behind the same step interface as ``model_runner.ModelRunner`` (``base.Runner``).

Our engine still schedules, samples, constrains, detokenises, stops, streams and cancels; only the forward pass is
transformers' (``AutoModelForCausalLM``, the class the checkpoint's ``architectures`` names). Each cache slot holds
its sequence's own transformers cache (``DynamicCache`` built from the config, so sliding-window and hybrid layers
keep what their architecture keeps). Prefill is chunked as the scheduler plans it, through ``cache_position``, one
sequence per forward. A step's decode rows share one forward where the cache allows it (``shares_steps``: every
layer a plain full-attention cache, and a probe at load finds two sequences of different lengths decoded together
equal to each alone): the caches are left-padded into one batch cache with the padding masked out, each row at its
own position. Elsewhere (sliding windows, linear attention, a model that reads padding its own way) each sequence
decodes as a batch of one. The numbers are transformers' own (batched, as its own batched ``generate`` computes
them); the path is slower than the lean one. A recurrent-state family's cache is the state its forward makes and
hands back (mamba's ``cache_params``, rwkv's ``state``). How a text model steps is chosen at load (``hf_stepping``):
the model's steps must give its own uncached logits, else each prompt runs in one forward, else every step
recomputes the whole sequence without a cache (exact, slower); a model whose forward fails outright is refused at
load with the reason. What a sequence's cache holds, for the KV budget, is measured then (``hf_cost``).

A vision-language model (``vision=True``) is driven as transformers' own ``generate`` drives it, one sequence at a
time (``hf_vision.VisionGenerations``); this runner keeps its load, its fresh cache and the step's output.
"""

from __future__ import annotations

import copy
import inspect
import logging
from pathlib import Path

import torch

from handler.engine.core import prompt_logprobs
from handler.engine.core.request import Sequence
from handler.engine.runners.base import StepOutput, StepPlan, advance
from handler.engine.runners.encoder_runner import transformers_embed
from handler.engine.runners.hf_cost import cache_cost
from handler.engine.runners.hf_stepping import Stepping, probe_stepping
from handler.engine.runners.hf_vision import VisionGenerations, load_vision_model
from handler.engine.runners.own_caches import OwnCaches
from handler.engine.types import Pooling
from handler.errors import Unprocessable

log = logging.getLogger(__name__)

# a shared decode forward copies its sequences' caches into one padded batch cache: at most this share of the budget
SHARED_COPY_SHARE = 4
# the names a model's forward takes its cache under, first found wins (recurrent families: mamba's, rwkv's)
CACHE_ARGS = ("cache_params", "state", "past_key_values")


class TransformersRunner:
    prefix_ids: tuple[int, ...] = ()  # no prefix cache: every prompt is computed whole

    def __init__(self, model, vision: bool = False) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.vision = vision
        # a VLM's sequences, each driven as generate drives it (``hf_vision``)
        self.generations = VisionGenerations(model, self.device, self._new_cache) if vision else None
        # recurrent-state families take and return their cache under their own name (mamba's ``cache_params``,
        # rwkv's ``state``) and make it on their first forward
        parameters = inspect.signature(model.forward).parameters
        self._cache_arg = next((name for name in CACHE_ARGS if name in parameters), "past_key_values")
        self._takes_positions = "position_ids" in parameters
        self.stepping = Stepping() if vision else probe_stepping(self)  # how a text model's steps run
        # the KV space (what a sequence's cache holds: ``hf_cost``), under the loader's budget (``lean.kv_budget``)
        self.space = OwnCaches(cache_cost(self))
        self._caches = self.space.caches  # sequence -> its transformers cache (a VLM's: its generate state)
        self._prompt_logits = self.space.prompt_logits
        self.shares_steps = self.stepping.chunked and self._probe_sharing()  # decode rows of a step in one forward

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: torch.device,
             vision: bool = False) -> TransformersRunner:
        if not vision:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
            return cls(model.to(device).eval())
        return cls(load_vision_model(model_dir, dtype).to(device).eval(), vision=True)

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def match_prefix(self, sequence: Sequence) -> None:
        return None

    def clear_prefix_cache(self) -> None:
        return None

    def embed(self, inputs: list[tuple[int, ...]], pooling: Pooling) -> torch.Tensor:
        """Pooled final hidden states of the inputs, through the checkpoint's base model (``encoder_runner``)."""
        if self.vision:
            raise Unprocessable("this vision-language model runs on the transformers path, which embeds text "
                                "models only", param="input")
        return transformers_embed(self.model, inputs, pooling, self.model.config.pad_token_id or 0)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        """Logits rows in ``ModelRunner``'s order: decoding sequences, then sequences whose prompt completes."""
        if self.generations is not None:
            return self._output(plan, *self.generations.run(plan, self.space))
        if not self.stepping.chunked:
            return self._run_whole(plan)
        scored = []
        # a prefilling sequence's decode row only holds its slot's place
        sequences = [sequence for sequence in plan.decode if not sequence.is_prefilling]
        rows = self._decode(sequences)
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
        return self._output(plan, sequences, rows, scored)

    def _output(self, plan: StepPlan, sequences: list[Sequence], rows: list[torch.Tensor], scored: list) -> StepOutput:
        """The step done: the plan's sequences advanced, the rows stacked ``[len(sequences), vocab]`` on the CPU."""
        advance(plan)
        logits = torch.stack(rows).float().cpu() if rows else torch.empty(0, self.vocab_size)
        return StepOutput(sequences, logits, scored)

    def _decode(self, sequences: list[Sequence]) -> list[torch.Tensor]:
        """One logits row per decoding sequence, in their order: each group of ``_sharing_groups`` in one forward."""
        rows: dict[Sequence, torch.Tensor] = {}
        for group in self._sharing_groups(sequences):
            if len(group) == 1:
                rows[group[0]] = self._forward(group[0], [group[0].next_token], group[0].num_cached)[-1]
                continue
            together = self._decode_together([self._caches[s] for s in group], [s.num_cached for s in group],
                                             [s.next_token for s in group])
            rows.update(zip(group, together, strict=True))
        return [rows[s] for s in sequences]

    def _sharing_groups(self, sequences: list[Sequence]) -> list[list[Sequence]]:
        """Decode rows that share a forward: sequences of one size class (up to 256 positions, then doubling, so
        padding at most doubles a row), while the group's padded batch cache, a copy made for that forward, stays
        within ``1 / SHARED_COPY_SHARE`` of the KV budget. A long sequence beside short ones decodes alone, and
        sharing never copies more than that share beside the budget."""
        if not self.shares_steps:
            return [[s] for s in sequences]
        cap = self.space.budget // SHARED_COPY_SHARE
        groups: list[list[Sequence]] = []
        for sequence in sorted(sequences, key=lambda s: _size_class(s.num_cached + 1)):
            group = groups[-1] if groups else []
            longest = max([s.num_cached + 1 for s in group] + [sequence.num_cached + 1])
            if (group and _size_class(group[0].num_cached + 1) == _size_class(sequence.num_cached + 1)
                    and (len(group) + 1) * self.space.bytes_for(longest) <= cap):
                group.append(sequence)
            else:
                groups.append([sequence])
        return groups

    def _new_cache(self):
        """A fresh cache for one sequence: None where the model makes its own on the first forward (a recurrent
        family's ``cache_params`` or ``state``)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config) if self._cache_arg == "past_key_values" else None

    def _decode_together(self, caches: list, lengths: list[int], tokens: list[int]) -> torch.Tensor:
        """One decode row per cache in one forward, ``[rows, vocab]``: the caches left-padded to the longest into
        one batch cache, the padding masked out, each row at its own position; each row's new keys and values are
        then appended to its own cache. (A copy of every cache per step: the price of sharing the weights' reads.)"""
        from transformers import DynamicCache

        longest = max(lengths)
        batch = DynamicCache()
        for index in range(len(caches[0].layers)):
            keys = [cache.layers[index].keys for cache in caches]
            values = [cache.layers[index].values for cache in caches]
            batch.update(torch.cat([_left_pad(k, longest) for k in keys]),
                         torch.cat([_left_pad(v, longest) for v in values]), index)
        mask = torch.ones(len(caches), longest + 1, dtype=torch.long, device=self.device)
        for row, length in enumerate(lengths):
            mask[row, :longest - length] = 0
        output = self.model(input_ids=torch.tensor(tokens, device=self.device)[:, None], attention_mask=mask,
                            position_ids=torch.tensor(lengths, device=self.device)[:, None], past_key_values=batch,
                            cache_position=torch.tensor([longest], device=self.device), use_cache=True,
                            logits_to_keep=1)
        for index, layer in enumerate(output.past_key_values.layers):
            for row, cache in enumerate(caches):
                cache.update(layer.keys[row:row + 1, :, -1:], layer.values[row:row + 1, :, -1:], index)
        return output.logits[:, -1]

    @torch.inference_mode()
    def _probe_sharing(self) -> bool:
        """Whether decode rows may share a forward here: every cache layer a plain full-attention one (sliding
        windows, linear attention and other states step one sequence at a time), and two sequences of different
        lengths decoded together get the logits each gets alone, within float rounding (checked at load, so a model
        that reads padding or positions its own way is never batched wrongly)."""
        from transformers.cache_utils import DynamicLayer

        cache = self._new_cache()
        if cache is None or any(type(layer) is not DynamicLayer for layer in cache.layers):
            return False
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
        try:
            alone, caches = [], []
            for prompt in prompts:
                cache = self._new_cache()
                positions = torch.arange(len(prompt), device=self.device)
                self.model(input_ids=torch.tensor([prompt], device=self.device), past_key_values=cache,
                           cache_position=positions, position_ids=positions[None], use_cache=True)
                caches.append(copy.deepcopy(cache))
                position = torch.tensor([len(prompt)], device=self.device)
                alone.append(self.model(input_ids=torch.tensor([[11]], device=self.device), past_key_values=cache,
                                        cache_position=position, position_ids=position[None], use_cache=True,
                                        logits_to_keep=1).logits[0, -1])
            together = self._decode_together(caches, [len(p) for p in prompts], [11, 11])
        except Exception as error:  # noqa: BLE001 (any failure means: do not share)
            log.info("transformers path: decode steps not shared (%s: %s)", type(error).__name__, error)
            return False
        tolerance = 1e-4 if self.model.dtype == torch.float32 else 3e-2
        error = max(float((a.float() - b.float()).abs().max()) for a, b in zip(alone, together, strict=True))
        shares = error <= tolerance * max(1.0, float(torch.stack(alone).abs().max()))
        log.info("transformers path: decode steps %s (batched vs alone: max |logit diff| %.2g)",
                 "shared" if shares else "not shared", error)
        return shares

    def _forward(self, sequence: Sequence, token_ids: list[int], start: int, keep: int = 1) -> torch.Tensor:
        """The last ``keep`` positions' logits (0: every position's), ``[rows, vocab]``, after feeding ``token_ids``
        at positions ``start..`` into the slot's cache."""
        logits, self._caches[sequence] = self.forward_cached(self._caches[sequence], token_ids, start, keep)
        return logits

    def forward_cached(self, cache, token_ids: list[int], start: int, keep: int = 1) -> tuple[torch.Tensor, object]:
        """``_forward`` on a given cache: the logits rows and the cache the model hands back."""
        positions = torch.arange(start, start + len(token_ids), device=self.device)
        output = self.model(input_ids=torch.tensor([token_ids], device=self.device), **{self._cache_arg: cache},
                            cache_position=positions, position_ids=positions[None], use_cache=True, logits_to_keep=keep)
        return output.logits[0], getattr(output, self._cache_arg)

    def forward_whole(self, token_ids: list[int], keep: int = 1) -> torch.Tensor:
        """The last ``keep`` positions' logits of ``token_ids`` from position 0, computed without a cache (position
        ids from 0 where the model takes them, as ``generate`` passes them: roberta's own would start elsewhere)."""
        ids = torch.tensor([token_ids], device=self.device)
        positions = {"position_ids": torch.arange(len(token_ids), device=self.device)[None]} if self._takes_positions \
            else {}
        output = self.model(input_ids=ids, use_cache=False, logits_to_keep=keep, **positions)
        return output.logits[0]

    # --- text models whose prefill cannot be chunked, or whose cache this path cannot drive (``Stepping``) ---

    def _run_whole(self, plan: StepPlan) -> StepOutput:
        """Each prompt computed whole on its first planned chunk (the plan's later chunks hand on its rows), and
        each decode row from the sequence's cache, or (``stepping.cached`` false) a forward over all its tokens."""
        rows, sequences, scored = [], [], []
        for sequence in plan.decode:
            if not sequence.is_prefilling:
                rows.append(self._decode_one(sequence))
                sequences.append(sequence)
        for sequence, start, length in plan.prefill:
            if start == 0:
                keep = 0 if sequence.wants_prompt_logprobs else 1
                self._prompt_logits[sequence] = self._prefill_whole(sequence, keep)
            logits = self._prompt_logits[sequence]
            if sequence.wants_prompt_logprobs:
                wanted = len(prompt_logprobs.scored_rows(sequence, start, length, 0))
                if wanted:
                    scored.append((sequence, start, logits[start:start + wanted].float()))
            if start + length == sequence.prefill_target:
                rows.append(self._prompt_logits.pop(sequence)[-1])
                sequences.append(sequence)
        return self._output(plan, sequences, rows, scored)

    def _prefill_whole(self, sequence: Sequence, keep: int) -> torch.Tensor:
        tokens = sequence.tokens(0, sequence.prefill_target)
        if not self.stepping.cached:
            self._caches[sequence] = None
            return self.forward_whole(tokens, keep)
        logits, self._caches[sequence] = self.forward_cached(self._new_cache(), tokens, 0, keep)
        return logits

    def _decode_one(self, sequence: Sequence) -> torch.Tensor:
        if self.stepping.cached:
            return self._forward(sequence, [sequence.next_token], sequence.num_cached)[-1]
        return self.forward_whole(sequence.tokens(0, sequence.num_cached + 1))[-1]


def _size_class(length: int) -> int:
    """0 up to 256 positions, then one more each doubling (the lean KV space's size classes)."""
    return max(0, (length - 1).bit_length() - 8)


def _left_pad(states: torch.Tensor, length: int) -> torch.Tensor:
    """``[1, heads, n, dim]`` -> ``[1, heads, length, dim]``, zeros before (masked out)."""
    return torch.nn.functional.pad(states, (0, 0, length - states.shape[-2], 0))
