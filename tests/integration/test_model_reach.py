"""Checkpoints the lean engine runs, proven against transformers' own forward on tiny random checkpoints (fp32,
whole and chunked prefill), and the load of a scaled-RoPE checkpoint in a fresh process (two threads importing
transformers at once used to fail it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from handler.engine.model import DecoderModel, build_layout
from tests.tiny_checkpoints import build_tiny

CONFIGS = {
    "llama": ("llama", {}),
    "llama-rope-llama3": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64}}),
    "llama-rope-yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 128}}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {}),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, overrides = CONFIGS[request.param]
    return build_tiny(tmp_path_factory.mktemp(request.param), model_type, **overrides)


def logits_in_chunks(model: DecoderModel, ids: list[int], cuts: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(ids))
    cache.ensure(1, len(ids))
    rows = []
    for start, end in zip([0, *cuts], [*cuts, len(ids)], strict=True):
        layout = build_layout([], [(0, start, end - start)], model.shape.num_heads // model.shape.num_kv_heads,
                              model.device)
        rows.append(model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), layout, cache,
                                  torch.arange(end - start)))
    return torch.cat(rows)


def test_lean_logits_match_transformers_whole_and_chunked(checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 49152, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = reference(torch.tensor([ids])).logits[0]
    ours = DecoderModel(checkpoint, dtype=torch.float32, device=torch.device("cpu"))
    for cuts in ([], [70, 130]):
        assert torch.allclose(logits_in_chunks(ours, ids, cuts), theirs, atol=1e-4), checkpoint.name


def test_a_scaled_rope_checkpoint_loads_in_a_fresh_process(tmp_path: Path) -> None:
    model_type, overrides = CONFIGS["llama-rope-llama3"]
    folder = build_tiny(tmp_path / "llama3", model_type, **overrides)
    script = (
        "from pathlib import Path\n"
        "from handler.engine.loader import LoadOptions, load, load_tokenizer\n"
        f"folder = Path({str(folder)!r})\n"
        "loaded, _ = load(LoadOptions(folder, 'float32', False, 'cpu', max_running=2, max_model_len=256),\n"
        "                 lambda: load_tokenizer(folder))\n"
        "print('loaded', loaded.vocab_size)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and "loaded 49152" in done.stdout, done.stderr[-2000:]
