"""Where the rows of one flat step batch go, and what each row's attention reads: positions, the decode groups and
prefill blocks a step's attention runs over, and their masks (``StepLayout``, ``build_layout``). Built by the runner
before each forward; read by the decoder's attention. ``KVStore`` is what the decoder needs of the memory the keys
and values live in: the dense ``kv_cache.KVCache``, or the runner's budgeted ``KVSpace`` of them.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    ``KVCache``); then come the prefill chunks, each ``(slot, start, length)`` with its tokens at consecutive
    positions, cut into ``prefill_blocks`` that never cross a multiple of KEY_BLOCK. ``decode_masks`` are one
    ``[count, 1, 1, L]`` per group (L: the group's longest row, in whole KEY_BLOCKs), the ``prefill_masks`` one
    ``[1, 1, G*KEY_BLOCK, K]`` per block (G query heads share a KV head), K the block's end rounded up to whole
    KEY_BLOCKs; its rows are every position of the KEY_BLOCK the block lies in, whichever of them the block holds.

    Why blocks: a query's attention is computed over exactly the keys its own position decides (whole blocks up to
    its block's end), so it is the same number whether its prompt is prefilled whole, in chunks, or after a cached
    prefix, and whatever else is in the step (measured: keys read up to the chunk's end made a prefix's rows
    differ between a 24- and a 37-token prefill on AVX-512, and int8 turned that into logits 1 apart). Why whole
    KEY_BLOCKs of query rows: a CPU GEMM's result for one row can depend on how many rows are beside it and where
    the row falls among them (MKL's sgemm, measured on an Intel AVX-512 machine held to AVX2 as Intel AVX2 CPUs run
    it: q k^T of a row differed between 39 and 111 rows, and a 37-token prompt's last 13 logits rows between
    whole and after a 24-token prefix). The decoder computes each block as all KEY_BLOCK positions (the ones it
    lacks as zero rows) with each query at row ``position % KEY_BLOCK``: every position's attention is the same
    shapes at the same row however the prompt was cut.

    ``window_decode_masks`` / ``window_prefill_masks``: the same shapes for a model's sliding-window layers (a query
    at ``p`` sees keys in ``(p - window, p]``), None until a model with such layers needs them (``with_window``).
    """

    num_decode: int
    decode_positions: torch.Tensor
    decode_groups: list[tuple[object, int]]
    decode_masks: list[torch.Tensor]
    prefill_blocks: list[tuple[object, int, int]]
    prefill_masks: list[torch.Tensor]
    window: int | None = None
    window_decode_masks: list[torch.Tensor] | None = None
    window_prefill_masks: list[torch.Tensor] | None = None


def build_layout(decode_positions: list[int], prefill_chunks: list[tuple[object, int, int]], groups: int,
                 device: torch.device, decode_groups: list[tuple[object, int]] | None = None,
                 window: int | None = None) -> StepLayout:
    """Positions tensor and attention masks (0 where a query may attend, -inf elsewhere) for one step. Each decode
    group's attention reads its longest row's keys rounded up to whole KEY_BLOCKs (the rest are masked out).
    Without ``decode_groups`` the decode rows are slots ``0..n-1`` of a dense ``KVCache``. ``window``: also the
    masks of sliding-window layers (else the model adds them when it has such layers, ``with_window``)."""
    num_decode = len(decode_positions)
    positions = torch.tensor(decode_positions, dtype=torch.long, device=device)
    if decode_groups is None:
        decode_groups = [((0, num_decode), num_decode)] if num_decode else []
    blocks = [block for chunk in prefill_chunks for block in _key_blocks(*chunk)]
    decode_masks, masks = _masks(decode_positions, positions, decode_groups, blocks, groups, None)
    layout = StepLayout(num_decode, positions, decode_groups, decode_masks, blocks, masks)
    return layout if window is None else with_window(layout, window, groups)


def decode_layout(positions: torch.Tensor, handle: object, length: int, groups: int,
                  window: int | None = None) -> StepLayout:
    """The layout of a step whose rows all decode into one group (``handle``), each reading ``length`` keys (whole
    KEY_BLOCKs, at least its own position + 1): ``build_layout``'s, computed from the positions on their device
    with no value read back to the host, so a CUDA graph can record it (``runners.cuda_graphs``). ``window``: the
    sliding-window masks too (the model's, else the model would add them itself)."""
    count = positions.shape[0]
    keys = torch.arange(length, device=positions.device)
    masks = [_additive(_allowed(keys, positions, None)).view(count, 1, 1, -1)]
    layout = StepLayout(count, positions, [(handle, count)], masks, [], [])
    if window is not None:
        layout.window_decode_masks = [_additive(_allowed(keys, positions, window)).view(count, 1, 1, -1)]
        layout.window_prefill_masks, layout.window = [], window
    return layout


def with_window(layout: StepLayout, window: int, groups: int) -> StepLayout:
    """Adds the masks of sliding-window layers to ``layout``: a query at ``p`` sees keys in ``(p - window, p]``
    (transformers' ``sliding_window_overlay``), over the same whole KEY_BLOCKs as the full masks."""
    positions = layout.decode_positions
    layout.window_decode_masks, layout.window_prefill_masks = _masks(
        positions.tolist(), positions, layout.decode_groups, layout.prefill_blocks, groups, window)
    layout.window = window
    return layout


def _masks(decode_positions: list[int], positions: torch.Tensor, decode_groups: list[tuple[object, int]],
           blocks: list[tuple[object, int, int]], groups: int,
           window: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The decode groups' masks and the prefill blocks' (``StepLayout``), causal and, with ``window``, within it."""
    device = positions.device
    decode_masks, row = [], 0
    for _handle, count in decode_groups:
        rows = positions[row:row + count]
        keys = torch.arange(whole_blocks(max(decode_positions[row:row + count]) + 1), device=device)
        decode_masks.append(_additive(_allowed(keys, rows, window)).view(count, 1, 1, -1))
        row += count
    masks = []
    for _slot, start, length in blocks:  # the whole KEY_BLOCK of query positions the block lies in (StepLayout)
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
