"""The prompt-logprob math (``engine/core/prompt_logprobs.py``): which prefill rows score the prompt, the scores
themselves against a hand computation, and how a request collects them across chunks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from handler.engine.core import prompt_logprobs
from handler.engine.core.request import RequestState
from handler.engine.types import GenerationRequest, PromptLogprob, TopLogprob


def log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    total = math.log(sum(math.exp(x - top) for x in row)) + top
    return [x - total for x in row]


@pytest.mark.parametrize(
    ("num_prompt", "start", "length", "first_row", "rows"),
    [
        (5, 0, 5, 3, [3, 4, 5, 6]),      # one chunk: every position but the last scores the next token
        (5, 0, 2, 0, [0, 1]),            # first chunk of two
        (5, 2, 3, 10, [10, 11]),         # the last chunk: its last row samples instead
        (5, 4, 1, 7, []),                # a last chunk of one token scores nothing
        (1, 0, 1, 0, []),                # a one-token prompt has nothing to score
    ],
)
def test_scored_rows(num_prompt: int, start: int, length: int, first_row: int, rows: list[int]) -> None:
    sequence = SimpleNamespace(num_prompt_tokens=num_prompt)
    assert prompt_logprobs.scored_rows(sequence, start, length, first_row) == rows


def test_score_matches_a_hand_computed_log_softmax() -> None:
    rows = [[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 3.0, 1.0]]
    scored = prompt_logprobs.score(torch.tensor(rows), [2, 1], num_top=2, special_ids=frozenset({1}))
    first, second = log_softmax(rows[0]), log_softmax(rows[1])
    assert [s.token_id for s in scored] == [2, 1]
    assert scored[0].logprob == pytest.approx(first[2], abs=1e-6)
    assert scored[1].logprob == pytest.approx(second[1], abs=1e-6)
    assert [s.rank for s in scored] == [3, 2]  # the tie with token 2 counts against token 1 (vLLM's count)
    assert [t.token_id for t in scored[0].top_logprobs] == [0, 1]
    assert scored[0].top_logprobs[0].logprob == pytest.approx(first[0], abs=1e-6)
    assert [s.is_special for s in scored] == [False, True]


def test_a_most_likely_target_has_exactly_the_top_logprob() -> None:
    """lm-evaluation-harness's is_greedy compares the token's logprob with the top one by equality."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    targets = logits.argmax(dim=-1).tolist()
    for entry in prompt_logprobs.score(logits, targets, num_top=1):
        assert entry.rank == 1 and entry.top_logprobs[0] == TopLogprob(entry.token_id, entry.logprob)


def test_no_alternatives_and_no_infinity() -> None:
    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    [entry] = prompt_logprobs.score(logits, [1], num_top=0)
    assert entry.top_logprobs == () and entry.logprob == prompt_logprobs.FLOOR and entry.rank == 3


def test_more_alternatives_than_the_vocabulary() -> None:
    [entry] = prompt_logprobs.score(torch.tensor([[0.0, 1.0]]), [0], num_top=5)
    assert [t.token_id for t in entry.top_logprobs] == [1, 0]


def test_a_request_collects_chunks_by_position_and_its_first_token_has_none() -> None:
    request = GenerationRequest("r", prompt_ids=(7, 1, 2, 3), prompt_logprobs=1)
    state = RequestState(request, make_sequence=lambda state, index: None)
    sequence = SimpleNamespace(request=state)
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    prompt_logprobs.record([(sequence, 0, logits[:2])], frozenset())   # positions 0, 1 score tokens 1, 2
    prompt_logprobs.record([(sequence, 2, logits[2:])], frozenset())   # position 2 scores token 3
    whole = state.prompt_logprob_entries()
    assert whole[0] == PromptLogprob(7, None)
    assert [e.token_id for e in whole] == [7, 1, 2, 3]
    assert whole[1:] == tuple(prompt_logprobs.score(logits, [1, 2, 3], 1))
    prompt_logprobs.record([(sequence, 0, logits[:2])], frozenset())   # a chunk computed again changes nothing
    assert state.prompt_logprob_entries() == whole


def test_a_request_that_did_not_ask_gets_none() -> None:
    state = RequestState(GenerationRequest("r", prompt_ids=(1, 2)), make_sequence=lambda state, index: None)
    assert state.prompt_logprob_entries() == ()
