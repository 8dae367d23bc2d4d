"""Tiny, randomly initialised causal-LM checkpoints of real transformers architectures, built locally.

Nothing is downloaded: the config comes from transformers' own config class for the model type (hidden 64, 2
layers, 4 heads sharing 2 KV heads, where the type has such fields), the weights are random (``torch.manual_seed``)
and the tokenizer and chat template are the embedded SmolLM2's (``model_store/smollm2-135m-instruct``, built by
``make model``), so the vocabularies agree; norm weights a family initialises to zero (gemma's ``1 + w``) are drawn
at random instead. Each folder is what ``save_pretrained`` writes for a real checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from devtools.model_sweep import declared

SMOLLM2_DIR = Path(__file__).resolve().parents[2] / "model_store" / "smollm2-135m-instruct"
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": False}


def build_tiny(path: Path, model_type: str, **overrides) -> Path:
    """A tiny ``model_type`` checkpoint in ``path`` (config fields in ``overrides`` win over the tiny defaults)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    # the tiny defaults the type's config has: one it lacks would sit on the config where a real checkpoint has
    # nothing (mamba has no attention heads)
    default = AutoConfig.for_model(model_type)
    known = {name: value for name, value in TINY.items() if name in declared(default)}
    config = AutoConfig.for_model(model_type, **{**known, "vocab_size": len(tokenizer), **overrides,
                                                 "bos_token_id": tokenizer.bos_token_id,
                                                 "eos_token_id": tokenizer.eos_token_id,
                                                 "pad_token_id": tokenizer.pad_token_id})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms stored as w in x * (1 + w) start at zero, which would hide a missing offset
        for name, param in model.named_parameters():
            if "norm" in name and not param.any():
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SMOLLM2_DIR / name, path / name)
    return path


def add_sentence_transformers_config(path: Path, mode: str, normalize: bool, hidden: int = 64) -> Path:
    """sentence-transformers' files for ``path``: modules.json (Transformer, Pooling, Normalize when asked) and
    1_Pooling/config.json with one pooling mode (``cls``, ``mean`` or ``last``)."""
    import json

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": mode == "last", "include_prompt": True}))
    return path


def build_tiny_bert(path: Path, mode: str = "mean", normalize: bool = True, hidden: int = 64) -> Path:
    """A tiny random BERT sentence-transformers folder (an encoder, as BGE, E5 and GTE are), with the embedded
    tokenizer (its vocabulary) and sentence-transformers' pooling config."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=2 * hidden, max_position_embeddings=128,
                        pad_token_id=tokenizer.pad_token_id or 0)
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOLLM2_DIR / name, path / name)
    return add_sentence_transformers_config(path, mode, normalize, hidden)


def reference_embeddings(folder: Path, texts: list[str], mode: str, normalize: bool) -> torch.Tensor:
    """Plain transformers + torch, one input at a time (no padding): the model's last hidden states pooled as
    sentence-transformers pools them."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    model = getattr(model, "base_model", model)
    vectors = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text, add_special_tokens=True)])
            states = model(input_ids=ids).last_hidden_state[0]
            vector = {"cls": states[0], "last": states[-1], "mean": states.mean(dim=0)}[mode]
            vectors.append(torch.nn.functional.normalize(vector, dim=-1) if normalize else vector)
    return torch.stack(vectors)


# What the tiny cross-encoders' tokenizers are trained on (so rerank texts tokenise into words, not characters).
PAIR_CORPUS = ["The capital of France is Paris.", "Paris is a city in France with museums and cafes.",
               "Berlin is the capital of Germany.", "Deep learning models rank documents for a query.",
               "A cross-encoder reads the query and the document together.", "What is the capital of France?",
               "Cats sleep most of the day.", "The weather today is sunny with a light wind."]


def _pair_tokenizer(family: str):
    """A small tokenizer of the family's own kind, trained here on ``PAIR_CORPUS``: BERT's WordPiece with its
    ``[CLS] a [SEP] b [SEP]`` pairs and token types, or XLM-RoBERTa's Unigram with ``<s> a </s></s> b </s>``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast, XLMRobertaTokenizerFast

    if family == "bert":
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.train_from_iterator(PAIR_CORPUS * 8, trainers.WordPieceTrainer(
            vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
        tokenizer.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
        tokenizer.decoder = decoders.WordPiece()
        return BertTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                                 cls_token="[CLS]", mask_token="[MASK]")
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(PAIR_CORPUS * 8, trainers.UnigramTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], unk_token="<unk>"))
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return XLMRobertaTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")


def build_tiny_cross_encoder(path: Path, family: str = "bert", hidden: int = 64, activation: str | None = None,
                             num_labels: int = 1, **overrides) -> Path:
    """A tiny random cross-encoder (``BertForSequenceClassification`` as ms-marco MiniLM, or
    ``XLMRobertaForSequenceClassification`` as bge-reranker), as ``save_pretrained`` writes one, with its own
    tokenizer (``_pair_tokenizer``). ``activation``: sentence-transformers' ``activation_fn`` in config.json;
    ``overrides``: config fields (layers, heads, ...) over the tiny sizes. The classifier head is drawn wide (std
    0.5, the rest at 0.2) so the pairs' scores spread."""
    from transformers import AutoModelForSequenceClassification, BertConfig, XLMRobertaConfig

    tokenizer = _pair_tokenizer(family)
    sizes = {"vocab_size": len(tokenizer), "hidden_size": hidden, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 2 * hidden, "num_labels": num_labels, "pad_token_id": tokenizer.pad_token_id,
             "initializer_range": 0.2}
    if family == "bert":
        config = BertConfig(**{**sizes, "max_position_embeddings": 128, **overrides})
    else:  # positions from the padding id + 1: 130 hold 128 tokens
        config = XLMRobertaConfig(**{**sizes, "max_position_embeddings": 130, "bos_token_id": 0, "eos_token_id": 2,
                                     **overrides})
    if activation is not None:
        config.sentence_transformers = {"activation_fn": activation}
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("classifier") and name.endswith("weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def reference_scores(folder: Path, pairs: list[tuple[str, str]], activation: str = "sigmoid") -> torch.Tensor:
    """Plain transformers, one pair at a time (no padding): the tokenizer's pair encoding through
    ``AutoModelForSequenceClassification``, its one logit through ``activation`` (sigmoid, identity or tanh)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    functions = {"sigmoid": torch.sigmoid, "identity": lambda x: x, "tanh": torch.tanh}
    with torch.no_grad():
        logits = torch.stack([model(**tokenizer(a, b, return_tensors="pt")).logits[0, 0] for a, b in pairs])
    return functions[activation](logits)
