"""What a download fetches and where it may go: the file choice both sources share, the disk checks, sizes."""

from __future__ import annotations

import os
from pathlib import Path

from handler.config import Settings
from handler.errors import ConfigError

PICKLED = (".bin", ".pth", ".pt")
# What serving reads from a Hub repo's top level: config, generation config, safetensors shards and their index,
# tokenizer (json, sentencepiece, tiktoken, vocab/merges), chat template, processor and pooling configs
SERVING_SUFFIXES = (".json", ".safetensors", ".model", ".tiktoken", ".txt", ".jinja")


def serving_files(paths: list[str], settings: Settings, name: str, everything: bool = False) -> list[str]:
    """The files a model folder needs, from a listing (relative paths). ``everything``: all of them (an S3 prefix
    is the user's own artefact: a model.py and its requirements come too), else what serving reads. Pickled
    weights only with ``option.load_format=pt``; a listing with no safetensors weights is refused in one line."""
    top = [p for p in paths if "/" not in p or (p.split("/")[0][:1].isdigit() and p.endswith(".json"))]
    has_safetensors = any(p.endswith(".safetensors") for p in top)
    pickled = [p for p in top if p.endswith(PICKLED) and p != "training_args.bin"]
    # a handler without weights: an S3 prefix is the user's own artefact; from the Hub its code runs only when
    # option.trust_remote_code says so
    handler_only = "model.py" in top and (everything or settings.trust_remote_code)
    if not has_safetensors and not handler_only:
        if not pickled:
            raise ConfigError(f"{name} holds no *.safetensors weights (and no model.py handler)")
        if settings.load_format != "pt":
            raise ConfigError(f"{name} has only pickled weights ({pickled[0]}), which run code when loaded; set "
                              "option.load_format=pt to download and convert them to safetensors")
    if everything:
        return [p for p in paths if not p.endswith("/") and (not p.endswith(PICKLED) or not has_safetensors)]
    wanted = [p for p in top if p.endswith(SERVING_SUFFIXES)]
    if settings.trust_remote_code:  # the checkpoint's own modelling code
        wanted += [p for p in top if p.endswith(".py")]
    return wanted + ([] if has_safetensors else pickled)


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under a folder (progress reads the download as it lands)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
            except OSError:
                continue  # renamed or removed between listing and stat
    return total


def check_space(folder: Path, needed: int, name: str) -> None:
    """Refuse at once, in one line, a download the disk cannot hold (rather than failing after most of it)."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    free = os.statvfs(existing).f_bavail * os.statvfs(existing).f_frsize
    if needed > free:
        raise ConfigError(f"{name} needs {gigabytes(needed)} and {existing} has {gigabytes(free)} free; set "
                          "option.download_dir to a larger disk")


def disk_full(error: OSError, folder: Path, name: str) -> ConfigError:
    return ConfigError(f"{name}: the disk filled while downloading to {folder} ({error.strerror}); set "
                       "option.download_dir to a larger disk")


def gigabytes(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"
