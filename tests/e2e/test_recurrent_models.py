"""Recurrent-state models through the real server: tiny random Mamba and Falcon-Mamba checkpoints (their configs have
the fields state-spaces/mamba-130m-hf's and tiiuae/falcon-mamba-7b's have, no attention heads) start on the
transformers path with a KV budget counted as their fixed conv and SSM states, and two requests run together get
transformers' own greedy tokens and logprobs. An encoder-decoder checkpoint is refused at start in one line,
without a traceback."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from tests.e2e.conftest import start_server, stop_server
from tests.e2e.test_model_reach import serve_and_fail
from tests.support.tiny_checkpoints import SMOLLM2_DIR, build_tiny

pytestmark = pytest.mark.skipif(not SMOLLM2_DIR.is_dir(), reason="the embedded model is not assembled (make model)")

PROMPTS = ["The weather today is", "Once upon a time, in a land far away, there lived a very curious dragon who"]
MAX_NEW_TOKENS = 6


def generated(folder: Path, prompt: str) -> list[tuple[int, float]]:
    """transformers' own greedy ``generate``: each token and its logprob (log-softmax of its raw logits)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    output = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                            output_logits=True, return_dict_in_generate=True)
    tokens = output.sequences[0, ids.shape[1]:].tolist()
    return [(token, float(torch.log_softmax(logits[0].float(), -1)[token]))
            for token, logits in zip(tokens, output.logits, strict=True)]


def served(url: str, prompt: str) -> list[tuple[int, float]]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "details": True, "ignore_eos": True}}
    response = requests.post(f"{url}/invocations", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return [(token["id"], token["log_prob"]) for token in response.json()["details"]["tokens"]]


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba"])
def test_a_recurrent_model_is_served_with_transformers_greedy_tokens_and_logprobs(tmp_path: Path,
                                                                                  model_type: str) -> None:
    from transformers import AutoConfig

    folder = build_tiny(tmp_path / model_type, model_type)
    assert not hasattr(AutoConfig.from_pretrained(folder), "num_attention_heads")  # as a real checkpoint's
    expected = [generated(folder, prompt) for prompt in PROMPTS]
    server = start_server(tmp_path, {"HF_MODEL_ID": str(folder), "OPTION_QUANTIZE": "none"})
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # two sequences' states side by side
            answers = list(pool.map(lambda prompt: served(server.url, prompt), PROMPTS))
        log = server.log()
    finally:
        stop_server(server)
    for answer, reference in zip(answers, expected, strict=True):
        assert [token for token, _ in answer] == [token for token, _ in reference]
        assert [logprob for _, logprob in answer] == pytest.approx([logprob for _, logprob in reference], abs=1e-4)
    assert f"serving {model_type} on the transformers path" in log
    assert "sequences at 20480 bytes each, whatever their length" in log  # 2 layers x (conv + SSM) x float32


def test_an_encoder_decoder_checkpoint_is_refused_at_start_in_one_line(tmp_path: Path) -> None:
    import shutil

    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    folder = tmp_path / "bart"
    config = AutoConfig.for_model("bart", vocab_size=512, d_model=64, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                  decoder_ffn_dim=128)
    AutoModelForSeq2SeqLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOLLM2_DIR / name, folder / name)
    code, lines = serve_and_fail(folder, tmp_path)
    assert code != 0
    [line] = [line for line in lines if line.startswith("error: ")]
    assert line.startswith("error: the model failed to load: UnsupportedModel: model_type 'bart': an "
                           "encoder-decoder model (BartForConditionalGeneration)")
    assert "Traceback" not in "\n".join(lines)
