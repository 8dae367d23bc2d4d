"""The int8 Linear's C kernel (``handler.engine.model.kernels``, ``int8_linear.c``) gives the bits of its torch
reference (``linear.reference_linear``) with each of its integer sums (AVX2's, and AVX-512 VNNI's where the CPU has
them), for every row count (a decode step's few, a prefill chunk's many, and the tails of its row tiles), odd
shapes, a bias, rows with outliers, several activation block sizes and integer sums past 2^24 (float conversions
that round); and a row's result does not depend on the rows beside it or on the number of threads."""

from __future__ import annotations

import os

import pytest
import torch

from handler.engine.model import kernels
from handler.engine.model.linear import MAX_BLOCK, Int8DynamicLinear, pack, reference_linear, unpack

pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= kernels.cpu_flags(), reason="the kernel needs AVX2 and FMA")

# (out, in): the embedded model's four projections, odd sizes (tails of the packed groups of 16 channels, of the
# steps of 2 inputs and of the activation blocks), and a wide input
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (37, 45), (9, 31), (130, 8192), (16, 1)]
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 13, 17, 33]


def rows_with_outliers(rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, k, generator=generator)
    x[:, torch.randint(0, k, (3,), generator=generator)] *= 40.0  # a few large channels, as activations have
    return x


def reference(layer: Int8DynamicLinear, x: torch.Tensor) -> torch.Tensor:
    return reference_linear(x, *layer.int8_weight(), layer.bias, layer.block)


def _isas() -> list[str]:
    """The kernel's sums this CPU can run: AVX2's everywhere, AVX-512 VNNI's where it has them."""
    flags = kernels.cpu_flags()
    return ["avx2"] + (["avx512_vnni"] if {"avx512_vnni", "avx512bw", "avx512vl"} <= flags else [])


@pytest.fixture(scope="module", params=_isas())
def kernel(request) -> kernels.Int8Kernel:
    """The kernel with each of its integer sums in turn; every test below must hold for each."""
    found = kernels.int8_kernel()
    assert found is not None, "the kernel did not build on a CPU with AVX2 and FMA"
    started_with = found.vnni
    assert found.use_vnni(request.param == "avx512_vnni") == (request.param == "avx512_vnni")
    yield found
    found.use_vnni(started_with)


def test_the_kernel_takes_vnni_where_the_cpu_has_it() -> None:
    """Unless held to AVX2 at start (``LLM_INT8_KERNEL_ISA=avx2``, as CI's AVX2 runs do)."""
    held = os.environ.get("LLM_INT8_KERNEL_ISA") == "avx2"
    assert kernels.int8_kernel().vnni == ("avx512_vnni" in _isas() and not held)


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_kernel_gives_the_references_bits(kernel, out_features: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    for bias in (None, torch.randn(out_features, generator=generator)):
        for block in (2, 6, 128, MAX_BLOCK) if in_features < 100 else (128, MAX_BLOCK):
            layer = Int8DynamicLinear(weight, bias, block=block)
            assert layer.kernel is kernel
            for rows in ROWS:
                x = rows_with_outliers(rows, in_features, generator)
                mine, theirs = layer(x), reference(layer, x)
                assert torch.equal(mine, theirs), (block, rows, (mine - theirs).abs().max())


def test_the_largest_sums_do_not_wrap(kernel) -> None:
    """Every code at +-32767 and every weight at +-127 over the widest block: each block's int32 sum is at its
    largest (512 * 32767 * 127, just under 2^31) and the kernel gives the exact one."""
    weight = torch.ones(32, MAX_BLOCK)
    weight[16:] = -1.0
    layer = Int8DynamicLinear(weight, None, block=MAX_BLOCK)
    x = torch.ones(3, MAX_BLOCK)
    x[1] = -1.0
    x[2, ::2] = -1.0
    expected = torch.tensor([1.0, -1.0, 0.0])[:, None] * MAX_BLOCK * torch.cat([torch.ones(16), -torch.ones(16)])
    assert torch.equal(layer(x), reference(layer, x))
    assert torch.allclose(layer(x), expected, rtol=1e-6, atol=1e-4)


def test_a_row_alone_and_beside_others(kernel) -> None:
    """Rows tile by 4 (AVX2) or 8 (VNNI), and a prefill chunk is many tiles: a row's bits are the same alone, in any
    tile, at any place."""
    generator = torch.Generator().manual_seed(3)
    layer = Int8DynamicLinear(torch.randn(3072, 576, generator=generator) * 0.05, None)
    batch = rows_with_outliers(45, 576, generator)
    together = layer(batch)
    for row in (0, 3, 7, 8, 21, 44):
        assert torch.equal(layer(batch[row:row + 1]), together[row:row + 1])
    assert torch.equal(layer(batch[5:16]), together[5:16])


def test_the_number_of_threads_changes_nothing(kernel) -> None:
    generator = torch.Generator().manual_seed(4)
    layer = Int8DynamicLinear(torch.randn(960, 576, generator=generator) * 0.05, torch.randn(960, generator=generator))
    x = rows_with_outliers(19, 576, generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(layer(x), alone)


def test_constant_zero_and_tiny_rows(kernel) -> None:
    """A constant row, a row of tiny values and a row of zeros (a block whose scale is 0 adds nothing) take the same
    codes and sums as the reference."""
    generator = torch.Generator().manual_seed(5)
    layer = Int8DynamicLinear(torch.randn(64, 96, generator=generator), torch.randn(64, generator=generator))
    x = torch.stack([torch.full((96,), 0.25), torch.randn(96, generator=generator) * 1e-30, torch.zeros(96)])
    x[0, 40:72] = 0.0
    assert torch.equal(layer(x), reference(layer, x))
    assert torch.equal(layer(x[2:]), layer.bias[None, :])


def test_packing_keeps_every_weight() -> None:
    """``pack`` pads to whole groups and steps and ``unpack`` gives the weights back; a layer made from its packed
    weights (as ``model.packed`` reads them) is the same layer."""
    generator = torch.Generator().manual_seed(6)
    for out_features, in_features in SHAPES:
        int8 = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
        packed = pack(int8)
        assert packed.shape == (-(-out_features // 16), -(-in_features // 2), 16, 2)
        assert torch.equal(unpack(packed, out_features, in_features), int8)
    layer = Int8DynamicLinear(torch.randn(40, 70, generator=generator), torch.randn(40, generator=generator))
    again = Int8DynamicLinear.from_packed(layer.packed.clone(), 70, layer.scales.clone(), layer.bias.clone())
    x = rows_with_outliers(6, 70, generator)
    assert torch.equal(again(x), layer(x))


@pytest.mark.parametrize("in_features", [576, 960])
def test_the_norm_before_and_the_residual_after_in_one_call_are_the_ops_one_by_one(kernel, in_features: int) -> None:
    """``Int8DynamicLinear.fused``: ``residual + layer(rms_norm(x))`` in one kernel call (the decoder's llama block
    takes it for a decode step's rows) gives the bits of the norm, the layer and torch's add run one by one, with a
    bias and without, for a decode step's rows and a prefill chunk's; it declines what it does not take."""
    norm = kernels.fused_rms_norm()
    assert norm is not None and norm.lanes in (8, 16)
    generator = torch.Generator().manual_seed(13)
    for bias in (None, torch.randn(768, generator=generator)):
        layer = Int8DynamicLinear(torch.randn(768, in_features, generator=generator) * 0.05, bias)
        weight = torch.rand(in_features, generator=generator) + 0.5
        for rows in (1, 2, 3, 5, 8, 9, 17, 40):
            x = rows_with_outliers(rows, in_features, generator) * 3
            residual = torch.randn(rows, 768, generator=generator)
            normed = norm(x, weight, 1e-5)
            assert torch.equal(layer.fused(x, norm=(weight, 1e-5, norm.lanes)), layer(normed))
            assert torch.equal(layer.fused(x, residual=residual), residual + layer(x))
            both = layer.fused(x, residual, (weight, 1e-5, norm.lanes))
            assert torch.equal(both, residual + layer(normed))
            assert torch.equal(both, residual + reference(layer, normed))
    x = rows_with_outliers(2, in_features, generator)
    assert layer.fused(x, residual=torch.zeros(2, 5)) is None, "a residual of another shape"
    assert layer.fused(x.double()) is None, "not fp32"


def test_a_gated_mlp_in_one_call_is_the_ops_one_by_one(kernel) -> None:
    """``GatedMLP.fused``: ``residual + down(silu(gate) * up)`` of ``gate_up(rms_norm(x))`` in one kernel call (the
    llama block's MLP) gives the bits of the norm, the two layers, the SiLU kernel and torch's add run one by one,
    with biases and without, for a decode step's rows and a prefill chunk's; it declines what it does not take."""
    from handler.engine.model.moe import GatedMLP

    norm, silu = kernels.fused_rms_norm(), kernels.fused_silu_mul()
    assert norm is not None and silu is not None and silu.lanes in (8, 16)
    generator = torch.Generator().manual_seed(14)
    for bias in (False, True):
        mlp = GatedMLP(Int8DynamicLinear(torch.randn(3072, 576, generator=generator) * 0.05,
                                         torch.randn(3072, generator=generator) if bias else None),
                       Int8DynamicLinear(torch.randn(576, 1536, generator=generator) * 0.05,
                                         torch.randn(576, generator=generator) if bias else None))
        weight = torch.rand(576, generator=generator) + 0.5
        for rows in (1, 2, 5, 17, 40):
            x = rows_with_outliers(rows, 576, generator) * 3
            one_by_one = x + mlp.down(mlp.gated(mlp.gate_up(norm(x, weight, 1e-5))))
            assert torch.equal(mlp.fused(x, residual=x, norm=(weight, 1e-5, norm.lanes)), one_by_one)
            assert torch.equal(mlp.fused(x), mlp(x))
    assert mlp.fused(x, residual=torch.zeros(rows, 5)) is None, "a residual of another shape"
    other = GatedMLP(mlp.gate_up, Int8DynamicLinear(torch.randn(576, 1536, generator=generator), None, block=64))
    assert other.fused(x) is None, "layers of other activation blocks"
