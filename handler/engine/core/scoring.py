"""Cross-encoders: which checkpoints are one, and the activation their scores take (plain data: no torch here, as
the vLLM backend's arguments read it; a scoring request in flight is ``embedding.ScoreJob``).

A checkpoint whose ``architectures`` name a ``*ForSequenceClassification`` of an encoder family (BERT, XLM-RoBERTa,
...) with one label is a cross-encoder (bge-reranker, mxbai-rerank, ms-marco MiniLM): it reads a query and a
document together and its classifier head gives one logit, the pair's relevance. Its score is that logit through
the activation the checkpoint names, read as sentence-transformers' ``CrossEncoder`` reads it: the config's
``sentence_transformers.activation_fn``, else its older ``sbert_ce_default_activation_function``, else sigmoid (one
label). vLLM reads the same names but lets ``problem_type: regression`` (which transformers' Trainer writes) win
over them; sentence-transformers ignores it, and so do we. TEI applies sigmoid whatever the checkpoint says.
"""

from __future__ import annotations

from dataclasses import dataclass

from handler.engine.core.pooling import ENCODER_TYPES

# sentence-transformers' names of the activations a one-label cross-encoder is saved with -> ours
ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
}


class UnsupportedCrossEncoder(ValueError):
    """A sequence classifier this server does not score with (the message says why)."""


@dataclass(frozen=True, slots=True)
class Activation:
    """What a cross-encoder's logit goes through to become its score, and where that was read."""

    name: str = "sigmoid"             # a value of ACTIVATIONS
    source: str = "default"           # the config key that named it, or "default" (sigmoid, one label)


def is_cross_encoder(config: dict) -> bool:
    """Whether the checkpoint's architectures name a sequence classifier (a cross-encoder, or a classifier the
    loader refuses in ``read_activation``)."""
    return any(str(name).endswith("ForSequenceClassification") for name in config.get("architectures") or ())


def read_activation(config: dict) -> Activation:
    """The activation of a cross-encoder's one logit; ``UnsupportedCrossEncoder`` for a classifier this server does
    not score with (a decoder, more than one label, an activation outside ``ACTIVATIONS``)."""
    architecture = next(str(n) for n in config["architectures"] if str(n).endswith("ForSequenceClassification"))
    if config.get("model_type") not in ENCODER_TYPES or config.get("is_decoder"):
        raise UnsupportedCrossEncoder(f"{architecture} is a decoder with a classification head; the cross-encoders "
                                      "served here are encoders (BERT, XLM-RoBERTa, DeBERTa, ModernBERT, ...)")
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if labels != 1:
        raise UnsupportedCrossEncoder(f"{architecture} has {labels} labels: a classifier, not a cross-encoder; "
                                      "rerank and score take a model with one label (its relevance logit)")
    named = (config.get("sentence_transformers") or {}).get("activation_fn")
    source = "sentence_transformers.activation_fn"
    if named is None and config.get("sbert_ce_default_activation_function") is not None:
        named, source = config["sbert_ce_default_activation_function"], "sbert_ce_default_activation_function"
    if named is None:
        return Activation()
    if named not in ACTIVATIONS:
        raise UnsupportedCrossEncoder(f"config.json's {source} is {named}; this server applies "
                                      f"{', '.join(sorted(ACTIVATIONS))}")
    return Activation(ACTIVATIONS[named], source)
