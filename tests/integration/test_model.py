"""The lean model against transformers itself, and the int8 path's batch invariance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handler.engine.loader import load_tokenizer
from handler.engine.model import DecoderModel, build_layout
from handler.engine.quantize import CALIBRATION_TEXT, calibrate, smooth_and_quantize
from tests.integration.conftest import DEVICE

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_store" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL_DIR)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def prefill(model: DecoderModel, chunks: list[list[int]]) -> torch.Tensor:
    """Run consecutive chunks of one prompt through one slot; logits at every position of the last chunk."""
    total = sum(map(len, chunks))
    cache = model.new_cache(1, total)
    cache.ensure(1, total)
    start = 0
    for chunk in chunks:
        layout = build_layout([], [(0, start, len(chunk))], 3, model.device)
        device = model.device
        positions = torch.arange(start, start + len(chunk), device=device)
        logits = model.forward(torch.tensor(chunk, device=device), positions, layout, cache,
                               torch.arange(len(chunk), device=device))
        start += len(chunk)
    return logits.cpu()


def test_model_matches_transformers(prompt_ids):
    from transformers import AutoModelForCausalLM

    ours = prefill(DecoderModel(MODEL_DIR, dtype=torch.float32, device=torch.device(DEVICE)), [prompt_ids])
    reference = AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()
    with torch.inference_mode():
        theirs = reference(torch.tensor([prompt_ids])).logits[0]
    assert torch.allclose(ours, theirs, atol=1e-3), (ours - theirs).abs().max()


def test_int8_rows_do_not_depend_on_their_neighbours(tokenizer, prompt_ids):
    model = DecoderModel(MODEL_DIR, dtype=torch.float32, device=torch.device("cpu"))  # int8 is the CPU path
    smooth_and_quantize(model, calibrate(model, tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)))
    whole = prefill(model, [prompt_ids])
    split = prefill(model, [prompt_ids[:24], prompt_ids[24:]])  # the shared-prefix cache's path
    assert torch.equal(whole[24:], split)
    assert tokenizer.decode([int(whole[-1].argmax())]).strip()
