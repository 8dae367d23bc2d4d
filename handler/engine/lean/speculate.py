"""Speculative decoding in the step loop: drafts proposed before a step, verified after it.

Before a step, each decoding sequence that speculates gets up to ``k`` drafted tokens (``option.speculative_length``,
or the request's ``num_assistant_tokens``), from prompt lookup (``NgramDrafter``: the tokens that followed the
latest earlier occurrence of the context's last n-gram) or a draft model (``draft.DraftModel``). Its slot grows to
hold them, and the runner computes its next token and the drafts as decode rows at consecutive positions of its
slot (``StepPlan.verify``): each row exactly as that position's lone decode row would be computed.

After the step, ``verify`` walks each sequence's rows in order: row ``i``'s logits are sampled with the sequence's
own sampler (penalties, grammar, seed, as if no draft existed), the token is accepted like any other, and the walk
goes on while it equals draft ``i``. The drafts are deterministic (a lookup, or the draft model's most likely
token), so accepting a draft exactly when the target's own sample equals it is rejection sampling with a one-point
proposal: every token has the target's distribution, and each emitted token consumed one draw of the sequence's
generator, as without drafts. Greedy and seeded answers are the same tokens with and without speculation; a step
emits one to ``k + 1`` tokens. The cache keeps the positions the accepted tokens filled; the rest are overwritten
later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from handler.engine.core.request import Sequence
from handler.engine.runners.base import StepPlan


class Drafter(Protocol):
    def propose(self, sequences: list[tuple[Sequence, int]]) -> list[tuple[int, ...]]:
        """Up to ``k`` drafted tokens for each ``(sequence, k)`` (empty: none this step)."""
        ...

    def verified(self, sequence: Sequence) -> None:
        """The sequence's drafts were verified (its tokens and cached count are up to date)."""
        ...

    def forget(self, sequence: Sequence) -> None:
        """The sequence ended or gave its slot back."""
        ...


class NgramDrafter:
    """Prompt lookup (vLLM's ``ngram`` method): the context's last ``n`` tokens, for ``n`` from ``max_n`` down to
    ``min_n``, are looked for earlier in the context (prompt and output); the tokens after the latest match are the
    draft. Costs no model: on a summary or an edit, whose answer copies its prompt, most drafts are right."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, sequences: list[tuple[Sequence, int]]) -> list[tuple[int, ...]]:
        return [self.lookup(sequence.prompt_ids + sequence.output_ids, k) for sequence, k in sequences]

    def lookup(self, tokens: list[int], k: int) -> tuple[int, ...]:
        context = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            suffix = context[-n:]
            # windows of n tokens that end before the last token: the suffix's own place is not a match
            windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if len(matches):
                start = matches[-1] + n
                return tuple(context[start:start + k].tolist())
        return ()

    def verified(self, sequence: Sequence) -> None:
        return None

    def forget(self, sequence: Sequence) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Speculation:
    """The server's speculative decoding: the drafter and how many tokens a step drafts by default."""

    drafter: Drafter
    length: int
    kind: str                      # "ngram" or "draft model"


class Speculator:
    """Moves the plan's speculating sequences to ``plan.verify`` with their drafts (on the engine thread)."""

    def __init__(self, speculation: Speculation, space, max_step_tokens: int,
                 sort_key: Callable[[Sequence], object]) -> None:
        self.speculation, self.space, self.sort_key = speculation, space, sort_key
        self.max_step_tokens = max_step_tokens
        self.num_drafted = 0     # drafted tokens since the last report, and how many were accepted
        self.num_accepted = 0

    def draft(self, plan: StepPlan) -> None:
        """Drafts for the decoding sequences that speculate, within what is left of the step's token budget."""
        budget = self.max_step_tokens - len(plan.decode) - sum(length for _s, _start, length in plan.prefill)
        wanted = []
        for sequence in plan.decode:
            k = min(self._length(sequence), budget)
            if k > 0 and not sequence.is_prefilling and not sequence.is_beam:
                wanted.append((sequence, k))
                budget -= k
        if not wanted:
            return
        for (sequence, _k), drafts in zip(wanted, self.speculation.drafter.propose(wanted), strict=True):
            if drafts and self.space.grow(sequence, sequence.num_cached + 1 + len(drafts)):
                plan.verify[sequence] = drafts
        if plan.verify:
            # growing moves slots (a sequence up a size class, another into the slot it left): keep the order
            plan.decode[:] = sorted((s for s in plan.decode if s not in plan.verify), key=self.sort_key)

    def _length(self, sequence: Sequence) -> int:
        """Tokens to draft for this sequence: the request's or the server's, never past its token limit."""
        asked = sequence.request.request.speculation
        length = asked.num_tokens if asked is not None and asked.num_tokens is not None else self.speculation.length
        return min(length, sequence.max_new_tokens - len(sequence.output_ids) - 1)
