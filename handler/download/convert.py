"""``option.load_format=pt``: a checkpoint whose weights are only pickled (``pytorch_model*.bin``), converted once
to safetensors in a folder beside the download, which is what the loaders read. ``torch.load(weights_only=True)``
unpickles tensors and containers only, so converting runs none of the file's code. The converted folder is
complete exactly when its marker exists (written last): an interrupted conversion is redone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from handler.download.progress import say

MARKER = ".converted"


def convert_pickled(source: Path, target: Path) -> Path:
    if (target / MARKER).is_file():
        return target
    import torch
    from safetensors.torch import save_file

    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    shards = sorted(p for p in source.glob("*.bin") if p.name != "training_args.bin") + sorted(source.glob("*.pt*"))
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        state = torch.load(shard, map_location="cpu", weights_only=True)
        name = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        # tied weights share storage, which safetensors refuses: each tensor gets its own copy
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(target / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, name))
    if len(shards) > 1:
        (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for other in source.iterdir():  # config, tokenizer and the rest, as they are
        if other.is_file() and other not in shards and not other.name.endswith(".index.json"):
            shutil.copyfile(other, target / other.name)
    (target / MARKER).write_text("complete\n")
    say(f"converted {len(shards)} pickled weight file(s) to safetensors in {target}")
    return target
