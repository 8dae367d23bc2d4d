"""LoRA adapters on the lean engine against PEFT's own forward: two adapters and the base model in one batch give
PEFT's greedy tokens (fp32, so the comparison can be exact: int8 rounds the base model's activations, which PEFT
does not), KV computed under one adapter is never reused by another, int8 keeps each row independent of its
neighbours, and the store's limits (rank, LRU eviction, pins, unknown names) hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from handler.engine.backend import EngineLimits
from handler.engine.lean.engine import Engine, wait_until_ready
from handler.engine.types import GenerationRequest, StopConditions
from handler.errors import BadRequest, Conflict, NotFound
from tests.support.tiny_adapters import build_adapter, peft_greedy
from tests.support.tiny_checkpoints import build_tiny

NUM_TOKENS = 8
# prompts over two prefix-cache blocks (16 tokens each), so cached prefixes are in play
PROMPTS = {"a1": list(range(300, 340)), "a2": list(range(500, 537)), None: list(range(700, 735))}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny(root / "base", "llama")
    return {"base": base,
            "a1": build_adapter(base, root / "a1", ["q_proj", "v_proj"], rank=4, alpha=8, seed=1),
            "a2": build_adapter(base, root / "a2", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"], rank=8, alpha=16, seed=2),
            "a3": build_adapter(base, root / "a3", ["o_proj", "down_proj"], rank=2, alpha=2, seed=3, use_rslora=True),
            "big": build_adapter(base, root / "big", ["q_proj"], rank=32, alpha=32, seed=4)}


@pytest.fixture(scope="module")
def reference(folders) -> dict:
    return peft_greedy(folders["base"], {"a1": folders["a1"], "a2": folders["a2"]}, PROMPTS, NUM_TOKENS)


def lora_engine(folder: Path, quantize: bool, max_loras: int = 2) -> Engine:
    from handler.engine.core.tokenizer import load_tokenizer
    from handler.engine.lean.load import load
    from handler.engine.lean.options import LoadOptions, LoraOptions

    options = LoadOptions(folder, "float32", quantize, "cpu", max_running=8, max_model_len=256,
                          lora=LoraOptions(max_loras, 16))
    loaded = load(options, lambda: load_tokenizer(folder))[0]
    engine = Engine(lambda: loaded, EngineLimits(max_running=8, max_model_len=256, max_step_tokens=64))
    engine.start()
    wait_until_ready(engine, timeout=120)
    return engine


def request(name: str, adapter: str | None, prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(name, tuple(prompt), stop=StopConditions(max_new_tokens=NUM_TOKENS, ignore_eos=True),
                             num_top_logprobs=1, adapter=adapter)


def tokens_and_logprobs(handle) -> tuple[list[int], list[float]]:
    events = [e for e in handle if e.token_id is not None]
    return [e.token_id for e in events], [e.logprob for e in events]


@pytest.fixture(scope="module")
def fp32(folders):
    engine = lora_engine(folders["base"], quantize=False)
    engine.adapters.register("a1", str(folders["a1"]))
    engine.adapters.register("a2", str(folders["a2"]))
    yield engine
    engine.stop()


def test_two_adapters_and_the_base_in_one_batch_match_peft(fp32, reference) -> None:
    handles = {adapter: fp32.submit(request(f"r-{adapter}", adapter, prompt)) for adapter, prompt in PROMPTS.items()}
    for adapter, handle in handles.items():
        tokens, logprobs = tokens_and_logprobs(handle)
        want_tokens, want_first = reference[adapter]
        assert tokens == want_tokens, adapter
        assert logprobs[0] == pytest.approx(float(want_first[tokens[0]]), abs=1e-4), adapter
    assert len({tuple(reference[a][0]) for a in PROMPTS}) == 3  # each adapter changes the answer


def test_kv_cached_under_one_adapter_is_not_reused_by_another(fp32, reference) -> None:
    """The same prompt, first under the base model and a2 (their blocks enter the prefix cache), then under a1:
    a1's answer is still PEFT's, so it computed its own KV."""
    prompt = PROMPTS["a1"]
    for adapter in (None, "a2", None):
        tokens_and_logprobs(fp32.submit(request(f"warm-{adapter}", adapter, prompt)))
    assert tokens_and_logprobs(fp32.submit(request("cold-a1", "a1", prompt)))[0] == reference["a1"][0]
    # and a1's own blocks are reused by a1: the same answer again
    assert tokens_and_logprobs(fp32.submit(request("warm-a1", "a1", prompt)))[0] == reference["a1"][0]


def test_unknown_adapter_is_404_naming_it(fp32) -> None:
    with pytest.raises(NotFound, match="nope"):
        fp32.submit(request("x", "nope", PROMPTS[None]))


def test_rank_over_the_limit_and_a_taken_name_are_refused(fp32, folders) -> None:
    with pytest.raises(BadRequest, match="max_lora_rank"):
        fp32.adapters.register("big", str(folders["big"]))
    with pytest.raises(Conflict, match="a1"):
        fp32.adapters.register("a1", str(folders["a1"]))
    with pytest.raises(BadRequest, match="no such folder"):
        fp32.adapters.register("gone", str(folders["base"] / "missing"))


def test_least_recently_used_unpinned_adapter_is_evicted(folders) -> None:
    engine = lora_engine(folders["base"], quantize=False, max_loras=2)
    try:
        store = engine.adapters
        store.register("a1", str(folders["a1"]), pin=True)
        store.register("a2", str(folders["a2"]))
        store.register("a3", str(folders["a3"]))  # a2 goes: a1 is pinned
        loaded = {info.name: info.loaded for info in store.list()}
        assert loaded == {"a1": True, "a2": False, "a3": True}
        assert ("evicted", "a2") in store.drain_events()
        tokens_and_logprobs(engine.submit(request("back", "a2", PROMPTS["a2"])))  # a2 reloads, a3 goes
        assert {info.name: info.loaded for info in store.list()} == {"a1": True, "a2": True, "a3": False}
        store.unregister("a3")
        assert [info.name for info in store.list()] == ["a1", "a2"]
        with pytest.raises(NotFound, match="a3"):
            store.unregister("a3")
    finally:
        engine.stop()


def test_int8_rows_do_not_depend_on_their_neighbours(folders) -> None:
    """int8 base weights with fp32 adapter deltas: each request's tokens and logprobs alone are bit for bit those it
    gets beside requests under other adapters and the base model."""
    engine = lora_engine(folders["base"], quantize=True)
    try:
        engine.adapters.register("a1", str(folders["a1"]))
        engine.adapters.register("a2", str(folders["a2"]))
        alone = {a: tokens_and_logprobs(engine.submit(request(f"alone-{a}", a, p))) for a, p in PROMPTS.items()}
        handles = {a: engine.submit(request(f"mixed-{a}", a, p)) for a, p in PROMPTS.items()}
        mixed = {a: tokens_and_logprobs(h) for a, h in handles.items()}
        assert mixed == alone
        assert len({tuple(alone[a][0]) for a in PROMPTS}) == 3
    finally:
        engine.stop()


def test_int8_adapters_follow_the_smoothing_folded_into_the_base(folders, reference) -> None:
    """int8 smooths each Linear's input (and divides v and up) inside the weights; an adapter that did not follow
    would be off by those factors, far more than int8's own rounding."""
    engine = lora_engine(folders["base"], quantize=True)
    try:
        engine.adapters.register("a2", str(folders["a2"]))
        events = [e for e in engine.submit(request("int8-a2", "a2", PROMPTS["a2"])) if e.token_id is not None]
        first = events[0]
        assert first.token_id == reference["a2"][0][0]
        assert first.logprob == pytest.approx(float(reference["a2"][1][first.token_id]), abs=0.05)
    finally:
        engine.stop()
