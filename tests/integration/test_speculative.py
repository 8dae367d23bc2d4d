"""Speculative decoding on the lean engine (issue #27), with the embedded model int8 as served: prompt lookup,
the embedded model drafting for itself (every greedy draft right) and a tiny random draft of the same vocabulary
(almost every draft wrong). Whatever the drafts, greedy and seeded answers are the same tokens with the same
logprobs as without speculation, and sampled tokens have the target's distribution (a chi-square test of two
independent samples); drafts that are right are accepted, several tokens a step."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from handler.config import DEFAULT_MODEL_DIR
from handler.engine.backend import EngineLimits
from handler.engine.core.tokenizer import load_tokenizer
from handler.engine.lean.engine import Engine, wait_until_ready
from handler.engine.lean.load import load
from handler.engine.lean.options import LoadOptions, SpeculationOptions
from handler.engine.types import GenerationRequest, SamplingParams, SpeculationParams, StopConditions
from handler.errors import BadRequest

SOURCE = ("The container serves a language model on SageMaker. It speaks the OpenAI chat-completions schema and the "
          "classic inputs and parameters schema. Its own engine batches requests continuously on the CPU, in int8.")


@pytest.fixture(scope="module")
def tokenizer():
    if not (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("the embedded model is not assembled (make model)")
    return load_tokenizer(DEFAULT_MODEL_DIR)


def chat(tokenizer, text: str) -> tuple[int, ...]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tuple(tokenizer.encode(rendered, add_special_tokens=False))


def engine(tokenizer, speculation: SpeculationOptions | None) -> Engine:
    options = LoadOptions(DEFAULT_MODEL_DIR, "float32", True, "cpu", max_running=8, max_model_len=512,
                          speculation=speculation)
    loaded = load(options, lambda: tokenizer)[0]
    built = Engine(lambda: loaded, EngineLimits(max_running=8, max_model_len=512, max_step_tokens=256))
    built.start()
    wait_until_ready(built, timeout=300)
    return built


@dataclasses.dataclass
class Answer:
    tokens: list[int]
    logprobs: list[float]
    finish: object


def answers(target: Engine, requests: list[GenerationRequest], together: bool = True) -> list[Answer]:
    """Run the requests together (or one after another); each choice's tokens, logprobs and finish reason."""
    handles = [target.submit(request) for request in requests] if together else requests
    found = []
    for handle in handles:
        events = list(handle if together else target.submit(handle))
        by_choice: dict[int, Answer] = {}
        for event in events:
            answer = by_choice.setdefault(event.index, Answer([], [], None))
            if event.token_id is not None:
                answer.tokens.append(event.token_id)
                answer.logprobs.append(event.logprob)
            answer.finish = event.finish_reason or answer.finish
        found += [by_choice[index] for index in sorted(by_choice)]
    return found


def workload(tokenizer, drafting: bool = True) -> list[GenerationRequest]:
    """Greedy and seeded requests together: a copy of the prompt (prompt lookup's case), a chat answer, a sampled
    answer, a request with its own draft length (where the server drafts) and one with a stop token id (the drafts
    run into it)."""
    copy = chat(tokenizer, f"Repeat this text word for word:\n\n{SOURCE}")
    question = chat(tokenizer, "What is the capital of France? Answer in one sentence.")
    stop = StopConditions(max_new_tokens=40)
    return [
        GenerationRequest("copy", copy, stop=stop, num_top_logprobs=2),
        GenerationRequest("question", question, stop=stop),
        GenerationRequest("sampled", question, sampling=SamplingParams(temperature=0.9, seed=11), stop=stop, n=2),
        GenerationRequest("own", copy, stop=stop, speculation=SpeculationParams(num_tokens=2) if drafting else None),
        GenerationRequest("stop-id", copy, stop=StopConditions(max_new_tokens=40, stop_token_ids=(13,))),
    ]


@pytest.fixture(scope="module")
def plain(tokenizer) -> Iterator[tuple[list[Answer], list[Answer]]]:
    """The workload without drafts: run together, and one request at a time."""
    target = engine(tokenizer, None)
    try:
        yield (answers(target, workload(tokenizer, drafting=False)),
               answers(target, workload(tokenizer, drafting=False), together=False))
    finally:
        target.stop()


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_checkpoints import build_tiny

    return build_tiny(tmp_path_factory.mktemp("draft") / "tiny-llama", "llama")


@pytest.mark.parametrize("draft", ["ngram", "self", "tiny"])
def test_answers_are_the_tokens_and_logprobs_of_decoding_without_drafts(tokenizer, plain, tiny_draft,
                                                                         draft: str) -> None:
    folder = {"ngram": "ngram", "self": str(DEFAULT_MODEL_DIR), "tiny": str(tiny_draft)}[draft]
    target = engine(tokenizer, SpeculationOptions(folder, length=4))
    try:
        together = answers(target, workload(tokenizer))
        alone = answers(target, workload(tokenizer), together=False)
        speculator = target._loop.speculator
        num_drafted, num_accepted = speculator.num_drafted, speculator.num_accepted
    finally:
        target.stop()
    plain_together, plain_alone = plain
    # run together, the prompts' prefill may be batched otherwise (the steps differ), which moves logprobs by
    # ~1e-4 with or without drafts; one at a time, every number is the same
    assert [a.tokens for a in together] == [a.tokens for a in plain_together]
    assert [a.finish for a in together] == [a.finish for a in plain_together]
    assert [a.tokens for a in alone] == [a.tokens for a in plain_alone]
    assert [a.logprobs for a in alone] == [a.logprobs for a in plain_alone]  # bit for bit
    assert [a.finish for a in alone] == [a.finish for a in plain_alone]
    assert num_drafted > 0
    if draft == "tiny":
        assert num_accepted < num_drafted / 4  # a random draft is rarely right, and nothing changes
    else:
        assert num_accepted > num_drafted / 3  # right drafts are taken: several tokens a step


def chi_square_same_distribution(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's chi-square statistic of homogeneity for two samples (categories under 5 expected pooled), and its
    degrees of freedom."""
    total_a, total_b = sum(a.values()), sum(b.values())
    categories, rare = [], (0, 0)
    for key in set(a) | set(b):
        if (a[key] + b[key]) * min(total_a, total_b) / (total_a + total_b) < 5:
            rare = (rare[0] + a[key], rare[1] + b[key])
        else:
            categories.append((a[key], b[key]))
    if sum(rare):
        categories.append(rare)
    statistic = 0.0
    for count_a, count_b in categories:
        pooled = (count_a + count_b) / (total_a + total_b)
        for count, total in ((count_a, total_a), (count_b, total_b)):
            expected = pooled * total
            statistic += (count - expected) ** 2 / expected
    return statistic, len(categories) - 1


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile for ``dof`` degrees of freedom at the normal quantile ``z`` (3.09: p = 0.001),
    by Wilson and Hilferty's approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_sampled_tokens_have_the_targets_distribution(tokenizer) -> None:
    """Different seeds on each side (independent samples): the second and third tokens of 256 sampled answers
    with the draft's proposals verified, against 256 without drafts."""
    prompt = chat(tokenizer, "Name a colour.")
    stop = StopConditions(max_new_tokens=3, ignore_eos=True)

    def sample(speculation: SpeculationOptions | None, first_seed: int) -> list[tuple[int, ...]]:
        target = engine(tokenizer, speculation)
        try:
            requests = [GenerationRequest(f"s{seed}", prompt, sampling=SamplingParams(temperature=1.0, seed=seed),
                                          stop=stop, n=8) for seed in range(first_seed, first_seed + 256, 8)]
            found = answers(target, requests)
            accepted = target._loop.speculator.num_accepted if speculation else None
        finally:
            target.stop()
        assert accepted is None or accepted > 0
        return [tuple(a.tokens) for a in found]

    drafted = sample(SpeculationOptions(str(DEFAULT_MODEL_DIR), length=2), 0)
    plain = sample(None, 100_000)
    for position in (1, 2):
        statistic, dof = chi_square_same_distribution(Counter(t[position] for t in drafted),
                                                      Counter(t[position] for t in plain))
        assert dof >= 1 and statistic < chi_square_critical(dof), (position, statistic, dof)


def test_a_requests_own_drafting_needs_the_servers(tokenizer) -> None:
    target = engine(tokenizer, None)
    try:
        with pytest.raises(BadRequest, match="drafts no tokens") as info:
            target.submit(GenerationRequest("r", (1, 2, 3), speculation=SpeculationParams(num_tokens=2)))
        assert info.value.param == "num_assistant_tokens"
    finally:
        target.stop()
    target = engine(tokenizer, SpeculationOptions("ngram"))
    try:
        with pytest.raises(BadRequest, match="needs a draft model") as info:
            target.submit(GenerationRequest("r", (1, 2, 3), speculation=SpeculationParams(
                confidence=0.5, param="assistant_confidence_threshold")))
        assert info.value.param == "assistant_confidence_threshold"
    finally:
        target.stop()
