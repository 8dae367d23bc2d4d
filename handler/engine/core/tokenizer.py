"""What every backend reads from a model folder's tokenizer: the tokenizer itself (with its chat template), and the
ids that end a choice."""

from __future__ import annotations

import importlib
import json
import logging
import os
from pathlib import Path

from handler import start_cache

log = logging.getLogger(__name__)

KEEP = 16  # tokenizer records the start cache keeps (most recently used first)


def load_tokenizer(model_dir: Path):
    """The model's own tokenizer (and chat template), from the folder only: no hub access.

    transformers' ``AutoTokenizer`` picks the class from the folder's model config, and reading that config imports
    the model family's config module, which imports most of torch's compiler and distributed packages: ~3 s of a
    start (the embedded model, 2 cores). So the class it picked for this folder is recorded in the start cache the
    first time (``prepare``, at ``make model`` and the image build, or the first start), and later starts construct
    that class as ``AutoTokenizer`` does, without reading the config."""
    record = record_path(model_dir)
    chosen = _read_record(record)
    if chosen is not None:
        try:
            tokenizer_class = getattr(importlib.import_module(chosen["module"]), chosen["name"])
            return tokenizer_class.from_pretrained(str(model_dir), local_files_only=True, _from_auto=True)
        except Exception as error:  # a record from another transformers, a damaged file: decide again
            log.warning("tokenizer: the recorded class %s could not load (%s); asking AutoTokenizer", chosen, error)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    _write_record(record, type(tokenizer))
    return tokenizer


def record_path(model_dir: Path) -> Path:
    """Where the class ``AutoTokenizer`` picks for ``model_dir`` is recorded: named by the folder's files, this
    module and transformers' version (its choice may change with it)."""
    from importlib.metadata import version

    name = start_cache.name_for(model_dir, f"tokenizer|transformers {version('transformers')}", (__file__,))
    return start_cache.home() / f"{name}.tokenizer.json"


def _read_record(path: Path) -> dict | None:
    try:
        chosen = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    start_cache.touch(path)
    return chosen if isinstance(chosen, dict) and {"module", "name"} <= chosen.keys() else None


def _write_record(path: Path, tokenizer_class: type) -> None:
    """Only transformers' own classes: a remote-code class lives in a module made at load, not importable later."""
    if not tokenizer_class.__module__.startswith("transformers."):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".partial-{os.getpid()}-{path.name}")
        partial.write_text(json.dumps({"module": tokenizer_class.__module__, "name": tokenizer_class.__qualname__}))
        partial.replace(path)
        start_cache.prune(path.parent, "*.tokenizer.json", KEEP)
    except OSError as error:  # a read-only cache: every start asks AutoTokenizer
        log.warning("tokenizer: the class transformers picked could not be recorded for later starts (%s)", error)


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
