"""The sampler: per-row parameters over one batch of logits."""

from __future__ import annotations

import math

import pytest
import torch

from handler.engine.core.request import make_generator
from handler.engine.core.sampler import RowState, sample
from handler.engine.types import SamplingParams

VOCAB = 16


def row(params: SamplingParams | None = None, *, prompt: list[int] | None = None, output: list[int] | None = None,
        seed: int | None = None, top: int = 0) -> RowState:
    params = params or SamplingParams()
    generator = make_generator(seed if seed is not None else params.seed, 0)
    return RowState(params, list(prompt or []), list(output or []), generator, top)


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def random_logits(num_rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = random_logits(5)
    result = sample(logits.clone(), [row() for _ in range(5)])
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.bad_rows == []


def test_chosen_logprob_is_log_softmax_value() -> None:
    logits = random_logits(3, seed=1)
    result = sample(logits.clone(), [row() for _ in range(3)])
    expected = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(result.token_ids):
        assert result.logprobs[i] == pytest.approx(expected[i, token].item(), abs=1e-5)


def test_sampled_logprob_comes_from_the_tempered_distribution() -> None:
    logits = random_logits(1, seed=2)
    result = sample(logits.clone(), [row(SamplingParams(temperature=0.5), seed=3)])
    expected = torch.log_softmax(logits / 0.5, dim=-1)[0, result.token_ids[0]].item()
    assert result.logprobs[0] == pytest.approx(expected, abs=1e-5)


def test_top_logprobs_sorted_and_of_asked_count() -> None:
    logits = random_logits(3, seed=4)
    result = sample(logits.clone(), [row(top=3), row(top=0), row(top=5)])
    assert [len(t) for t in result.top_logprobs] == [3, 0, 5]
    expected = torch.log_softmax(logits, dim=-1)
    for i, top in ((0, result.top_logprobs[0]), (2, result.top_logprobs[2])):
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        ids = [t for t, _ in top]
        assert ids == expected[i].topk(len(top)).indices.tolist()
        assert ids[0] == result.token_ids[i]
        for token_id, lp in top:
            assert lp == pytest.approx(expected[i, token_id].item(), abs=1e-5)


def test_no_top_logprobs_when_none_asked() -> None:
    result = sample(random_logits(2), [row(), row()])
    assert result.top_logprobs == [[], []]


def _draws(seed: int, neighbours: int, steps: int = 20) -> list[int]:
    params = SamplingParams(temperature=1.0, seed=seed)
    target = row(params)
    others = [row(SamplingParams(temperature=1.3)) for _ in range(neighbours // 2)]
    others += [row(SamplingParams(temperature=0.9, seed=seed + 100 + i, top_k=4)) for i in range(neighbours // 2)]
    tokens = []
    for step in range(steps):
        target_logits = random_logits(1, seed=1000 + step, vocab=VOCAB)[0] / 3  # flat enough to vary
        batch = [random_logits(1, seed=step + 7 * k, vocab=VOCAB)[0] for k in range(len(others))]
        rows = others[: len(others) // 2] + [target] + others[len(others) // 2:]
        stacked = torch.stack(batch[: len(others) // 2] + [target_logits] + batch[len(others) // 2:])
        result = sample(stacked, rows)
        tokens.append(result.token_ids[len(others) // 2])
    return tokens


def test_seeded_sampling_is_reproducible_and_independent_of_neighbours() -> None:
    alone = _draws(seed=42, neighbours=0)
    assert alone == _draws(seed=42, neighbours=0)
    assert alone == _draws(seed=42, neighbours=4)
    assert alone == _draws(seed=42, neighbours=6)
    assert len(set(alone)) > 3                 # it really sampled
    assert alone != _draws(seed=43, neighbours=0)


def test_seeded_choices_of_one_request_differ() -> None:
    logits = torch.zeros(2, VOCAB)
    params = SamplingParams(temperature=1.0, seed=7)
    rows = [RowState(params, [], [], make_generator(7, i), 0) for i in range(2)]
    draws = [sample(logits.clone(), rows).token_ids for _ in range(20)]
    assert [a for a, _ in draws] != [b for _, b in draws]


def test_top_k_1_equals_greedy_at_high_temperature() -> None:
    logits = random_logits(4, seed=5)
    rows = [row(SamplingParams(temperature=2.0, top_k=1), seed=i) for i in range(4)]
    for _ in range(10):
        assert sample(logits.clone(), rows).token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy() -> None:
    logits = random_logits(4, seed=6)
    rows = [row(SamplingParams(temperature=1.5, top_p=1e-6), seed=i) for i in range(4)]
    for _ in range(10):
        assert sample(logits.clone(), rows).token_ids == logits.argmax(dim=-1).tolist()


def test_top_p_keeps_the_nucleus() -> None:
    # probabilities 0.5, 0.3, 0.2 (and ~0 elsewhere): top_p=0.7 keeps the first two
    logits = torch.full((1, VOCAB), -1e4)
    logits[0, :3] = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    rows = [row(SamplingParams(temperature=1.0, top_p=0.7), seed=0)]
    seen = {sample(logits.clone(), rows).token_ids[0] for _ in range(200)}
    assert seen == {0, 1}


def test_top_k_keeps_k_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 9], logits[0, 2] = 3.0, 2.9, 2.8
    rows = [row(SamplingParams(temperature=5.0, top_k=2), seed=0)]
    seen = {sample(logits.clone(), rows).token_ids[0] for _ in range(200)}
    assert seen == {5, 9}


def test_min_p_filters_unlikely_tokens() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    logits = torch.full((1, VOCAB), -1e4)
    logits[0, :5] = torch.log(probs)
    rows = [row(SamplingParams(temperature=1.0, min_p=0.4), seed=0)]  # keep p >= 0.16
    seen = {sample(logits.clone(), rows).token_ids[0] for _ in range(300)}
    assert seen == {0, 1, 2}
    result = sample(logits.clone(), rows)
    renormalised = math.log(probs[result.token_ids[0]].item() / 0.9)
    assert result.logprobs[0] == pytest.approx(renormalised, abs=1e-4)


def test_logit_bias_minus_100_on_argmax_changes_choice() -> None:
    logits = logits_of([0.0, 5.0, 4.0] + [0.0] * (VOCAB - 3))
    result = sample(logits.clone(), [row(SamplingParams(logit_bias=((1, -100.0),)))])
    assert result.token_ids == [2]


def test_logit_bias_plus_100_forces_a_token() -> None:
    logits = random_logits(2, seed=8)
    least = logits[0].argmin().item()
    rows = [row(SamplingParams(logit_bias=((least, 100.0),))), row()]
    result = sample(logits.clone(), rows)
    assert result.token_ids == [least, logits[1].argmax().item()]


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    # token 0 (seen) leads 2.0 vs 1.5; divided by 2 it drops to 1.0 and token 1 wins
    logits = logits_of([2.0, 1.5] + [-5.0] * (VOCAB - 2))
    assert sample(logits.clone(), [row()]).token_ids == [0]
    assert sample(logits.clone(), [row(SamplingParams(repetition_penalty=2.0), prompt=[0])]).token_ids == [1]
    # negative logits of seen tokens are pushed further down: -1.0 * 3 = -3.0 loses to unseen -2.0
    logits = logits_of([-1.0, -2.0] + [-5.0] * (VOCAB - 2))
    assert sample(logits.clone(), [row(SamplingParams(repetition_penalty=3.0), output=[0])]).token_ids == [1]
    # unseen tokens are untouched, and a penalty below 1 rewards seen tokens
    logits = logits_of([1.0, 1.5] + [-5.0] * (VOCAB - 2))
    assert sample(logits.clone(), [row(SamplingParams(repetition_penalty=0.5), prompt=[0])]).token_ids == [0]


def test_repetition_penalty_logprob_reflects_penalised_logits() -> None:
    logits = logits_of([2.0, 1.5] + [-5.0] * (VOCAB - 2))
    result = sample(logits.clone(), [row(SamplingParams(repetition_penalty=2.0), prompt=[0])])
    penalised = logits.clone()
    penalised[0, 0] = 1.0
    assert result.logprobs[0] == pytest.approx(torch.log_softmax(penalised, -1)[0, 1].item(), abs=1e-5)


def test_frequency_penalty_scales_with_count() -> None:
    logits = logits_of([3.0, 2.0] + [-5.0] * (VOCAB - 2))
    # 0.4 * 2 occurrences = 0.8: 3.0 -> 2.2, still ahead; 0.6 * 2 = 1.2: 3.0 -> 1.8, behind
    assert sample(logits.clone(), [row(SamplingParams(frequency_penalty=0.4), output=[0, 0])]).token_ids == [0]
    assert sample(logits.clone(), [row(SamplingParams(frequency_penalty=0.6), output=[0, 0])]).token_ids == [1]
    # the prompt does not count for OpenAI-style penalties
    assert sample(logits.clone(), [row(SamplingParams(frequency_penalty=2.0), prompt=[0, 0])]).token_ids == [0]


def test_presence_penalty_is_once_per_token() -> None:
    logits = logits_of([3.0, 2.0] + [-5.0] * (VOCAB - 2))
    # presence 0.9 once: 2.1 > 2.0 regardless of count
    assert sample(logits.clone(), [row(SamplingParams(presence_penalty=0.9), output=[0] * 5)]).token_ids == [0]
    assert sample(logits.clone(), [row(SamplingParams(presence_penalty=1.1), output=[0])]).token_ids == [1]
    # a negative penalty encourages repetition
    logits = logits_of([2.0, 3.0] + [-5.0] * (VOCAB - 2))
    assert sample(logits.clone(), [row(SamplingParams(presence_penalty=-1.5), output=[0])]).token_ids == [0]


def test_non_finite_row_is_reported_and_others_still_sampled() -> None:
    logits = random_logits(4, seed=9)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    rows = [row(), row(), row(), row(SamplingParams(temperature=1.0), seed=1)]
    result = sample(logits.clone(), rows)
    assert result.bad_rows == [1, 2]
    assert len(result.token_ids) == 4
    assert result.token_ids[0] == logits[0].argmax().item()
    assert 0 <= result.token_ids[3] < VOCAB
    assert math.isfinite(result.logprobs[0]) and math.isfinite(result.logprobs[3])


def test_all_rows_non_finite() -> None:
    logits = torch.full((2, VOCAB), float("nan"))
    result = sample(logits, [row(), row(SamplingParams(temperature=1.0), seed=0)])
    assert result.bad_rows == [0, 1]
    assert len(result.token_ids) == 2


def test_mixed_batch_each_row_follows_its_own_params() -> None:
    logits = random_logits(3, seed=10)
    least = logits[2].argmin().item()
    rows = [row(), row(SamplingParams(temperature=3.0, top_k=1), seed=0),
            row(SamplingParams(logit_bias=((least, 100.0),)))]
    result = sample(logits.clone(), rows)
    assert result.token_ids == [logits[0].argmax().item(), logits[1].argmax().item(), least]


def test_min_tokens_holds_the_ending_ids_back_until_the_output_is_long_enough() -> None:
    logits = logits_of([0.0, 5.0, 4.0, 1.0] + [0.0] * (VOCAB - 4))  # 1 (say EOS) first, then 2 (a stop token)
    short = RowState(SamplingParams(), [], [7], None, 0, min_new_tokens=2, ending_ids=(1, 2))
    grown = RowState(SamplingParams(), [], [7, 8], None, 0, min_new_tokens=2, ending_ids=(1, 2))
    result = sample(logits.repeat(2, 1), [short, grown])
    assert result.token_ids == [3, 1]
    assert result.bad_rows == [] and math.isfinite(result.logprobs[0])


def test_greedy_choice_and_the_finiteness_check_are_torchs_own() -> None:
    """``_greedy`` (numpy's argmax) and ``_non_finite_rows`` (a row sum first) answer as ``argmax`` and
    ``isfinite`` do: ties go to the first index, a NaN counts as largest, strided rows, and a row whose finite values
    overflow its sum is not called non-finite."""
    from handler.engine.core.sampler import _greedy, _non_finite_rows

    x = random_logits(6, seed=3, vocab=4096)
    x[0, 10] = x[0, 900] = x[0].max() + 1          # a tie: the first
    x[1, 77] = float("nan")
    x[2, 5] = float("inf")
    x[3, 9] = float("-inf")
    x[4, 1] = x[4, 2] = 3e38                        # finite, but the sum overflows
    x[5, 3], x[5, 4] = float("inf"), float("-inf")  # the sum is NaN
    with torch.inference_mode():
        assert torch.equal(_greedy(x), x.argmax(dim=-1))
        assert torch.equal(_greedy(x[:, ::3]), x[:, ::3].argmax(dim=-1))
        assert _non_finite_rows(x) == torch.nonzero(~torch.isfinite(x).all(dim=-1)).flatten().tolist() == [1, 2, 3, 5]
        assert _non_finite_rows(random_logits(3, seed=4, vocab=4096)) == []
