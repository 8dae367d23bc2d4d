"""The batched LoRA delta (``lora_delta``) keeps each row's result bit for bit what the row gets alone, for 1..17
rows of an adapter beside rows of other adapters (one of another rank) and of the base model, on the embedded
model's projection shapes; and it is the adapter's delta (against float64)."""

from __future__ import annotations

import pytest
import torch

from handler.engine.model.linear import DenseLinear
from handler.engine.model.lora import AdapterWeights, LoraLinear, SiteDelta
from handler.engine.model.lora_delta import AdapterBatch

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]   # qkv, out, gate_up, down of the embedded model


def adapter(name: str, in_dim: int, out: int, rank: int, seed: int) -> AdapterWeights:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(in_dim, rank, generator=g) / in_dim ** 0.5
    b = torch.randn(rank, out, generator=g)
    a[3, 0], b[1, 5] = 40.0, -25.0   # outliers in the weights too
    return AdapterWeights(name, name.encode(), rank, ("q_proj",), ({"qkv": SiteDelta(a, b)},))


def inputs(num_rows: int, in_dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(in_dim)
    x = torch.randn(num_rows, in_dim, generator=g)
    x[:, 7] *= 3000.0                  # an outlier channel, as real activations have
    x[::3, 100] = -1.5e4
    x[1::4, 200] = 1e-6
    return x


def run(layer: LoraLinear, batch: AdapterBatch, x: torch.Tensor, groups: list) -> torch.Tensor:
    batch.set_groups(groups)
    try:
        return layer(x)
    finally:
        batch.set_groups([])


@pytest.mark.parametrize(("in_dim", "out"), SHAPES)
@pytest.mark.parametrize("rank", [8, 16])
def test_each_rows_delta_is_the_rows_delta_alone(in_dim: int, out: int, rank: int) -> None:
    batch = AdapterBatch()
    # a zero base: the layer's output is exactly the delta (0 + d == d), through LoraLinear's own placement
    layer = LoraLinear(DenseLinear(torch.zeros(out, in_dim), None), 0, "qkv", batch)
    main, same_rank = adapter("main", in_dim, out, rank, 1), adapter("same", in_dim, out, rank, 2)
    other_rank = adapter("other", in_dim, out, 24 - rank, 3)
    x = inputs(40, in_dim)
    alone = [run(layer, batch, x[i:i + 1], [(main, [0])])[0] for i in range(17)]
    for n in range(1, 18):
        # x's rows 0..n-1 under main, shuffled among neighbours: rows of another adapter of its rank, of one of
        # another rank, and of the base model
        mixed = torch.cat([x[:n], x[20:20 + n + 3]])
        order = torch.randperm(len(mixed), generator=torch.Generator().manual_seed(n))
        mixed = mixed[order]
        position = {int(original): i for i, original in enumerate(order)}
        main_rows = [position[i] for i in range(n)]
        neighbours = [position[i] for i in range(n, len(mixed))]
        groups = [(same_rank, neighbours[0::3]), (main, main_rows), (other_rank, neighbours[1::3])]
        y = run(layer, batch, mixed, groups)
        for i in range(n):
            assert torch.equal(y[main_rows[i]], alone[i]), (n, i)
        for row in neighbours[2::3]:   # base rows get no delta
            assert not y[row].any()


@pytest.mark.parametrize(("in_dim", "out"), SHAPES)
def test_the_delta_is_the_adapters_delta(in_dim: int, out: int) -> None:
    batch = AdapterBatch()
    layer = LoraLinear(DenseLinear(torch.zeros(out, in_dim), None), 0, "qkv", batch)
    first, second = adapter("first", in_dim, out, 8, 4), adapter("second", in_dim, out, 16, 5)
    x = inputs(9, in_dim)
    y = run(layer, batch, x, [(first, [0, 2, 4, 6]), (second, [1, 3, 5])])
    for rows, weights in (([0, 2, 4, 6], first), ([1, 3, 5], second)):
        delta = weights.deltas[0]["qkv"]
        expected = (x[rows].double() @ delta.a.double()) @ delta.b.double()
        scale = expected.abs().max()
        assert (y[rows].double() - expected).abs().max() <= 1e-5 * scale
    assert not y[[7, 8]].any()


def test_tables_built_for_more_adapters_serve_a_step_with_fewer() -> None:
    """A step after one with more adapters reuses the wider tables; a row's result is the same either way."""
    batch = AdapterBatch()
    layer = LoraLinear(DenseLinear(torch.zeros(576, 576), None), 0, "qkv", batch)
    one, two = adapter("one", 576, 576, 8, 6), adapter("two", 576, 576, 8, 7)
    x = inputs(4, 576)
    both = run(layer, batch, x, [(one, [0, 1]), (two, [2, 3])])
    only_two = run(layer, batch, x[2:], [(two, [0, 1])])
    assert batch._tables[(0, "qkv", 8)].slots == {one: 0, two: 1}   # not rebuilt for the smaller set
    assert torch.equal(only_two, both[2:])
