"""Tiny, randomly initialised causal-LM checkpoints of real transformers architectures, built locally.

Nothing is downloaded: the config comes from transformers' own config class for the model type (hidden 64, 2
layers, 4 heads sharing 2 KV heads), the weights are random (``torch.manual_seed``) and the tokenizer and chat
template are the embedded SmolLM2's (``model_store/smollm2-135m-instruct``, built by ``make model``), so the
vocabularies agree; norm weights a family initialises to zero (gemma's ``1 + w``) are drawn at random instead.
Each folder is what ``save_pretrained`` writes for a real checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

SMOLLM2_DIR = Path(__file__).resolve().parents[1] / "model_store" / "smollm2-135m-instruct"
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": False}


def build_tiny(path: Path, model_type: str, **overrides) -> Path:
    """A tiny ``model_type`` checkpoint in ``path`` (config fields in ``overrides`` win over the tiny defaults)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    config = AutoConfig.for_model(model_type, **{**TINY, "vocab_size": len(tokenizer), **overrides,
                                                 "bos_token_id": tokenizer.bos_token_id,
                                                 "eos_token_id": tokenizer.eos_token_id,
                                                 "pad_token_id": tokenizer.pad_token_id})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms stored as w in x * (1 + w) start at zero, which would hide a missing offset
        for name, param in model.named_parameters():
            if "norm" in name and not param.any():
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SMOLLM2_DIR / name, path / name)
    return path
