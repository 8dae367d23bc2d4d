"""Every causal-LM model type transformers registers, started as a new user would start it: a tiny random
checkpoint of the type, loaded through our loader and engine (the path the server picks under
``option.rolling_batch=auto``, warm-up included), then two greedy requests run together compared with transformers'
own ``generate(do_sample=False)``.

Each type ends in one row: ``exact`` (our tokens are generate's), ``refused`` (the load or warm-up failed: the one
line the server would exit with), ``no tiny config`` (why none could be built), or a failure the server must not
have: ``mismatch`` (served, tokens differ) or ``failed`` (served, requests end in errors). Nothing downloads; the
tokenizer is the embedded SmolLM2's (``make model``), the vocabulary a small slice of it.

    python -m devtools.model_sweep [model_type ...]     # the table, every registered type when none is named

``tests/integration/test_model_sweep.py`` runs it per type.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SMOLLM2_DIR = Path(__file__).resolve().parents[1] / "model_store" / "smollm2-135m-instruct"
VOCAB = 512  # the first ids of the embedded tokenizer: prompts are token ids, so a slice is enough
# the shape every type starts from; the names a config class aliases (n_embd, d_model, ...) follow its attribute_map
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "is_decoder": True}
# the same sizes under the other names config classes use, set where a type's config has the field
ALIASES = {"hidden_size": ("d_model", "n_embd", "hidden_dim", "dim", "embed_dim", "word_embed_proj_dim"),
           "intermediate_size": ("ffn_dim", "d_ff", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim",
                                 "ffn_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                                 "expert_intermediate_size"),
           "num_hidden_layers": ("num_layers", "n_layer", "n_layers", "decoder_layers", "encoder_layers"),
           "num_attention_heads": ("n_head", "n_heads", "num_heads", "decoder_attention_heads",
                                   "encoder_attention_heads"),
           "num_experts": ("num_local_experts", "n_routed_experts", "moe_num_experts"),
           "num_experts_per_tok": ("moe_k", "moe_topk", "top_k")}
TINY_MOE = {"num_experts": 4, "num_experts_per_tok": 2}
# multi-head latent attention at a tiny size (no KV-head sharing)
LATENT = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
          "num_key_value_heads": 4, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}
# a sparse-attention indexer (DSA) that keeps every key of the sweep's short sequences: with fewer, transformers'
# own cached steps and its uncached forward pick different keys, a difference of its own
INDEXER = {"index_n_heads": 2, "index_head_dim": 16, "index_topk": 64}
# fields of types whose defaults stay large (experts, latent ranks, per-layer lists) or that need their own shape
OVERRIDES: dict[str, dict] = {
    "codegen": {"rotary_dim": 8}, "gptj": {"rotary_dim": 8}, "helium": {"head_dim": 16},
    "cohere2": {"sliding_window": 8},  # a window the prompts pass
    "deepseek_v2": {**LATENT, "num_experts_per_tok": 2}, "deepseek_v3": LATENT, "minicpm3": LATENT, "youtu": LATENT,
    "axk1": LATENT, "axk2": LATENT,
    # latent attention with an indexer
    "deepseek_v32": {**LATENT, **INDEXER},
    "glm_moe_dsa": {**LATENT, **INDEXER},
    "hy_v4": {**LATENT, **INDEXER, "head_dim": 16},
    "dots3_note_text": {**LATENT, **INDEXER},
    "deepseek_v4": {"q_lora_rank": 32, "head_dim": 16, "o_lora_rank": 32, "o_groups": 2, **INDEXER},
    "longcat_flash": {**LATENT, "head_dim": 8, "zero_expert_num": 2, "expert_ffn_hidden_size": 64},
    # sizes the defaults leave unset or inconsistent at the tiny shape
    "ministral": {"head_dim": 16}, "hunyuan_v1_dense": {"head_dim": 16}, "hunyuan_v1_moe": {"head_dim": 16},
    "mamba2": {"num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [16, 16]},
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "n_shared_experts": 1},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "prophetnet": {"num_encoder_layers": 2, "num_decoder_layers": 2},
    "roc_bert": {"shape_embed_dim": 16, "pronunciation_embed_dim": 16},
    "gemma3n_text": {"num_kv_shared_layers": 0, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16},
    "gemma4_text": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16},
    # hybrids: attention layers beside the recurrent ones, as their real checkpoints have (the defaults put none in
    # two layers)
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"]},
    "zamba": {"num_hidden_layers": 3},
    "zamba2": {"layers_block_type": ["mamba", "hybrid"]},
    "recurrent_gemma": {"num_hidden_layers": 3},
    "kimi_linear": {"layer_types": ["linear_attention", "full_attention"], "num_key_value_heads": 4},
    "bailing_hybrid": {"layer_group_size": 2, "num_key_value_heads": 4},
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"]},
    "qwen3_5_moe_text": {"layer_types": ["linear_attention", "full_attention"]},
    "qwen4_exp_text": {"layer_types": ["linear_attention", "indexed_attention"], "head_dim": 16,
                       "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 64,
                       "indexer_compress_ratio": 4},
    "lfm3": {"layer_types": ["conv", "full_attention"]},
}
# TINY fields a type's config refuses to be given (its setter raises): left at their defaults
LEAVE_OUT: dict[str, tuple[str, ...]] = {"xlnet": ("max_position_embeddings",), "prophetnet": ("num_hidden_layers",)}
# types no tiny checkpoint of can be built here, and why: any other type whose build crashes fails the sweep, as does
# a type listed here that builds
NO_TINY_CONFIG: dict[str, str] = {
    "gemma3n": "its vision tower is a timm model, and timm is not installed",
    "gemma4_assistant": "a drafter for Gemma 4 (speculative decoding), not a model of its own: its config wraps a "
                        "gemma4_text config under constraints the defaults fail",
    "gemma4_unified_assistant": "a drafter for Gemma 4 (speculative decoding), not a model of its own: its default "
                                "layers share KV caches no layer of theirs produces",
    "musicgen": "an audio composite (text encoder, audio codec, decoder) whose causal LM takes the decoder's own "
                "config, which AutoConfig does not make for this type",
    "musicgen_melody": "an audio composite (text encoder, audio codec, decoder) whose causal LM takes the decoder's "
                       "own config, which AutoConfig does not make for this type",
    "qwen4_exp": "a vision-language composite whose default text config leaves its indexer's sizes unset (None), so "
                 "the defaults build no model; its text model is swept as qwen4_exp_text",
}
MAX_PARAMETERS = 10_000_000  # a tiny config stays under this; a larger one names its type's size fields otherwise
PROMPTS = ([5, 17, 300, 42, 7, 99, 400, 23, 11, 4, 242, 77, 3, 8, 60, 61, 62, 63, 64, 65], [8, 9, 10])
MAX_NEW_TOKENS = 4
GOOD = ("exact", "refused", "no tiny config")


@dataclass(frozen=True, slots=True)
class SweepRow:
    model_type: str
    path: str     # "lean" | "transformers" | "encoder" | "-" (refused before a path served)
    result: str   # one of GOOD, or "mismatch" | "failed"
    detail: str = ""
    cost: object = None  # what one sequence's cache was counted at (the runner's space: ``CacheCost`` or ``KVSpace``)

    @property
    def is_good(self) -> bool:
        return self.result in GOOD


class NoTinyConfig(Exception):
    """No tiny checkpoint of this type can be built here (the message says why)."""


class BuildFailed(Exception):
    """The tiny checkpoint of a type not on ``NO_TINY_CONFIG`` cannot be built: a failure of the sweep."""


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def one_line(error: BaseException | str, limit: int = 300) -> str:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def build(folder: Path, model_type: str) -> Path:
    """A tiny random ``model_type`` checkpoint in ``folder`` with the embedded tokenizer. Raises ``NoTinyConfig`` for
    a type on ``NO_TINY_CONFIG`` whose build fails, or whose tiny fields still make it large; ``BuildFailed`` for any
    other type whose build fails, and for a listed type that builds (the list is out of date)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(model_type, **tiny_fields(model_type))
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size <= MAX_PARAMETERS:
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    except Exception as error:  # noqa: BLE001 (a crash: a failure unless the type is listed, with why)
        if model_type in NO_TINY_CONFIG:
            raise NoTinyConfig(one_line(f"{NO_TINY_CONFIG[model_type]} ({one_line(error, 150)})")) from None
        raise BuildFailed(f"its tiny checkpoint cannot be built: {one_line(error)}") from None
    if model_type in NO_TINY_CONFIG:
        raise BuildFailed(f"NO_TINY_CONFIG lists it ({NO_TINY_CONFIG[model_type]}), yet its tiny checkpoint builds: "
                          "take it off the list")
    if size > MAX_PARAMETERS:
        raise NoTinyConfig(f"{size / 1e6:.0f}M parameters with the tiny fields (its size fields are named otherwise)")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOLLM2_DIR / name, folder / name)
    return folder


def tiny_fields(model_type: str) -> dict:
    """The config fields of a tiny ``model_type``: ``TINY``'s where its config class has them (a field it does not
    know would only sit on the config, where a real checkpoint's config has nothing: mamba has no attention heads),
    under its own names (``aliases``), then the type's ``OVERRIDES``."""
    default = default_config(model_type)
    known = {name: value for name, value in TINY.items()
             if name in declared(default) and name not in LEAVE_OUT.get(model_type, ())}
    return {**known, **aliases(model_type), **OVERRIDES.get(model_type, {}),
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@functools.cache
def default_config(model_type: str):
    """The type's config at its defaults (with its ``OVERRIDES`` where the defaults fail their own validation)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 (the overrides may mend it; if not, the build names this error)
        return AutoConfig.for_model(model_type, **OVERRIDES.get(model_type, {}))


def declared(config) -> set[str]:
    """The fields a config has: its class's, the names it maps onto them, and what its init set."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()
    return fields | set(getattr(config, "attribute_map", {})) | set(vars(config))


def aliases(model_type: str) -> dict:
    """TINY's sizes under the names this type's config stores them as (an alias it maps, under its target)."""
    default = vars(default_config(model_type))
    mapped, sizes = getattr(default_config(model_type), "attribute_map", {}), {**TINY, **TINY_MOE}
    found = {mapped.get(alias, alias): sizes[field] for field, names in ALIASES.items() for alias in (field, *names)
             if alias not in TINY and isinstance(default.get(mapped.get(alias, alias)), int)}
    return {name: value for name, value in found.items() if default[name] > value}


def reference_tokens(folder: Path, prompt: list[int]) -> tuple[list[int], str]:
    """transformers' own greedy tokens, and why not from ``generate`` when it failed (then from the model's plain
    forward: ``greedy_uncached``). Up to the EOS it stops at (the server's requests ignore EOS: min_new_tokens would
suppress it in generate instead); without the EOS some configs force at the
    length limit (bart's family): the server does not apply it (a length stop is reported as such)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    try:
        output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=2,
                                forced_eos_token_id=None)
    except Exception as error:  # noqa: BLE001 (some tiny configs break generate: greedy on the plain forward)
        return greedy_uncached(model, prompt), one_line(error)
    return output[0, len(prompt):].tolist(), ""


def greedy_uncached(model, prompt: list[int]) -> list[int]:
    """Greedy tokens from the model's forward over the whole sequence each step, without a cache."""
    import torch

    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(MAX_NEW_TOKENS):
            ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def start_engine(folder: Path):
    """The lean engine as the server builds it (``load_for``'s path choice, warm-up), or the start's one-line error."""
    from handler.engine.backend import EngineLimits
    from handler.engine.core.tokenizer import load_tokenizer
    from handler.engine.lean.engine import Engine
    from handler.engine.lean.load import load
    from handler.engine.lean.options import LoadOptions

    options = LoadOptions(folder, "float32", False, "cpu", max_running=2, max_model_len=64, rolling_batch="auto")
    limits = EngineLimits(max_running=2, max_model_len=64, max_step_tokens=16)  # the longer prompt: two chunks
    engine = Engine(lambda: load(options, lambda: load_tokenizer(folder))[0], limits)
    engine.start()
    while not engine.wait_ready(0.1):
        if engine.load_error or not engine.is_alive:
            return None, one_line(engine.load_error or "the engine thread ended")
    return engine, ""


def served_tokens(engine) -> list[list[int]] | str:
    """Both prompts submitted together: each one's tokens, or the first error an event carried."""
    from handler.engine.types import GenerationRequest, StopConditions

    stop = StopConditions(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    handles = [engine.submit(GenerationRequest(f"sweep-{i}", tuple(p), stop=stop)) for i, p in enumerate(PROMPTS)]
    results = []
    for handle in handles:
        tokens = []
        for event in handle:
            if event.error:
                return one_line(event.error)
            if event.token_id is not None:
                tokens.append(event.token_id)
        results.append(tokens)
    return results


def sweep_one(model_type: str, workdir: Path) -> SweepRow:
    """One type's row (``workdir``: an empty folder for its checkpoint)."""
    try:
        folder = build(workdir, model_type)
    except NoTinyConfig as error:
        return SweepRow(model_type, "-", "no tiny config", str(error))
    except BuildFailed as error:
        return SweepRow(model_type, "-", "failed", str(error))
    engine, reason = start_engine(folder)
    if engine is None:
        return SweepRow(model_type, "-", "refused", reason)
    try:
        path, space = engine._loaded.path, getattr(engine._loaded.runner, "space", None)
        if path == "encoder":
            return SweepRow(model_type, path, "refused", "an encoder: embeddings only, generation refused per request")
        ours = served_tokens(engine)
        stepping = getattr(getattr(engine._loaded.runner, "stepping", None), "note", "")
    finally:
        engine.stop()
    cost = getattr(space, "cost", space)
    if isinstance(ours, str):
        return SweepRow(model_type, path, "failed", ours, cost)
    references = [reference_tokens(folder, list(prompt)) for prompt in PROMPTS]
    expected, why_not_generate = [tokens for tokens, _ in references], references[0][1]
    against = f"transformers' uncached forward (its generate fails here: {why_not_generate})" if (
        why_not_generate) else "generate"
    if all(tokens[:len(reference)] == reference for tokens, reference in zip(ours, expected, strict=True)):
        notes = [note for note in (stepping, why_not_generate and f"vs {against}") if note]
        return SweepRow(model_type, path, "exact", one_line("; ".join(notes)), cost)
    return SweepRow(model_type, path, "mismatch", one_line(f"ours {ours}, {against} {expected}"), cost)


def describe_cost(cost: object) -> str:
    """What one sequence's cache is counted at, for the table: bytes a position adds (and the windows they stop
    at) and bytes whatever the length (recurrent states)."""
    layers = getattr(cost, "layers", None)
    if layers is None:  # the lean path's KV space, or none (refused before serving)
        return f"{cost.bytes_per_token} B/position" if cost is not None else ""
    fixed, per_position = sum(layer.fixed for layer in layers), sum(layer.per_position for layer in layers)
    windows = sorted({layer.window for layer in layers if layer.window and layer.per_position})
    parts = [f"{per_position} B/position" + (f" (window {', '.join(map(str, windows))})" if windows else "")]
    parts = (parts if per_position else []) + ([f"{fixed} B fixed"] if fixed else [])
    return " + ".join(parts) or "no cache"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.model_sweep")
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type transformers registers)")
    args = parser.parse_args(argv)
    import logging

    import torch
    from transformers.utils import logging as transformers_logging

    logging.basicConfig(level=logging.CRITICAL)  # a step's failure is the row's detail, not a traceback
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    torch.set_num_threads(2)
    types = args.types or causal_lm_types()
    rows, started = [], time.monotonic()
    print("| model_type | path | result | cache a sequence | detail |\n|---|---|---|---|---|", flush=True)
    for model_type in types:
        with tempfile.TemporaryDirectory(prefix=f"sweep-{model_type}-") as workdir:
            row = sweep_one(model_type, Path(workdir))
        rows.append(row)
        print(f"| {row.model_type} | {row.path} | {row.result} | {describe_cost(row.cost)} | {row.detail} |",
              flush=True)
    bad = [row.model_type for row in rows if not row.is_good]
    print(f"\n{len(rows)} types in {time.monotonic() - started:.0f} s; "
          f"{sum(r.result == 'exact' for r in rows)} exact, {sum(r.result == 'refused' for r in rows)} refused, "
          f"{sum(r.result == 'no tiny config' for r in rows)} without a tiny config; not good: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
