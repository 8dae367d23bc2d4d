"""What every backend reads from a model folder's tokenizer: the tokenizer itself (with its chat template), and the
ids that end a choice."""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(model_dir: Path):
    """The model's own tokenizer (and chat template), from the folder only: no hub access."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def eos_token_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (int or list) and the tokenizer."""
    ids = set()
    config_path = model_dir / "generation_config.json"
    if config_path.is_file():
        value = json.loads(config_path.read_text()).get("eos_token_id")
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
