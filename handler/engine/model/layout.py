"""Where the rows of one flat step batch go, and what each row's attention reads: positions, the decode groups and
prefill blocks a step's attention runs over, and their masks (``StepLayout``, ``build_layout``). Built by the runner
before each forward; read by the decoder's attention. ``KVStore`` is what the decoder needs of the memory the keys
and values live in: the dense ``kv_cache.KVCache``, or the runner's budgeted ``KVSpace`` of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from handler.engine.model.kv_cache import KEY_BLOCK, whole_blocks


class KVStore(Protocol):
    """Where a layer's keys and values are written and read (``handle``: a decode group's or a prefill slot's, as
    the store hands them out in the layout)."""

    def write_decode(self, layer: int, group: object, k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor) -> None: ...

    def decode_view(self, layer: int, group: object, length: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def write_prefill(self, layer: int, slot: object, start: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def prefill_view(self, layer: int, slot: object, length: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(slots=True)
class StepLayout:
    """Where the rows of one flat step batch go.

    Rows ``[0, num_decode)`` are one token per decoding slot, in ``decode_groups``: runs of slots the cache reads
    as one batch, ``(handle, count)`` (the handle is the cache's: ``(first_slot, count)`` for a dense
    ``KVCache``); then come the prefill chunks, ``(slot, start, length)`` each with its tokens at consecutive
    positions, in ``prefill_chunks`` and cut into ``prefill_blocks`` that never cross a multiple of KEY_BLOCK.

    What a row's attention reads is decided by its position alone: keys ``0..p`` (a sliding layer's ``p - window +
    1..p``), so it is the same number whether its prompt is prefilled whole, in chunks, or after a cached prefix, and
    whatever else is in the step (measured: keys read up to the chunk's end made a prefix's rows differ between a
    24- and a 37-token prefill on AVX-512, and int8 turned that into logits 1 apart). The attention kernel
    (``attention.KernelAttention``) reads exactly those keys and needs nothing more from the layout.

    The matmul path (``attention.MatmulAttention``: on CUDA, or where the kernel does not run) reads keys in whole
    KEY_BLOCKs under masks, built on first use: ``decode_masks`` one ``[count, 1, 1, L]`` per group (L: the group's
    longest row, in whole KEY_BLOCKs), ``prefill_masks`` one ``[1, 1, G*KEY_BLOCK, K]`` per block (G query heads
    share a KV head), K the block's end rounded up to whole KEY_BLOCKs, its rows every position of the KEY_BLOCK the
    block lies in, whichever of them the block holds. Why whole KEY_BLOCKs of query rows: a CPU GEMM's result for
    one row can depend on how many rows are beside it and where the row falls among them (MKL's sgemm, measured on
    an Intel AVX-512 machine held to AVX2 as Intel AVX2 CPUs run it: q k^T of a row differed between 39 and 111
    rows, and a 37-token prompt's last 13 logits rows between whole and after a 24-token prefix). That path computes
    each block as all KEY_BLOCK positions (the ones it lacks as zero rows) with each query at row ``position %
    KEY_BLOCK``: every position's attention is the same shapes at the same row however the prompt was cut.

    ``window_decode_masks`` / ``window_prefill_masks``: the same shapes for a model's sliding-window layers (a query
    at ``p`` sees keys in ``(p - window, p]``), for a layout that has a ``window`` (``with_window``).
    """

    num_decode: int
    decode_positions: torch.Tensor
    decode_groups: list[tuple[object, int]]
    decode_lengths: list[int]          # keys each decode group's view reads: its longest row's, in whole KEY_BLOCKs
    prefill_chunks: list[tuple[object, int, int]]
    prefill_blocks: list[tuple[object, int, int]]
    groups: int                        # query heads per KV head
    window: int | None = None
    _masks: dict = field(default_factory=dict)   # window (None: full) -> (decode masks, prefill masks), built once

    @property
    def decode_masks(self) -> list[torch.Tensor]:
        return self._built(None)[0]

    @property
    def prefill_masks(self) -> list[torch.Tensor]:
        return self._built(None)[1]

    @property
    def window_decode_masks(self) -> list[torch.Tensor] | None:
        return None if self.window is None else self._built(self.window)[0]

    @property
    def window_prefill_masks(self) -> list[torch.Tensor] | None:
        return None if self.window is None else self._built(self.window)[1]

    def _built(self, window: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        masks = self._masks.get(window)
        if masks is None:
            masks = self._masks[window] = _masks(self, window)
        return masks


def build_layout(decode_positions: list[int], prefill_chunks: list[tuple[object, int, int]], groups: int,
                 device: torch.device, decode_groups: list[tuple[object, int]] | None = None,
                 window: int | None = None) -> StepLayout:
    """The layout of one step (``StepLayout``): each decode group's view reads its longest row's keys rounded up to
    whole KEY_BLOCKs. Without ``decode_groups`` the decode rows are slots ``0..n-1`` of a dense ``KVCache``.
    ``window``: the model's sliding window, where it has sliding layers (else the model sets it, ``with_window``)."""
    num_decode = len(decode_positions)
    positions = torch.tensor(decode_positions, dtype=torch.long, device=device)
    if decode_groups is None:
        decode_groups = [((0, num_decode), num_decode)] if num_decode else []
    lengths, row = [], 0
    for _handle, count in decode_groups:
        lengths.append(whole_blocks(max(decode_positions[row:row + count]) + 1))
        row += count
    blocks = [block for chunk in prefill_chunks for block in _key_blocks(*chunk)]
    return StepLayout(num_decode, positions, decode_groups, lengths, list(prefill_chunks), blocks, groups, window)


def decode_layout(positions: torch.Tensor, handle: object, length: int, groups: int,
                  window: int | None = None) -> StepLayout:
    """The layout of a step whose rows all decode into one group (``handle``), each reading ``length`` keys (whole
    KEY_BLOCKs, at least its own position + 1): ``build_layout``'s, with its masks computed from the positions on
    their device and no value read back to the host, so a CUDA graph can record it (``runners.cuda_graphs``).
    ``window``: the sliding-window masks too (the model's, else the model would add them itself)."""
    count = positions.shape[0]
    keys = torch.arange(length, device=positions.device)
    layout = StepLayout(count, positions, [(handle, count)], [length], [], [], groups, window)
    for size in {None, window}:
        layout._masks[size] = ([_additive(_allowed(keys, positions, size)).view(count, 1, 1, -1)], [])
    return layout


def with_window(layout: StepLayout, window: int) -> StepLayout:
    """``layout`` for a model whose sliding layers see keys in ``(p - window, p]`` (transformers'
    ``sliding_window_overlay``), over the same whole KEY_BLOCKs as the full masks."""
    layout.window = window
    return layout


def _masks(layout: StepLayout, window: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The decode groups' masks and the prefill blocks' (``StepLayout``), causal and, with ``window``, within it."""
    positions = layout.decode_positions
    device = positions.device
    decode_masks, row = [], 0
    for (_handle, count), length in zip(layout.decode_groups, layout.decode_lengths, strict=True):
        keys = torch.arange(length, device=device)
        decode_masks.append(_additive(_allowed(keys, positions[row:row + count], window)).view(count, 1, 1, -1))
        row += count
    masks = []
    groups = layout.groups
    for _slot, start, length in layout.prefill_blocks:  # the whole KEY_BLOCK of query positions the block lies in
        first = start - start % KEY_BLOCK
        query_pos = torch.arange(first, first + KEY_BLOCK, device=device).repeat(groups)  # (group, t) order
        keys = torch.arange(whole_blocks(start + length), device=device)
        masks.append(_additive(_allowed(keys, query_pos, window)).view(1, 1, groups * KEY_BLOCK, -1))
    return decode_masks, masks


def _allowed(keys: torch.Tensor, queries: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[queries, keys]``: True where the query at that position may attend the key."""
    allowed = keys <= queries[:, None]
    return allowed if window is None else allowed & (keys > queries[:, None] - window)


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    """A boolean mask (True = may attend) as the float mask attention adds to its scores: 0 or -inf."""
    return torch.where(allowed, 0.0, float("-inf"))


def _key_blocks(slot: object, start: int, length: int) -> list[tuple[object, int, int]]:
    """A prefill chunk cut where its positions cross a multiple of KEY_BLOCK."""
    blocks, end = [], start + length
    while start < end:
        stop = min(end, (start // KEY_BLOCK + 1) * KEY_BLOCK)
        blocks.append((slot, start, stop - start))
        start = stop
    return blocks
