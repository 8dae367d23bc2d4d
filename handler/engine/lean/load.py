"""Load a model folder into what the lean engine's thread runs: our model (int8 on CPU, calibrated here) or the
checkpoint's transformers model, its runner and KV budget, the tokenizer and the vocabulary (``LoadedModel``), and
what the prompt layer renders with (``core.tokenizer.PromptParts``). ``options_from`` turns settings into
``LoadOptions``; ``load`` runs on the engine thread."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from handler.config import Settings, memory_amount
from handler.engine.backend import EngineLimits
from handler.engine.core.constraints import GrammarCompiler
from handler.engine.core.pooling import UnsupportedPooling, is_encoder, read_pooling
from handler.engine.core.scoring import UnsupportedCrossEncoder, is_cross_encoder, read_activation
from handler.engine.core.tokenizer import eos_token_ids, load_tokenizer
from handler.engine.lean.draft import DraftModel
from handler.engine.lean.engine import LoadedModel
from handler.engine.lean.speculate import NgramDrafter, Speculation
from handler.engine.model import packed, vision
from handler.engine.model.decoder import DecoderModel
from handler.engine.model.family import load_state_dict, read_config
from handler.engine.model.kv_cache import whole_blocks
from handler.engine.model.linear import ACTIVATION_BLOCK, describe_cpu
from handler.engine.model.lora import enable_adapters, load_adapter
from handler.engine.model.quantize import CALIBRATION_TEXT, calibrate, smooth_and_quantize
from handler.engine.model.support import UnsupportedModel, check_lean, rope_type, tensor_names
from handler.engine.runners.adapters import AdapterStore
from handler.engine.runners.encoder_runner import CrossEncoderRunner, EncoderRunner
from handler.engine.runners.hf_runner import TransformersRunner
from handler.engine.runners.kv_space import KVSpace
from handler.engine.runners.model_runner import ModelRunner
from handler.engine.runners.own_caches import OwnCaches
from handler.engine.types import Pooling, PromptParts
from handler.errors import ConfigError
from handler.knobs import knob

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class KVMemory:
    """How much memory the KV cache may take (``option.kv_cache_memory``, on CUDA also
    ``option.gpu_memory_utilization``), and whether it keeps prefixes (``option.enable_prefix_caching``)."""

    amount: str | None = None          # bytes or a fraction of the available memory (``config.memory_amount``)
    gpu_memory_utilization: float | None = None
    workers: int = 1                   # processes sharing the machine's memory, each with its own cache
    prefix_caching: bool = True


# option.kv_cache_memory's default on CPU: this much of the memory available once the weights are in, shared by
# the workers; on CUDA, vLLM's default gpu_memory_utilization
DEFAULT_KV_FRACTION = 0.4
DEFAULT_GPU_UTILIZATION = 0.9


@dataclass(frozen=True, slots=True)
class LoadOptions:
    model_dir: Path
    dtype: str                 # a key of DTYPES
    quantize: bool             # int8 dynamic quantisation of the Linear layers (CPU)
    device: str                # "cpu" or "cuda"
    max_running: int
    max_model_len: int
    rolling_batch: str = "lean"  # option.rolling_batch: "auto" | "lean" | "transformers"
    quantize_asked: bool = False  # int8 named explicitly (not only auto's CPU default)
    kv_memory: KVMemory = KVMemory()
    speculation: SpeculationOptions | None = None
    lora: LoraOptions | None = None   # option.enable_lora: serve LoRA adapters
    cuda_graphs: bool = False         # on CUDA, decode steps replay recorded graphs (option.enforce_eager=false)


@dataclass(frozen=True, slots=True)
class LoraOptions:
    """option.max_loras (loaded at once) and option.max_lora_rank."""

    max_loras: int = 4
    max_rank: int = 16


@dataclass(frozen=True, slots=True)
class SpeculationOptions:
    """option.speculative_draft_model (a folder, or ``ngram``), option.speculative_length, and prompt lookup's
    n-gram lengths (option.prompt_lookup_min / max)."""

    draft: str
    length: int = 5
    lookup_min: int = 3
    lookup_max: int = 5


@dataclass(frozen=True, slots=True)
class Resolved:
    device: str
    dtype: str
    quantize: bool


def resolve(settings: Settings, cuda_available: bool) -> Resolved:
    """``auto`` device, dtype and int8 made concrete: CUDA when visible, bf16 there and fp32 on CPU, int8 on CPU in
    fp32; combinations that cannot run are refused naming the key."""
    device = settings.device if settings.device != "auto" else ("cuda" if cuda_available else "cpu")
    if device == "cuda" and not cuda_available:
        raise ConfigError("option.device='cuda': no CUDA device is visible")
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    quantize = settings.quantize == "dynamic_int8" or (
        settings.quantize == "auto" and device == "cpu" and dtype == "float32")
    if quantize and (device != "cpu" or dtype != "float32"):
        raise ConfigError("option.quantize='dynamic_int8' needs option.device=cpu and option.dtype=float32")
    return Resolved(device, dtype, quantize)


def warn_retired(settings: Settings) -> None:
    """The settings of the int8 activations' earlier numerics (14-bit rows split in two 7-bit halves, or 7 or 8 bits
    per row by CPU), retired: one warning each where set, and ignored. Every layer's activations now take 16-bit
    codes per block of ``ACTIVATION_BLOCK`` inputs, the same integers on every CPU, in one pass: the answers ``all``
    gave, faster than ``none`` ran."""
    why = (f"the int8 layers' activations are 16-bit codes per block of {ACTIVATION_BLOCK} inputs, the same integers "
           "on every CPU, in one pass (docs/development.md: Numerics)")
    if settings.int8_split != "auto":
        log.warning("option.int8_split=%s is retired and ignored: %s", settings.int8_split, why)
    if bits := knob("LLM_INT8_ACTIVATION_BITS"):
        log.warning("LLM_INT8_ACTIVATION_BITS=%s is retired and ignored: %s", bits, why)


def load_for(settings: Settings, limits: EngineLimits, on_parts: Callable[[PromptParts, str, str], object],
             num_threads: int | None = None) -> LoadedModel:
    """``load`` as the settings say, on the engine thread; hands the prompt layer its parts and logs the load."""
    if num_threads:
        torch.set_num_threads(num_threads)
    resolved = resolve(settings, torch.cuda.is_available())
    warn_retired(settings)
    options = LoadOptions(settings.model_dir, resolved.dtype, resolved.quantize, resolved.device,
                          limits.max_running, limits.max_model_len, settings.rolling_batch,
                          settings.quantize == "dynamic_int8",
                          kv_memory=KVMemory(settings.kv_cache_memory, settings.gpu_memory_utilization,
                                             settings.workers, settings.enable_prefix_caching),
                          speculation=speculation_options(settings),
                          lora=lora_options(settings), cuda_graphs=settings.enforce_eager is False)
    loaded, parts = load(options, lambda: load_tokenizer(settings.model_dir))
    on_parts(parts, loaded.path, loaded.path_reason)
    log.info("loaded %s on %s (%s%s%s), pid %d", settings.model_dir.name, resolved.device, resolved.dtype,
             ", int8 dynamic" if resolved.quantize and loaded.path == "lean" else "",
             ", vision" if parts.vision else "", os.getpid())
    return loaded


def lora_options(settings: Settings) -> LoraOptions | None:
    return LoraOptions(settings.max_loras, settings.max_lora_rank) if settings.enable_lora else None


def speculation_options(settings: Settings) -> SpeculationOptions | None:
    """The speculative-decoding settings; None when option.speculative_draft_model is unset."""
    draft = settings.speculative_draft_model
    if draft is None:
        return None
    if settings.prompt_lookup_min > settings.prompt_lookup_max:
        raise ConfigError(f"option.prompt_lookup_min={settings.prompt_lookup_min} is above "
                          f"option.prompt_lookup_max={settings.prompt_lookup_max}")
    draft = "ngram" if settings.drafts_by_lookup else draft
    return SpeculationOptions(draft, settings.draft_length, settings.prompt_lookup_min, settings.prompt_lookup_max)


def chat_template_prefix(tokenizer) -> list[int]:
    """The tokens every chat prompt starts with (template opening, default system prompt): the common prefix of
    two renders that differ only in the user's text. Empty when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    try:
        first, second = (tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                       tokenize=False) for text in ("Hello", "Bonjour"))
    except Exception:  # a template that needs more than one user message has no prefix worth caching
        return []
    a, b = tokenizer.encode(first, add_special_tokens=False), tokenizer.encode(second, add_special_tokens=False)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    return a[:common]


def load(options: LoadOptions, load_full_tokenizer: Callable[[], object]) -> tuple[LoadedModel, PromptParts]:
    """What the engine runs, and what the prompt layer renders with. transformers' tokenizer (needed for the chat
    template) takes seconds to import and load, so it loads on another thread while the weights load and quantise;
    calibration only needs the fast tokenizer."""
    result: dict[str, object] = {}
    config = read_config(options.model_dir)
    if is_encoder(config) or is_cross_encoder(config):
        return _load_encoder(options, config, load_full_tokenizer)
    path, reason = choose_path(options, config)
    log.info("serving %s on the %s path: %s", options.model_dir.name, path, reason)
    if path == "transformers" and options.speculation is not None:
        raise UnsupportedModel(f"option.speculative_draft_model: speculative decoding runs on the lean path, and "
                               f"this model is served on the transformers path ({reason})")
    if path == "transformers" and options.lora is not None:
        raise UnsupportedModel(f"option.enable_lora: LoRA adapters are served on the lean path (and by vLLM), and "
                               f"this model is served on the transformers path ({reason})")
    if path == "transformers":
        return _load_reference(options, load_full_tokenizer, reason)
    if needs_transformers(config):
        _import_transformers()
    started = time.monotonic()

    def load_tokenizer() -> None:
        result.update(tokenizer=_capture(load_full_tokenizer), tokenizer_s=time.monotonic() - started)

    loader = threading.Thread(target=load_tokenizer, name="tokenizer-load", daemon=True)
    loader.start()
    device = torch.device(options.device)
    with _sharing_cores(loader):
        # with the int8 form an earlier start wrote, the Linears' float weights are never read
        kept = packed.kept_for(options.model_dir, config) if options.quantize else None
        model, encoder = _load_model(options.model_dir, config, DTYPES[options.dtype], device, options.max_model_len,
                                     linears=kept is None)
        if options.quantize:
            model = _quantize(model, options.model_dir,
                              lambda: calibration_ids(options.model_dir, loader, result), options,
                              rebuild=lambda: _load_model(options.model_dir, config, DTYPES[options.dtype], device,
                                                          options.max_model_len)[0])
            log.info(describe_cpu())
    weights_s = time.monotonic() - started
    loader.join()
    tokenizer = result["tokenizer"]
    if isinstance(tokenizer, BaseException):
        raise tokenizer
    budget, how = kv_budget(options, whole_blocks(options.max_model_len) * model.kv_bytes_per_token())
    runner = ModelRunner(model, options.max_running, options.max_model_len, budget, options.kv_memory.prefix_caching,
                         adapters=adapter_store(model, options.lora),
                         cuda_graphs=options.cuda_graphs and device.type == "cuda")
    check_budget(runner.space, options.max_model_len, how)
    if encoder is None:  # a vision model's template renders through its processor
        runner.set_shared_prefix(chat_template_prefix(tokenizer))
    log.info("load took %.1f s: the weights %.1f s, the tokenizer %.1f s beside them, then the KV cache and the "
             "chat template's shared prefix %.1f s", time.monotonic() - started, weights_s, result["tokenizer_s"],
             time.monotonic() - started - max(weights_s, result["tokenizer_s"]))
    eos_ids = eos_token_ids(options.model_dir, tokenizer)
    grammar = GrammarCompiler(lambda: tokenizer, model.shape.vocab_size, sorted(eos_ids))
    loaded = LoadedModel(runner=runner, tokenizer=tokenizer.backend_tokenizer, eos_token_ids=eos_ids,
                         special_token_ids=frozenset(tokenizer.all_special_ids), vocab_size=model.shape.vocab_size,
                         grammar=grammar, path="lean", path_reason=reason,
                         embedding=decoder_pooling(options.model_dir, encoder is not None),
                         speculation=load_speculation(options, model, runner))
    return loaded, PromptParts(tokenizer, encoder)


@contextlib.contextmanager
def _sharing_cores(loader: threading.Thread):
    """While the tokenizer thread imports and loads (CPU-bound Python), the weights load on one fewer torch thread:
    a team of as many OpenMP threads as cores, one of them waiting for the core the tokenizer thread holds, made
    the two together take 7.9 s where each alone took 3.5 s (the embedded model, 2 cores)."""
    threads = torch.get_num_threads()
    if threads > 1 and loader.is_alive():
        torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
        draft = _quantize(draft, folder, lambda: calibration_ids(folder, None, {}), options)
    # the draft's cache may take the share of the target's budget its tokens' size is of the target's
    budget = runner.space.budget * draft.kv_bytes_per_token() // model.kv_bytes_per_token()
    log.info("speculative decoding: draft model %s, %d tokens a step, KV budget %.0f MiB", folder.name, spec.length,
             budget / 2**20)
    return Speculation(DraftModel(draft, model.shape.vocab_size, budget, options.max_running, options.max_model_len),
                       spec.length, "draft model")


def _quantize(model: DecoderModel, model_dir: Path, calibration: Callable[[], list[int]],
              options: LoadOptions, rebuild: Callable[[], DecoderModel] | None = None) -> DecoderModel:
    """int8, smoothed on the calibration tokens (the model's, and a draft's): read from the
    form an earlier start wrote (``packed``), else computed and written for the next start. Returns the model:
    ``model`` itself, or, when it was built without its Linears' weights and the file could not be read, the
    model ``rebuild`` reads whole, quantised."""
    if not packed.supports(model):
        smooth_and_quantize(model, calibrate(model, calibration()))
        return model
    path = packed.path_for(model_dir)
    if path.is_file():
        try:
            packed.load(model, path)
            log.info("int8: read the quantised model written by an earlier start (%s)", path)
            return model
        except Exception as error:  # a damaged file: compute it again and replace it
            log.warning("int8: %s could not be read (%s); quantising again", path, error)
    if packed.lacks_weights(model):
        model = rebuild()
    smooth_and_quantize(model, calibrate(model, calibration()))
    try:
        packed.save(model, path)
        log.info("int8: quantised model written for later starts (%s)", path)
    except OSError as error:
        log.warning("int8: the quantised model could not be kept for later starts (%s)", error)
    return model


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


def _load_encoder(options: LoadOptions, config: dict,
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


def choose_path(options: LoadOptions, config: dict) -> tuple[str, str]:
    """``("lean" | "transformers", why)`` for ``option.rolling_batch``: auto takes the lean path when it implements
    the checkpoint (``support``), else the checkpoint's own transformers code; lean refuses what it cannot run, and
    both refuse an encoder-decoder model."""
    if config.get("is_encoder_decoder"):
        architectures = ", ".join(config.get("architectures") or []) or "no architecture named"
        raise UnsupportedModel(f"model_type {config.get('model_type')!r}: an encoder-decoder model ({architectures}); "
                               "this server generates with decoder-only models (transformers' causal-LM class would "
                               "load its decoder alone, without the encoder)")
    if vision.is_vision_model(config):
        return _choose_vision_path(options, config)
    if options.rolling_batch == "transformers":
        return "transformers", "option.rolling_batch=transformers"
    try:
        check_lean(config, tensor_names(options.model_dir), options.max_model_len)
    except UnsupportedModel as error:
        if options.rolling_batch == "lean":
            raise
        return "transformers", f"{error} (exact, slower)"
    return "lean", "the lean engine implements this checkpoint"


def _choose_vision_path(options: LoadOptions, config: dict) -> tuple[str, str]:
    """A VLM: lean when ``vision`` runs its type and language model (auto, lean); any other VLM transformers knows
    on the transformers path under auto (``option.rolling_batch=transformers`` forces it for any VLM); lean loads and
    refuses there (``vision.text_config``'s reason). Types refused on both paths (``vision.refused_everywhere``)
    raise here."""
    if reason := vision.refused_everywhere(config):
        raise UnsupportedModel(reason)
    if options.rolling_batch == "transformers":
        return "transformers", "option.rolling_batch=transformers (vision-language model, exact, slower)"
    try:
        vision.check_text_model(vision.text_config(config), options.max_model_len)
    except (ValueError, UnsupportedModel) as error:
        if options.rolling_batch == "lean":
            return "lean", "option.rolling_batch=lean"  # _load_model refuses it with the reason
        if not vision.transformers_knows(config):
            return "lean", "transformers does not know this vision-language model"  # refused there too
        return "transformers", f"the lean path cannot run this vision-language model: {error} (exact, slower)"
    return "lean", "the lean engine implements this vision-language model"


def _load_reference(options: LoadOptions, load_full_tokenizer: Callable[[], object],
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


def needs_transformers(config: dict) -> bool:
    """Whether loading this model imports transformers on the loading thread (scaled RoPE tables, a VLM)."""
    return vision.is_vision_model(config) or rope_type(config) != "default"


def _import_transformers() -> None:
    """Import what the loading thread will use from transformers before the tokenizer thread starts: two threads
    importing transformers at once failed (``ImportError: cannot import name 'AutoConfig' from 'transformers'``
    for a Llama 3.1-style checkpoint), so one thread imports it first and the other finds it imported."""
    from transformers import CONFIG_MAPPING, AutoConfig  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401


def _load_model(model_dir: Path, config: dict, dtype: torch.dtype, device: torch.device,
                max_model_len: int, linears: bool = True) -> tuple[DecoderModel, object | None]:
    """The lean language model, and for a vision-language model its vision encoder (``model.vision``). A text
    model was checked by ``choose_path``; a VLM's language model is checked here, before any weight is read.
    ``linears=False`` (a text model whose int8 form is kept): the Linears' weights are left unread."""
    if not vision.is_vision_model(config):
        return DecoderModel(model_dir, dtype=dtype, device=device, config=config, linears=linears), None
    text = vision.text_config(config)
    vision.check_text_model(text, max_model_len)
    model = DecoderModel(model_dir, dtype=dtype, device=device, config=text,
                         state=vision.text_state_dict(load_state_dict(model_dir), config))
    return model, vision.VisionEncoder.load(model_dir, dtype, device)


def _capture(function: Callable[[], object]) -> object:
    try:
        return function()
    except BaseException as error:  # re-raised on the loading thread
        return error


def calibration_ids(model_dir: Path, loader: threading.Thread | None, result: dict) -> list[int]:
    """CALIBRATION_TEXT as token ids, from tokenizer.json when there is one (else from what ``loader`` loads)."""
    fast = model_dir / "tokenizer.json"
    if fast.is_file():
        return Tokenizer.from_file(str(fast)).encode(CALIBRATION_TEXT, add_special_tokens=False).ids
    loader.join()
    if isinstance(result["tokenizer"], BaseException):
        raise result["tokenizer"]
    return result["tokenizer"].encode(CALIBRATION_TEXT, add_special_tokens=False)


def kv_budget(options: LoadOptions, full_sequence: int) -> tuple[int, str]:
    """The KV cache's byte budget and where it comes from (``full_sequence``: the bytes one sequence of the
    context length takes). The default never exceeds what ``max_running`` full-length sequences would take."""
    kv = options.kv_memory
    ceiling = options.max_running * full_sequence
    amount, fraction = memory_amount(kv.amount) if kv.amount is not None else (None, None)
    if amount is not None:
        budget, how = amount, "option.kv_cache_memory"
    elif options.device == "cuda":
        import torch

        utilization = kv.gpu_memory_utilization or fraction or DEFAULT_GPU_UTILIZATION
        total = torch.cuda.get_device_properties(0).total_memory
        budget = int(total * utilization) - torch.cuda.memory_reserved() - ACTIVATION_RESERVE
        how = f"{utilization:g} of the GPU's {total / 2**30:.1f} GiB less the weights"
        budget = budget if fraction or kv.gpu_memory_utilization else min(budget, ceiling)
    else:
        share = (fraction or DEFAULT_KV_FRACTION) / kv.workers
        available = available_memory()
        budget, how = int(available * share), f"{share:.2g} of the {available / 2**30:.1f} GiB available"
        if fraction is None:
            budget, how = min(budget, ceiling), how + f", at most {options.max_running} full-length sequences"
    return budget, how


def check_budget(space: KVSpace | OwnCaches, max_model_len: int, how: str) -> None:
    """Log the budget; a start error (one line) when it cannot hold one sequence of the context length."""
    one = space.bytes_for(max_model_len)
    if space.budget < one:
        raise ConfigError(f"the KV cache budget ({space.budget / 2**20:.0f} MiB: {how}) cannot hold one sequence of "
                          f"option.max_model_len={max_model_len} tokens ({one / 2**20:.0f} MiB); raise "
                          "option.kv_cache_memory or lower option.max_model_len")
    if space.bytes_per_token:
        log.info("KV cache budget %.0f MiB (%s): %d tokens at %d bytes each", space.budget / 2**20, how,
                 space.budget // space.bytes_per_token, space.bytes_per_token)
    elif not one:
        log.info("KV cache budget: none needed (the model keeps no cache between steps)")
    else:  # a recurrent state, the same size at every length
        log.info("KV cache budget %.0f MiB (%s): %d sequences at %d bytes each, whatever their length",
                 space.budget / 2**20, how, space.budget // max(one, 1), one)


# bytes a CUDA step's activations may need beside the KV cache
ACTIVATION_RESERVE = 1 << 30


def available_memory() -> int:
    """Bytes this process may still take: the kernel's MemAvailable, or the cgroup's limit less its usage when a
    container limit is lower (SageMaker and docker set one)."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit, usage = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            available = min(available, max(int(limit) - int(usage), 0))
        break
    return available
