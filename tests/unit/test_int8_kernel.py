"""The decode step's C kernel (``handler.engine.model.kernels``) gives the torch path's bits: the split int8 Linear
of linear.py (torch's elementwise ops around fbgemm's GEMM), for every row count it takes, odd shapes, a bias, rows
with outliers, and integer sums past 2^24; and a row's result does not depend on the rows beside it or on the
number of threads."""

from __future__ import annotations

import pytest
import torch

from handler.engine.model import kernels
from handler.engine.model.linear import Int8DynamicLinear, _split_int8_linear

pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= kernels.cpu_flags(), reason="the kernel needs AVX2 and FMA")

# (out, in): the embedded model's four projections and its head's width, odd sizes (tails of the 32-wide loop and
# of the 8-channel thread blocks), and an input wide enough for integer sums past 2^24
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (37, 45), (9, 31), (130, 8192)]


def rows_with_outliers(rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, k, generator=generator)
    x[:, torch.randint(0, k, (3,), generator=generator)] *= 40.0  # a few large channels, as activations have
    return x


def torch_path(layer: Int8DynamicLinear, x: torch.Tensor) -> torch.Tensor:
    y = _split_int8_linear(x, layer.packed, layer.row_sums, layer.sentinel)
    return y if layer.bias is None else y.add_(layer.bias)


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
    assert kernels.int8_kernel().vnni == ("avx512_vnni" in _isas())


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_kernel_gives_the_torch_paths_bits(kernel, out_features: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    for bias in (None, torch.randn(out_features, generator=generator)):
        layer = Int8DynamicLinear(weight, bias, split=True)
        assert layer.kernel is kernel
        for rows in range(1, kernels.MAX_ROWS + 1):
            x = rows_with_outliers(rows, in_features, generator)
            mine = kernel.split_linear(x, layer.int8, layer.col_sums, layer.scales, layer.row_sums, layer.bias)
            theirs = torch_path(layer, x)
            assert torch.equal(mine, theirs), (rows, (mine - theirs).abs().max())


def test_a_row_alone_and_beside_others(kernel) -> None:
    generator = torch.Generator().manual_seed(3)
    layer = Int8DynamicLinear(torch.randn(3072, 576, generator=generator) * 0.05, None, split=True)
    batch = rows_with_outliers(kernels.KERNEL_ROWS, 576, generator)
    together = layer(batch)
    for row in range(kernels.KERNEL_ROWS):
        assert torch.equal(layer(batch[row:row + 1]), together[row:row + 1])
    # and beyond the kernel's rows, through fbgemm: the same numbers
    wide = torch.cat([batch, rows_with_outliers(9, 576, generator)])
    assert torch.equal(layer(wide)[:kernels.KERNEL_ROWS], together)


def test_constant_and_tiny_rows(kernel) -> None:
    """A constant row (zero range: the step's floor) and a row of tiny values go through the same grid."""
    generator = torch.Generator().manual_seed(5)
    layer = Int8DynamicLinear(torch.randn(64, 96, generator=generator), torch.randn(64, generator=generator),
                              split=True)
    x = torch.stack([torch.full((96,), 0.25), torch.randn(96, generator=generator) * 1e-8, torch.zeros(96)])
    assert torch.equal(layer(x), torch_path(layer, x))


def test_fbgemm_packing_waits_and_the_kernel_serves_long_batches_meanwhile(kernel) -> None:
    """A kernel layer is made without fbgemm's packed weights (a start's load leaves them until the engine is
    idle): batches under FBGEMM_ROWS take the kernel in blocks of its rows, packed or not, and the answers are
    fbgemm's bits, before and after ``pack_one`` packs it."""
    from handler.engine.model.linear import pack_one

    generator = torch.Generator().manual_seed(11)
    layer = Int8DynamicLinear(torch.randn(960, 576, generator=generator) * 0.05, torch.randn(960, generator=generator),
                              split=True)
    assert layer._packed is None
    x = rows_with_outliers(3 * kernels.KERNEL_ROWS + 5, 576, generator)
    waiting = layer(x)
    assert layer._packed is None, "the long batch packed it"
    packed = 0
    while pack_one():
        packed += 1
    assert packed >= 1 and layer._packed is not None
    assert torch.equal(layer(x), waiting)
    assert torch.equal(torch_path(layer, x), waiting)
    # a batch of FBGEMM_ROWS takes fbgemm's GEMM, packing a waiting layer first: the same bits as the kernel's
    from handler.engine.model.linear import FBGEMM_ROWS

    other = Int8DynamicLinear.from_int8(*layer.int8_weight(), layer.bias, split=True)
    assert other(x) is not None and other._packed is None, "fewer rows than FBGEMM_ROWS packed it"
    many = rows_with_outliers(FBGEMM_ROWS, 576, generator)
    packed_now = other(many)
    assert other._packed is not None
    assert torch.equal(packed_now, torch.cat([layer(many[i:i + 8]) for i in range(0, FBGEMM_ROWS, 8)]))


def test_a_layer_made_from_kept_sums_is_the_same_layer(kernel) -> None:
    """``packed.save`` keeps each layer's sums and a start reads them instead of computing them: the same numbers."""
    generator = torch.Generator().manual_seed(12)
    layer = Int8DynamicLinear(torch.randn(576, 1536, generator=generator) * 0.05, None, split=True)
    again = Int8DynamicLinear.from_int8(*layer.int8_weight(), None, split=True, sums=layer.sums())
    fresh = Int8DynamicLinear.from_int8(*layer.int8_weight(), None, split=True)
    assert torch.equal(again.row_sums, fresh.row_sums) and torch.equal(again.col_sums, fresh.col_sums)
    x = rows_with_outliers(20, 1536, generator)
    assert torch.equal(again(x), layer(x))


@pytest.mark.parametrize("in_features", [576, 960])
def test_the_norm_before_and_the_residual_after_in_one_call_are_the_ops_one_by_one(kernel, in_features: int) -> None:
    """``Int8DynamicLinear.fused``: ``residual + layer(rms_norm(x))`` in one kernel call (the decoder's llama block
    takes it for a decode step's rows) gives the bits of the norm, the layer and torch's add run one by one, with a
    bias and without, for every row count the kernel takes; it declines what the kernel does not take."""
    norm = kernels.fused_rms_norm()
    assert norm is not None and norm.lanes in (8, 16)
    generator = torch.Generator().manual_seed(13)
    for bias in (None, torch.randn(768, generator=generator)):
        layer = Int8DynamicLinear(torch.randn(768, in_features, generator=generator) * 0.05, bias, split=True)
        weight = torch.rand(in_features, generator=generator) + 0.5
        for rows in range(1, kernels.KERNEL_ROWS + 1):
            x = rows_with_outliers(rows, in_features, generator) * 3
            residual = torch.randn(rows, 768, generator=generator)
            normed = norm(x, weight, 1e-5)
            assert torch.equal(layer.fused(x, norm=(weight, 1e-5, norm.lanes)), layer(normed))
            assert torch.equal(layer.fused(x, residual=residual), residual + layer(x))
            both = layer.fused(x, residual, (weight, 1e-5, norm.lanes))
            assert torch.equal(both, residual + layer(normed))
            assert torch.equal(both, residual + torch_path(layer, normed))
    x = rows_with_outliers(kernels.KERNEL_ROWS + 1, in_features, generator)
    assert layer.fused(x) is None, "more rows than the kernel takes"
    assert layer.fused(x[:2], residual=torch.zeros(2, 5)) is None, "a residual of another shape"
