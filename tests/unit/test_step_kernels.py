"""The decode step's small kernels give torch's bits: a layer's q/k/v split with RoPE (``kernels/rope.c``) and its
KV writes (``kv_cache.c``), below; and RMSNorm in one call (``handler/engine/model/kernels/rms_norm.c``) gives torch's
``rms_norm`` bits: every
width a model has and odd ones (the tails of the vector and four-vector loops), 1 to 40 rows, scales from tiny to
large, several eps; torch's op where the kernel does not apply. The sum order matters: a plain left-to-right sum,
the obvious hand-roll, differs from torch's (shown below), so equality here is not an accident of easy inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from handler.engine.model import kernels

pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= kernels.cpu_flags(), reason="the kernels need AVX2 and FMA")

WIDTHS = [16, 17, 31, 64, 100, 127, 128, 576, 600, 768, 896, 960, 1024, 1536, 2048, 2304, 2560, 3072, 3584, 4096,
          5120, 8192, 12288, 16384, 20000]


@pytest.fixture(scope="module")
def norm():
    found = kernels.fused_rms_norm()
    # torch's float sum runs 8 lanes both on the AVX2-only and on the AVX-512 machines this was built on (dispatch
    # "AVX2" and "AVX512"), so the kernel must be taken on both
    assert found is not None, f"the fused RMSNorm was not taken ({torch.backends.cpu.get_cpu_capability()})"
    return found


@pytest.mark.parametrize("width", WIDTHS)
def test_the_fused_norm_gives_torchs_bits(norm, width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    for rows in (1, 2, 3, 7, 40):
        for scale in (1e-6, 1e-2, 1.0, 25.0, 3e3):
            x = torch.randn(rows, width, generator=generator) * scale
            x[:, torch.randint(0, width, (2,), generator=generator)] *= 50.0  # outlier channels, as activations have
            weight = torch.randn(width, generator=generator)
            for eps in (1e-6, 9.999999747378752e-06, 1e-5):
                expected = F.rms_norm(x, (width,), weight, eps)
                assert torch.equal(norm(x, weight, eps), expected), (rows, scale, eps)


def test_a_plain_sum_would_not_give_torchs_bits() -> None:
    """What the test above guards: summing the squares left to right (not torch's cascade) changes the result."""
    generator = torch.Generator().manual_seed(1)
    differs = 0
    for _ in range(50):
        x = torch.randn(1, 576, generator=generator)
        weight = torch.ones(576)
        total = torch.zeros((), dtype=torch.float32)
        for value in (x[0] * x[0]):
            total = total + value
        plain = x * (1.0 / torch.sqrt(total / 576 + 1e-6)) * weight
        differs += not torch.equal(plain, F.rms_norm(x, (576,), weight, 1e-6))
    assert differs > 0


def test_what_the_kernel_does_not_take_runs_torchs_op(norm) -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(64, generator=generator)
    wide = torch.randn(4, 128, generator=generator)[:, ::2]  # not contiguous
    assert torch.equal(norm(wide, weight, 1e-6), F.rms_norm(wide, (64,), weight, 1e-6))
    half = torch.randn(3, 64, generator=generator).bfloat16()
    assert torch.equal(norm(half, weight.bfloat16(), 1e-6), F.rms_norm(half, (64,), weight.bfloat16(), 1e-6))
    narrow = torch.randn(2, 8, generator=generator)
    assert torch.equal(norm(narrow, weight[:8].contiguous(), 1e-6), F.rms_norm(narrow, (8,), weight[:8], 1e-6))


def test_rows_are_normed_alone(norm) -> None:
    """A row's result does not depend on the rows beside it (the engine's batch invariance)."""
    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(9, 576, generator=generator), torch.randn(576, generator=generator)
    together = norm(x, weight, 1e-5)
    for row in range(9):
        assert torch.equal(norm(x[row:row + 1].contiguous(), weight, 1e-5), together[row:row + 1])


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 8), (14, 2, 64), (8, 8, 128), (3, 1, 7)])
def test_the_split_and_rope_kernel_gives_the_scripted_helpers_bits(heads: int, kv_heads: int, dim: int) -> None:
    """``rope.c`` against ``qk_split.split_and_rotate`` (torch's ops): q, k and v, for 1 to 33 rows, an odd head
    width, and positions far out (large angles)."""
    from handler.engine.model.qk_split import split_and_rotate

    kernel = kernels.int8_kernel()
    generator = torch.Generator().manual_seed(heads * 100 + dim)
    for rows in (1, 2, 5, 33):
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator) * 4.0
        angles = torch.randint(0, 100000, (rows, 1), generator=generator) * torch.rand(dim, generator=generator)
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)  # [rows, 1, dim], as the model passes them
        ours = kernel.split_rotate(qkv, cos, sin, heads, kv_heads, dim)
        theirs = split_and_rotate(qkv, cos, sin, heads, kv_heads, dim)
        for a, b in zip(ours, theirs, strict=True):
            assert a.shape == b.shape and torch.equal(a, b), rows


def test_the_kv_write_kernel_writes_what_index_put_writes() -> None:
    """``kv_cache.c`` against torch's indexing: the rows land in the same places (strided k and v, as the split
    leaves them), nothing else changes, and a position or slot outside the cache raises, writing nothing."""
    from handler.engine.model.kv_cache import KVCache

    kernel = kernels.int8_kernel()
    generator = torch.Generator().manual_seed(4)
    cache = KVCache(2, 3, 64, torch.float32, torch.device("cpu"), 8, 256)
    cache.ensure(8, 256)
    cache.keys.normal_(generator=generator)
    cache.values.normal_(generator=generator)
    keys, values = cache.keys.clone(), cache.values.clone()
    qk = torch.randn(5, 12, 64, generator=generator)          # a split's output: k is a strided view of it
    k, v = qk[:, 9:], torch.randn(5, 30 * 64, generator=generator)[:, 64 * 24:].view(5, 6, 64)[:, :3]
    positions = torch.tensor([0, 255, 17, 64, 3])
    assert kernel.kv_write(cache.keys[1], cache.values[1], 2, k, v, positions)
    keys[1][torch.arange(2, 7), :, positions] = k
    values[1][torch.arange(2, 7), :, positions] = v
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)
    for first, bad in ((2, torch.tensor([0, 256, 1, 1, 1])), (4, positions)):  # a position, then a slot, outside
        with pytest.raises(IndexError):
            kernel.kv_write(cache.keys[1], cache.values[1], first, k, v, bad)
        assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)
    assert not kernel.kv_write(cache.keys[1], cache.values[1], 2, k.double(), v.double(), positions)


@pytest.mark.parametrize("width", [8, 16, 33, 100, 1536, 2048, 4864, 8960, 11008, 14336])
def test_the_fused_silu_gives_torchs_bits(width: int) -> None:
    """``silu.c``: a gated MLP's ``silu(gate) * up`` equals torch's two ops on random rows (tiny values, values past
    exp's range, widths that leave scalar tails), and ``GatedMLP.gated`` takes it. On the AVX2 and AVX-512 machines
    this was built on torch's dispatch runs SLEEF's exp on 8 and 16 floats, so the kernel must be taken on both."""
    from handler.engine.model.moe import GatedMLP

    gated = kernels.fused_silu_mul()
    assert gated is not None, f"the fused SiLU was not taken ({torch.backends.cpu.get_cpu_capability()})"
    mlp = GatedMLP(gate_up=None, down=None)
    generator = torch.Generator().manual_seed(width)
    for rows in (1, 3, 8, 33):
        for scale in (1e-6, 1e-2, 1.0, 10.0, 150.0):
            gate_up = torch.randn(rows, 2 * width, generator=generator) * scale
            gate, up = gate_up.chunk(2, dim=-1)
            expected = F.silu(gate) * up
            assert torch.equal(gated(gate_up), expected), (rows, scale)
            assert torch.equal(mlp.gated(gate_up), expected), (rows, scale)


def test_a_silu_computed_otherwise_would_not_give_torchs_bits() -> None:
    """What the test above guards: the last bits depend on how exp is computed (here in double precision, then
    rounded), so only SLEEF's own exp, as torch calls it, reproduces torch's SiLU."""
    import math

    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 4
    scalar = torch.tensor([v / (1.0 + math.exp(-v)) for v in x.double().tolist()]).float()
    assert not torch.equal(scalar, F.silu(x))
