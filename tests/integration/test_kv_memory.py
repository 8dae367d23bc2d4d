"""The engine's KV memory with the embedded model (fp32): the budget holds whatever the mix of lengths,
preempted sequences resume to the same greedy text, and a prefix-cache hit gives the logits of a miss."""

from __future__ import annotations

import pytest

from handler.engine.backend import EngineStats
from handler.engine.types import GenerationRequest, StopConditions
from tests.integration.conftest import make_engine
from tests.integration.test_engine_small import assert_same_or_near_tie, chat_ids, collect

PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32

STORY = ("Once upon a time in a small village by the sea there lived an old fisherman who knew every rock and "
         "current of the bay. ")


def request(name: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> GenerationRequest:
    return GenerationRequest(name, prompt_ids, stop=StopConditions(max_new_tokens=max_new_tokens, ignore_eos=True),
                             num_top_logprobs=3)


def run_all(engine, requests: list[GenerationRequest]) -> list:
    handles = [engine.submit(r) for r in requests]
    return [collect(h)[0] for h in handles]


@pytest.fixture(scope="module")
def mixed(renderer) -> list[GenerationRequest]:
    """One long prompt (~370 tokens) among seven short chats."""
    long = request("long", chat_ids(renderer, "Summarise: " + STORY * 13), 40)
    assert 300 < len(long.prompt_ids) < 460
    shorts = [request(f"s{i}", chat_ids(renderer, f"Count to {i + 3}."), 30) for i in range(7)]
    return [long, *shorts]


@pytest.fixture(scope="module")
def undisturbed(loaded, mixed) -> list:
    engine = make_engine(loaded, max_step_tokens=512)
    try:
        return run_all(engine, mixed)
    finally:
        engine.stop()


def test_the_budget_holds_under_one_long_and_many_short_sequences(loaded, mixed, undisturbed) -> None:
    stats: list[EngineStats] = []
    budget = 3000 * PER_TOKEN   # the old dense cache took 8 slots x 512 positions = 4096 tokens here
    engine = make_engine(loaded, max_step_tokens=512, budget=budget, on_stats=stats.append)
    try:
        results = run_all(engine, mixed)
    finally:
        engine.stop()
    assert max(s.kv_cache_allocated_bytes for s in stats) <= budget
    assert max(s.kv_cache_allocated_bytes for s in stats) > 0
    assert all(s.kv_cache_budget_bytes == budget for s in stats)
    for got, want in zip(results, undisturbed, strict=True):
        assert len(got.token_ids) == len(want.token_ids)
        assert_same_or_near_tie(got, want)


def test_preempted_sequences_resume_to_the_same_greedy_text(loaded, renderer) -> None:
    prompts = [chat_ids(renderer, f"Tell a long story about a {animal}.") for animal in ("cat", "dog", "fox", "owl")]
    requests = [request(f"r{i}", ids, 240) for i, ids in enumerate(prompts)]  # each outgrows a 256-position slot
    engine = make_engine(loaded, max_step_tokens=512)
    try:
        alone = run_all(engine, requests)
    finally:
        engine.stop()
    stats: list[EngineStats] = []
    # room for two slots of 512 positions: four sequences growing past 256 must take turns
    engine = make_engine(loaded, max_step_tokens=512, budget=1100 * PER_TOKEN, on_stats=stats.append)
    try:
        squeezed = run_all(engine, requests)
    finally:
        engine.stop()
    assert sum(s.num_preemptions for s in stats) > 0
    assert max(s.kv_cache_allocated_bytes for s in stats) <= 1100 * PER_TOKEN
    for got, want in zip(squeezed, alone, strict=True):
        assert got.finish is not None and len(got.token_ids) == 240
        assert_same_or_near_tie(got, want)


def test_a_prefix_cache_hit_gives_the_logits_of_a_miss(loaded, renderer) -> None:
    system = "You are a careful assistant. " + STORY * 8
    first = request("first", chat_ids_with_system(renderer, system, "Who lived by the sea?"), 12)
    second = request("second", chat_ids_with_system(renderer, system, "What did he know?"), 12)
    stats: list[EngineStats] = []
    engine = make_engine(loaded, max_step_tokens=512, on_stats=stats.append)
    cold = make_engine(loaded, max_step_tokens=512, prefix_caching=False)
    try:
        run_all(engine, [first])
        hits_before = sum(s.prefix_cache_hits for s in stats)
        warm = run_all(engine, [second])[0]
        hits = sum(s.prefix_cache_hits for s in stats) - hits_before
        miss = run_all(cold, [second])[0]
    finally:
        engine.stop()
        cold.stop()
    assert hits >= 128  # the system prompt's whole blocks came from the cache
    assert warm.token_ids == miss.token_ids
    for a, b in zip(warm.events, miss.events, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]
        assert [t.logprob for t in a.top_logprobs] == pytest.approx([t.logprob for t in b.top_logprobs], abs=1e-5)


def chat_ids_with_system(renderer, system: str, user: str) -> tuple[int, ...]:
    return tuple(renderer.render_chat([{"role": "system", "content": system}, {"role": "user", "content": user}]))


def test_beams_keep_their_slots_while_growing_sequences_take_turns(loaded, renderer) -> None:
    """Beam requests beside sequences that outgrow memory: the beams (placed whole, never preempted) give the
    answers they give alone, the greedy sequences are preempted and resume to their own, and the budget holds."""
    from handler.engine.types import BeamParams

    beams = [GenerationRequest(f"b{i}", chat_ids(renderer, question), stop=StopConditions(max_new_tokens=24), n=2,
                               beam=BeamParams(3)) for i, question in enumerate(("Name a fruit.", "Name a river."))]
    growing = [request(f"r{i}", chat_ids(renderer, f"Tell a long story about a {animal}."), 240)
               for i, animal in enumerate(("cat", "dog", "fox"))]
    engine = make_engine(loaded, max_step_tokens=512)
    try:
        alone = [collect(engine.submit(r)) for r in beams]
    finally:
        engine.stop()
    stats: list[EngineStats] = []
    engine = make_engine(loaded, max_step_tokens=512, budget=1100 * PER_TOKEN, on_stats=stats.append)
    try:
        handles = [engine.submit(r) for r in growing[:2]] + [engine.submit(r) for r in beams] + [
            engine.submit(growing[2])]
        results = [collect(h) for h in handles]
    finally:
        engine.stop()
    assert sum(s.num_preemptions for s in stats) > 0
    assert max(s.kv_cache_allocated_bytes for s in stats) <= 1100 * PER_TOKEN
    for got, want in zip(results[2:4], alone, strict=True):
        assert [got[i].token_ids for i in range(2)] == [want[i].token_ids for i in range(2)]
    assert all(len(r[0].token_ids) == 240 for r in results[:2] + results[4:])
