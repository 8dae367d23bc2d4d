"""What each path loads from a model folder: the lean language model (and a vision-language model's encoder,
``load_lean_model``), its LoRA adapter store and its drafter (``adapter_store``, ``load_speculation``); the
checkpoint's transformers model behind our engine (``load_reference``); an encoder's or a cross-encoder's
(``load_encoder``). ``load`` picks among them and orders the lean path's steps.

May import: ``core`` (tokenizer, grammars, pooling, scoring), ``runners``, ``model``, ``types``, the lean engine's
``LoadedModel`` and drafters, and the lean load's options, int8 and KV budget."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer

from handler.engine.core.constraints import GrammarCompiler
from handler.engine.core.pooling import UnsupportedPooling, read_pooling
from handler.engine.core.scoring import UnsupportedCrossEncoder, is_cross_encoder, read_activation
from handler.engine.core.tokenizer import eos_token_ids
from handler.engine.lean.draft import DraftModel
from handler.engine.lean.engine import LoadedModel
from handler.engine.lean.int8 import calibration_ids, quantize
from handler.engine.lean.kv_budget import check_budget, kv_budget
from handler.engine.lean.options import DTYPES, LoadOptions, LoraOptions
from handler.engine.lean.speculate import NgramDrafter, Speculation
from handler.engine.model import vision
from handler.engine.model.decoder import DecoderModel
from handler.engine.model.family import load_state_dict, read_config
from handler.engine.model.lora import enable_adapters, load_adapter
from handler.engine.model.support import UnsupportedModel, check_lean, tensor_names
from handler.engine.runners.adapters import AdapterStore
from handler.engine.runners.encoder_runner import CrossEncoderRunner, EncoderRunner
from handler.engine.runners.hf_runner import TransformersRunner
from handler.engine.runners.model_runner import ModelRunner
from handler.engine.types import Pooling, PromptParts
from handler.errors import ConfigError

log = logging.getLogger(__name__)


def load_lean_model(model_dir: Path, config: dict, dtype: torch.dtype, device: torch.device,
                    max_model_len: int, linears: bool = True) -> tuple[DecoderModel, object | None]:
    """The lean language model, and for a vision-language model its vision encoder (``model.vision``). A text
    model was checked by ``paths.choose_path``; a VLM's language model is checked here, before any weight is read.
    ``linears=False`` (a text model whose int8 form is kept): the Linears' weights are left unread."""
    if not vision.is_vision_model(config):
        return DecoderModel(model_dir, dtype=dtype, device=device, config=config, linears=linears), None
    text = vision.text_config(config)
    vision.check_text_model(text, max_model_len)
    model = DecoderModel(model_dir, dtype=dtype, device=device, config=text,
                         state=vision.text_state_dict(load_state_dict(model_dir), config))
    return model, vision.VisionEncoder.load(model_dir, dtype, device)


def adapter_store(model: DecoderModel, lora: LoraOptions | None) -> AdapterStore | None:
    """With option.enable_lora: the model's Linears wrapped for adapters (after int8 replaced them) and the store
    that loads adapters for it."""
    if lora is None:
        return None
    enable_adapters(model)
    log.info("LoRA adapters: up to %d loaded at once, rank up to %d", lora.max_loras, lora.max_rank)
    return AdapterStore(lambda folder, name: load_adapter(folder, name, model, lora.max_rank), lora.max_loras,
                        lora.max_rank)


def load_speculation(options: LoadOptions, model: DecoderModel, runner: ModelRunner) -> Speculation | None:
    """The server's drafter: prompt lookup, or a draft model (``draft``) loaded as the target is."""
    spec = options.speculation
    if spec is None:
        return None
    if spec.draft == "ngram":
        log.info("speculative decoding: prompt lookup (n-grams of %d to %d tokens), %d tokens a step",
                 spec.lookup_min, spec.lookup_max, spec.length)
        return Speculation(NgramDrafter(spec.lookup_min, spec.lookup_max), spec.length, "ngram")
    folder = Path(spec.draft)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"option.speculative_draft_model={spec.draft!r}: not a model folder (no config.json), nor "
                          "ngram")
    check_same_vocabulary(options.model_dir, folder)
    config = read_config(folder)
    try:
        check_lean(config, tensor_names(folder), options.max_model_len)
    except UnsupportedModel as error:
        raise UnsupportedModel(f"option.speculative_draft_model={spec.draft!r}: the lean engine cannot run it: "
                               f"{error}") from None
    draft = DecoderModel(folder, dtype=model.dtype, device=model.device, config=config)
    if options.quantize:  # the draft's tokenizer.json is the model's (checked above)
        draft = quantize(draft, folder, lambda: calibration_ids(folder, None, {}), options)
    # the draft's cache may take the share of the target's budget its tokens' size is of the target's
    budget = runner.space.budget * draft.kv_bytes_per_token() // model.kv_bytes_per_token()
    log.info("speculative decoding: draft model %s, %d tokens a step, KV budget %.0f MiB", folder.name, spec.length,
             budget / 2**20)
    return Speculation(DraftModel(draft, model.shape.vocab_size, budget, options.max_running, options.max_model_len),
                       spec.length, "draft model")


def check_same_vocabulary(model_dir: Path, draft_dir: Path) -> None:
    """A draft proposes token ids: its tokenizer must be the target's (the same vocabulary in tokenizer.json)."""
    files = [folder / "tokenizer.json" for folder in (model_dir, draft_dir)]
    if not all(f.is_file() for f in files):
        raise ConfigError(f"option.speculative_draft_model={str(draft_dir)!r}: both the model and the draft need a "
                          "tokenizer.json to compare their vocabularies")
    if Tokenizer.from_file(str(files[0])).get_vocab() != Tokenizer.from_file(str(files[1])).get_vocab():
        raise ConfigError(f"option.speculative_draft_model={str(draft_dir)!r}: its tokenizer's vocabulary is not the "
                          "model's; a draft must share the tokenizer")


def decoder_pooling(model_dir: Path, is_vision: bool) -> Pooling | str:
    """How a decoder's embeddings pool (its sentence-transformers config, or the last token), or why it cannot
    embed."""
    if is_vision:
        return "this vision-language model embeds no text here (option.rolling_batch serves its generation only)"
    try:
        return read_pooling(model_dir, is_encoder=False)
    except UnsupportedPooling as error:
        return str(error)


def load_reference(options: LoadOptions, load_full_tokenizer: Callable[[], object],
                   reason: str) -> tuple[LoadedModel, PromptParts]:
    """The checkpoint's own transformers model behind our engine (``runners.hf_runner``); fp32 on CPU, never int8."""
    if options.quantize_asked:
        raise UnsupportedModel("int8 (option.quantize=dynamic_int8) is the lean path's; the "
                               "transformers path serves option.dtype")
    tokenizer = load_full_tokenizer()  # one thread imports transformers here
    is_vision = vision.is_vision_model(read_config(options.model_dir))
    runner = TransformersRunner.load(options.model_dir, DTYPES[options.dtype], torch.device(options.device),
                                     vision=is_vision)
    if runner.stepping.note:
        reason = f"{reason}; {runner.stepping.note}"
    # its caches are budgeted as the lean engine's are, counted as transformers stores them (``own_caches``)
    budget, how = kv_budget(options, runner.space.bytes_for(options.max_model_len))
    runner.space.budget = budget
    check_budget(runner.space, options.max_model_len, how)
    eos_ids = eos_token_ids(options.model_dir, tokenizer)
    grammar = GrammarCompiler(lambda: tokenizer, runner.vocab_size, sorted(eos_ids))
    loaded = LoadedModel(runner=runner, tokenizer=tokenizer.backend_tokenizer, eos_token_ids=eos_ids,
                         special_token_ids=frozenset(tokenizer.all_special_ids), vocab_size=runner.vocab_size,
                         grammar=grammar, path="transformers", path_reason=reason,
                         embedding=decoder_pooling(options.model_dir, is_vision))
    # a VLM's prompts render through its processor, whose outputs (pixel values, ...) go on to the runner
    encoder = vision.ImageProcessor.load(options.model_dir, keep_inputs=True) if is_vision else None
    return loaded, PromptParts(tokenizer, encoder)


def load_encoder(options: LoadOptions, config: dict,
                 load_full_tokenizer: Callable[[], object]) -> tuple[LoadedModel, PromptParts]:
    """An encoder checkpoint (BERT and its kin) through its transformers model in option.dtype (int8 is the lean
    decoder's): embeddings only, or for a cross-encoder (``core.scoring``) scores only, from its classifier head. An
    embedding pipeline or a classifier this server does not run is a start error."""
    kind = "a cross-encoder" if is_cross_encoder(config) else "an encoder"
    if options.quantize_asked:
        raise UnsupportedModel(f"int8 (option.quantize=dynamic_int8) is the lean decoder's; {kind} serves option.dtype")
    if options.speculation is not None:
        raise UnsupportedModel(f"option.speculative_draft_model: {kind} does not generate")
    if options.rolling_batch == "lean":
        raise UnsupportedModel(f"option.rolling_batch=lean: {config.get('model_type')} is {kind}, which the lean "
                               "engine's own model code does not run (auto serves it)")
    if is_cross_encoder(config):
        return _load_cross_encoder(options, config, load_full_tokenizer)
    try:
        pooling = read_pooling(options.model_dir, is_encoder=True)
    except UnsupportedPooling as error:
        raise UnsupportedModel(f"this encoder cannot be served: {error}") from None
    tokenizer = load_full_tokenizer()
    runner = EncoderRunner.load(options.model_dir, DTYPES[options.dtype], torch.device(options.device),
                                tokenizer.pad_token_id or 0)
    reason = f"{config.get('model_type')} is an encoder: embeddings only ({pooling.mode} pooling, {pooling.source})"
    log.info("serving %s on the encoder path: %s", options.model_dir.name, reason)
    loaded = LoadedModel(runner=runner, tokenizer=tokenizer.backend_tokenizer, eos_token_ids=frozenset(),
                         special_token_ids=frozenset(tokenizer.all_special_ids), vocab_size=len(tokenizer),
                         grammar=None, path="encoder", path_reason=reason, embedding=pooling)
    return loaded, PromptParts(tokenizer, None)


def _load_cross_encoder(options: LoadOptions, config: dict,
                        load_full_tokenizer: Callable[[], object]) -> tuple[LoadedModel, PromptParts]:
    """A cross-encoder: its ``AutoModelForSequenceClassification``, scoring pairs (never embedding with its head
    dropped)."""
    try:
        activation = read_activation(config)
    except UnsupportedCrossEncoder as error:
        raise UnsupportedModel(f"this sequence classifier cannot be served: {error}") from None
    tokenizer = load_full_tokenizer()
    runner = CrossEncoderRunner.load(options.model_dir, DTYPES[options.dtype], torch.device(options.device),
                                     tokenizer.pad_token_id or 0)
    reason = (f"{config['architectures'][0]} is a cross-encoder: rerank and score only ({activation.name} of its "
              f"logit, {activation.source})")
    log.info("serving %s on the cross-encoder path: %s", options.model_dir.name, reason)
    loaded = LoadedModel(runner=runner, tokenizer=tokenizer.backend_tokenizer, eos_token_ids=frozenset(),
                         special_token_ids=frozenset(tokenizer.all_special_ids), vocab_size=len(tokenizer),
                         grammar=None, path="cross-encoder", path_reason=reason,
                         embedding="a cross-encoder scores pairs (POST /rerank, /score) and has no embeddings",
                         scoring=activation)
    return loaded, PromptParts(tokenizer, None)
