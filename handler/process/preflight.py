"""Checks the server's master process makes before it starts a worker, each failing in one line. Light on purpose:
no torch, no transformers, so a refusal comes within a second of ``serve``."""

from __future__ import annotations

import json

from handler.config import Settings
from handler.engine.loader import lean_refusal
from handler.errors import ConfigError

# Without a setting, the context is the model's own, capped so one sequence's KV cache stays modest.
_DEFAULT_CONTEXT_CAP = 8192
# RoBERTa's kin number their positions from the padding id + 1 (transformers' create_position_ids_from_input_ids)
_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert"})


def context_length(settings: Settings, config: dict) -> int:
    """Tokens one sequence may hold (prompt + completion): the setting, else the model's own, capped."""
    model_max = config.get("max_position_embeddings") or _DEFAULT_CONTEXT_CAP
    if config.get("model_type") in _OFFSET_POSITIONS and config.get("max_position_embeddings"):
        model_max -= (config.get("pad_token_id") or 0) + 1  # 514 positions hold 512 tokens
    max_len = settings.max_model_len or min(model_max, _DEFAULT_CONTEXT_CAP)
    if max_len > model_max:
        raise ConfigError(f"option.max_model_len={max_len} is more than the model's positions hold ({model_max}, "
                          "from max_position_embeddings)")
    return max_len


def preflight(settings: Settings) -> None:
    """What can be refused before a worker starts, in one line (``ConfigError``): a folder with no model in it, a
    context the model cannot take, and with ``option.rolling_batch=lean`` a text model the lean engine does not
    implement (from config.json and the safetensors headers; no weight is read, torch is not imported). Whatever
    fails later, as the worker loads (a VLM's language model, an architecture transformers does not know), stops
    the server too (``__main__.stop_on_load_failure``)."""
    folder = settings.model_dir
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} has no config.json: not a Hugging Face model folder")
    if not any(folder.glob("*.safetensors")):
        raise ConfigError(f"{folder} has no *.safetensors weights")
    config = json.loads((folder / "config.json").read_text())
    context = context_length(settings, config)
    if settings.rolling_batch != "lean" or "vision_config" in config or "text_config" in config:
        return  # auto serves what the lean engine does not implement through transformers
    if reason := lean_refusal(folder, context):
        raise ConfigError(f"{folder}: {reason}")
