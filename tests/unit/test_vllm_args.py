"""The vLLM backend's mapping, as plain data (no vLLM needed): settings -> engine arguments, a request -> sampling
parameters per choice, grammars -> one Lark grammar, and what is refused (naming the key or field).

That vLLM accepts these names and honours them is proven against vLLM itself by tests/vllm/ (``make test-vllm``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from handler.config import Settings
from handler.config_sources import load_settings
from handler.engine.backend import EngineLimits
from handler.engine.core.checks import check_request, fit_prompt
from handler.engine.core.json_rules import INTEGER_LIMIT, JSON_LAYOUT
from handler.engine.types import (
    BeamParams,
    GenerationRequest,
    GrammarSpec,
    PromptImages,
    SamplingParams,
    SpeculationParams,
    StopConditions,
)
from handler.engine.vllm.args import (
    CPU_MEMORY_FRACTION,
    Placement,
    check_backend,
    cpu_thread_binding,
    engine_environment,
    engine_kwargs,
    grammar_source,
    prompt_inputs,
    sampling_kwargs,
)
from handler.engine.vllm.beams import check_beams
from handler.errors import BadRequest, ConfigError, Unprocessable

CPU = Placement("cpu", 0)
GPUS8 = Placement("cuda", 8)
LIMITS = EngineLimits(max_running=4, max_model_len=64, max_step_tokens=512)
LLAMA_70B = {"num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80}
SMOLLM2_135M = {"num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}  # the embedded model


def settings(**values) -> Settings:
    return Settings(rolling_batch="vllm", **values)


# ---- settings -> engine arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize(("setting", "detected", "expected"), [
    ("auto", "qwen3", "qwen3"),            # auto: the format the prompt layer read in the chat template
    ("auto", "gpt_oss", "openai_gptoss"),  # vLLM's name for harmony's parser
    ("auto", None, None),                  # a template without reasoning: no parser, grammars from the start
    ("none", None, None),
    ("deepseek_r1", "deepseek_r1", "deepseek_r1"),
    ("gpt_oss", None, "openai_gptoss"),    # the setting alone (a caller that detected nothing)
])
def test_the_reasoning_format_maps_to_vllms_reasoning_parser(setting: str, detected, expected) -> None:
    """vLLM starts a structured output after the reasoning only when its engine has a reasoning parser: under
    auto it must get the detected format, in vLLM's spelling."""
    kwargs = engine_kwargs(settings(reasoning_parser=setting), CPU, 2048, SMOLLM2_135M, detected)
    assert "reasoning_parser" not in kwargs  # vLLM copies it onto structured_outputs_config, a dict here: crash
    assert kwargs["structured_outputs_config"].get("reasoning_parser") == expected



def test_lmi_names_map_onto_vllm_engine_arguments() -> None:
    kwargs = engine_kwargs(settings(tensor_parallel_degree=4, pipeline_parallel_degree=2, max_rolling_batch_size=64,
                                    max_num_batched_tokens=4096, dtype="fp16", quantize="awq",
                                    gpu_memory_utilization=0.85, enable_prefix_caching=False, enforce_eager=True,
                                    trust_remote_code=True), GPUS8, 4096, LLAMA_70B)
    assert {k: kwargs[k] for k in ("tensor_parallel_size", "pipeline_parallel_size", "max_num_seqs",
                                   "max_num_batched_tokens", "dtype", "quantization", "gpu_memory_utilization",
                                   "enable_prefix_caching", "enforce_eager", "trust_remote_code", "max_model_len")} == {
        "tensor_parallel_size": 4, "pipeline_parallel_size": 2, "max_num_seqs": 64, "max_num_batched_tokens": 4096,
        "dtype": "float16", "quantization": "awq", "gpu_memory_utilization": 0.85, "enable_prefix_caching": False,
        "enforce_eager": True, "trust_remote_code": True, "max_model_len": 4096}
    # what our front needs of vLLM whatever the settings: our logprob meaning, llguidance for grammars
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["structured_outputs_config"] == {"backend": "guidance"}


def test_defaults_follow_the_lean_engines_meanings() -> None:
    cpu = engine_kwargs(settings(), CPU, 2048, SMOLLM2_135M)
    assert (cpu["dtype"], cpu["quantization"], cpu["trust_remote_code"]) == ("float32", None, False)
    assert cpu["enforce_eager"] is False  # option.enforce_eager unset: vLLM's own default (graphs)
    assert cpu["gpu_memory_utilization"] == CPU_MEMORY_FRACTION
    assert "distributed_executor_backend" not in cpu
    # a request's priority (body or x-priority) is vLLM's: fcfs would refuse any priority but 0
    assert cpu["scheduling_policy"] == "priority"
    cuda = engine_kwargs(settings(), GPUS8, 2048, LLAMA_70B)
    assert (cuda["dtype"], cuda["gpu_memory_utilization"], cuda["tensor_parallel_size"]) == ("bfloat16", 0.9, 1)


def test_tensor_parallel_max_is_every_visible_gpu_and_cpu_workers_are_processes() -> None:
    assert engine_kwargs(settings(tensor_parallel_degree="max"), GPUS8, 2048, LLAMA_70B)["tensor_parallel_size"] == 8
    two = engine_kwargs(settings(tensor_parallel_degree=2), CPU, 2048, LLAMA_70B)
    assert (two["tensor_parallel_size"], two["distributed_executor_backend"]) == (2, "mp")
    stages = engine_kwargs(settings(pipeline_parallel_degree=2), CPU, 2048, SMOLLM2_135M)
    assert (stages["pipeline_parallel_size"], stages["distributed_executor_backend"]) == (2, "mp")


@pytest.mark.parametrize(("values", "placement", "model", "key"), [
    ({"tensor_parallel_degree": "max"}, CPU, LLAMA_70B, "option.tensor_parallel_degree"),
    ({"tensor_parallel_degree": 8, "pipeline_parallel_degree": 2}, GPUS8, LLAMA_70B, "option.tensor_parallel_degree"),
    # the embedded model's 9 heads do not split in two (vLLM's own rule, said before it starts)
    ({"tensor_parallel_degree": 2}, CPU, SMOLLM2_135M, "option.tensor_parallel_degree=2 does not divide"),
    ({"tensor_parallel_degree": 3}, GPUS8, {"num_attention_heads": 12, "num_key_value_heads": 8},
     "option.tensor_parallel_degree=3 and the model's 8 key/value heads"),
    ({"pipeline_parallel_degree": 4}, GPUS8, {"num_hidden_layers": 3}, "option.pipeline_parallel_degree=4"),
    ({"quantize": "dynamic_int8"}, CPU, SMOLLM2_135M, "option.quantize"),
    ({"device": "cuda"}, CPU, SMOLLM2_135M, "option.device"),
    ({"kv_cache_memory": "4GiB"}, GPUS8, LLAMA_70B, "option.kv_cache_memory"),
    ({"int8_split": "all"}, CPU, SMOLLM2_135M, "option.int8_split"),
])
def test_what_vllm_cannot_honour_is_a_start_error_naming_the_key(values: dict, placement: Placement, model: dict,
                                                                  key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        engine_kwargs(settings(**values), placement, 2048, model)


def test_pipeline_stages_on_cpu_refuse_eager_mode_where_vllm_cpu_fails() -> None:
    with pytest.raises(ConfigError, match="option.enforce_eager=true with option.pipeline_parallel_degree=2"):
        engine_kwargs(settings(pipeline_parallel_degree=2, enforce_eager=True), CPU, 2048, SMOLLM2_135M)
    assert engine_kwargs(settings(pipeline_parallel_degree=2, enforce_eager=True), GPUS8, 2048, LLAMA_70B)


def test_cpu_workers_get_the_cores_split_between_them_unless_the_user_bound_them() -> None:
    two_cores = Placement("cpu", 0, (0, 1))
    assert engine_environment(settings(tensor_parallel_degree=2), two_cores, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert engine_environment(settings(tensor_parallel_degree=2), two_cores, {"VLLM_CPU_OMP_THREADS_BIND": "0"}) == {}
    assert engine_environment(settings(), two_cores, {}) == {}          # one worker: vLLM's own binding
    assert engine_environment(settings(tensor_parallel_degree=8), GPUS8, {}) == {}
    assert cpu_thread_binding((4, 5, 6, 7, 0, 1, 2, 3), 2) == "0,1,2,3|4,5,6,7"
    with pytest.raises(ConfigError, match="3 vLLM CPU workers"):
        cpu_thread_binding((0, 1), 3)


def test_tensor_parallelism_may_replicate_key_value_heads() -> None:
    model = {"num_attention_heads": 32, "num_key_value_heads": 2, "num_hidden_layers": 4}
    assert engine_kwargs(settings(tensor_parallel_degree=8), GPUS8, 2048, model)["tensor_parallel_size"] == 8
    assert engine_kwargs(settings(tensor_parallel_degree=3), GPUS8, 2048, SMOLLM2_135M)["tensor_parallel_size"] == 3


# ---- the settings themselves (the lean engine refuses vLLM-only keys) --------------------------------------------

@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    props = tmp_path / "serving.properties"
    props.write_text("")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    return {"SERVING_PROPERTIES": str(props), "SAGEMAKER_MODEL_DIR": str(tmp_path / "none"), "HF_MODEL_ID": str(model)}


@pytest.mark.parametrize(("environ", "named"), [
    ({"OPTION_TENSOR_PARALLEL_DEGREE": "2"}, "option.tensor_parallel_degree=2"),
    ({"SM_NUM_GPUS": "4"}, "SM_NUM_GPUS (option.tensor_parallel_degree)=4"),
    ({"OPTION_PIPELINE_PARALLEL_DEGREE": "2"}, "option.pipeline_parallel_degree=2"),
    ({"OPTION_QUANTIZE": "awq"}, "option.quantize='awq'"),
    ({"OPTION_TRUST_REMOTE_CODE": "true"}, "option.trust_remote_code=True"),
])
def test_the_lean_engine_refuses_vllm_only_settings_naming_them(env: dict, environ: dict, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({**env, **environ, "OPTION_ROLLING_BATCH": "lean"})
    assert str(info.value).startswith(named)
    assert "option.rolling_batch=vllm" in str(info.value)


def test_one_gpu_and_the_defaults_are_fine_on_the_lean_engine(env: dict) -> None:
    loaded = load_settings({**env, "SM_NUM_GPUS": "1", "OPTION_ENFORCE_EAGER": "true"})
    assert (loaded.tensor_parallel_degree, loaded.enforce_eager, loaded.trust_remote_code) == (1, True, False)


def test_rolling_batch_vllm_is_a_known_value_and_degree_is_checked(env: dict) -> None:
    with pytest.raises(ConfigError, match="option.tensor_parallel_degree"):
        load_settings({**env, "OPTION_TENSOR_PARALLEL_DEGREE": "0"})
    with pytest.raises(ConfigError, match="option.rolling_batch"):
        load_settings({**env, "OPTION_ROLLING_BATCH": "vlm"})


# ---- request -> sampling parameters -------------------------------------------------------------------------------

def request(**values) -> GenerationRequest:
    return GenerationRequest("r", prompt_ids=tuple(range(1, 11)), **values)


def test_sampling_fields_keep_their_meaning() -> None:
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.2,
                              frequency_penalty=0.5, presence_penalty=-0.5, logit_bias=((5, -100.0), (7, 2.5)), seed=11)
    kwargs = sampling_kwargs(request(sampling=sampling, num_top_logprobs=3, prompt_logprobs=2,
                                     stop=StopConditions(max_new_tokens=20, stop_token_ids=(9,), min_new_tokens=4)),
                            0, 64, {2})
    assert {k: kwargs[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                   "frequency_penalty", "presence_penalty", "logit_bias", "seed", "max_tokens",
                                   "logprobs", "prompt_logprobs", "stop_token_ids", "ignore_eos", "n",
                                   "min_tokens")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.2,
        "frequency_penalty": 0.5, "presence_penalty": -0.5, "logit_bias": {5: -100.0, 7: 2.5}, "seed": 11,
        "max_tokens": 20, "logprobs": 3, "prompt_logprobs": 2, "stop_token_ids": [9, 2], "ignore_eos": False, "n": 1,
        "min_tokens": 4}
    # our detokenizer releases the text (stop strings held back across tokens), so vLLM does not detokenise
    assert kwargs["detokenize"] is False and "stop" not in kwargs


def test_each_choice_is_its_own_request_seeded_as_the_lean_engine_seeds_it() -> None:
    seeded = request(sampling=SamplingParams(temperature=1.0, seed=7), n=3)
    assert [sampling_kwargs(seeded, i, 64)["seed"] for i in range(3)] == [7, 8, 9]
    assert sampling_kwargs(request(n=2), 1, 64)["seed"] is None


def test_greedy_below_the_sampling_floor_and_no_extras_by_default() -> None:
    kwargs = sampling_kwargs(request(sampling=SamplingParams(temperature=1e-7)), 0, 64)
    assert kwargs["temperature"] == 0.0
    assert (kwargs["logit_bias"], kwargs["stop_token_ids"], kwargs["logprobs"], kwargs["prompt_logprobs"]) == (
        None, None, 0, None)
    assert "structured_outputs" not in kwargs


def test_max_tokens_is_bounded_by_the_context_left_and_ignore_eos_drops_eos_stops() -> None:
    assert sampling_kwargs(request(), 0, 64)["max_tokens"] == 54          # no limit: up to the context
    assert sampling_kwargs(request(stop=StopConditions(max_new_tokens=500)), 0, 64)["max_tokens"] == 54
    kwargs = sampling_kwargs(request(stop=StopConditions(ignore_eos=True)), 0, 64, {2, 3})
    assert (kwargs["ignore_eos"], kwargs["stop_token_ids"]) == (True, None)


# ---- grammars -------------------------------------------------------------------------------------------------

def test_a_json_schema_becomes_one_lark_grammar_with_the_servers_rules_and_layout() -> None:
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}),
                       "response_format")
    source = grammar_source(spec)
    assert source.startswith("start: %json ")
    schema = json.loads(source.removeprefix("start: %json "))
    assert schema["x-guidance"] == JSON_LAYOUT
    assert schema["additionalProperties"] is False
    assert schema["properties"]["n"]["maximum"] == INTEGER_LIMIT
    assert sampling_kwargs(request(grammar=spec), 0, 64)["structured_outputs"] == {"grammar": source}


def test_a_lark_grammar_passes_through() -> None:
    spec = GrammarSpec("lark", 'start: "<tool_call>" %json {"type": "object"}', "tool_choice")
    assert grammar_source(spec) == spec.source


def test_a_vision_model_gets_vllm_its_image_limit() -> None:
    vlm = {**SMOLLM2_135M, "vision_config": {}}
    assert engine_kwargs(settings(max_images_per_request=3), CPU, 2048, vlm)["limit_mm_per_prompt"] == {"image": 3}
    assert "limit_mm_per_prompt" not in engine_kwargs(settings(), CPU, 2048, SMOLLM2_135M)


# ---- prompts ------------------------------------------------------------------------------------------------------

IMAGES = PromptImages(placeholder_ids=(7, 49152, 8), images=("picture",), processor_kwargs=(("do_image_splitting",
                                                                                              False),))


def test_images_go_to_vllm_with_the_unexpanded_prompt_and_the_processor_options() -> None:
    assert prompt_inputs(GenerationRequest("r", prompt_ids=(1, 2, 3))) == {"prompt_token_ids": [1, 2, 3]}
    expanded = GenerationRequest("r", prompt_ids=(7,) + (49152,) * 17 + (8,), prompt_images=IMAGES)
    assert prompt_inputs(expanded) == {"prompt_token_ids": [7, 49152, 8], "multi_modal_data": {"image": ["picture"]},
                                       "mm_processor_kwargs": {"do_image_splitting": False}}
    plain = dataclasses.replace(IMAGES, processor_kwargs=())
    assert "mm_processor_kwargs" not in prompt_inputs(dataclasses.replace(expanded, prompt_images=plain))


def test_a_prompt_with_images_is_checked_at_its_expanded_length_and_never_truncated() -> None:
    expanded = GenerationRequest("r", prompt_ids=(5,) * 70, prompt_images=IMAGES, prompt_param="messages")
    with pytest.raises(BadRequest, match="64 tokens"):
        check_request(expanded, LIMITS, vocab_size=100_000)
    with pytest.raises(BadRequest, match="cannot be truncated") as info:
        fit_prompt(dataclasses.replace(expanded, truncate_prompt=True), LIMITS)
    assert info.value.param == "messages"


# ---- refusals at submit -------------------------------------------------------------------------------------------

def test_truncate_prompt_keeps_the_last_tokens() -> None:
    long = GenerationRequest("r", prompt_ids=tuple(range(100)), truncate_prompt=True,
                             stop=StopConditions(max_new_tokens=4))
    assert fit_prompt(long, LIMITS).prompt_ids == tuple(range(40, 100))
    assert fit_prompt(request(), LIMITS) == request()


@pytest.mark.parametrize(("bad", "error", "param"), [
    (GenerationRequest("r", prompt_ids=()), BadRequest, "prompt"),
    (GenerationRequest("r", prompt_ids=tuple(range(64)), prompt_param="messages"), BadRequest, "messages"),
    (GenerationRequest("r", prompt_ids=(1,), n=5), BadRequest, "n"),
    (GenerationRequest("r", prompt_ids=(1,), sampling=SamplingParams(logit_bias=((1000, 1.0),))), BadRequest,
     "logit_bias"),
    (GenerationRequest("r", prompt_ids=(1, 2), prompt_embeds=object(), prompt_param="messages"), Unprocessable,
     "messages"),
    (GenerationRequest("r", prompt_ids=(1,), beam=BeamParams(8, param="num_beams")), BadRequest, "num_beams"),
    (GenerationRequest("r", prompt_ids=(1,), beam=BeamParams(2, param="best_of"),
                       sampling=SamplingParams(frequency_penalty=0.5)), Unprocessable, "frequency_penalty"),
    (GenerationRequest("r", prompt_ids=(1,), beam=BeamParams(4, param="best_of")), Unprocessable, "best_of"),
    (GenerationRequest("r", prompt_ids=(1,), speculation=SpeculationParams(3)), Unprocessable,
     "num_assistant_tokens"),
])
def test_requests_vllm_cannot_serve_are_refused_naming_the_field(bad: GenerationRequest, error: type,
                                                                  param: str) -> None:
    with pytest.raises(error) as info:
        check_backend(bad)
        check_request(bad, LIMITS, vocab_size=1000)
        check_beams(bad, eos_token_ids=(0, 2), max_logprobs=10)  # 4 beams rank 12 candidates a beam
    assert info.value.param == param


def test_speculative_decoding_maps_onto_vllms_speculative_config() -> None:
    ngram = engine_kwargs(settings(speculative_draft_model="ngram", speculative_length=3), CPU, 2048, SMOLLM2_135M)
    assert ngram["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 3,
                                           "prompt_lookup_max": 5}
    default = engine_kwargs(settings(speculative_draft_model="[ngram]"), CPU, 2048, SMOLLM2_135M)
    assert default["speculative_config"]["num_speculative_tokens"] == 2
    draft = engine_kwargs(settings(speculative_draft_model="/opt/ml/draft"), CPU, 2048, SMOLLM2_135M)
    assert draft["speculative_config"] == {"model": "/opt/ml/draft", "num_speculative_tokens": 5}
    assert "speculative_config" not in engine_kwargs(settings(), CPU, 2048, SMOLLM2_135M)


def test_an_encoder_runs_on_vllms_pooling_runner_with_our_pooling(tmp_path: Path) -> None:
    from tests.support.tiny_checkpoints import add_sentence_transformers_config

    add_sentence_transformers_config(tmp_path, "cls", False)
    bert = {"model_type": "bert", "num_attention_heads": 4, "num_hidden_layers": 2}
    kwargs = engine_kwargs(settings(model_id=str(tmp_path)), CPU, 512, bert)
    assert kwargs["runner"] == "pooling" and kwargs["enable_prefix_caching"] is False
    assert kwargs["pooler_config"] == {"seq_pooling_type": "CLS", "use_activation": False}
    assert "runner" not in engine_kwargs(settings(model_id=str(tmp_path)), CPU, 512, SMOLLM2_135M)
    with pytest.raises(ConfigError, match="speculative_draft_model"):
        engine_kwargs(settings(model_id=str(tmp_path), speculative_draft_model="ngram"), CPU, 512, bert)
