"""The prompt's own logprobs, computed in the same batched prefill as the prompt's KV (only the extra logits cost).

A prefill chunk of a sequence that wants them (``Sequence.wants_prompt_logprobs``) asks the model for the logits of
every row whose next token is also a prompt token: the row at position ``p`` scores the prompt token at ``p + 1``.
The engine turns those rows into ``PromptLogprob``s (``score``) and keeps them on the request (``record``), so each
choice's first event can carry the whole prompt's (``RequestState.prompt_logprob_entries``). The first prompt token
has no context and no logprob.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from handler.engine.types import PromptLogprob, TopLogprob

if TYPE_CHECKING:
    from handler.engine.core.request import Sequence

# What a logprob of -inf (a token the model rules out) is reported as: JSON has no infinity (vLLM's value too)
FLOOR = -9999.0


def scored_rows(sequence: Sequence, start: int, length: int, first_row: int) -> list[int]:
    """The flat-batch rows of the prefill chunk ``[start, start + length)`` (at ``first_row``) whose logits score a
    prompt token: every position but the prompt's last, whose logits choose the first generated token instead."""
    end = min(start + length, sequence.num_prompt_tokens - 1)
    return list(range(first_row, first_row + max(end - start, 0)))


def split(scored: list[tuple[Sequence, int, list[int]]],
          logits: torch.Tensor) -> list[tuple[Sequence, int, torch.Tensor]]:
    """``(sequence, start, rows)`` per chunk -> ``(sequence, start, its logits)``, from the step's prompt-scoring
    logits (``[sum of rows, vocab]``, in the chunks' order)."""
    found, first = [], 0
    for sequence, start, rows in scored:
        if rows:
            found.append((sequence, start, logits[first:first + len(rows)]))
            first += len(rows)
    return found


@torch.inference_mode()
def score(logits: torch.Tensor, target_ids: list[int], num_top: int,
          special_ids: frozenset[int] = frozenset()) -> list[PromptLogprob]:
    """logits: ``[len(target_ids), vocab]``; row ``i`` is the model's guess at ``target_ids[i]``. Log-softmax in
    fp32; the target's logprob and rank, and the ``num_top`` most likely tokens, all read from the same values (so
    a target that is the most likely has exactly the top logprob)."""
    if not target_ids:
        return []
    log_probs = torch.log_softmax(logits.float(), dim=-1).nan_to_num_(nan=FLOOR, neginf=FLOOR)  # [rows, vocab]
    targets = torch.tensor(target_ids, dtype=torch.long, device=log_probs.device)[:, None]  # [rows, 1]
    chosen = log_probs.gather(1, targets)                                                   # [rows, 1]
    ranks = (log_probs >= chosen).sum(dim=-1).tolist()      # ties count against the target, as vLLM counts them
    tops: list[tuple[TopLogprob, ...]] = [()] * len(target_ids)
    if num_top:
        values, ids = log_probs.topk(min(num_top, log_probs.shape[-1]), dim=-1)
        tops = [tuple(TopLogprob(t, v) for t, v in zip(row_ids, row_values, strict=True))
                for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)]
    return [PromptLogprob(token_id, logprob, rank, top, token_id in special_ids)
            for token_id, logprob, rank, top in zip(target_ids, chosen.squeeze(1).tolist(), ranks, tops, strict=True)]


def record(scored: Iterable[tuple[Sequence, int, torch.Tensor]], special_ids: frozenset[int]) -> None:
    """Score a step's prompt rows and keep them on their requests, by position (a chunk computed again after a
    preemption writes the same values again): ``(sequence, start, logits)`` holds the logits of the chunk's
    positions ``start, start + 1, ...``, which score the prompt tokens one further on."""
    for sequence, start, logits in scored:
        state = sequence.request
        targets = list(state.request.prompt_ids[start + 1:start + 1 + logits.shape[0]])
        entries = score(logits, targets, state.request.prompt_logprobs or 0, special_ids)
        state.prompt_logprobs.update(zip(range(start + 1, start + 1 + len(entries)), entries, strict=True))
