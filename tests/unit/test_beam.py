"""``core.beam.BeamSearch`` against transformers' own beam search, on a tiny random Llama: the same hypotheses
(tokens, order, scores) for each length penalty and early-stopping mode. The model is run whole for each beam at
each step (no cache), so only the search rule is compared."""

from __future__ import annotations

import pytest
import torch

from handler.engine.core.beam import BeamSearch
from handler.engine.types import BeamParams

VOCAB, EOS, PROMPT = 24, 3, [5, 9, 14, 2]


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=EOS, pad_token_id=EOS, bos_token_id=1)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # peaked distributions, and an EOS close to a frequent token: beams part, some end early
        model.lm_head.weight.mul_(12.0)
        model.lm_head.weight[EOS] = model.lm_head.weight[19] + 0.3 * torch.randn(
            32, generator=torch.Generator().manual_seed(1))
    return model


def ours(model, params: BeamParams, n: int, max_new_tokens: int) -> list[tuple[list[int], float]]:
    search = BeamSearch(params, max_new_tokens, frozenset({EOS}))
    while True:
        with torch.no_grad():
            rows = [model(torch.tensor([PROMPT + search.tokens_of(slot)])).logits[0, -1]
                    for slot in range(params.width)]
        step = search.step(torch.log_softmax(torch.stack(rows).float(), dim=-1))
        if step.done:
            return [(list(h.token_ids), h.score) for h in search.best(n)]


def theirs(model, params: BeamParams, n: int, max_new_tokens: int) -> list[tuple[list[int], float]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), num_beams=params.width, num_return_sequences=n,
                             max_new_tokens=max_new_tokens, length_penalty=params.length_penalty,
                             early_stopping=params.early_stopping, do_sample=False, return_dict_in_generate=True,
                             output_scores=True)
    found = []
    for row, score in zip(out.sequences[:, len(PROMPT):].tolist(), out.sequences_scores.tolist(), strict=True):
        end = row.index(EOS) + 1 if EOS in row else len(row)
        found.append((row[:end], score))
    return found


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0, -1.0])
@pytest.mark.parametrize(("width", "n"), [(2, 1), (4, 3)])
def test_same_hypotheses_as_transformers(model, width: int, n: int, length_penalty: float,
                                         early_stopping: bool | str) -> None:
    params = BeamParams(width, length_penalty, early_stopping)
    expected = theirs(model, params, n, 12)
    got = ours(model, params, n, 12)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert [score for _, score in got] == pytest.approx([score for _, score in expected], rel=1e-5)


def test_the_search_finds_endings_and_lengths(model) -> None:
    """Not a vacuous comparison: among the cases above some hypotheses end with EOS before the limit and the
    beams part (the best beam is not the greedy answer everywhere)."""
    found = ours(model, BeamParams(4), 3, 12)
    assert any(tokens[-1] == EOS and len(tokens) < 12 for tokens, _ in found)
    assert len({tuple(tokens) for tokens, _ in found}) == 3


def test_a_pruned_beam_slot_takes_a_copy_of_its_new_parent() -> None:
    """Two continuations of slot 0 win: the second moves into slot 1 (pruned) as a copy of slot 0's cache."""
    search = BeamSearch(BeamParams(2), 10, frozenset({EOS}))
    first = torch.full((2, VOCAB), -10.0)
    first[:, 7], first[:, 8] = -0.1, -0.2
    assert search.step(first).copies == ((0, 1),)  # the start: every beam comes from slot 0
    second = torch.full((2, VOCAB), -10.0)
    second[0, 11], second[0, 12] = -0.1, -0.3      # slot 0 ("7") continues twice; slot 1 ("8") only badly
    step = search.step(second)
    assert step.copies == ((0, 1),) and search.tokens_of(0) == [7, 11] and search.tokens_of(1) == [7, 12]


def run(model, search, width: int, n: int) -> list[list[int]]:
    while True:
        with torch.no_grad():
            rows = [model(torch.tensor([PROMPT + search.tokens_of(slot)])).logits[0, -1] for slot in range(width)]
        if search.step(torch.log_softmax(torch.stack(rows).float(), dim=-1)).done:
            return [list(h.token_ids) for h in search.best(n)]


def test_diverse_groups_take_different_first_tokens(model) -> None:
    """Hamming diversity, a group a beam (no ending token, so every answer runs to the limit): with a penalty that
    outweighs any logprob gap, each group's first token is one no earlier group took, so the four answers start
    with the model's four most likely first tokens; without it every group follows the same greedy path."""
    from handler.engine.core.beam import GroupBeamSearch

    with torch.no_grad():
        first = torch.topk(model(torch.tensor([PROMPT])).logits[0, -1], k=4).indices.tolist()
    diverse = run(model, GroupBeamSearch(BeamParams(4, groups=4, diversity_penalty=100.0), 8, frozenset()), 4, 4)
    assert sorted(tokens[0] for tokens in diverse) == sorted(first)
    same = run(model, GroupBeamSearch(BeamParams(4, groups=4, diversity_penalty=0.0), 8, frozenset()), 4, 4)
    assert len({tuple(tokens) for tokens in same}) == 1


def test_groups_of_two_beams_search_within_the_group(model) -> None:
    """Two groups of two: each group's best pair is a beam search of width 2 among the tokens the other group
    left (so the groups' answers differ), and 4 hypotheses come back ranked."""
    from handler.engine.core.beam import GroupBeamSearch

    found = run(model, GroupBeamSearch(BeamParams(4, groups=2, diversity_penalty=5.0), 10, frozenset()), 4, 4)
    assert len(found) == 4 and len({tuple(tokens) for tokens in found}) == 4
