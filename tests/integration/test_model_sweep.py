"""No architecture starts and then fails every request: every causal-LM model type transformers registers, as a
tiny random checkpoint through our loader and engine (``devtools.model_sweep``), is served with transformers' own
greedy tokens or refused at start in one line (or no tiny config of it can be built here, and the row says why).
And the start's backstop itself: a model whose steps fail is refused before it says ready, naming the failure."""

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


@pytest.mark.parametrize("model_type", model_sweep.causal_lm_types())
def test_every_causal_lm_type_is_served_exactly_or_refused_at_start(model_type: str, tmp_path: Path) -> None:
    row = model_sweep.sweep_one(model_type, tmp_path)
    assert row.is_good, f"{row.model_type} on the {row.path} path: {row.result}: {row.detail}"
    assert row.result != "refused" or "\n" not in row.detail


def test_a_model_whose_steps_fail_is_refused_at_start_naming_the_failure(tmp_path: Path) -> None:
    """Loads fine, then every forward of a step fails (mamba's failure before the runner knew ``cache_params``):
    the warm-up ends the start with the step's own error in one line, and the engine never says ready."""
    from handler.engine.core.tokenizer import load_tokenizer
    from handler.engine.lean.load import LoadOptions, load

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
