"""Where a start keeps what it computed once for a model folder, so later starts read it instead: the lean
engine's int8 model (``model.packed``) and the tokenizer class transformers picks for the folder
(``core.tokenizer``).

The cache is ``LLM_INT8_CACHE`` (the image sets its own and fills it at build), else the user's cache, never the
model folder (it is the user's, and SageMaker mounts it read-only). A file's name is a digest of the folder's path
and a digest of everything that decides its contents: the folder's files (name, size, modification time), the
settings its caller names, and the source of the code that computes it, so a changed model, setting or algorithm
never reads a stale file.

May import: ``handler.knobs`` (where the cache lives) and the standard library. It is in the base layer so the model
code may use it: nothing of the engine or the server."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from handler.knobs import path_knob


def home() -> Path:
    return path_knob("LLM_INT8_CACHE")


def name_for(model_dir: Path, settings: str, sources: Iterable[str]) -> str:
    """``<folder digest>-<contents digest>``: the stem of the file kept for ``model_dir`` under ``settings``."""
    digest = hashlib.sha256(settings.encode())
    for source in sources:
        digest.update(Path(source).read_bytes())
    for file in sorted(model_dir.iterdir()):  # weights, config, tokenizer files
        if file.is_file():
            stat = file.stat()
            digest.update(f"{file.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    folder = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:12]
    return f"{folder}-{digest.hexdigest()[:24]}"


def prune(folder: Path, pattern: str, keep: int) -> None:
    """Keep the ``keep`` most recently used files matching ``pattern`` (a read touches its file): the cache is bounded
    whatever number of folders or settings pass through it."""
    files = sorted(folder.glob(pattern), key=lambda f: f.stat().st_mtime, reverse=True)
    for stale in files[keep:]:
        stale.unlink(missing_ok=True)


def touch(path: Path) -> None:
    """Mark ``path`` recently used (kept by ``prune``); a cache the server may read but not write (an image's, run
    as another user) keeps its files all the same."""
    try:
        os.utime(path)
    except OSError:
        pass
