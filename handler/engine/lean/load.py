"""Load a model folder into what the lean engine's thread runs (``LoadedModel``: our model, int8 on CPU, or the
checkpoint's transformers model, its runner and KV budget, the tokenizer and the vocabulary) and what the prompt
layer renders with (``core.tokenizer.PromptParts``). ``load_for`` turns the settings into options (``options``) and
runs ``load`` on the engine thread; ``load`` picks the path (``paths``) and, on the lean path, orders its steps: the
weights (``loaders``) and int8 (``int8``) beside the tokenizer on another thread, then the KV budget (``kv_budget``).

May import: ``handler.config`` (``Settings``, for ``load_for``), ``core``, ``runners``, ``model``, ``types``,
``backend`` and the lean engine's ``LoadedModel``."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

import torch

from handler.config import Settings
from handler.engine.backend import EngineLimits
from handler.engine.core.constraints import GrammarCompiler
from handler.engine.core.pooling import is_encoder
from handler.engine.core.scoring import is_cross_encoder
from handler.engine.core.tokenizer import eos_token_ids, load_tokenizer
from handler.engine.lean.engine import LoadedModel
from handler.engine.lean.int8 import calibration_ids, quantize
from handler.engine.lean.kv_budget import check_budget, kv_budget
from handler.engine.lean.loaders import (
    adapter_store,
    decoder_pooling,
    load_encoder,
    load_lean_model,
    load_reference,
    load_speculation,
)
from handler.engine.lean.options import DTYPES, LoadOptions, options_from, resolve, warn_retired
from handler.engine.lean.paths import choose_path
from handler.engine.model import packed, vision
from handler.engine.model.family import read_config
from handler.engine.model.family_config import rope_type
from handler.engine.model.kv_cache import whole_blocks
from handler.engine.model.linear import describe_cpu
from handler.engine.model.support import UnsupportedModel
from handler.engine.runners.model_runner import ModelRunner
from handler.engine.types import PromptParts

log = logging.getLogger(__name__)


def load_for(settings: Settings, limits: EngineLimits, on_parts: Callable[[PromptParts, str, str], object],
             num_threads: int | None = None) -> LoadedModel:
    """``load`` as the settings say, on the engine thread; hands the prompt layer its parts and logs the load."""
    if num_threads:
        torch.set_num_threads(num_threads)
    resolved = resolve(settings, torch.cuda.is_available())
    warn_retired(settings)
    options = options_from(settings, limits, resolved)
    loaded, parts = load(options, lambda: load_tokenizer(settings.model_dir))
    on_parts(parts, loaded.path, loaded.path_reason)
    log.info("loaded %s on %s (%s%s%s), pid %d", settings.model_dir.name, resolved.device, resolved.dtype,
             ", int8 dynamic" if resolved.quantize and loaded.path == "lean" else "",
             ", vision" if parts.vision else "", os.getpid())
    return loaded


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
        return load_encoder(options, config, load_full_tokenizer)
    path, reason = choose_path(options, config)
    log.info("serving %s on the %s path: %s", options.model_dir.name, path, reason)
    if path == "transformers" and options.speculation is not None:
        raise UnsupportedModel(f"option.speculative_draft_model: speculative decoding runs on the lean path, and "
                               f"this model is served on the transformers path ({reason})")
    if path == "transformers" and options.lora is not None:
        raise UnsupportedModel(f"option.enable_lora: LoRA adapters are served on the lean path (and by vLLM), and "
                               f"this model is served on the transformers path ({reason})")
    if path == "transformers":
        return load_reference(options, load_full_tokenizer, reason)
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
        model, encoder = load_lean_model(options.model_dir, config, DTYPES[options.dtype], device,
                                         options.max_model_len, linears=kept is None)
        if options.quantize:
            model = quantize(model, options.model_dir,
                             lambda: calibration_ids(options.model_dir, loader, result), options,
                             rebuild=lambda: load_lean_model(options.model_dir, config, DTYPES[options.dtype], device,
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


def needs_transformers(config: dict) -> bool:
    """Whether loading this model imports transformers on the loading thread (scaled RoPE tables, a VLM)."""
    return vision.is_vision_model(config) or rope_type(config) != "default"


def _import_transformers() -> None:
    """Import what the loading thread will use from transformers before the tokenizer thread starts: two threads
    importing transformers at once failed (``ImportError: cannot import name 'AutoConfig' from 'transformers'``
    for a Llama 3.1-style checkpoint), so one thread imports it first and the other finds it imported."""
    from transformers import CONFIG_MAPPING, AutoConfig  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401


def _capture(function: Callable[[], object]) -> object:
    try:
        return function()
    except BaseException as error:  # re-raised on the loading thread
        return error

