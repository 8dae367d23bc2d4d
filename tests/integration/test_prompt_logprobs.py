"""Prompt logprobs through the engine equal transformers' on the same tokens: the embedded model on the lean path
(fp32, the prompt prefilled in several chunks, run alongside another request), and a tiny checkpoint on the
transformers path. Every choice's first event carries them; sampling is not disturbed by the extra rows."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from handler.config import DEFAULT_MODEL_DIR
from handler.engine.types import GenerationRequest, StopConditions
from tests.integration.conftest import engine_on_path, make_engine
from tests.integration.test_engine_small import collect
from tests.support.tiny_checkpoints import build_tiny

TEXT = ("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. The capital of France is Paris, "
        "and the capital of Italy is Rome. Water boils at one hundred degrees Celsius at sea level.")
TOL = 2e-3  # our fp32 model against transformers' fp32 (different kernels and summation orders)


@functools.lru_cache(maxsize=1)
def _transformers_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def reference_logprobs(folder: Path, prompt_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the prompt: row ``p`` scores token ``p + 1``. ``[len - 1, vocab]``."""
    model = _transformers_model(folder)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches(prompt_logprobs: tuple, prompt_ids: list[int], expected: torch.Tensor, num_top: int) -> None:
    assert [e.token_id for e in prompt_logprobs] == prompt_ids
    first, *rest = prompt_logprobs
    assert (first.logprob, first.rank, first.top_logprobs) == (None, None, ())
    for position, entry in enumerate(rest):
        row = expected[position]
        assert entry.logprob == pytest.approx(row[prompt_ids[position + 1]].item(), abs=TOL), position
        values, ids = row.topk(num_top)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=TOL), position
        if values[0] - values[1] > TOL:  # a clear favourite: the same token
            assert entry.top_logprobs[0].token_id == ids[0].item(), position
        target = row[prompt_ids[position + 1]]  # rank: how many tokens are at least as likely, itself included
        assert int((row >= target + TOL).sum()) + 1 <= entry.rank <= int((row >= target - TOL).sum()), position


@pytest.fixture(scope="module")
def chunked_engine(loaded):
    engine = make_engine(loaded, max_step_tokens=16)  # a prompt of ~45 tokens takes several prefill chunks
    yield engine
    engine.stop()


def test_lean_prompt_logprobs_equal_transformers(chunked_engine, renderer) -> None:
    prompt_ids = renderer.encode(TEXT, add_special_tokens=True)
    assert len(prompt_ids) > 40
    stop = StopConditions(max_new_tokens=3, ignore_eos=True)
    scored = chunked_engine.submit(GenerationRequest("scored", tuple(prompt_ids), stop=stop, n=2, prompt_logprobs=3))
    other = chunked_engine.submit(GenerationRequest("other", tuple(prompt_ids[:20]), stop=stop))  # shares steps
    choices, others = collect(scored), collect(other)
    expected = reference_logprobs(DEFAULT_MODEL_DIR, prompt_ids)
    for choice in choices.values():  # the fork carries them too, the same
        assert_matches(choice.events[0].prompt_logprobs, prompt_ids, expected, 3)
        assert all(event.prompt_logprobs == () for event in choice.events[1:])
    assert choices[0].events[0].prompt_logprobs == choices[1].events[0].prompt_logprobs
    assert all(event.prompt_logprobs == () for event in others[0].events)
    plain = collect(chunked_engine.submit(GenerationRequest("plain", tuple(prompt_ids), stop=stop)))
    assert choices[0].token_ids == choices[1].token_ids == plain[0].token_ids  # greedy, undisturbed


def test_only_the_tokens_logprob_when_no_alternatives(chunked_engine, renderer) -> None:
    prompt_ids = renderer.encode("One, two, three, four", add_special_tokens=True)
    stop = StopConditions(max_new_tokens=1, ignore_eos=True)
    [choice] = collect(chunked_engine.submit(GenerationRequest("r", tuple(prompt_ids), stop=stop,
                                                                prompt_logprobs=0))).values()
    entries = choice.events[0].prompt_logprobs
    assert len(entries) == len(prompt_ids) and all(e.top_logprobs == () for e in entries)
    assert choice.finish is choice.events[0]  # one token: its only event is also the last, and carries them


def test_a_token_id_outside_the_vocabulary_is_a_400(chunked_engine) -> None:
    from handler.errors import BadRequest

    with pytest.raises(BadRequest) as info:
        chunked_engine.submit(GenerationRequest("r", (1, 10**7), prompt_param="prompt[1]"))
    assert info.value.param == "prompt[1]"


def test_transformers_path_prompt_logprobs_equal_transformers(tmp_path: Path) -> None:
    folder = build_tiny(tmp_path / "llama", "llama")
    engine = engine_on_path(folder, "transformers", "transformers")
    try:
        prompt_ids = list(range(100, 140))  # the engine's step budget (16) chunks it
        stop = StopConditions(max_new_tokens=2, ignore_eos=True)
        choices = collect(engine.submit(GenerationRequest("r", tuple(prompt_ids), stop=stop, n=2, prompt_logprobs=2)))
    finally:
        engine.stop()
    expected = reference_logprobs(folder, prompt_ids)
    for choice in choices.values():
        assert_matches(choice.events[0].prompt_logprobs, prompt_ids, expected, 2)
