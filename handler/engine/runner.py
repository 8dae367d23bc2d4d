"""Turns a ``StepPlan`` into tensors, runs the model once, and hands back the logits rows that need sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from handler.engine.model import DecoderModel, build_layout
from handler.engine.scheduler import SlotMove, StepPlan
from handler.engine.sequence import Sequence


@dataclass(slots=True)
class StepOutput:
    """``logits[i]`` belongs to ``sequences[i]``: decoding sequences, then sequences whose prompt just completed."""

    sequences: list[Sequence]
    logits: torch.Tensor  # [len(sequences), vocab] fp32


class ModelRunner:
    def __init__(self, model: DecoderModel, max_slots: int, max_len: int) -> None:
        self.model = model
        self.cache = model.new_cache(max_slots, max_len)
        self.groups = model.shape.num_heads // model.shape.num_kv_heads
        self.prefix_ids: tuple[int, ...] = ()
        self.prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_shared_prefix(self, prefix_ids: list[int]) -> None:
        """Compute once the KV of a prefix most prompts share (the chat template's opening and default system
        prompt); prompts that start with it copy it into their slot instead of prefilling it."""
        if len(prefix_ids) < 2:
            return
        scratch = self.model.new_cache(1, len(prefix_ids))
        scratch.ensure(1, len(prefix_ids))
        layout = build_layout([], [(0, 0, len(prefix_ids))], self.groups, self.model.device)
        device = self.model.device
        self.model.forward(torch.tensor(prefix_ids, device=device), torch.arange(len(prefix_ids), device=device),
                           layout, scratch, torch.tensor([len(prefix_ids) - 1], device=device))
        self.prefix_ids = tuple(prefix_ids)
        self.prefix_kv = (scratch.keys[:, 0].clone(), scratch.values[:, 0].clone())

    def cached_prefix_length(self, prompt_ids: list[int]) -> int:
        """How many leading tokens of a prompt the shared prefix covers (always leaving one to compute)."""
        n = len(self.prefix_ids)
        if n and len(prompt_ids) > n and tuple(prompt_ids[:n]) == self.prefix_ids:
            return n
        return 0

    def run(self, plan: StepPlan) -> StepOutput:
        tokens = [s.next_token for s in plan.decode]
        positions = [s.num_cached for s in plan.decode]
        chunks, logit_rows, sequences = [], [], []
        for row, sequence in enumerate(plan.decode):
            if not sequence.is_prefilling:
                logit_rows.append(row)
                sequences.append(sequence)
        row = len(tokens)
        embeds = []
        for sequence, start, length in plan.prefill:
            embeds += _chunk_embeds(sequence, start, length, row)
            tokens.extend(sequence.prompt_ids[start:start + length])
            positions.extend(range(start, start + length))
            chunks.append((sequence.slot, start, length))
            row += length
            if start + length == sequence.num_prompt_tokens:
                logit_rows.append(row - 1)
                sequences.append(sequence)
        # attention reads whole key blocks (the cache rounds up to them): a row's result then does not depend on
        # how long its neighbours are, and shapes repeat (on CUDA each new key length cost ~80 ms the first time)
        self.cache.ensure(len(plan.decode), max(p + 1 for p in positions))
        for sequence, start, _length in plan.prefill:
            if start and start == sequence.num_cached_prefix:  # first chunk after the shared prefix
                self.cache.load(sequence.slot, *self.prefix_kv)
        device = self.model.device
        layout = build_layout(positions[: len(plan.decode)], chunks, self.groups, device)
        logits = self.model.forward(torch.tensor(tokens, device=device), torch.tensor(positions, device=device),
                                    layout, self.cache, torch.tensor(logit_rows, dtype=torch.long, device=device),
                                    _join_embeds(embeds, device))
        advance(plan)
        return StepOutput(sequences, logits.cpu())

    def move(self, move: SlotMove) -> None:
        self.cache.move(move.src, move.dst, move.length)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Give a forked choice its own copy of the prompt's cache."""
        self.cache.ensure(dst + 1, length)
        self.cache.move(src, dst, length)

    def release(self) -> None:
        self.cache.release()


def advance(plan: StepPlan) -> None:
    """After a step: every decoded sequence holds one more cached position, every prefill chunk its length."""
    for sequence in plan.decode:
        if not sequence.is_prefilling:
            sequence.num_cached += 1
    for sequence, _start, length in plan.prefill:
        sequence.num_cached += length


def _chunk_embeds(sequence: Sequence, start: int, length: int, first_row: int) -> list[tuple[list[int], torch.Tensor]]:
    """The flat-batch rows and values of a prompt's input embeddings that fall in this prefill chunk."""
    embeds = sequence.request.request.prompt_embeds
    if embeds is None:
        return []
    offsets, values = embeds.in_chunk(start, length)
    return [([first_row + offset for offset in offsets], values)] if offsets else []


def _join_embeds(embeds: list[tuple[list[int], torch.Tensor]], device: torch.device) -> tuple | None:
    if not embeds:
        return None
    rows = [r for chunk_rows, _values in embeds for r in chunk_rows]
    values = torch.cat([values for _rows, values in embeds]).to(device)
    return torch.tensor(rows, dtype=torch.long, device=device), values
