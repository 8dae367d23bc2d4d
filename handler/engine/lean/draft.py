"""A draft model for speculative decoding (``option.speculative_draft_model``: a folder with the target's tokenizer).

The draft is a lean ``DecoderModel`` (int8 on CPU as the target is), with a KV space of its own under a budget in
proportion to the target's. It keeps, for each speculating sequence, a slot holding the sequence's tokens as far
as it has computed them (``num_cached``). Each step it catches every drafting sequence up to its current tokens in
one forward (prefill chunks), then proposes one token per forward, all sequences together, until each has its
``k`` tokens, or (``assistant_confidence_threshold``) its most likely token is less likely than the request's
threshold. Its proposals are its most likely tokens, so the target's verification keeps the target's own
distribution (``speculate``). After verification its cache is cut back to what the target accepted. A sequence
the draft has no room for drafts nothing that step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from handler.engine.core.request import Sequence
from handler.engine.model.decoder import DecoderModel
from handler.engine.model.layout import build_layout
from handler.engine.runners.kv_space import KVSpace, SlotRef

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class _DraftSlot:
    """A sequence's place in the draft's KV space (``kv_space.Occupant``)."""

    kv_slot: SlotRef | None = None
    num_cached: int = 0


@dataclass(slots=True)
class _Drafting:
    sequence: Sequence
    slot: _DraftSlot
    k: int
    confidence: float | None
    drafts: list[int] = field(default_factory=list)
    done: bool = False


class DraftModel:
    """``speculate.Drafter`` from a smaller model with the same vocabulary."""

    def __init__(self, model: DecoderModel, vocab_size: int, budget: int, max_slots: int, max_len: int) -> None:
        self.model, self.vocab_size = model, vocab_size  # the target's: the draft's padding rows are never proposed
        shape = model.shape
        self.space = KVSpace(shape.num_layers, shape.num_kv_heads, shape.head_dim, model.dtype, model.device,
                             budget=budget, max_len=max_len, max_slots=max_slots, prefix_caching=False)
        self.groups = shape.num_heads // shape.num_kv_heads
        self.slots: dict[Sequence, _DraftSlot] = {}

    def propose(self, sequences: list[tuple[Sequence, int]]) -> list[tuple[int, ...]]:
        drafting = [d for d in (self._start(sequence, k) for sequence, k in sequences) if d is not None]
        if drafting:
            self._catch_up(drafting)
            while not all(d.done for d in drafting):
                self._next([d for d in drafting if not d.done])
        found = {id(d.sequence): tuple(d.drafts) for d in drafting}
        return [found.get(id(sequence), ()) for sequence, _k in sequences]

    def verified(self, sequence: Sequence) -> None:
        """The target kept ``sequence.num_cached`` positions: the draft keeps no more than those."""
        slot = self.slots.get(sequence)
        if slot is not None:
            slot.num_cached = min(slot.num_cached, sequence.num_cached)

    def forget(self, sequence: Sequence) -> None:
        slot = self.slots.pop(sequence, None)
        if slot is not None:
            self.space.free(slot)

    # ---- inside --------------------------------------------------------------------------------------------
    def _start(self, sequence: Sequence, k: int) -> _Drafting | None:
        """The sequence's slot, grown for its tokens and ``k`` more; None when the draft has no room."""
        length = len(sequence.prompt_ids) + len(sequence.output_ids) + k
        if length > min(self.space.max_len, self.model.shape.max_position_embeddings):
            return None  # past the draft's own context
        slot = self.slots.get(sequence)
        if slot is None:
            slot = _DraftSlot()
            if not self.space.place(slot, length):
                return None
            self.slots[sequence] = slot
        elif not self.space.grow(slot, length):
            return None
        asked = sequence.request.request.speculation
        return _Drafting(sequence, slot, k, asked.confidence if asked is not None else None)

    def _catch_up(self, drafting: list[_Drafting]) -> None:
        """One forward of every sequence's tokens the draft has not computed; each proposes its first token."""
        chunks = []
        for d in drafting:
            tokens = d.sequence.prompt_ids + d.sequence.output_ids
            chunks.append((d, d.slot.num_cached, tokens[d.slot.num_cached:]))
        self._forward(chunks)

    def _next(self, drafting: list[_Drafting]) -> None:
        """One forward of every sequence's latest draft: the next proposal each."""
        self._forward([(d, d.slot.num_cached, [d.drafts[-1]]) for d in drafting])

    def _forward(self, chunks: list[tuple[_Drafting, int, list[int]]]) -> None:
        tokens, positions, layout_chunks, last_rows = [], [], [], []
        for d, start, ids in chunks:
            tokens += ids
            positions += range(start, start + len(ids))
            layout_chunks.append((d.slot.kv_slot, start, len(ids)))
            last_rows.append(len(tokens) - 1)
        device = self.model.device
        layout = build_layout([], layout_chunks, self.groups, device)
        logits = self.model.forward(torch.tensor(tokens, device=device), torch.tensor(positions, device=device),
                                    layout, self.space, torch.tensor(last_rows, device=device))
        probabilities, proposals = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        for (d, start, ids), token, probability in zip(chunks, proposals.tolist(), probabilities.tolist(),
                                                       strict=True):
            d.slot.num_cached = start + len(ids)
            if (d.confidence is not None and probability < d.confidence) or token >= self.vocab_size:
                d.done = True  # below the request's threshold (or a padding row): the target verifies the rest
                continue
            d.drafts.append(token)
            d.done = len(d.drafts) >= d.k
