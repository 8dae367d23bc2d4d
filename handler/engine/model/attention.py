"""A step's attention over the KV cache: each layer's keys and values written for the step's rows, then every row
attended over its own position's keys (``layout.StepLayout``: why a row's keys are decided by its position alone).

Two implementations, one picked per model at load (``pick``):

- ``KernelAttention`` (CPU, fp32): our kernel (``kernels/attention.c``), one call a layer for every decode row and
  prefill chunk of the step, causal work only (a row reads keys up to its own position, in tiles, with an online
  softmax), the query heads of a KV head sharing its reads, over torch's OpenMP threads. A row's bits depend on its
  position, its query and its keys alone, in a summation order fixed by its position: the same whether it is
  prefilled whole, in chunks or after a cached prefix, beside any other rows, as a prefill row or a decode row, with
  any thread count, on AVX2 and AVX-512 machines alike.
- ``MatmulAttention``: two matmuls and a masked softmax over whole KEY_BLOCKs (on CUDA, where the kernel cannot
  run, for gemma2's capped scores, or with ``LLM_ATTENTION_KERNEL=torch``). Rows are invariant to chunking and
  neighbours there too (whole blocks of query rows), but a decode row and a prefill row at one position may differ.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from handler.engine.model.kernels import cpu_flags
from handler.engine.model.kernels.build import build
from handler.engine.model.kv_cache import KEY_BLOCK
from handler.engine.model.layout import KVStore, StepLayout
from handler.knobs import knob, path_knob

log = logging.getLogger(__name__)


class Segment(ctypes.Structure):
    """``attention.c``'s ``segment_t``: one decode group's or prefill chunk's rows and where their keys are."""

    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("slot_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64), ("first_row", ctypes.c_int64), ("count", ctypes.c_int64),
                ("positions", ctypes.c_void_p), ("start", ctypes.c_int64)]


@functools.cache
def attention_library() -> ctypes.CDLL | None:
    """The kernels' library with ``attention_rows`` bound; None where it cannot run (no AVX2 and FMA, no compiler)
    or ``LLM_ATTENTION_KERNEL=torch`` asks for the matmul path (one log line says why)."""
    if knob("LLM_ATTENTION_KERNEL") == "torch":
        return None
    if not {"avx2", "fma"} <= cpu_flags():
        log.info("attention: no AVX2 and FMA on this CPU; attention runs as torch's matmuls")
        return None
    try:
        lib = ctypes.CDLL(str(build(path_knob("LLM_KERNEL_CACHE"))))
    except OSError as error:
        log.warning("attention: the kernel could not be built (%s); attention runs as torch's matmuls", error)
        return None
    lib.attention_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.POINTER(Segment), ctypes.c_int, ctypes.c_int64,
                                   ctypes.c_void_p]
    lib.attention_rows.restype = ctypes.c_int
    lib.attention_use_avx512.argtypes = [ctypes.c_int]
    lib.attention_use_avx512.restype = ctypes.c_int
    use_avx512(lib)
    return lib


def use_avx512(lib: ctypes.CDLL) -> bool:
    """AVX-512 where the CPU has it (the same bits as AVX2: ``attention.c``), unless the kernels are held to AVX2
    (``LLM_INT8_KERNEL_ISA=avx2``, which measures an AVX2 machine's speed here); whether it is taken."""
    return bool(lib.attention_use_avx512(int(knob("LLM_INT8_KERNEL_ISA") != "avx2")))


def pick(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
         softcap: float | None, window: int | None):
    """The model's attention: the kernel's where it runs (CPU, fp32, no score cap, a head_dim of whole 16-float
    vectors up to 256, up to 16 query heads a KV head), else the matmuls."""
    lib = attention_library() if device.type == "cpu" and dtype == torch.float32 and softcap is None else None
    if lib is not None and head_dim % 16 == 0 and head_dim <= 256 and num_heads // num_kv_heads <= 16:
        return KernelAttention(lib, num_heads, num_kv_heads, head_dim, window)
    return MatmulAttention(num_heads, num_kv_heads, head_dim, softcap)


def write_kv(k: torch.Tensor, v: torch.Tensor, layer: int, layout: StepLayout, cache: KVStore) -> None:
    """The step's keys and values into their slots: the decode rows', then each prefill chunk's."""
    if len(layout.decode_groups) == 1 and not layout.prefill_chunks:  # one decode group is every row: no slicing
        cache.write_decode(layer, layout.decode_groups[0][0], k, v, layout.decode_positions)
        return
    row = 0
    for group, count in layout.decode_groups:
        rows = slice(row, row + count)
        cache.write_decode(layer, group, k[rows], v[rows], layout.decode_positions[rows])
        row += count
    for slot, start, length in layout.prefill_chunks:
        cache.write_prefill(layer, slot, start, k[row:row + length], v[row:row + length])
        row += length


class KernelAttention:
    """Every row of a step in one kernel call a layer (``kernels/attention.c``; module doc)."""

    query_block = 1  # a prefill chunk costs its own rows' work, wherever it ends

    def __init__(self, lib: ctypes.CDLL, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None) -> None:
        self.call = lib.attention_rows
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = window or 0
        self._layout: StepLayout | None = None  # the step whose rows ``_segments`` holds (one array for its layers)
        self._segments: ctypes.Array | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, layout: StepLayout,
                 cache: KVStore, sliding: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q ``[rows, heads, head_dim]``, k and v ``[rows, kv_heads, head_dim]``; returns ``[rows, heads *
        head_dim]``."""
        write_kv(k, v, layer, layout, cache)
        return self.attend(q, layout, cache, layer, sliding, sinks)

    def attend(self, q: torch.Tensor, layout: StepLayout, cache: KVStore, layer: int, sliding: bool = False,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The rows' attention over what the cache holds (their own keys and values written); ``sinks``
        contiguous."""
        segments = self.segments(layer, layout, cache)
        if q.stride(2) != 1 or q.stride(1) != self.head_dim:
            q = q.contiguous()
        out = torch.empty(q.shape[0], self.heads * self.head_dim)
        if self.call(q.data_ptr(), q.stride(0), out.data_ptr(), self.heads, self.kv_heads, self.head_dim, segments,
                     len(segments), self.window if sliding else 0, None if sinks is None else sinks.data_ptr()):
            raise IndexError(f"attention: a row's position is outside its KV slot (layer {layer})")
        return out

    def segments(self, layer: int, layout: StepLayout, cache: KVStore) -> ctypes.Array:
        """The step's rows as ``attention.c`` reads them, with this layer's keys and values (one array per step,
        its pointers set for each layer)."""
        if layout is not self._layout:
            self._layout = layout
            self._segments = (Segment * (len(layout.decode_groups) + len(layout.prefill_chunks)))()
        segments, index, row = self._segments, 0, 0
        positions = layout.decode_positions
        for (group, count), length in zip(layout.decode_groups, layout.decode_lengths, strict=True):
            keys, values = cache.decode_view(layer, group, length)  # [count, kv_heads, length, head_dim]
            segments[index] = Segment(keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1), row, count,
                                      positions.data_ptr() + row * 8, 0)
            index, row = index + 1, row + count
        for slot, start, length in layout.prefill_chunks:
            keys, values = cache.prefill_view(layer, slot, start + length)  # [1, kv_heads, length, head_dim]
            segments[index] = Segment(keys.data_ptr(), values.data_ptr(), 0, keys.stride(1), row, length, None, start)
            index, row = index + 1, row + length
        return segments


class MatmulAttention:
    """Attention as torch's matmuls over whole KEY_BLOCKs under the layout's masks (module doc)."""

    query_block = KEY_BLOCK  # a prefill block is computed as all the query positions of its KEY_BLOCK

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, softcap: float | None) -> None:
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.softcap = softcap

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, layout: StepLayout,
                 cache: KVStore, sliding: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        decode_masks = layout.window_decode_masks if sliding else layout.decode_masks
        prefill_masks = layout.window_prefill_masks if sliding else layout.prefill_masks
        if len(decode_masks) == 1 and not prefill_masks:  # one decode group is every row: no gathering copy
            (group, _count), = layout.decode_groups
            cache.write_decode(layer, group, k, v, layout.decode_positions)
            return self._decode(q, layer, group, decode_masks[0], cache, sinks)
        write_kv(k, v, layer, layout, cache)
        out = torch.empty(q.shape[0], self.heads * self.head_dim, dtype=q.dtype, device=q.device)
        row = 0
        for (group, count), mask in zip(layout.decode_groups, decode_masks, strict=True):
            out[row:row + count] = self._decode(q[row:row + count], layer, group, mask, cache, sinks)
            row += count
        for (slot, start, length), mask in zip(layout.prefill_blocks, prefill_masks, strict=True):
            out[row:row + length] = self._prefill(q[row:row + length], layer, slot, start, mask, cache, sinks)
            row += length
        return out

    def _decode(self, q: torch.Tensor, layer: int, group: object, mask: torch.Tensor, cache: KVStore,
                sinks: torch.Tensor | None) -> torch.Tensor:
        n, groups = q.shape[0], self.heads // self.kv_heads
        keys, values = cache.decode_view(layer, group, mask.shape[-1])  # [n, kv_heads, L, head_dim]
        # The query heads that share a KV head become that head's "query rows": [n, kv_heads, groups, head_dim]
        q = q.view(n, self.kv_heads, groups, self.head_dim)
        if n > 1 and keys.stride(0) == 0:
            # one slot's keys read by several rows (speculative decoding's drafts, ``KVStore.decode_view``): row by
            # row, as each position's lone decode row is computed (a batched matmul over the stride-0 view rounds
            # differently, measured: 4e-6)
            out = torch.cat([attend(q[i:i + 1], keys[i:i + 1], values[i:i + 1], mask[i:i + 1], self.softcap, sinks)
                             for i in range(n)])
        else:
            out = attend(q, keys, values, mask, self.softcap, sinks)
        return out.reshape(n, self.heads * self.head_dim)

    def _prefill(self, q: torch.Tensor, layer: int, slot: object, start: int, mask: torch.Tensor, cache: KVStore,
                 sinks: torch.Tensor | None) -> torch.Tensor:
        """One prefill block's queries (positions ``start..start+t``, inside one KEY_BLOCK) as rows ``start %
        KEY_BLOCK..`` of the whole KEY_BLOCK's, the other rows zero (``StepLayout``: why)."""
        t, groups, kv_heads, dim = q.shape[0], self.heads // self.kv_heads, self.kv_heads, self.head_dim
        keys, values = cache.prefill_view(layer, slot, mask.shape[-1])  # [1, kv_heads, length, head_dim]
        offset = start % KEY_BLOCK
        rows = q.new_zeros(kv_heads, groups, KEY_BLOCK, dim)
        rows[:, :, offset:offset + t] = q.view(t, kv_heads, groups, dim).permute(1, 2, 0, 3)
        if sinks is not None:  # one per query row: [kv_heads, groups * KEY_BLOCK, 1], (group, t) order
            sinks = sinks.expand(-1, -1, KEY_BLOCK).reshape(kv_heads, groups * KEY_BLOCK, 1)
        out = attend(rows.view(1, kv_heads, groups * KEY_BLOCK, dim), keys, values, mask, self.softcap, sinks)
        out = out.view(kv_heads, groups, KEY_BLOCK, dim)[:, :, offset:offset + t]
        return out.permute(2, 0, 1, 3).reshape(t, -1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q k^T + mask) v`` (q already carries 1/sqrt(head_dim)); ``mask`` is 0 where a query may attend,
    -inf elsewhere. With ``softcap`` (gemma2) the scores are ``tanh(q k^T) * softcap`` before the mask, q carrying
    ``1 / softcap`` too: torch's tanh computes every element alike wherever it falls in a vector (measured: the
    same bits alone, at any offset or in any batch), so capped rows stay independent of their neighbours. With
    ``sinks`` (gpt_oss; one logit per query row, broadcast against ``scores[..., :1]``) each row's softmax runs
    over its scores and its sink, whose probability is dropped: the sink takes a share of the weight, no value.

    On CPU as two matmuls and a row softmax rather than SDPA: the CPU flash kernel divides its work between threads
    by the size of the batch, so a decode row's result changed with the number of rows beside it (measured with 2
    threads: 1 row against 3 differed by 6e-8, which int8 turned into a different logprob 12 tokens later). Here
    no sum is split by the batch: the score dot products run over head_dim, each softmax over one row, and the
    value sums over the row's keys (whole KEY_BLOCKs, the masked ones adding exact zeros)."""
    if q.device.type != "cpu" and softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.to(q.dtype), scale=1.0)
    scores = torch.matmul(q, keys.transpose(-1, -2))
    if softcap is not None:
        scores = torch.tanh(scores).mul_(softcap)
    scores = scores.add_(mask)
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), values)
    scores = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1)[..., :-1], values)
