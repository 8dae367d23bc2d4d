"""Our attention kernel (``handler/engine/model/kernels/attention.c``, ``attention.KernelAttention``): close to
float64 attention, and a row's bits decided by its position alone. The reference is the kernel's own order for one row
(``attention.c``: a score's chain over head_dim, tiles of 64 keys at multiples of 64, an online softmax across them):
the same bits whether the row is computed as a lone decode row, in a prefill chunk of any length starting anywhere,
beside decode rows of other slots and other chunks, on one thread or two, with AVX2 or AVX-512."""

from __future__ import annotations

import pytest
import torch

from handler.engine.model import attention
from handler.engine.model.attention import KernelAttention, MatmulAttention
from handler.engine.model.kernels import cpu_flags
from handler.engine.model.kv_cache import KVCache
from handler.engine.model.layout import build_layout

pytestmark = pytest.mark.skipif(attention.attention_library() is None, reason="the kernel needs AVX2, FMA and cc")
CPU = torch.device("cpu")
# (heads, kv_heads, head_dim): the embedded model's, llama's 4:1 at 128, no grouping at 80, 16 heads a KV head
SHAPES = [(9, 3, 64), (8, 2, 128), (4, 4, 80), (16, 1, 64)]


class Sequence:
    """One slot's keys, values and queries at positions 0..n-1, random and fixed."""

    def __init__(self, heads: int, kv_heads: int, dim: int, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.q = torch.randn(n, heads, dim, generator=generator) * 0.4
        self.k = torch.randn(n, kv_heads, dim, generator=generator)
        self.v = torch.randn(n, kv_heads, dim, generator=generator)


def kernel(heads: int, kv_heads: int, dim: int, window: int | None = None) -> KernelAttention:
    return KernelAttention(attention.attention_library(), heads, kv_heads, dim, window)


def new_cache(kv_heads: int, dim: int, slots: int, length: int) -> KVCache:
    cache = KVCache(1, kv_heads, dim, torch.float32, CPU, slots, length)
    cache.ensure(slots, length)
    return cache


def prefill(attend, seq: Sequence, cuts: list[int], slot: int = 0, cache: KVCache | None = None,
            window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every position's output, the prompt cut at ``cuts``: ``[n, heads * dim]``."""
    n, kv_heads, dim = seq.q.shape[0], seq.k.shape[1], seq.k.shape[2]
    cache = new_cache(kv_heads, dim, slot + 1, n) if cache is None else cache
    bounds, rows = [0, *cuts, n], []
    for start, end in zip(bounds, bounds[1:], strict=False):
        layout = build_layout([], [(slot, start, end - start)], seq.q.shape[1] // kv_heads, CPU, window=window)
        rows.append(attend(seq.q[start:end], seq.k[start:end], seq.v[start:end], 0, layout, cache,
                           sliding=window is not None, sinks=sinks))
    return torch.cat(rows)


def exact(seq: Sequence, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention in float64, row by row."""
    q, k, v = seq.q.double(), seq.k.double(), seq.v.double()
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    out = torch.empty(n, heads, dim, dtype=torch.float64)
    for p in range(n):
        first = 0 if window is None else max(0, p - window + 1)
        for h in range(heads):
            scores = k[first:p + 1, h // group] @ q[p, h]
            if sinks is not None:
                scores = torch.cat([scores, sinks.reshape(-1)[h:h + 1].double()])
            weights = torch.softmax(scores, 0)[:p + 1 - first]
            out[p, h] = weights @ v[first:p + 1, h // group]
    return out.reshape(n, heads * dim)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_is_attention(shape: tuple[int, int, int]) -> None:
    """Against float64 softmax attention, over 300 positions (tiles of 64, a partial last one): as close as the
    matmul path, which it replaces."""
    seq = Sequence(*shape, 300, seed=1)
    expected = exact(seq)
    ours = prefill(kernel(*shape), seq, [])
    theirs = prefill(MatmulAttention(*shape, None), seq, [])
    assert (ours.double() - expected).abs().max() < 1e-5
    assert (ours.double() - expected).abs().max() <= 2 * (theirs.double() - expected).abs().max()


def test_a_sliding_window_and_sinks_are_the_layers_math() -> None:
    """gpt_oss's layers: keys in (p - window, p] (a window across tile boundaries), and one sink logit per head."""
    seq = Sequence(8, 2, 64, 200, seed=2)
    sinks = torch.randn(2, 4, 1, generator=torch.Generator().manual_seed(3))
    ours = prefill(kernel(8, 2, 64, window=48), seq, [], window=48, sinks=sinks)
    assert (ours.double() - exact(seq, window=48, sinks=sinks)).abs().max() < 1e-5
    full = prefill(kernel(8, 2, 64, window=48), seq, [], sinks=sinks)  # a full-attention layer of the same model
    assert (full.double() - exact(seq, sinks=sinks)).abs().max() < 1e-5


@pytest.mark.parametrize("shape", SHAPES)
def test_a_rows_bits_do_not_depend_on_how_its_prompt_was_cut(shape: tuple[int, int, int]) -> None:
    seq = Sequence(*shape, 260, seed=4)
    attend = kernel(*shape)
    whole = prefill(attend, seq, [])
    for cuts in ([1], [63], [64], [65, 130], [3, 70, 71, 200, 259], list(range(10, 260, 37))):
        assert torch.equal(prefill(attend, seq, cuts), whole), cuts


def test_a_decode_row_gives_a_prefill_rows_bits_beside_anything() -> None:
    """Each of a prompt's last positions as a lone decode row, and in a step beside a longer sequence's decode row
    and two other prefill chunks, windowed too: the bits its prefill row has (the prefix cache and chunked prefill
    mix the two; a preempted sequence recomputes its decoded tokens as prefill)."""
    shape, n = (9, 3, 64), 200
    seq, other, third = Sequence(*shape, n, seed=5), Sequence(*shape, 300, seed=6), Sequence(*shape, 90, seed=7)
    for window in (None, 70):
        attend = kernel(*shape, window=window)
        cache = new_cache(3, 64, 4, 320)
        whole = prefill(attend, seq, [], slot=0, cache=cache, window=window)
        prefill(attend, other, [], slot=1, cache=cache, window=window)
        for p in (n - 1, n - 2, 128, 64, 63, 0):
            alone = build_layout([p], [], 3, CPU, [((0, 1), 1)], window=window)
            row = attend(seq.q[p:p + 1], seq.k[p:p + 1], seq.v[p:p + 1], 0, alone, cache, sliding=window is not None)
            assert torch.equal(row, whole[p:p + 1]), (window, p)
            # slots 0 and 1 decode as one group; slot 2 prefills two chunks' worth in this step (positions 0..89)
            crowd = build_layout([p, 299], [(2, 0, 50), (3, 0, 90)], 3, CPU, [((0, 2), 2)], window=window)
            q = torch.cat([seq.q[p:p + 1], other.q[299:300], third.q[:50], third.q])
            k = torch.cat([seq.k[p:p + 1], other.k[299:300], third.k[:50], third.k])
            v = torch.cat([seq.v[p:p + 1], other.v[299:300], third.v[:50], third.v])
            rows = attend(q, k, v, 0, crowd, cache, sliding=window is not None)
            assert torch.equal(rows[:1], whole[p:p + 1]), (window, p)


def test_the_thread_count_changes_no_bit() -> None:
    seq = Sequence(9, 3, 64, 700, seed=8)
    attend, threads = kernel(9, 3, 64), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prefill(attend, seq, [300])
        torch.set_num_threads(2)
        two = prefill(attend, seq, [300])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.skipif(not {"avx512f", "avx512dq", "avx512vl"} <= cpu_flags(), reason="this CPU has no AVX-512")
@pytest.mark.parametrize("shape", SHAPES)
def test_avx2_and_avx512_give_the_same_bits(shape: tuple[int, int, int]) -> None:
    """An AVX-512 machine runs the 16-lane scores and sums; an AVX2 one (``LLM_INT8_KERNEL_ISA=avx2`` here) the
    8-lane ones: the same operations on the same lanes, so one model answers alike on both machine kinds."""
    seq, lib = Sequence(*shape, 333, seed=9), attention.attention_library()
    outputs = []
    try:
        for wanted in (True, False):
            assert lib.attention_use_avx512(int(wanted)) == int(wanted)
            outputs.append(prefill(kernel(*shape), seq, [100], window=None))
    finally:
        attention.use_avx512(lib)
    assert torch.equal(*outputs)


def test_a_position_outside_its_slot_is_refused() -> None:
    """A row whose keys would lie past its slot's capacity raises IndexError, as torch's indexing would, and nothing
    is read out of bounds."""
    seq = Sequence(9, 3, 64, 70, seed=10)
    cache = new_cache(3, 64, 1, 64)   # capacity 64
    attend = kernel(9, 3, 64)
    prefill(attend, Sequence(9, 3, 64, 64, seed=11), [], cache=cache)
    with pytest.raises(IndexError):
        attend.attend(seq.q[60:70], build_layout([], [(0, 60, 10)], 3, CPU), cache, 0)
