"""Reading a checkpoint folder's safetensors files (every shard): tensor names from the headers, or the tensors.

Importable without torch: ``tensor_names`` reads headers through numpy, so the server's master process can check a
folder before it starts a worker; only ``read_tensors`` needs torch (safetensors imports it for ``framework="pt"``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

if TYPE_CHECKING:
    import torch

Prefixes = tuple[tuple[str, str], ...]  # checkpoint prefix -> new prefix, first match wins


def weight_files(model_dir: Path) -> list[Path]:
    """The folder's ``*.safetensors`` files in name order; ``FileNotFoundError`` when there is none."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def tensor_names(model_dir: Path) -> set[str]:
    """Every tensor name in the folder's safetensors files (headers only: no weight is read, torch not imported);
    empty when the folder has none."""
    names: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as handle:
            names.update(handle.keys())
    return names


def rename(key: str, prefixes: Prefixes) -> str | None:
    """``key`` with the first matching prefix replaced; None when no prefix matches."""
    for old, new in prefixes:
        if key.startswith(old):
            return new + key[len(old) :]
    return None


def read_tensors(
    model_dir: Path, prefixes: Prefixes | None = None, dtype: torch.dtype | None = None,
    skip: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """The folder's tensors (only those under ``prefixes``, renamed, when given; floats cast to ``dtype`` when
    given), copied out of the file mapping: a tensor kept from it (the embeddings) would otherwise keep the whole
    file mapped and resident (measured: 525 MB of RSS for the embedded model after int8 replaced the rest).

    ``skip(name)``: tensors left out, not read (the float Linears whose int8 form a start reads from its cache:
    ``model.packed``)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                name = key if prefixes is None else rename(key, prefixes)
                if name is None:
                    continue
                if skip is not None and skip(name):
                    continue
                tensor = handle.get_tensor(key)
                cast = dtype is not None and tensor.is_floating_point()
                tensors[name] = tensor.to(dtype, copy=True) if cast else tensor.clone()
    return tensors
