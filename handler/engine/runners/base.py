"""The interface between the step loop and a runner: the loop's scheduler plans a step (``StepPlan``), a runner
runs its forward and hands back the logits rows to sample (``StepOutput``), and ``advance`` moves every planned
sequence's cached count on. A runner (``Runner``) also owns the KV space the scheduler places sequences in: a
budgeted one (``kv_space.KVSpace``) or ``Unbounded`` for a runner that keeps each sequence's cache itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from handler.engine.core.request import Sequence


@dataclass(slots=True)
class StepPlan:
    """One step: a decode row for every running sequence (in the KV space's order; a sequence still prefilling
    holds its row's place), then prefill chunks ``(sequence, start, length)``."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int, int]]
    # speculative decoding: decoding sequences (not in ``decode``) whose next token and drafted tokens after it are
    # computed as decode rows at consecutive positions of their slot, each row's logits returned
    verify: dict[Sequence, tuple[int, ...]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill and not self.verify


class Unbounded:
    """The KV space of a runner that keeps each sequence's cache itself: every sequence fits."""

    def fits(self, length: int, count: int = 1) -> bool:
        return True

    def place(self, owner: Sequence, length: int) -> bool:
        return True

    def grow(self, owner: Sequence, length: int) -> bool:
        return True

    def free(self, owner: Sequence) -> None:
        return None

    def copy(self, src: Sequence, dst: Sequence, length: int) -> None:
        return None

    def release(self) -> None:
        return None

    def sort_key(self, owner: Sequence) -> tuple[int, int]:
        return owner.order


@dataclass(slots=True)
class StepOutput:
    """``logits[i]`` belongs to ``sequences[i]``: decoding sequences, then sequences whose prompt just completed."""

    sequences: list[Sequence]
    logits: torch.Tensor  # [len(sequences), vocab] fp32
    # prefill chunks that score their prompt: (sequence, chunk start, logits [rows, vocab] of positions start, ...)
    prompt_logits: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)
    # the plan's verify rows: (sequence, its drafts, logits [1 + len(drafts), vocab] of its next token and drafts)
    verified: list[tuple[Sequence, tuple[int, ...], torch.Tensor]] = field(default_factory=list)


class Runner(Protocol):
    """What the step loop drives: ``ModelRunner`` (our model) and ``TransformersRunner`` (the checkpoint's own)."""

    space: object                      # the KV space the scheduler places sequences in (``fits``, ``place``, ...)
    prefix_ids: tuple[int, ...]        # a prefix most prompts share, computed once (empty: none)
    device: torch.device               # where the model runs

    def run(self, plan: StepPlan) -> StepOutput: ...

    def match_prefix(self, sequence: Sequence) -> None:
        """At admission: how much of the sequence's prompt a cached prefix covers (sets ``num_cached``)."""
        ...

    def clear_prefix_cache(self) -> None: ...


def advance(plan: StepPlan) -> None:
    """After a step: every decoded sequence holds one more cached position (a verified one its next token and drafts),
    every prefill chunk its length."""
    for sequence in plan.decode:
        if not sequence.is_prefilling:
            sequence.num_cached += 1
    for sequence, drafts in plan.verify.items():
        # every computed position counts until the drafts are verified (a slot moved meanwhile keeps them all)
        sequence.num_cached += 1 + len(drafts)
    for sequence, _start, length in plan.prefill:
        sequence.num_cached += length
        if sequence.resuming and sequence.num_cached == sequence.prefill_target:
            sequence.resuming = False  # caught up: it decodes from here
