"""Settings: serving.properties parsing, environment overrides (LMI and TGI names), and model-folder checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from handler.config import DEFAULT_MODEL_DIR, Settings
from handler.config_sources import env_overrides, load_settings, parse_properties
from handler.errors import ConfigError


def make_model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    return path


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    """An environment isolated from the machine: an empty properties file and an empty SageMaker model dir."""
    props = tmp_path / "serving.properties"
    props.write_text("")
    sm_dir = tmp_path / "opt-ml-model"
    sm_dir.mkdir()
    model = make_model_dir(tmp_path / "model")
    return {"SERVING_PROPERTIES": str(props), "SAGEMAKER_MODEL_DIR": str(sm_dir), "HF_MODEL_ID": str(model)}


def write_props(env: dict[str, str], text: str) -> None:
    Path(env["SERVING_PROPERTIES"]).write_text(text)


# ---- parse_properties -----------------------------------------------------------------------------------------

def test_parse_properties_comments_separators_and_blank_lines() -> None:
    text = (
        "# a comment\n"
        "! another comment\n"
        "\n"
        "engine=Python\n"
        "option.dtype = fp32\n"
        "option.max_model_len: 1024\n"
        "   option.model_id=/a/b=c   \n"
        "option.empty=\n"
    )
    assert parse_properties(text) == {
        "engine": "Python",
        "option.dtype": "fp32",
        "option.max_model_len": "1024",
        "option.model_id": "/a/b=c",
        "option.empty": "",
    }


@pytest.mark.parametrize(("text", "line"), [
    ("justakey\n", 1),
    ("engine=Python\n# c\n\n= value\n", 4),
    ("a=1\nb=2\nc=3\nnot a pair at all\n", 4),
])
def test_parse_properties_bad_line_names_its_number(text: str, line: int) -> None:
    with pytest.raises(ConfigError, match=rf"line {line}\b"):
        parse_properties(text)


# ---- env overrides --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("environ", "expected"), [
    ({"OPTION_MAX_MODEL_LEN": "64"}, {"max_model_len": "64"}),
    ({"OPTION_entryPoint": "m.py"}, {"entryPoint": "m.py"}),          # mixed case: kept as is
    ({"OPTION_max_model_len": "64"}, {"max_model_len": "64"}),
    ({"OPTION_": "x", "PATH": "/bin"}, {}),
    ({"HF_MODEL_ID": "/m"}, {"model_id": "/m"}),
    # ours beat TGI's aliases
    # HF_MODEL_ID beats OPTION_MODEL_ID
    ({"OPTION_MODEL_ID": "/a", "HF_MODEL_ID": "/b"}, {"model_id": "/b"}),
])
def test_env_overrides(environ: dict[str, str], expected: dict[str, str]) -> None:
    assert env_overrides(environ) == expected


def test_env_option_overrides_properties_file(env: dict[str, str]) -> None:
    write_props(env, "option.max_model_len=128\noption.max_rolling_batch_size=3\n")
    settings = load_settings({**env, "OPTION_MAX_MODEL_LEN": "64"})
    assert settings.max_model_len == 64
    assert settings.max_rolling_batch_size == 3


def test_properties_file_values_are_typed_and_aliased(env: dict[str, str]) -> None:
    write_props(env, "engine=Python\noption.dtype=bf16\noption.quantize=none\noption.max_num_batched_tokens=100\n"
                     "option.output_formatter=sse\noption.default_max_new_tokens=7\n")
    settings = load_settings(env)
    assert isinstance(settings, Settings)
    assert (settings.dtype, settings.quantize, settings.max_num_batched_tokens) == ("bfloat16", "none", 100)
    assert (settings.output_formatter, settings.default_max_new_tokens) == ("sse", 7)


def test_settings_are_frozen(env: dict[str, str]) -> None:
    settings = load_settings(env)
    with pytest.raises(ValidationError):  # frozen
        settings.max_model_len = 5  # type: ignore[misc]


def test_hf_model_id_names_the_model(env: dict[str, str], tmp_path: Path) -> None:
    other = make_model_dir(tmp_path / "other")
    settings = load_settings({**env, "HF_MODEL_ID": str(other)})
    assert settings.model_id == str(other)
    assert settings.model_dir == other


def test_tgi_aliases_used_when_set(env: dict[str, str]) -> None:
    settings = load_settings({**env, "MAX_BATCH_SIZE": "5", "MAX_TOTAL_TOKENS": "300"})
    assert settings.max_rolling_batch_size == 5
    assert settings.max_model_len == 300


def test_tgi_aliases_unset_leave_defaults(env: dict[str, str]) -> None:
    settings = load_settings(env)
    assert settings.max_rolling_batch_size == 32
    assert settings.max_model_len is None


def test_mixed_case_option_keeps_its_case_and_is_unknown(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({**env, "OPTION_maxFooBar": "1"})
    assert "option.maxFooBar" in str(info.value)
    assert "unknown" in str(info.value)


def test_entry_point_keeps_its_case(env: dict[str, str]) -> None:
    assert load_settings({**env, "OPTION_entryPoint": "my_handler.py"}).entryPoint == "my_handler.py"


@pytest.mark.parametrize("environ", [
    {"OPTION_ENTRYPOINT": "my_handler.py"},      # as LMI's own examples spell it (lower-cased by the OPTION_ rule)
    {"DJL_ENTRY_POINT": "my_handler.py"},        # DJL Serving's name
], ids=["OPTION_ENTRYPOINT", "DJL_ENTRY_POINT"])
def test_lmis_spellings_of_the_entry_point_name_the_handler(env: dict[str, str], environ: dict[str, str]) -> None:
    settings = load_settings({**env, **environ})
    assert settings.entryPoint == settings.custom_entry_point == "my_handler.py"


def test_a_lower_case_entry_point_in_serving_properties_names_the_handler(env: dict[str, str]) -> None:
    write_props(env, "option.entrypoint=my_handler.py\n")
    assert load_settings(env).entryPoint == "my_handler.py"


def test_lmis_huggingface_entry_point_is_our_builtin_handler(env: dict[str, str]) -> None:
    settings = load_settings({**env, "OPTION_ENTRYPOINT": "djl_python.huggingface", "OPTION_ROLLING_BATCH": "lean"})
    assert settings.custom_entry_point is None and settings.rolling_batch == "lean"
    assert load_settings({**env, "OPTION_ENTRYPOINT": "djl_python.huggingface"}).rolling_batch == "auto"


def test_lmis_vllm_entry_point_runs_on_vllm(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("handler.config_sources.vllm_installed", lambda: True)
    settings = load_settings({**env, "OPTION_ENTRYPOINT": "djl_python.lmi_vllm.vllm_async_service"})
    assert settings.rolling_batch == "vllm" and settings.custom_entry_point is None
    with pytest.raises(ConfigError, match="option.rolling_batch='lean' names another engine"):
        load_settings({**env, "OPTION_ENTRYPOINT": "djl_python.lmi_vllm.vllm_async_service",
                       "OPTION_ROLLING_BATCH": "lean"})


def test_lmis_vllm_entry_point_without_vllm_says_what_to_do(env: dict[str, str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("handler.config_sources.vllm_installed", lambda: False)
    with pytest.raises(ConfigError, match="vLLM is not installed .*leave option.entryPoint unset"):
        load_settings({**env, "OPTION_ENTRYPOINT": "djl_python.lmi_vllm.vllm_async_service"})


@pytest.mark.parametrize(("entry_point", "why"), [
    ("djl_python.tensorrt_llm", "TensorRT-LLM is not in this container"),
    ("djl_python.lmi_trtllm.trtllm_async_service", "TensorRT-LLM is not in this container"),
    ("djl_python.transformers_neuronx", "AWS Neuron (transformers-neuronx) is not in this container"),
    ("djl_python.sklearn_handler", "LMI's handler djl_python.sklearn_handler is not in this container"),
])
def test_lmis_other_entry_points_are_refused_saying_what_to_set(env: dict[str, str], entry_point: str,
                                                                why: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({**env, "OPTION_ENTRYPOINT": entry_point})
    message = str(info.value)
    assert f"option.entryPoint={entry_point!r}" in message and why in message
    assert "leave option.entryPoint unset" in message and "\n" not in message


@pytest.mark.parametrize(("environ", "key"), [
    ({"OPTION_FOO_BAR": "1"}, "option.foo_bar"),
    ({"OPTION_Max_Model_Len": "64"}, "option.Max_Model_Len"),
])
def test_unknown_env_key_is_named(env: dict[str, str], environ: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError, match="unknown setting") as info:
        load_settings({**env, **environ})
    assert key in str(info.value)


def test_unknown_properties_key_is_named(env: dict[str, str]) -> None:
    write_props(env, "option.rolling_batch_size_typo=4\n")
    with pytest.raises(ConfigError, match="unknown setting") as info:
        load_settings(env)
    assert "option.rolling_batch_size_typo" in str(info.value)


@pytest.mark.parametrize(("environ", "key", "reason"), [
    ({"OPTION_MAX_MODEL_LEN": "abc"}, "option.max_model_len", "integer"),
    ({"OPTION_MAX_MODEL_LEN": "8"}, "option.max_model_len", "greater than or equal to 16"),
    ({"OPTION_DTYPE": "int4"}, "option.dtype", "must be one of"),
    ({"OPTION_QUANTIZE": "gptq"}, "option.quantize", "dynamic_int8"),
    ({"OPTION_ENGINE": "vllm"}, "option.engine", "Python"),
    ({"MAX_BATCH_SIZE": "0"}, "option.max_rolling_batch_size", "greater than or equal to 1"),
    ({"OPTION_OUTPUT_FORMATTER": "xml"}, "option.output_formatter", "jsonlines"),
    ({"OPTION_INT8_SPLIT": "down,mlp"}, "option.int8_split", "qkv, out, gate_up, down, lm_head"),
])
def test_bad_value_names_key_and_reason(env: dict[str, str], environ: dict[str, str], key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({**env, **environ})
    message = str(info.value)
    assert key in message
    assert reason in message
    assert "\n" not in message


@pytest.mark.parametrize("value", ["none", "all", "down, qkv"])
def test_the_retired_int8_settings_start_with_one_warning_each(env: dict[str, str], value: str,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """option.int8_split and LLM_INT8_ACTIVATION_BITS chose the earlier int8 numerics: an old config still starts
    (fp32 too), each setting named in one warning and ignored."""
    from handler.engine.lean.options import resolve, warn_retired

    settings = load_settings({**env, "OPTION_INT8_SPLIT": value})
    assert resolve(settings.model_copy(update={"quantize": "none"}), cuda_available=False).quantize is False
    monkeypatch.delenv("LLM_INT8_ACTIVATION_BITS", raising=False)
    caplog.set_level("WARNING")
    warn_retired(load_settings(env))
    assert caplog.text == ""
    warn_retired(settings)
    monkeypatch.setenv("LLM_INT8_ACTIVATION_BITS", "7")
    warn_retired(load_settings(env))
    lines = caplog.text.strip().splitlines()
    assert len(lines) == 2
    assert "option.int8_split=" in lines[0] and "is retired and ignored" in lines[0]
    assert "LLM_INT8_ACTIVATION_BITS=7 is retired and ignored" in lines[1]
    assert all("16-bit codes per block of 128" in line for line in lines)


@pytest.mark.parametrize("model_id", ["HuggingFaceTB/SmolLM2-135M-Instruct", "s3://bucket/model"])
def test_a_hub_id_or_s3_prefix_is_a_download(env: dict[str, str], model_id: str) -> None:
    """Accepted by the settings; the master downloads it before any worker starts (tests/e2e/test_download.py)."""
    from handler.config_sources import is_remote

    assert load_settings({**env, "HF_MODEL_ID": model_id}).model_id == model_id and is_remote(model_id)


def test_another_url_scheme_is_refused_in_one_line(env: dict[str, str]) -> None:
    from handler.download import fetch_model

    with pytest.raises(ConfigError, match="'https://x/y': not a folder, a Hub id .org/name. or an s3:// prefix"):
        fetch_model(load_settings({**env, "HF_MODEL_ID": "https://x/y"}))


LISTING = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
           "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer.model",
           "chat_template.jinja", "README.md", ".gitattributes", "original/consolidated.00.pth", "onnx/model.onnx",
           "pytorch_model.bin", "1_Pooling/config.json", "modeling_custom.py", "model.gguf"]


def test_only_what_serving_reads_is_downloaded_from_the_hub() -> None:
    from handler.download.files import serving_files

    wanted = serving_files(LISTING, Settings(), "org/m")
    assert sorted(wanted) == sorted(["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                                     "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                     "tokenizer.json", "tokenizer.model", "chat_template.jinja",
                                     "1_Pooling/config.json"])
    assert "modeling_custom.py" in serving_files(LISTING, Settings(trust_remote_code=True), "org/m")


def test_pickled_weights_only_are_refused_unless_load_format_pt() -> None:
    from handler.download.files import serving_files

    pickled = ["config.json", "tokenizer.json", "pytorch_model.bin", "training_args.bin"]
    with pytest.raises(ConfigError, match=r"org/m has only pickled weights \(pytorch_model.bin\).*"
                                          "set option.load_format=pt"):
        serving_files(pickled, Settings(), "org/m")
    assert "pytorch_model.bin" in serving_files(pickled, Settings(load_format="pt"), "org/m")
    with pytest.raises(ConfigError, match="org/m holds no \\*.safetensors weights"):
        serving_files(["config.json", "model.gguf"], Settings(), "org/m")


def test_an_s3_prefix_brings_everything_but_pickles_beside_safetensors() -> None:
    from handler.download.files import serving_files

    files = serving_files(["model.py", "serving.properties", "requirements.txt", "model.safetensors",
                           "pytorch_model.bin", "config.json"], Settings(), "s3://b/p/", everything=True)
    assert sorted(files) == ["config.json", "model.py", "model.safetensors", "requirements.txt",
                             "serving.properties"]


def test_missing_local_folder(env: dict[str, str], tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="no such folder") as info:
        load_settings({**env, "HF_MODEL_ID": str(missing)})
    assert str(missing) in str(info.value)


def test_folder_without_config_json(env: dict[str, str], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="config.json is missing"):
        load_settings({**env, "HF_MODEL_ID": str(empty)})


def test_sagemaker_model_dir_is_the_model_when_nothing_names_one(env: dict[str, str]) -> None:
    del env["HF_MODEL_ID"]
    sm_dir = make_model_dir(Path(env["SAGEMAKER_MODEL_DIR"]))
    settings = load_settings(env)
    assert settings.model_id == str(sm_dir)
    assert settings.model_dir == sm_dir


def test_named_model_beats_sagemaker_model_dir(env: dict[str, str]) -> None:
    make_model_dir(Path(env["SAGEMAKER_MODEL_DIR"]))
    settings = load_settings(env)
    assert settings.model_id == env["HF_MODEL_ID"]


def test_properties_model_id_beats_sagemaker_model_dir(env: dict[str, str], tmp_path: Path) -> None:
    del env["HF_MODEL_ID"]
    make_model_dir(Path(env["SAGEMAKER_MODEL_DIR"]))
    named = make_model_dir(tmp_path / "named")
    write_props(env, f"option.model_id={named}\n")
    assert load_settings(env).model_dir == named


def test_serving_properties_in_sagemaker_model_dir_is_read(env: dict[str, str]) -> None:
    del env["SERVING_PROPERTIES"]
    sm_dir = make_model_dir(Path(env["SAGEMAKER_MODEL_DIR"]))
    (sm_dir / "serving.properties").write_text("option.max_model_len=99\n")
    assert load_settings(env).max_model_len == 99


def test_serving_properties_env_points_at_tmp_file(env: dict[str, str], tmp_path: Path) -> None:
    other = tmp_path / "custom.properties"
    other.write_text("# custom\noption.max_rolling_batch_size: 6\noption.max_model_len = 200\n")
    settings = load_settings({**env, "SERVING_PROPERTIES": str(other)})
    assert (settings.max_rolling_batch_size, settings.max_model_len) == (6, 200)


def test_bad_line_in_serving_properties_fails_load(env: dict[str, str]) -> None:
    write_props(env, "engine=Python\noops\n")
    with pytest.raises(ConfigError, match="line 2"):
        load_settings(env)


def test_default_model_when_nothing_names_one(env: dict[str, str]) -> None:
    del env["HF_MODEL_ID"]
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip("the embedded model is not assembled (make model)")
    settings = load_settings(env)
    assert settings.model_id is None
    assert settings.model_dir == DEFAULT_MODEL_DIR


def test_tgi_alias_does_not_override_properties_file(env: dict[str, str]) -> None:
    write_props(env, "option.max_rolling_batch_size=8\noption.max_model_len=1024\n")
    settings = load_settings({**env, "MAX_BATCH_SIZE": "4", "MAX_TOTAL_TOKENS": "512"})
    assert settings.max_rolling_batch_size == 8
    assert settings.max_model_len == 1024


def test_serving_properties_pointing_at_a_missing_file_fails(env: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SERVING_PROPERTIES"):
        load_settings({**env, "SERVING_PROPERTIES": str(tmp_path / "typo.properties")})


def test_sagemaker_process_names_fill_the_gunicorn_options(env: dict[str, str]) -> None:
    from handler.__main__ import gunicorn_options

    settings = load_settings({**env, "SAGEMAKER_BIND_TO_PORT": "9123", "SAGEMAKER_MODEL_SERVER_WORKERS": "2",
                              "SAGEMAKER_MODEL_SERVER_THREADS": "64", "SAGEMAKER_CONTAINER_LOG_LEVEL": "30",
                              "SERVER_HOST": "127.0.0.1", "SERVER_GRACEFUL_TIMEOUT": "20"})
    options = gunicorn_options(settings)
    assert (options["bind"], options["workers"], options["threads"]) == ("127.0.0.1:9123", 2, 64)
    assert (options["loglevel"], options["graceful_timeout"]) == ("warning", 20)


@pytest.mark.parametrize(("timeout", "request_timeout", "worker_timeout"), [
    (None, 60.0, 120),      # the defaults: 60 s per request, gunicorn's 120 s silence timeout
    ("300", 300.0, 300),    # one name, one meaning: the request timeout; the worker waits at least as long
    ("30", 30.0, 120),
])
def test_model_server_timeout_is_the_request_timeout(env: dict[str, str], timeout: str | None,
                                                     request_timeout: float, worker_timeout: int) -> None:
    environ = env if timeout is None else {**env, "SAGEMAKER_MODEL_SERVER_TIMEOUT": timeout}
    settings = load_settings(environ)
    assert (settings.request_timeout, settings.worker_timeout) == (request_timeout, worker_timeout)


def test_an_async_endpoints_longest_invocation_is_the_longest_request_timeout(env: dict[str, str]) -> None:
    settings = load_settings({**env, "SAGEMAKER_MODEL_SERVER_TIMEOUT": "3600"})
    assert (settings.request_timeout, settings.worker_timeout) == (3600.0, 3600)
    with pytest.raises(ConfigError, match=r"SAGEMAKER_MODEL_SERVER_TIMEOUT \(option.request_timeout\)='3601'"):
        load_settings({**env, "SAGEMAKER_MODEL_SERVER_TIMEOUT": "3601"})


def test_sagemakers_names_set_the_body_limit_and_the_sessions(env: dict[str, str], tmp_path: Path) -> None:
    from handler.__main__ import gunicorn_options, prepare_sessions_dir

    settings = load_settings({**env, "SAGEMAKER_MAX_REQUEST_SIZE": str(10 * 2**20),
                              "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true", "SAGEMAKER_SESSIONS_EXPIRATION": "600"})
    assert (settings.max_request_size, settings.enable_stateful_sessions, settings.sessions_expiration) == (
        10 * 2**20, True, 600)
    assert gunicorn_options(settings)["worker_class"].max_body_bytes == 10 * 2**20  # the worker's read budget
    prepared, made = prepare_sessions_dir(settings)  # the master makes the folder the workers share
    assert made is not None and made.is_dir() and prepared.sessions_path == str(made)
    made.rmdir()
    named = load_settings({**env, "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true",
                           "SAGEMAKER_SESSIONS_PATH": str(tmp_path / "sessions")})
    assert prepare_sessions_dir(named) == (named, None)
    assert load_settings(env).max_request_size == 6 * 2**20 and not load_settings(env).enable_stateful_sessions


def test_a_bad_environment_value_names_the_variable(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"SAGEMAKER_BIND_TO_PORT \(option.port\)='abc'"):
        load_settings({**env, "SAGEMAKER_BIND_TO_PORT": "abc"})


def test_a_handler_folder_without_config_json_is_a_model_unless_the_builtin_engine_is_asked_for(
        env: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "handler-only"
    folder.mkdir()
    (folder / "model.py").write_text("def handle(inputs):\n    return None\n")
    assert load_settings({**env, "HF_MODEL_ID": str(folder)}).model_dir == folder
    with pytest.raises(ConfigError, match="config.json is missing"):
        load_settings({**env, "HF_MODEL_ID": str(folder), "OPTION_BUILTIN_ENGINE": "true"})


def test_speculative_decoding_defaults_follow_the_drafter(env: dict[str, str]) -> None:
    """Prompt lookup drafts 2 tokens a step (measured fastest here), a draft model 5 (LMI's default)."""
    assert load_settings({**env, "OPTION_SPECULATIVE_DRAFT_MODEL": "ngram"}).draft_length == 2
    assert load_settings({**env, "OPTION_SPECULATIVE_DRAFT_MODEL": "/opt/ml/draft"}).draft_length == 5
    assert load_settings({**env, "OPTION_SPECULATIVE_DRAFT_MODEL": "[ngram]",
                          "OPTION_SPECULATIVE_LENGTH": "4"}).draft_length == 4
    with pytest.raises(ConfigError, match="option.speculative_length"):
        load_settings({**env, "OPTION_SPECULATIVE_LENGTH": "0"})
