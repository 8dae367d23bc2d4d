"""The transformers path starts every kind of cache a causal LM keeps: one real registered type of each kind, as a
tiny random checkpoint through our loader and engine (``devtools.model_sweep``: load, KV budget, warm-up, two
requests together), served with transformers' own greedy tokens under a budget that counts what its cache holds;
an encoder-decoder checkpoint refused at start in one line. (``python -m devtools.model_sweep`` runs every type
transformers registers; this is the guard each merge runs.) And the start's backstop itself: a model whose steps
fail is refused before it says ready, naming the failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools import model_sweep
from handler.engine.backend import EngineLimits
from handler.engine.lean.engine import Engine

pytestmark = pytest.mark.skipif(not (model_sweep.SMOLLM2_DIR / "tokenizer.json").is_file(),
                                reason="the embedded tokenizer is not assembled (make model)")


@pytest.fixture(scope="module", autouse=True)
def quiet_transformers() -> None:
    import torch
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    torch.set_num_threads(2)


def recurrent(layer) -> bool:
    return layer.fixed > 0 and layer.per_position == 0


def attention(layer) -> bool:
    return layer.per_position > 0


# kind -> (a real registered type of it, what each layer's counted cost must show)
KINDS = {
    "full attention": ("gpt2", lambda layers: all(attention(x) and x.window is None for x in layers)),
    "sliding window": ("cohere2", lambda layers: any(attention(x) and x.window == 8 for x in layers)),
    "multi-head latent attention": ("deepseek_v3", lambda layers: all(attention(x) for x in layers)),
    "recurrent": ("mamba", lambda layers: all(recurrent(x) for x in layers)),
    "hybrid": ("jamba", lambda layers: any(map(recurrent, layers)) and any(map(attention, layers))),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_of_cache_is_served_exactly_under_a_budget_that_counts_it(kind: str, tmp_path: Path) -> None:
    """A recurrent layer counts its fixed state (mamba's conv and SSM states), an attention layer its keys and values
    per position (within a window where it slides), a hybrid both: before, mamba's start failed counting attention
    heads it does not have (``AttributeError: 'MambaConfig' object has no attribute 'num_attention_heads'``)."""
    model_type, shows = KINDS[kind]
    row = model_sweep.sweep_one(model_type, tmp_path)
    assert (row.path, row.result) == ("transformers", "exact"), f"{model_type}: {row.result}: {row.detail}"
    assert shows(row.cost.layers), f"{model_type}'s cache counted as {row.cost}"


def test_an_encoder_decoder_checkpoint_is_refused_at_start_in_one_line(tmp_path: Path) -> None:
    """bart is registered as a causal LM (its decoder alone); a seq2seq checkpoint of it loaded so would lose its
    encoder and answer with something else than the model, so it is refused, naming the type and why."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    config = AutoConfig.for_model("bart", **{**model_sweep.tiny_fields("bart"), "is_decoder": False})
    torch.manual_seed(0)
    AutoModelForSeq2SeqLM.from_config(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_sweep.SMOLLM2_DIR / name, tmp_path / name)
    engine, reason = model_sweep.start_engine(tmp_path)
    assert engine is None
    assert reason.startswith("UnsupportedModel: model_type 'bart': an encoder-decoder model "
                             "(BartForConditionalGeneration)") and "\n" not in reason


def test_a_build_that_crashes_fails_the_sweep_unless_its_type_is_listed_with_why(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """No crash passes as 'no tiny config': only a type on NO_TINY_CONFIG, with its reason, is let off, and a
    listed type that builds fails too (its entry is stale)."""
    monkeypatch.setitem(model_sweep.OVERRIDES, "gpt2", {"hidden_size": 63})  # no multiple of its 4 heads
    crashed = model_sweep.sweep_one("gpt2", tmp_path / "crashed")
    assert (crashed.result, crashed.is_good) == ("failed", False)
    assert crashed.detail.startswith("its tiny checkpoint cannot be built: ")
    monkeypatch.setitem(model_sweep.NO_TINY_CONFIG, "gpt2", "asked to crash")
    listed = model_sweep.sweep_one("gpt2", tmp_path / "listed")
    assert (listed.result, listed.is_good) == ("no tiny config", True) and listed.detail.startswith("asked to crash (")
    monkeypatch.setitem(model_sweep.OVERRIDES, "gpt2", {})
    stale = model_sweep.sweep_one("gpt2", tmp_path / "stale")
    assert (stale.result, stale.is_good) == ("failed", False) and "take it off the list" in stale.detail


def test_a_model_whose_steps_fail_is_refused_at_start_naming_the_failure(tmp_path: Path) -> None:
    """Loads fine, then every forward of a step fails: the warm-up ends the start with the step's own error in one
    line, and the engine never says ready."""
    from handler.engine.core.tokenizer import load_tokenizer
    from handler.engine.lean.load import load
    from handler.engine.lean.options import LoadOptions

    folder = model_sweep.build(tmp_path, "gpt2")
    options = LoadOptions(folder, "float32", False, "cpu", max_running=2, max_model_len=64, rolling_batch="auto")
    loaded = load(options, lambda: load_tokenizer(folder))[0]
    assert loaded.path == "transformers"

    def step_fails(sequence, token_ids, start, keep=1):
        raise AttributeError("'MambaCausalLMOutput' object has no attribute 'past_key_values'")

    loaded.runner._forward = step_fails
    failures = []
    engine = Engine(lambda: loaded, EngineLimits(max_running=2, max_model_len=64, max_step_tokens=16),
                    on_failed=failures.append)
    engine.start()
    engine._thread.join(timeout=60)
    assert not engine.is_ready and failures == [engine.load_error]
    assert engine.load_error == ("WarmUpFailed: the model cannot run a generation step (prefill, then decode, as "
                                 "requests run): AttributeError: 'MambaCausalLMOutput' object has no attribute "
                                 "'past_key_values'")
