"""The lean model against transformers itself, and the int8 path's batch invariance."""

from __future__ import annotations

import itertools
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
from handler.engine.model.linear import describe_cpu
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
    """A prompt prefilled whole, after a cached prefix, or in several chunks: the same logits at every position
    (the cuts leave 1 to 36 rows in a chunk, so a GEMM's row count and a row's place among them both vary; on
    Intel CPUs held to AVX2, MKL's q k^T gave 24 + 13 other bits than 37 before prefill attention ran whole
    KEY_BLOCKs)."""
    whole = prefill(int8_model, [prompt_ids])
    assert tokenizer.decode([int(whole[-1].argmax())]).strip()
    n = len(prompt_ids)
    for cuts in ([24], [1], [n - 1], [5, 6, 20], [3, 11, 30]):
        bounds = [0, *cuts, n]
        split = prefill(int8_model, [prompt_ids[a:b] for a, b in itertools.pairwise(bounds)])  # the prefix cache's path
        assert torch.equal(whole[cuts[-1]:], split), cuts


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


def test_int8_decode_row_gives_the_prefill_rows_bits(int8_model, prompt_ids):
    """Each of a prompt's last positions computed as a decode row, after the positions before it were prefilled: the
    logits its row gets in the whole prompt's prefill. Attention computes a row alike either way (``attention.c``) and
    the int8 Linears give a row the same bits in any batch, so a sequence that recomputes its decoded tokens as a
    prefill (after a preemption) continues exactly as it would have."""
    from handler.engine.model.attention import KernelAttention

    if not isinstance(int8_model.attention, KernelAttention):
        pytest.skip("attention runs as matmuls here (no kernel)")
    whole = prefill(int8_model, [prompt_ids])
    n = len(prompt_ids)
    for last in (n - 1, n - 5):
        cache = int8_model.new_cache(1, n)
        cache.ensure(1, n)
        layout = build_layout([], [(0, 0, last)], 3, int8_model.device)
        int8_model.forward(torch.tensor(prompt_ids[:last]), torch.arange(last), layout, cache, torch.tensor([0]))
        for position in range(last, n):
            row = int8_model.forward(torch.tensor([prompt_ids[position]]), torch.tensor([position]),
                                     build_layout([position], [], 3, int8_model.device), cache, torch.tensor([0]))
            assert torch.equal(row[0], whole[position]), (last, position)


def test_the_norm_and_rope_kernels_leave_every_logit_as_torchs_ops_gave_it(int8_model, prompt_ids):
    """The served model (int8) with RMSNorm and the q/k/v split with RoPE in our kernels (``kernels/rms_norm.c``,
    ``rope.c``; a decode row's norm before qkv and gate_up runs inside the int8 kernel's call) and with torch's
    ops (``F.rms_norm`` everywhere, the norm taken out of the int8 call, the scripted split): a prefill and ten
    greedy decode steps give the same logits bit for bit, so greedy output is what it was before the kernels. The
    int8 kernel itself and the residual add in its call are compared with torch's ops in a process of their own
    (``test_greedy_decoding_with_our_kernels_is_torchs_token_for_token``): their choice is made at load."""
    from functools import partial

    from handler.engine.model.decoder import _rms_norm
    from handler.engine.model.qk_split import SCRIPTED

    if int8_model.norm is _rms_norm:
        pytest.skip("the fused kernels are not taken on this CPU")
    fused = (int8_model.norm, int8_model._norm_lanes, [layer.split for layer in int8_model.layers])
    torch_ops = (_rms_norm, None, [partial(SCRIPTED["split_and_rotate"], **split.keywords) for split in fused[2]])
    assert all(split.func is not SCRIPTED["split_and_rotate"] for split in fused[2])

    def use(norm, lanes, splits) -> None:
        int8_model.norm, int8_model._norm_lanes = norm, lanes
        for layer, split in zip(int8_model.layers, splits, strict=True):
            layer.split = split

    def generate(norm, lanes, splits) -> list[torch.Tensor]:
        use(norm, lanes, splits)
        cache = int8_model.new_cache(1, 256)
        cache.ensure(1, 256)
        n = len(prompt_ids)
        layout = build_layout([], [(0, 0, n)], 3, int8_model.device)
        logits = [int8_model.forward(torch.tensor(prompt_ids), torch.arange(n), layout, cache, torch.arange(n))]
        for position in range(n, n + 10):
            token = int(logits[-1][-1].argmax())
            layout = build_layout([position], [], 3, int8_model.device)
            logits.append(int8_model.forward(torch.tensor([token]), torch.tensor([position]), layout, cache,
                                             torch.tensor([0])))
        return logits

    try:
        ours, theirs = generate(*fused), generate(*torch_ops)
    finally:
        use(*fused)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_int8_invariance_holds_on_avx2_kernels_too():
    """The same checks with every kernel library held to AVX2 (no VNNI, no AVX-512), so CI proves both paths on
    whichever CPU it has: our int8 kernel, ATen's vector kernels, MKL and oneDNN each honour their variable."""
    if "avx2" not in cpu_flags():
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, LLM_INT8_KERNEL_ISA="avx2", ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2",
               ONEDNN_MAX_CPU_ISA="AVX2", ENGINE_TEST_DEVICE="cpu")
    _invariance_tests_pass(env, timeout=600)


def _invariance_tests_pass(env: dict[str, str], timeout: int) -> None:
    """The four int8 invariance checks of this module, in a fresh interpreter under ``env`` (kernel choices are
    made once per process)."""
    tests = [f"{__file__}::test_int8_rows_do_not_depend_on_their_neighbours",
             f"{__file__}::test_int8_decode_row_does_not_depend_on_its_neighbours",
             f"{__file__}::test_int8_decode_row_gives_the_prefill_rows_bits",
             f"{__file__}::test_the_start_line_names_the_int8_kernel"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "4 passed" in done.stdout


def test_the_start_line_names_the_int8_kernel():
    """The line logged at start names the activation blocks and the kernel's sums: AVX2's when held to them
    (``LLM_INT8_KERNEL_ISA=avx2``) or on a CPU without AVX-512 VNNI, VNNI's where the CPU has them."""
    line = describe_cpu()
    assert "16-bit activations per block of 128" in line
    if not {"avx2", "fma"} <= cpu_flags() or os.environ.get("LLM_INT8_KERNEL") == "torch":
        assert "torch's int8 GEMM" in line
    elif os.environ.get("LLM_INT8_KERNEL_ISA") == "avx2" or not {"avx512_vnni", "avx512bw", "avx512vl"} <= cpu_flags():
        assert "our AVX2 kernel" in line
    else:
        assert "our AVX-512 VNNI kernel" in line


def test_the_avx2_and_vnni_sums_give_the_same_logits():
    """The served int8 model decoding with our kernel's AVX-512 VNNI sums and, in another process, held to its AVX2
    sums (``LLM_INT8_KERNEL_ISA=avx2``, nothing else changed): the same tokens and the same logits, bit for bit, on
    a prefill of three prompts and 24 greedy steps of three rows. The activations' integers are the same on every
    CPU, so the answers are too."""
    if not {"avx512_vnni", "avx512bw", "avx512vl", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX-512 VNNI to compare with AVX2")
    runs = {}
    for isa in ("auto", "avx2"):
        env = dict(os.environ, LLM_INT8_KERNEL_ISA=isa, ENGINE_TEST_DEVICE="cpu")
        done = subprocess.run([sys.executable, "-c", "from tests.integration.test_model import _greedy_probe; "
                               "_greedy_probe()"], env=env, capture_output=True, text=True, timeout=600,
                              cwd=Path(__file__).resolve().parents[2])
        assert done.returncode == 0, done.stderr[-3000:]
        runs[isa] = done.stdout.strip().splitlines()
    assert runs["auto"][0] == runs["avx2"][0] == "kernels: True"
    assert runs["auto"][1:] == runs["avx2"][1:]


def test_greedy_decoding_with_our_kernels_is_torchs_token_for_token():
    """The served int8 model decoding three prompts together (prefill, then 24 greedy steps of three rows: the
    kernels' decode path) in a process with our kernels (int8 Linear, RMSNorm, split and RoPE, KV writes) and in one
    with ``LLM_INT8_KERNEL=torch`` (every op torch's): the same tokens and the same logits, bit for bit."""
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("the kernels need AVX2 and FMA")
    runs = {}
    for mode in ("auto", "torch"):
        env = dict(os.environ, LLM_INT8_KERNEL=mode, ENGINE_TEST_DEVICE="cpu")
        done = subprocess.run([sys.executable, "-c", "from tests.integration.test_model import _greedy_probe; "
                               "_greedy_probe()"], env=env, capture_output=True, text=True, timeout=600,
                              cwd=Path(__file__).resolve().parents[2])
        assert done.returncode == 0, done.stderr[-3000:]
        runs[mode] = done.stdout.strip().splitlines()
    assert runs["auto"][0] == "kernels: True" and runs["torch"][0] == "kernels: False"
    assert runs["auto"][1:] == runs["torch"][1:]


def _greedy_probe() -> None:
    """``test_greedy_decoding_with_our_kernels_is_torchs_token_for_token``'s subprocess: whether the kernels ran,
    then each step's tokens and the exact bits of its logits."""
    import hashlib

    from handler.engine.model.decoder import _rms_norm
    from handler.engine.model.kernels import int8_kernel

    torch.set_num_threads(2)
    tokenizer = load_tokenizer(MODEL_DIR)
    model = DecoderModel(MODEL_DIR, dtype=torch.float32, device=torch.device("cpu"))
    smooth_and_quantize(model, calibrate(model, tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)))
    print(f"kernels: {int8_kernel() is not None and model.norm is not _rms_norm}")
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "Write a haiku about rain:",
                                                   "List three prime numbers:")]
    cache = model.new_cache(3, 256)
    cache.ensure(3, 256)
    tokens = [t for ids in prompts for t in ids]
    positions = [p for ids in prompts for p in range(len(ids))]
    ends = list(torch.tensor([len(ids) for ids in prompts]).cumsum(0) - 1)
    layout = build_layout([], [(slot, 0, len(ids)) for slot, ids in enumerate(prompts)], 3, model.device)
    logits = model.forward(torch.tensor(tokens), torch.tensor(positions), layout, cache, torch.tensor(ends))
    lengths = [len(ids) for ids in prompts]
    for _step in range(24):
        chosen = logits.argmax(-1).tolist()
        print(chosen, hashlib.sha256(logits.numpy().tobytes()).hexdigest()[:16])
        layout = build_layout(lengths, [], 3, model.device)
        logits = model.forward(torch.tensor(chosen), torch.tensor(lengths), layout, cache, torch.arange(3))
        lengths = [n + 1 for n in lengths]
