"""The int8 Linear's numerics, in its torch reference (``linear.reference_linear``, what the C kernel reproduces bit for
bit: ``test_int8_kernel.py``): symmetric 16-bit codes per activation block, an error within half a code step per
block, and a row computed alike alone and beside others."""

from __future__ import annotations

import pytest
import torch

from handler.engine.model.linear import CODE_MAX, _quantise_weight, quantise_activations, reference_linear

SHAPES = [(96, 64), (300, 576), (64, 1536), (32, 8192)]


@pytest.mark.parametrize("block", [32, 64, 128])
def test_each_block_takes_16_bit_codes_scaled_by_its_largest(block: int) -> None:
    generator = torch.Generator().manual_seed(block)
    x = torch.randn(5, 300, generator=generator) * torch.rand(5, 1, generator=generator) * 10
    x[:, 7] += 50.0  # an outlier channel, as smoothing leaves them
    x[3, :] = 0.0  # a row of zeros: scale 0, codes 0
    codes, scales = quantise_activations(x, block)
    blocks = -(-300 // block)
    assert codes.shape == (5, blocks * block) and scales.shape == (5, blocks)
    assert codes.dtype is torch.int16 and codes.abs().max() == CODE_MAX
    assert torch.equal(codes[:, 300:], torch.zeros_like(codes[:, 300:]))
    padded = torch.nn.functional.pad(x, (0, blocks * block - 300)).view(5, blocks, block)
    assert torch.equal(scales, padded.abs().amax(-1) / CODE_MAX)
    lit = scales > 0  # every block with a nonzero value reaches +-CODE_MAX at its largest
    peaks = codes.view(5, blocks, block).abs().amax(-1)[lit]
    assert torch.equal(peaks, torch.full_like(peaks, int(CODE_MAX)))
    assert torch.equal(codes[3], torch.zeros_like(codes[3]))
    # each value within half a step of its code's
    error = (codes.view(5, blocks, block).float() * scales[..., None] - padded).abs()
    assert (error <= scales[..., None] * 0.5 * (1 + 1e-5) + 1e-30).all()


def test_weights_take_plus_minus_127() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(50, 70, generator=generator)
    int8, scales = _quantise_weight(weight)
    assert int8.min() >= -127
    assert torch.equal(int8.abs().amax(dim=1), torch.full((50,), 127, dtype=torch.int8))
    assert torch.allclose(int8.float() * scales[:, None], weight, atol=float(scales.max()) / 2 * 1.001)


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_the_error_is_half_a_step_per_block(out_features: int, in_features: int) -> None:
    """Against the dequantised weights' exact product, each activation off by at most half its block's step:
    |error| <= sum over blocks of step_b / 2 * sum|w| over the block (plus float rounding), far below what
    rounding the weights to int8 costs."""
    generator = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(5, in_features, generator=generator) * torch.rand(1, in_features, generator=generator) * 4
    x[:, 3] += 40.0
    int8, scales = _quantise_weight(weight)
    dequantised = int8.double() * scales.double()[:, None]
    exact = x.double() @ dequantised.T
    block = 128
    y = reference_linear(x, int8, scales, None, block).double()
    _codes, steps = quantise_activations(x, block)
    blocks = steps.shape[1]
    magnitude = torch.nn.functional.pad(dequantised.abs(), (0, blocks * block - in_features)).view(
        out_features, blocks, block).sum(-1)  # [out, blocks]
    bound = (steps.double() / 2) @ magnitude.T  # [rows, out]
    assert ((y - exact).abs() <= bound * 1.01 + 1e-3).all()
    # 16-bit codes: the activations' error is far below the int8 weights' own
    weights_error = (exact - x.double() @ weight.double().T).abs().max()
    assert (y - exact).abs().max() * 20 < weights_error


def test_a_row_is_computed_alike_alone_and_beside_others() -> None:
    generator = torch.Generator().manual_seed(7)
    int8, scales = _quantise_weight(torch.randn(200, 576, generator=generator))
    bias = torch.randn(200, generator=generator)
    batch = torch.randn(33, 576, generator=generator) * torch.rand(33, 1, generator=generator) * 10
    together = reference_linear(batch, int8, scales, bias, 128)
    for row in (0, 16, 32):
        assert torch.equal(reference_linear(batch[row:row + 1].clone(), int8, scales, bias, 128)[0], together[row])
