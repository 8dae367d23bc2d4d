"""The int8 Linear kernels: the float64 stand-in for fbgemm's full-range (VNNI) kernel gives fbgemm's own bits, the
14-bit split kernel is as close to the dequantised weights' product as 14 bits allow, and every kernel computes a
row alike alone and beside others."""

from __future__ import annotations

import pytest
import torch

from handler.engine.model.linear import (
    Int8DynamicLinear,
    _exact_int8_linear,
    _exact_weights,
    _int8_linear,
    _pack,
    _quantise_weight,
    full_range_is_exact,
)

SHAPES = [(96, 64), (300, 576), (64, 1536), (32, 8192)]  # the last: integer sums past 2^24, rounded to fp32


def low_rows(rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Rows whose 8-bit codes stay below 61 except one 255 beside a 0 (channels 1 and 0), so that fbgemm's AVX2
    kernel, which sums u8*s8 pairs into int16, does not saturate either: its full-range result is then exact on any
    CPU, the product the VNNI kernel computes."""
    x = torch.rand(rows, k, generator=generator) * 60.0
    x[:, 0], x[:, 1] = 0.0, 255.0
    offset = torch.randn(rows, 1, generator=generator)
    return offset + x * (0.01 + torch.rand(rows, 1, generator=generator))


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_exact_kernel_gives_fbgemms_full_range_bits(out_features: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    packed, row_sums = _pack(weight)
    sentinel = torch.zeros(in_features)
    sentinel[0], sentinel[-1] = -128, 127
    for rows in (1, 3, 17):
        x = low_rows(rows, in_features, generator)
        fbgemm = _int8_linear(x, packed, row_sums, sentinel, 256)
        exact = _exact_int8_linear(x, *_exact_weights(weight), row_sums)
        assert torch.equal(fbgemm, exact), (fbgemm - exact).abs().max()


def test_exact_kernel_is_not_fbgemms_saturating_one() -> None:
    """The stand-in matters only where fbgemm's kernel saturates: there the two differ, and the stand-in is the
    integer product (what the VNNI kernel computes)."""
    weight = torch.full((2, 256), 1.0)
    weight[1] = -128.0 / 127.0  # int8 weights 127 and -128
    packed, row_sums = _pack(weight)
    x = torch.ones(1, 256)
    x[0, 0] = 0.0  # every other code is 255
    exact = _exact_int8_linear(x, *_exact_weights(weight), row_sums)
    assert torch.allclose(exact[0], torch.tensor([255.0, -255.0 * 128 / 127]), rtol=1e-6)
    sentinel = torch.zeros(256)
    sentinel[0], sentinel[-1] = -128, 127
    fbgemm = _int8_linear(x, packed, row_sums, sentinel, 256)
    assert torch.equal(fbgemm, exact) == full_range_is_exact()


def dequantised_product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    int8, scales = _quantise_weight(weight)
    return x.double() @ (int8.double() * scales.double()[:, None]).T


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES[:3])
def test_split_activations_are_14_bits(out_features: int, in_features: int) -> None:
    """The split kernel's error against the dequantised weights is the 14-bit grid's, 128 times below 7 bits'."""
    generator = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(5, in_features, generator=generator) * torch.rand(1, in_features, generator=generator) * 4
    x[:, 3] += 40.0  # an outlier channel, as smoothing leaves them
    exact = dequantised_product(weight, x)
    split = Int8DynamicLinear(weight, None, split=True)(x).double()
    seven = Int8DynamicLinear(weight, None, levels=128)(x).double()
    split_error, seven_error = (split - exact).abs().max(), (seven - exact).abs().max()
    # each activation within half a step: |error| <= step / 2 * sum|w| (plus float rounding)
    step = (x.amax(-1) - x.amin(-1)) / 16383
    bound = (step[:, None].double() / 2 * weight.abs().sum(-1).double()[None, :]).amax() * 1.01 + 1e-3
    assert split_error <= bound, (split_error, bound)
    assert split_error * 20 < seven_error, (split_error, seven_error)


@pytest.mark.parametrize("kind", ["7-bit", "8-bit", "split"])
def test_a_row_is_computed_alike_alone_and_beside_others(kind: str) -> None:
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 576, generator=generator)
    bias = torch.randn(200, generator=generator)
    linear = Int8DynamicLinear(weight, bias, split=kind == "split", levels=256 if kind == "8-bit" else 128)
    batch = torch.randn(33, 576, generator=generator) * torch.rand(33, 1, generator=generator) * 10
    together = linear(batch)
    for row in (0, 16, 32):
        assert torch.equal(linear(batch[row:row + 1].clone())[0], together[row])
