"""Encoders through transformers: embeddings from the checkpoint's own model (an encoder such as BERT, loaded with
``AutoModel``; or a decoder on the transformers path, through its base model), its last hidden states pooled
(``core.pooling``); and a cross-encoder's scores, from its own ``AutoModelForSequenceClassification`` (the
classifier head the checkpoint carries).

``EncoderRunner`` is the runner of an encoder checkpoint: it embeds and never generates (the engine refuses
generation for it at submit), so its KV space is empty; ``CrossEncoderRunner`` the same for a cross-encoder, which
scores pairs. Inputs are batched right-padded with an attention mask (and a pair's token types); the numbers are the
model's own, as sentence-transformers computes them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from handler.engine.core.pooling import pool
from handler.engine.runners.base import StepOutput, StepPlan, Unbounded
from handler.engine.types import Pooling, TokenPair


@torch.inference_mode()
def transformers_embed(model, inputs: list[tuple[int, ...]], pooling: Pooling, pad_id: int) -> torch.Tensor:
    """Pooled last hidden states of ``model``'s base model (the final norm applied, as transformers returns them)."""
    base = getattr(model, "base_model", model)
    device = next(model.parameters()).device
    ids, mask = _right_padded(inputs, pad_id)
    states = base(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
    return pool(states.cpu(), [len(tokens) for tokens in inputs], pooling)


def _right_padded(inputs: list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[inputs, longest]`` token ids padded on the right with ``pad_id``, and the attention mask."""
    ids = torch.full((len(inputs), max(len(tokens) for tokens in inputs)), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(inputs):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
    return ids, mask


@torch.inference_mode()
def transformers_score(model, pairs: list[TokenPair], pad_id: int) -> torch.Tensor:
    """A sequence classifier's one logit a pair: ``[pairs]`` fp32, before any activation. Token type 1 from each
    pair's second segment on, for a model with token types (BERT); padding is type 0, as tokenizers pad it."""
    device = next(model.parameters()).device
    ids, mask = _right_padded([pair.ids for pair in pairs], pad_id)
    inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    if (getattr(model.config, "type_vocab_size", 0) or 0) > 1:
        positions = torch.arange(ids.shape[1])[None, :]
        starts = torch.tensor([pair.second_start for pair in pairs])[:, None]
        inputs["token_type_ids"] = ((positions >= starts) & mask.bool()).long().to(device)
    return model(**inputs).logits.float().cpu().reshape(len(pairs), -1)[:, 0]


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


class CrossEncoderRunner:
    """A cross-encoder checkpoint behind the engine: its classifier head scores pairs; it neither embeds nor
    generates."""

    prefix_ids: tuple[int, ...] = ()

    def __init__(self, model, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id
        self.space = Unbounded()

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: torch.device, pad_id: int) -> CrossEncoderRunner:
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        return cls(model.to(device).eval(), pad_id)

    def score(self, pairs: list[TokenPair]) -> torch.Tensor:
        return transformers_score(self.model, pairs, self.pad_id)

    def run(self, plan: StepPlan) -> StepOutput:
        raise RuntimeError("a cross-encoder does not generate")  # the engine refuses generation before it queues

    def match_prefix(self, sequence) -> None:
        return None

    def clear_prefix_cache(self) -> None:
        return None
