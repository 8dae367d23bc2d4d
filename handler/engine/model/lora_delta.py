"""The adapter deltas of a step's rows, every adapter of a site at once, each row's arithmetic fixed by its own
adapter and shapes alone (batch invariance by construction, not by the luck of a BLAS kernel).

Why ``embedding_bag``: a LoRA delta is two weighted sums of table rows. ``h = x @ A`` is, for one row, the sum over
``k`` of ``x[k] * A[k, :]`` (a bag of ``in`` rows of the table ``A [in, rank]`` weighted by ``x``), and ``h @ B`` the
sum over ``r`` of ``h[r] * B[r, :]`` (a bag of ``rank`` rows of ``B [rank, out]`` weighted by ``h``). PyTorch's CPU
``embedding_bag(mode="sum", per_sample_weights=...)`` computes each bag on its own: ``at::parallel_for`` over bags,
and for each bag one accumulation over its indices in order into that bag's output row (fbgemm's EmbeddingSpMDM
kernel, generated for the table's row width only; aten/src/ATen/native/EmbeddingBag.cpp, index_select_scale_add).
Nothing in a bag's arithmetic reads another bag or the number of bags: a row's delta is a function of its values,
its adapter's table rows and the row width (``rank``, ``out``), whatever rows run beside it. A GEMM of the same rows
is not: its kernel, blocking and threading change with the number of rows, and so can the rounding of each row.

So one step's rows of every adapter of a site go through two calls; the tables are the adapters' own ``a``/``b``
side by side (built once per set of adapters, kept across steps), and a row's bag indexes its adapter's block.
Adapters whose site deltas differ in width (rank x modules) go through separate calls: the width is part of the
kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class _Tables:
    slots: dict[object, int]   # adapter -> its block in the tables
    a: torch.Tensor            # [num_adapters * in, width]: each adapter's a, one block after another
    b: torch.Tensor            # [num_adapters * width, out]


@dataclass(frozen=True, slots=True)
class BagPlan:
    """One width class of a site in one step: which rows, and each row's bags in the tables."""

    rows: torch.Tensor         # [n]: the rows of the step under these adapters
    a_index: torch.Tensor      # [n * in]: row i's bag is its adapter's block of ``a``, rows 0..in-1
    a_offsets: torch.Tensor    # [n]
    b_index: torch.Tensor      # [n * width]
    b_offsets: torch.Tensor    # [n]
    tables: _Tables


@dataclass(slots=True)
class AdapterBatch:
    """The rows of the step being run, by adapter (rows of the base model are in no group); set by the runner
    around each forward (``set_groups``), read by every ``LoraLinear`` through ``plans``."""

    groups: list[tuple[object, list[int]]] = field(default_factory=list)
    device: torch.device | str = "cpu"
    _plans: dict = field(default_factory=dict)     # (layer, site) -> [BagPlan], this step
    _indexes: dict = field(default_factory=dict)   # bag indices by (rows, slots, in, width), this step
    _tables: dict = field(default_factory=dict)    # (layer, site, width) -> _Tables, across steps

    def set_groups(self, groups: list[tuple[object, list[int]]], device: torch.device | str = "cpu") -> None:
        self.groups, self.device = groups, device
        self._plans.clear()
        self._indexes.clear()

    def plans(self, layer: int, site: str) -> list[BagPlan]:
        """The bag plans of ``site`` in ``layer`` for this step (built at the first layer that asks)."""
        plans = self._plans.get((layer, site))
        if plans is None:
            plans = self._plans[(layer, site)] = self._build(layer, site)
        return plans

    def _build(self, layer: int, site: str) -> list[BagPlan]:
        by_width: dict[int, list[tuple[object, object, list[int]]]] = {}
        for adapter, rows in self.groups:
            delta = adapter.deltas[layer].get(site)
            if delta is not None:
                by_width.setdefault(delta.a.shape[1], []).append((adapter, delta, rows))
        plans = []
        for width, members in by_width.items():
            tables = self._site_tables(layer, site, width, members)
            row_ids = tuple(row for _adapter, _delta, rows in members for row in rows)
            slots = tuple(tables.slots[adapter] for adapter, _delta, rows in members for _ in rows)
            plans.append(self._plan(row_ids, slots, members[0][1].a.shape[0], width, tables))
        return plans

    def _site_tables(self, layer: int, site: str, width: int, members: list) -> _Tables:
        """The tables of the last set of adapters seen at this site, rebuilt only when an adapter is not in them
        (a step with fewer adapters reuses them: a bag reads its own block only)."""
        tables = self._tables.get((layer, site, width))
        if tables is None or any(adapter not in tables.slots for adapter, _delta, _rows in members):
            slots = {adapter: i for i, (adapter, _delta, _rows) in enumerate(members)}
            tables = _Tables(slots, torch.cat([delta.a for _adapter, delta, _rows in members]),
                             torch.cat([delta.b for _adapter, delta, _rows in members]))
            self._tables[(layer, site, width)] = tables
        return tables

    def _plan(self, row_ids: tuple[int, ...], slots: tuple[int, ...], in_dim: int, width: int,
              tables: _Tables) -> BagPlan:
        key = (row_ids, slots, in_dim, width)
        index = self._indexes.get(key)
        if index is None:
            device, n = self.device, len(row_ids)
            slot = torch.tensor(slots, dtype=torch.long, device=device)[:, None]
            a_index = (slot * in_dim + torch.arange(in_dim, device=device)).reshape(-1)
            b_index = (slot * width + torch.arange(width, device=device)).reshape(-1)
            index = self._indexes[key] = (torch.tensor(row_ids, dtype=torch.long, device=device), a_index,
                                          torch.arange(n, device=device) * in_dim, b_index,
                                          torch.arange(n, device=device) * width)
        return BagPlan(*index, tables)


def bag_delta(x: torch.Tensor, plan: BagPlan) -> torch.Tensor:
    """``(x @ A) @ B`` of each row ``x [n, in]`` under its own adapter -> ``[n, out]`` (module doc: two bag sums,
    each row's on its own)."""
    h = F.embedding_bag(plan.a_index, plan.tables.a, plan.a_offsets, mode="sum",
                        per_sample_weights=x.reshape(-1))                               # [n, width]
    return F.embedding_bag(plan.b_index, plan.tables.b, plan.b_offsets, mode="sum",
                           per_sample_weights=h.reshape(-1))                            # [n, out]
