"""The lean model against transformers itself, and the int8 path's batch invariance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from handler.engine.core.tokenizer import load_tokenizer
from handler.engine.model.decoder import DecoderModel
from handler.engine.model.kernels import cpu_flags
from handler.engine.model.layout import build_layout
from handler.engine.model.linear import activation_levels, describe_cpu, full_range_is_exact
from handler.engine.model.quantize import CALIBRATION_TEXT, calibrate, smooth_and_quantize
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


@pytest.fixture(scope="module")
def int8_model(tokenizer) -> DecoderModel:
    model = DecoderModel(MODEL_DIR, dtype=torch.float32, device=torch.device("cpu"))  # int8 is the CPU path
    smooth_and_quantize(model, calibrate(model, tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)))
    return model


def test_int8_rows_do_not_depend_on_their_neighbours(int8_model, tokenizer, prompt_ids):
    whole = prefill(int8_model, [prompt_ids])
    split = prefill(int8_model, [prompt_ids[:24], prompt_ids[24:]])  # the shared-prefix cache's path
    assert torch.equal(whole[24:], split)
    assert tokenizer.decode([int(whole[-1].argmax())]).strip()


def test_int8_decode_row_does_not_depend_on_its_neighbours(int8_model, prompt_ids):
    """One decode row alone, then beside a much longer sequence's decode row (more keys read) and a prefill chunk
    of a third prompt in the same step: its logits are the same bits."""
    model, n = int8_model, len(prompt_ids)
    long_ids = (prompt_ids * 8)[:150]
    cache = model.new_cache(3, 256)
    cache.ensure(3, 256)
    layout = build_layout([], [(0, 0, n), (1, 0, len(long_ids))], 3, model.device)
    positions = torch.tensor(list(range(n)) + list(range(len(long_ids))))
    model.forward(torch.tensor(prompt_ids + long_ids), positions, layout, cache, torch.tensor([0]))
    token = prompt_ids[-1]

    def decode(positions: list[int], tokens: list[int], chunks: list[tuple[int, int, int]], extra: list[int]):
        layout = build_layout(positions, chunks, 3, model.device)
        all_positions = positions + [p for _slot, start, length in chunks for p in range(start, start + length)]
        return model.forward(torch.tensor(tokens + extra), torch.tensor(all_positions), layout, cache,
                             torch.tensor([0]))[0]

    alone = decode([n], [token], [], [])
    crowded = decode([n, len(long_ids)], [token, long_ids[-1]], [(2, 0, 40)], long_ids[:40])
    assert torch.equal(alone, crowded), (alone - crowded).abs().max()


def test_int8_invariance_holds_on_avx2_kernels_too():
    """The same checks with every kernel library held to AVX2 (no VNNI, no AVX-512), so CI proves both paths on
    whichever CPU it has: fbgemm, ATen's vector kernels, MKL and oneDNN each honour their variable."""
    if "avx2" not in cpu_flags():
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, FBGEMM_ENABLE_INSTRUCTIONS="AVX2", ATEN_CPU_CAPABILITY="avx2",
               MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2", ENGINE_TEST_DEVICE="cpu")
    _invariance_tests_pass(env, timeout=600)


def test_int8_invariance_holds_on_the_8_bit_path_on_any_cpu():
    """The same checks with 8-bit activations forced: VNNI's kernel where this CPU has it, else the exact float64
    stand-in for it (``linear._exact_int8_linear``), so an AVX2 machine proves the 8-bit path too."""
    env = dict(os.environ, LLM_INT8_ACTIVATION_BITS="8", ENGINE_TEST_DEVICE="cpu")
    _invariance_tests_pass(env, timeout=900)


def _invariance_tests_pass(env: dict[str, str], timeout: int) -> None:
    """The three int8 invariance checks of this module, in a fresh interpreter under ``env`` (kernel choices are
    made once per process)."""
    tests = [f"{__file__}::test_int8_rows_do_not_depend_on_their_neighbours",
             f"{__file__}::test_int8_decode_row_does_not_depend_on_its_neighbours",
             f"{__file__}::test_avx2_kernels_take_the_7_bit_path"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "3 passed" in done.stdout


def test_avx2_kernels_take_the_7_bit_path():
    """Held to AVX2, the load-time probe finds full-range u8*s8 products saturating and picks 7-bit activations;
    on an AVX-512 VNNI CPU left alone it picks 8 bits; ``LLM_INT8_ACTIVATION_BITS`` forces either. Each way the
    line logged at start names the path, and whether the 8-bit one is computed by the exact stand-in."""
    levels = activation_levels()
    forced = os.environ.get("LLM_INT8_ACTIVATION_BITS")
    if forced:
        assert levels == {"7": 128, "8": 256}[forced]
        emulated = "computed exactly in float64" in describe_cpu()
        assert emulated == (levels == 256 and not full_range_is_exact())
    elif os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS") == "AVX2":
        assert levels == 128
    elif "avx512_vnni" in cpu_flags():
        assert levels == 256  # fbgemm's VNNI kernels (AMX CPUs have them too); AVX-VNNI alone is left to the probe
    assert f"{'8' if levels == 256 else '7'}-bit per-row activations" in describe_cpu()
