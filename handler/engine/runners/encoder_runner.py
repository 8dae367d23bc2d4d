"""Embeddings through transformers: the checkpoint's own model (an encoder such as BERT, loaded with ``AutoModel``;
or a decoder on the transformers path, through its base model), its last hidden states pooled (``core.pooling``).

``EncoderRunner`` is the runner of an encoder checkpoint: it embeds and never generates (the engine refuses
generation for it at submit), so its KV space is empty. Inputs are batched right-padded with an attention mask; the
numbers are the model's own, as sentence-transformers computes them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from handler.engine.core.pooling import pool
from handler.engine.runners.base import StepOutput, StepPlan, Unbounded
from handler.engine.types import Pooling


@torch.inference_mode()
def transformers_embed(model, inputs: list[tuple[int, ...]], pooling: Pooling, pad_id: int) -> torch.Tensor:
    """Pooled last hidden states of ``model``'s base model (the final norm applied, as transformers returns them)."""
    base = getattr(model, "base_model", model)
    device = next(model.parameters()).device
    lengths = [len(ids) for ids in inputs]
    ids = torch.full((len(inputs), max(lengths)), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(inputs):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
    states = base(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
    return pool(states.cpu(), lengths, pooling)


class EncoderRunner:
    """An encoder checkpoint behind the engine: embeddings only."""

    prefix_ids: tuple[int, ...] = ()

    def __init__(self, model, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id
        self.space = Unbounded()

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: torch.device, pad_id: int) -> EncoderRunner:
        from transformers import AutoModel

        model = AutoModel.from_pretrained(model_dir, dtype=dtype, local_files_only=True).to(device).eval()
        return cls(model, pad_id)

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    def embed(self, inputs: list[tuple[int, ...]], pooling: Pooling) -> torch.Tensor:
        return transformers_embed(self.model, inputs, pooling, self.pad_id)

    def run(self, plan: StepPlan) -> StepOutput:
        raise RuntimeError("an encoder does not generate")  # the engine refuses generation before it queues

    def match_prefix(self, sequence) -> None:
        return None

    def clear_prefix_cache(self) -> None:
        return None
