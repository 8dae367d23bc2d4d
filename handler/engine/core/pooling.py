"""Embeddings from a model's token states: how to pool them, read from the checkpoint, and the pooling itself.

A sentence-transformers folder says how its embeddings are made: ``modules.json`` lists the pipeline (the
transformer, a ``Pooling`` module with its ``config.json``, optionally ``Normalize``). We run the pipelines made of
those three; one with other modules (``Dense`` projections, ...) is refused in one line rather than answered with
different vectors. Without that config a decoder pools its last token and an encoder its first (``[CLS]``), both
normalised (vLLM's defaults for embedding models).
"""

from __future__ import annotations

import json
from pathlib import Path

from handler.engine.types import Pooling

# model types whose checkpoints are encoders (bidirectional attention, no language-model head to generate with)
ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra", "camembert",
                           "albert", "deberta", "deberta-v2", "modernbert", "nomic_bert", "new"})


def is_encoder(config: dict) -> bool:
    return config.get("model_type") in ENCODER_TYPES and not config.get("is_decoder", False)

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")


class UnsupportedPooling(ValueError):
    """The folder's embedding pipeline is one this server does not run (the message says which part)."""


def read_pooling(folder: Path, is_encoder: bool) -> Pooling:
    """The folder's pooling: from sentence-transformers' ``modules.json`` when present, else the default."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return Pooling("cls" if is_encoder else "last", True, "default")
    modules = json.loads(modules_file.read_text())
    kinds = [module.get("type", "") for module in modules]
    others = [kind for kind in kinds if kind not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if others:
        raise UnsupportedPooling(f"modules.json has {', '.join(k.rsplit('.', 1)[-1] for k in others)}: this server "
                                 "runs sentence-transformers pipelines of Transformer, Pooling and Normalize only")
    pooling = next((module for module in modules if module.get("type") == _POOLING), None)
    if pooling is None:
        raise UnsupportedPooling("modules.json has no Pooling module: the token states would be the answer")
    config = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    for key in _UNSUPPORTED_MODES:
        if config.get(key):
            raise UnsupportedPooling(f"{pooling.get('path')}/config.json sets {key}: this server pools by cls token, "
                                     "mean or last token")
    modes = [mode for key, mode in _MODES.items() if config.get(key)]
    if len(modes) != 1:
        raise UnsupportedPooling(f"{pooling.get('path')}/config.json sets {len(modes)} pooling modes; this server "
                                 "pools by exactly one (cls token, mean or last token)")
    return Pooling(modes[0], _NORMALIZE in kinds, "sentence-transformers")


def pool(states, lengths: list[int], pooling: Pooling):
    """``states``: ``[inputs, longest, hidden]`` tensor with each input's tokens first (the rest padding); returns
    ``[inputs, hidden]`` fp32. (torch is imported here: the vLLM backend's plain-data arguments read this module's
    pooling facts without it.)"""
    import torch

    states = states.float()
    if pooling.mode == "cls":
        pooled = states[:, 0]
    elif pooling.mode == "last":
        pooled = states[torch.arange(len(lengths)), torch.tensor(lengths) - 1]
    else:
        mask = torch.arange(states.shape[1])[None, :] < torch.tensor(lengths)[:, None]
        pooled = (states * mask[..., None]).sum(dim=1) / torch.tensor(lengths, dtype=torch.float32)[:, None]
    return torch.nn.functional.normalize(pooled, dim=-1) if pooling.normalize else pooled
