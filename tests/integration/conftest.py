"""Fixtures shared by the engine tests: the embedded model (fp32, not quantised), loaded once per module."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from handler.config import DEFAULT_MODEL_DIR
from handler.engine.backend import EngineLimits
from handler.engine.lean.engine import Engine, wait_until_ready
from handler.engine.runners.model_runner import ModelRunner
from handler.prompt.renderer import PromptRenderer

MAX_MODEL_LEN = 512
# ENGINE_TEST_DEVICE=cuda runs the engine tests on a GPU (the CUDA path; CI has none, so cpu by default)
DEVICE = os.environ.get("ENGINE_TEST_DEVICE", "cpu")


def post(client, path: str, body: object, **kwargs):
    """POST a JSON body through a Flask test client."""
    return client.post(path, data=json.dumps(body), content_type="application/json", **kwargs)


def make_engine(loaded, max_step_tokens: int, *, budget: int = 1 << 30, prefix_caching: bool = True,
                max_running: int = 8, on_stats=None, runner_class: type[ModelRunner] = ModelRunner) -> Engine:
    """An engine over the shared weights with a runner (KV memory) of its own: an engine frees its cache on its
    own thread after its last event, which must not land in another engine's step. ``runner_class``: a
    ``ModelRunner`` subclass that watches the steps."""
    runner = runner_class(loaded.runner.model, max_running, MAX_MODEL_LEN, budget, prefix_caching)
    runner.prefix_ids, runner.prefix_kv = loaded.runner.prefix_ids, loaded.runner.prefix_kv
    own = dataclasses.replace(loaded, runner=runner)
    engine = Engine(lambda: own,
                    EngineLimits(max_running=max_running, max_model_len=MAX_MODEL_LEN, max_step_tokens=max_step_tokens),
                    on_stats=on_stats)
    engine.start()
    wait_until_ready(engine, timeout=120)
    return engine


def engine_on_path(folder: Path, rolling_batch: str, path: str, kv_cache_memory: str | None = None,
                   on_stats=None) -> Engine:
    """A small fp32 CPU engine over ``folder``, loaded as ``option.rolling_batch`` says (and
    ``option.kv_cache_memory``); asserts it took ``path`` (``lean`` or ``transformers``). The caller stops it."""
    from handler.engine.core.tokenizer import load_tokenizer
    from handler.engine.lean.load import load
    from handler.engine.lean.options import KVMemory, LoadOptions
    from handler.engine.lean.paths import choose_path
    from handler.engine.model.family import read_config

    options = LoadOptions(folder, "float32", False, "cpu", max_running=4, max_model_len=128,
                          rolling_batch=rolling_batch, kv_memory=KVMemory(kv_cache_memory))
    assert choose_path(options, read_config(folder))[0] == path
    loaded = load(options, lambda: load_tokenizer(folder))[0]
    engine = Engine(lambda: loaded, EngineLimits(max_running=4, max_model_len=128, max_step_tokens=16),
                    on_stats=on_stats)
    engine.start()
    wait_until_ready(engine, timeout=120)
    return engine


@pytest.fixture(scope="module")
def tokenizer():
    if not (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("the embedded model is not assembled (make model)")
    import torch

    torch.set_num_threads(2)
    from handler.engine.core.tokenizer import load_tokenizer

    return load_tokenizer(Path(DEFAULT_MODEL_DIR))


@pytest.fixture(scope="module")
def renderer(tokenizer) -> PromptRenderer:
    return PromptRenderer(tokenizer)


@pytest.fixture(scope="module")
def loaded(tokenizer):
    """The model, loaded once; engines take turns with it (only one of them runs at a time in these tests)."""
    from handler.engine.lean.load import load
    from handler.engine.lean.options import LoadOptions

    options = LoadOptions(Path(DEFAULT_MODEL_DIR), "float32", False, DEVICE, max_running=8, max_model_len=MAX_MODEL_LEN)
    return load(options, lambda: tokenizer)[0]


@pytest.fixture(scope="module")
def engine(loaded):
    engine = make_engine(loaded, max_step_tokens=512)
    yield engine
    engine.stop()


