"""Checkpoints other than the embedded one through the real server. One the lean engine implements is served by
it, one it does not by the checkpoint's own transformers code (option.rolling_batch=auto), both exactly: greedy
tokens equal transformers' own ``generate``, alone and batched. With option.rolling_batch=lean an unimplemented
checkpoint is refused at start in one line naming the model type and the reason, the process exiting non-zero
(never a server answering 503 for ever)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from tests.e2e.conftest import REPO_ROOT, start_server, stop_server
from tests.support.tiny_checkpoints import build_tiny
from tests.support.vision_fixture import build_tiny_vlm

LLAMA3 = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}}


def serve_and_fail(folder: Path, tmp_path: Path, **env: str) -> tuple[int, list[str]]:
    """Start ``serve`` on a folder that cannot be served; its exit code and its output lines."""
    environ = {**os.environ, "HF_MODEL_ID": str(folder), "SAGEMAKER_BIND_TO_PORT": "0", "SERVER_HOST": "127.0.0.1",
               "SAGEMAKER_MODEL_DIR": str(tmp_path / "no-sagemaker-model"), **env}
    done = subprocess.run([sys.executable, "-m", "handler", "serve"], cwd=REPO_ROOT, env=environ,
                          capture_output=True, text=True, timeout=180)
    return done.returncode, (done.stdout + done.stderr).splitlines()


def generate(folder: Path, prompt: str, max_new_tokens: int) -> list[int]:
    """transformers' own greedy tokens for a prompt (no EOS stop: the server is asked to ignore it too)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    output = reference.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                do_sample=False)
    return output[0, ids.shape[1]:].tolist()


def served_tokens(url: str, prompt: str, max_new_tokens: int) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True,
                                             "ignore_eos": True}}
    response = requests.post(f"{url}/invocations", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


PROMPTS = ["The weather today is", "Once upon a time, in a land far away, there lived a very curious dragon who"]


@pytest.mark.parametrize(("model_type", "overrides", "path"), [
    ("llama", LLAMA3, "lean"),
    ("qwen3", {}, "lean"),
    ("gemma2", {"head_dim": 16, "sliding_window": 8}, "lean"),
    ("gemma3_text", {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
     "lean"),
    ("gemma", {"head_dim": 16}, "transformers"),
    ("phi3", {}, "lean"),
], ids=["llama3-lean", "qwen3-lean", "gemma2-lean", "gemma3_text-lean", "gemma-transformers", "phi3-lean"])
def test_a_checkpoint_is_served_exactly_alone_and_batched(tmp_path: Path, model_type: str, overrides: dict,
                                                           path: str) -> None:
    folder = build_tiny(tmp_path / model_type, model_type, **overrides)
    expected = [generate(folder, prompt, 12) for prompt in PROMPTS]
    # a small step budget so the longer prompt is prefilled in chunks beside the other request's decoding
    server = start_server(tmp_path, {"HF_MODEL_ID": str(folder), "OPTION_QUANTIZE": "none",
                                     "OPTION_MAX_NUM_BATCHED_TOKENS": "16"})
    try:
        alone = [served_tokens(server.url, prompt, 12) for prompt in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            batched = list(pool.map(lambda prompt: served_tokens(server.url, prompt, 12), PROMPTS))
        log = server.log()
        card = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
        info = [line for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines()
                if line.startswith("llm_engine_path_info{")]
    finally:
        stop_server(server)
    assert alone == expected and batched == expected
    assert f"on the {path} path" in log and card["engine_path"] == path
    assert len(info) == 1 and f'path="{path}"' in info[0] and info[0].endswith(" 1.0")


@pytest.mark.parametrize(("model_type", "overrides", "named"), [
    ("stablelm", {}, "model_type 'stablelm': the lean engine does not implement this model type"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
     "set option.max_model_len to at most 64"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
])
def test_with_lean_asked_a_checkpoint_it_does_not_implement_is_refused_in_one_line(
        tmp_path: Path, model_type: str, overrides: dict, named: str) -> None:
    folder = build_tiny(tmp_path / model_type, model_type, **overrides)
    code, lines = serve_and_fail(folder, tmp_path, OPTION_ROLLING_BATCH="lean")
    assert code != 0
    [line] = [line for line in lines if line.startswith("error: ")]
    assert named in line and "Traceback" not in "\n".join(lines)


def test_with_lean_asked_a_vlm_whose_language_model_is_not_implemented_stops_the_server(tmp_path: Path) -> None:
    """A VLM's language model is checked as it loads (in the worker); the failed load ends the process. (Under auto
    the transformers path serves it: tests/e2e/test_reference_vision.py.)"""
    folder = build_tiny_vlm(tmp_path / "vlm")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(config))
    code, lines = serve_and_fail(folder, tmp_path, OPTION_ROLLING_BATCH="lean")
    assert code != 0
    [line] = [line for line in lines if line.startswith("error: ")]
    assert "hidden_act 'gelu'" in line
