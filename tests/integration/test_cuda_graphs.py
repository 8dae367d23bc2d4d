"""CUDA graphs for the lean engine's decode steps (``handler/engine/runners/cuda_graphs.py``).

On a GPU (``ENGINE_TEST_DEVICE=cuda``, bf16 as served there): the same requests, driven step by step through two
step loops over one model, one replaying recorded graphs and one eager, give the same tokens and the same
logprobs bit for bit, across batch sizes that shrink and grow, a key length that crosses a KEY_BLOCK, a request
that joins mid-way (its prompt steps run eagerly) and n > 1; and the graphs were in fact recorded and replayed.
On CPU (CI) the parts that need no GPU: the graph's layout equals the eager step's, and what the recorder refuses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handler.config import DEFAULT_MODEL_DIR
from handler.engine.backend import Admission, EngineLimits
from handler.engine.core.admission import AdmissionControl
from handler.engine.core.request import RequestState, Vocabulary
from handler.engine.lean.steps import StepLoop
from handler.engine.model.layout import build_layout, decode_layout
from handler.engine.runners.cuda_graphs import why_eager
from handler.engine.runners.model_runner import ModelRunner
from handler.engine.types import GenerationRequest, SamplingParams, StopConditions
from tests.integration.conftest import DEVICE
from tests.support.tiny_checkpoints import build_tiny

MAX_LEN = 512
on_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU (ENGINE_TEST_DEVICE=cuda)")


@pytest.mark.parametrize("window", [None, 48])
def test_the_graphs_layout_is_the_eager_steps(window: int | None) -> None:
    """Masks computed from the positions tensor alone (what a graph records) equal ``build_layout``'s."""
    positions = [3, 70, 64, 127, 5]
    handle = (0, 0, 0, len(positions))
    eager = build_layout(positions, [], 3, torch.device("cpu"), [(handle, len(positions))], window=window)
    length = eager.decode_masks[0].shape[-1]
    graphed = decode_layout(torch.tensor(positions), handle, length, 3, window)
    assert graphed.decode_groups == eager.decode_groups and graphed.num_decode == eager.num_decode
    assert torch.equal(graphed.decode_positions, eager.decode_positions)
    assert torch.equal(graphed.decode_masks[0], eager.decode_masks[0])
    if window is not None:
        assert graphed.window == window and torch.equal(graphed.window_decode_masks[0], eager.window_decode_masks[0])


def test_the_recorder_refuses_what_it_cannot_record(tmp_path: Path) -> None:
    from handler.engine.model.decoder import DecoderModel

    moe = build_tiny(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    model = DecoderModel(moe, dtype=torch.float32, device=torch.device("cpu"))
    assert "cpu" in why_eager(model)
    model.device = torch.device("cuda")  # as if on a GPU: the reason is then the experts' routing
    assert "mixture-of-experts" in why_eager(model)


def _loop(loaded, graphs: bool) -> StepLoop:
    runner = ModelRunner(loaded.runner.model, 8, MAX_LEN, 1 << 30, cuda_graphs=graphs)
    runner.prefix_ids, runner.prefix_kv = loaded.runner.prefix_ids, loaded.runner.prefix_kv
    vocab = Vocabulary(loaded.tokenizer, loaded.eos_token_ids, loaded.special_token_ids)
    limits = EngineLimits(max_running=8, max_model_len=MAX_LEN, max_step_tokens=256)
    return StepLoop(runner, vocab, limits, AdmissionControl(lambda: Admission()))


def _request(name: str, text_ids: list[int], new_tokens: int, n: int = 1) -> GenerationRequest:
    sampling = SamplingParams() if n == 1 else SamplingParams(temperature=0.8, seed=7)
    return GenerationRequest(name, tuple(text_ids), sampling=sampling, n=n, num_top_logprobs=3,
                             stop=StopConditions(max_new_tokens=new_tokens, ignore_eos=True))


def _drive(loop: StepLoop, requests: list[GenerationRequest], late: GenerationRequest, join_at: int) -> list:
    """Run the requests to the end, one step at a time; ``late`` joins after ``join_at`` steps. Every event."""
    states = [RequestState(r, loop.new_sequence) for r in requests]
    for state in states:
        loop.add(state)
    step = 0
    while loop.has_work or step <= join_at:
        if step == join_at:
            states.append(RequestState(late, loop.new_sequence))
            loop.add(states[-1])
        loop.step()
        step += 1
    events = []
    for state in states:
        while not state.events.empty():
            event = state.events.get_nowait()
            assert event.error is None, event.error
            events.append((state.request.request_id, event.index, event.token_id, event.logprob,
                           tuple((t.token_id, t.logprob) for t in event.top_logprobs)))
    return events


@on_gpu
def test_graphed_decode_steps_equal_eager_ones_bit_for_bit(tokenizer) -> None:
    from handler.engine.lean.load import load
    from handler.engine.lean.options import LoadOptions

    options = LoadOptions(Path(DEFAULT_MODEL_DIR), "bfloat16", False, "cuda", max_running=8, max_model_len=MAX_LEN,
                          cuda_graphs=True)
    loaded = load(options, lambda: tokenizer)[0]
    assert loaded.runner.graphs is not None
    ids = [tokenizer.encode(text) for text in ("The sea at night", "A short poem about bread, please",
                                               "Count from one to twenty", "Why is the sky blue?")]
    requests = [_request("a", ids[0], 90), _request("b", ids[1], 40), _request("c", ids[2], 65, n=2)]
    late = _request("late", ids[3], 30)
    graphed_loop, eager_loop = _loop(loaded, True), _loop(loaded, False)
    assert eager_loop.runner.graphs is None
    graphed = _drive(graphed_loop, requests, late, join_at=20)
    eager = _drive(eager_loop, requests, late, join_at=20)
    tokens = {}
    for name, index, token_id, _logprob, _top in graphed:
        tokens[name, index] = tokens.get((name, index), 0) + (token_id is not None)
    assert tokens == {("a", 0): 90, ("b", 0): 40, ("c", 0): 65, ("c", 1): 65, ("late", 0): 30}
    assert graphed == eager
    graphs = graphed_loop.runner.graphs
    # recorded shapes: rows 5 -> 4 -> 5 -> ... and the key length crossing 64 positions; most steps replay
    assert graphs.disabled is None and graphs.num_recorded >= 4 and graphs.num_replayed > 100


@on_gpu
def test_a_recorded_step_follows_a_slab_that_moved(tokenizer) -> None:
    """After the KV slabs are given back and allocated again (the warm-up's release), a step of a recorded shape
    reads the new slab: its tokens equal an eager loop's."""
    from handler.engine.lean.load import load
    from handler.engine.lean.options import LoadOptions

    options = LoadOptions(Path(DEFAULT_MODEL_DIR), "bfloat16", False, "cuda", max_running=8, max_model_len=MAX_LEN)
    loaded = load(options, lambda: tokenizer)[0]
    ids = tokenizer.encode("Tell me about lighthouses")
    graphed_loop, eager_loop = _loop(loaded, True), _loop(loaded, False)
    first = _drive(graphed_loop, [_request("x", ids, 20)], _request("y", ids[:5], 10), join_at=3)
    graphed_loop.scheduler.space.release()
    _keep = torch.empty(1 << 20, device="cuda")  # the next slab is likely elsewhere
    second = _drive(graphed_loop, [_request("x", ids, 20)], _request("y", ids[:5], 10), join_at=3)
    eager = _drive(eager_loop, [_request("x", ids, 20)], _request("y", ids[:5], 10), join_at=3)
    assert first == second == eager
    del _keep


def test_the_plain_split_helpers_compute_what_the_scripted_ones_do() -> None:
    """A GPU runs the plain helpers (``qk_split.EAGER``; TorchScript's GPU fuser would change their rounding), a CPU
    the scripted ones: the same arithmetic, bit for bit where no fuser runs."""
    from handler.engine.model import qk_split

    torch.manual_seed(0)
    heads, kv_heads, dim, rows = 4, 2, 8, 5
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    cos, sin = torch.randn(rows, 1, dim), torch.randn(rows, 1, dim)
    common = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": dim}
    extra = {"split_and_rotate": {}, "split": {},
             "split_norm_rotate": {"q_norm": torch.randn(heads * dim), "k_norm": torch.randn(kv_heads * dim),
                                   "eps": 1e-6},
             "split_head_norm_rotate": {"qk_norm": torch.randn(heads + kv_heads, dim), "eps": 1e-6}}
    assert set(extra) == set(qk_split.EAGER) == set(qk_split.SCRIPTED)
    for name, kwargs in extra.items():
        plain = qk_split.EAGER[name](qkv, cos, sin, **common, **kwargs)
        scripted = qk_split.SCRIPTED[name](qkv, cos, sin, **common, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(plain, scripted, strict=True)), name
