"""Checkpoints other than the embedded one through the real server: one the lean engine implements is served
exactly (greedy tokens equal transformers' own ``generate``), and one it does not is refused at start in one line
naming the model type and the reason, the process exiting non-zero (never a server answering 503 for ever)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import torch

from tests.e2e.conftest import REPO_ROOT, start_server, stop_server
from tests.tiny_checkpoints import build_tiny
from tests.vision_fixture import build_tiny_vlm

LLAMA3 = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}}


def serve_and_fail(folder: Path, tmp_path: Path) -> tuple[int, list[str]]:
    """Start ``serve`` on a folder that cannot be served; its exit code and its output lines."""
    environ = {**os.environ, "HF_MODEL_ID": str(folder), "SAGEMAKER_BIND_TO_PORT": "0", "SERVER_HOST": "127.0.0.1",
               "SAGEMAKER_MODEL_DIR": str(tmp_path / "no-sagemaker-model")}
    done = subprocess.run([sys.executable, "-m", "handler", "serve"], cwd=REPO_ROOT, env=environ,
                          capture_output=True, text=True, timeout=180)
    return done.returncode, (done.stdout + done.stderr).splitlines()


def test_a_lean_checkpoint_is_served_exactly(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_tiny(tmp_path / "llama3", "llama", **LLAMA3)
    server = start_server(tmp_path, {"HF_MODEL_ID": str(folder), "OPTION_QUANTIZE": "none"})
    try:
        body = {"inputs": "The weather today is", "parameters": {"max_new_tokens": 12, "details": True}}
        answer = requests.post(f"{server.url}/invocations", json=body, timeout=120).json()
    finally:
        stop_server(server)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("The weather today is", return_tensors="pt", add_special_tokens=False).input_ids
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = reference.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, ids.shape[1]:]
    assert [t["id"] for t in answer["details"]["tokens"]] == expected.tolist()


@pytest.mark.parametrize(("model_type", "overrides", "named"), [
    ("qwen3", {}, "model_type 'qwen3': the lean engine does not implement this model type"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("mistral", {"sliding_window": 128}, "set option.max_model_len to at most 128"),
])
def test_a_checkpoint_the_engine_does_not_implement_is_refused_in_one_line(
        tmp_path: Path, model_type: str, overrides: dict, named: str) -> None:
    code, lines = serve_and_fail(build_tiny(tmp_path / model_type, model_type, **overrides), tmp_path)
    assert code != 0
    [line] = [line for line in lines if line.startswith("error: ")]
    assert named in line and "Traceback" not in "\n".join(lines)


def test_a_vlm_whose_language_model_is_not_implemented_stops_the_server(tmp_path: Path) -> None:
    """A VLM's language model is checked as it loads (in the worker); the failed load ends the process."""
    folder = build_tiny_vlm(tmp_path / "vlm")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(config))
    code, lines = serve_and_fail(folder, tmp_path)
    assert code != 0
    [line] = [line for line in lines if line.startswith("error: ")]
    assert "hidden_act 'gelu'" in line
