"""Prometheus metrics, served on ``GET /metrics``; every name starts with ``llm_``.

gunicorn runs several worker processes and a scrape reaches only one of them, so in production the metrics live in
files shared through ``PROMETHEUS_MULTIPROC_DIR`` (set up by the master before it forks, see ``__main__``) and the
route merges every worker's files with ``MultiProcessCollector``. Without that variable (tests, one process) the
default registry is served. prometheus-client picks the mode when it is first imported, so this module is imported
in the workers only (the master's part, which touches no metric, is in ``__main__``).

The engine knows nothing of Prometheus: it reports an ``EngineStats`` after its steps, and ``record_step`` turns
that into the gauges and the batch-size histogram. Request-level figures come from the server's ``RequestRecord``.

Beside them, the names routers and autoscalers read (the Gateway API inference extension and llm-d, AIBrix, KEDA
recipes, AIPerf): vLLM's ``vllm:*`` metrics, with vLLM's types, units, buckets and ``model_name`` label, filled from
the same figures on every backend (docs/operations.md, "Metrics", has the table). Several workers are merged as the
``llm_*`` ones are, except ``vllm:kv_cache_usage_perc``: each worker has its own KV cache, so it is computed when
scraped, as the blocks all workers' running sequences hold over all their blocks. ``orca_header`` answers a request that
asks for an ORCA load report (``endpoint-load-metrics-format``) as vLLM does.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from handler.engine.backend import EngineStats

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

REQUESTS = Counter("llm_requests_total", "HTTP requests answered, by route, schema and status code.",
                   ["route", "schema", "status"])
REQUEST_DURATION = Histogram("llm_request_duration_seconds", "Time from request arrival to the last byte sent.",
                             ["route", "schema"], buckets=_LATENCY_BUCKETS)
TIME_TO_FIRST_TOKEN = Histogram("llm_time_to_first_token_seconds",
                                "Time from request arrival to its first generated token.", buckets=_TTFT_BUCKETS)
INTER_TOKEN_LATENCY = Histogram("llm_inter_token_latency_seconds",
                                "Time between consecutive tokens of one choice.", buckets=_ITL_BUCKETS)
PROMPT_TOKENS = Histogram("llm_prompt_tokens", "Prompt tokens per request.", buckets=_TOKEN_BUCKETS)
GENERATED_TOKENS = Histogram("llm_generated_tokens", "Completion tokens per request (all choices).",
                             buckets=_TOKEN_BUCKETS)
ENGINE_TOKENS = Counter("llm_engine_generated_tokens_total",
                        "Tokens the engine sampled, including those of requests whose client went away.")
RUNNING = Gauge("llm_running_requests", "Requests holding batch slots.", multiprocess_mode="livesum")
WAITING = Gauge("llm_waiting_requests", "Requests waiting for a batch slot.", multiprocess_mode="livesum")
BATCH_SIZE = Histogram("llm_batch_size", "Sequences in one engine step.", buckets=_BATCH_BUCKETS)
KV_CACHE_USED = Gauge("llm_kv_cache_used_bytes", "KV-cache bytes holding tokens of running sequences.",
                      multiprocess_mode="livesum")
KV_CACHE_ALLOCATED = Gauge("llm_kv_cache_allocated_bytes", "KV-cache bytes allocated (grows with the load).",
                           multiprocess_mode="livesum")
KV_CACHE_BUDGET = Gauge("llm_kv_cache_budget_bytes", "KV-cache bytes the engine never allocates past "
                        "(option.kv_cache_memory).", multiprocess_mode="livesum")
PREFIX_CACHE_QUERIES = Counter("llm_prefix_cache_queries_tokens_total",
                               "Prompt tokens admitted to the engine (the prefix cache looked each prompt up).")
PREFIX_CACHE_HITS = Counter("llm_prefix_cache_hits_tokens_total",
                            "Prompt tokens whose KV came from the prefix cache instead of being computed; the hit "
                            "rate is this over llm_prefix_cache_queries_tokens_total.")
PREEMPTIONS = Counter("llm_preemptions_total",
                      "Running sequences whose KV was given back for memory; each resumes by recomputing it.")
DRAFT_TOKENS = Counter("llm_spec_decode_draft_tokens_total",
                       "Tokens drafted for speculative decoding (option.speculative_draft_model).")
ACCEPTED_TOKENS = Counter("llm_spec_decode_accepted_tokens_total",
                          "Drafted tokens the model's own sampling agreed with (each saved a step).")
QUEUE_REJECTIONS = Counter("llm_queue_rejections_total",
                           "Requests refused with 429 because the wait queue was full (option.max_queue_size).")
REQUEST_TIMEOUTS = Counter("llm_request_timeouts_total",
                           "Requests ended by the engine after option.request_timeout seconds.")
IMAGE_FETCH_FAILURES = Counter("llm_image_fetch_failures_total", "Image URLs that could not be fetched, by reason.",
                               ["reason"])
IMAGE_WAITS = Counter("llm_image_waits_total",
                      "Requests that waited for an image fetch slot (option.image_fetch_concurrency) or for image "
                      "memory (option.image_memory_budget), by resource.", ["resource"])
IMAGE_REJECTIONS = Counter("llm_image_rejections_total",
                           "Requests refused by an image budget: fetch_concurrency and memory_budget (429), "
                           "total_pixels (400).", ["reason"])
ADAPTER_REQUESTS = Counter("llm_adapter_requests_total", "Generation requests served with a LoRA adapter, by adapter.",
                           ["adapter"])
ADAPTER_TOKENS = Counter("llm_adapter_generated_tokens_total", "Completion tokens generated with a LoRA adapter, by "
                         "adapter.", ["adapter"])
ADAPTER_EVENTS = Counter("llm_adapter_events_total", "LoRA adapters loaded into memory and evicted from it "
                         "(option.max_loras), by adapter and event.", ["adapter", "event"])
THREAD_RESTARTS = Counter("llm_thread_restarts_total",
                          "Background threads of a worker (disconnect watcher, engine loop, ...) started again "
                          "after an unexpected error, by thread; each is in the log with its cause.", ["thread"])
ENGINE_PATH = Gauge("llm_engine_path_info", "1 for the engine path serving the model (lean or transformers) and why.",
                    ["path", "reason"], multiprocess_mode="livemax")


# ---- vLLM's names (vllm/v1/metrics/loggers.py, vLLM 0.32; its buckets: vllm/v1/metrics/buckets.py) -------------
_VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                         480.0, 960.0, 1920.0, 7680.0)
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                      40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)
_MODEL = ["model_name"]
KV_USAGE_NAME = "vllm:kv_cache_usage_perc"
VLLM_RUNNING = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", _MODEL,
                     multiprocess_mode="livesum")
VLLM_WAITING = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", _MODEL,
                     multiprocess_mode="livesum")
# what vllm:kv_cache_usage_perc is computed from at scrape time (each worker's own cache, summed)
KV_BLOCKS_USED_NAME, KV_BLOCKS_NAME = "llm_kv_cache_used_blocks", "llm_kv_cache_blocks"
KV_BLOCKS_USED = Gauge(KV_BLOCKS_USED_NAME, "KV-cache blocks (vllm:cache_config_info's block_size tokens) "
                       "that running sequences hold.", multiprocess_mode="livesum")
KV_BLOCKS = Gauge(KV_BLOCKS_NAME, "KV-cache blocks the engines hold in all (an engine that tells no block count "
                  "counts as one).", multiprocess_mode="livesum")
VLLM_CACHE_CONFIG = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", ["block_size",
                          "num_gpu_blocks", "engine"], multiprocess_mode="livemax")
VLLM_LORA_INFO = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                       ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], multiprocess_mode="livemax")
VLLM_PREFIX_QUERIES = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                              "tokens.", _MODEL)
VLLM_PREFIX_HITS = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                           _MODEL)
VLLM_PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", _MODEL)
VLLM_GENERATION_TOKENS = Counter("vllm:generation_tokens", "Number of generation tokens processed.", _MODEL)
VLLM_TTFT = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _MODEL,
                      buckets=_VLLM_TTFT_BUCKETS)
VLLM_ITL = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _MODEL,
                     buckets=_VLLM_ITL_BUCKETS)
VLLM_E2E = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _MODEL,
                     buckets=_VLLM_LATENCY_BUCKETS)
VLLM_QUEUE_TIME = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for "
                            "request.", _MODEL, buckets=_VLLM_LATENCY_BUCKETS)
# ORCA load reports (vllm/entrypoints/serve/utils/orca_metrics.py): the request header asks, in TEXT or JSON
ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"
ORCA_HEADER = "endpoint-load-metrics"


class _Served:
    """The model name the ``vllm:*`` metrics carry, and this worker's latest load (for ORCA reports)."""

    model_name = ""
    kv_cache_usage = 0.0
    num_waiting = 0
    lora_labels: tuple[str, str, str] | None = None


def set_model_name(name: str) -> None:
    """The served model's name (``model_name`` on the ``vllm:*`` metrics), before the engine reports; its series are
    there from now on, at zero, as vLLM's are before any request."""
    _Served.model_name = name
    for gauge in (VLLM_RUNNING, VLLM_WAITING):
        gauge.labels(name).set(0)
    for series in (VLLM_PREFIX_QUERIES, VLLM_PREFIX_HITS, VLLM_PROMPT_TOKENS, VLLM_GENERATION_TOKENS, VLLM_TTFT,
                   VLLM_ITL, VLLM_E2E, VLLM_QUEUE_TIME):
        series.labels(name)


def _record_vllm_step(stats: EngineStats) -> None:
    name = _Served.model_name
    _Served.kv_cache_usage, _Served.num_waiting = stats.kv_cache_usage, stats.num_waiting
    VLLM_RUNNING.labels(name).set(stats.num_running)
    VLLM_WAITING.labels(name).set(stats.num_waiting)
    blocks = stats.kv_num_blocks or 1  # an engine that tells no block count weighs as one block
    KV_BLOCKS.set(blocks)
    KV_BLOCKS_USED.set(stats.kv_cache_usage * blocks)
    if stats.kv_num_blocks:
        VLLM_CACHE_CONFIG.labels(str(stats.kv_block_size), str(stats.kv_num_blocks), "0").set(1)
    if stats.prefix_cache_queries:
        VLLM_PREFIX_QUERIES.labels(name).inc(stats.prefix_cache_queries)
        VLLM_PREFIX_HITS.labels(name).inc(stats.prefix_cache_hits)
        VLLM_PROMPT_TOKENS.labels(name).inc(stats.prefix_cache_queries)
    if stats.num_sampled:
        VLLM_GENERATION_TOKENS.labels(name).inc(stats.num_sampled)
    for seconds in stats.queue_times:
        VLLM_QUEUE_TIME.labels(name).observe(seconds)
    if stats.max_loras:  # vLLM sets the current labels to now; the newest is what a reader takes
        labels = (str(stats.max_loras), ",".join(stats.waiting_adapters), ",".join(stats.running_adapters))
        VLLM_LORA_INFO.labels(*labels).set(time.time())


def orca_header(metrics_format: str) -> str | None:
    """``endpoint-load-metrics`` for a request's ``endpoint-load-metrics-format`` (``TEXT`` or ``JSON``, any case;
    None for another): this worker's KV-cache usage and waiting requests, named and written as vLLM writes them."""
    named = {"kv_cache_usage_perc": float(_Served.kv_cache_usage), "num_requests_waiting": float(_Served.num_waiting)}
    if metrics_format.lower() == "text":
        return "TEXT " + ", ".join(f"named_metrics.{key}={value}" for key, value in named.items())
    if metrics_format.lower() == "json":
        return "JSON " + json.dumps({"named_metrics": named})
    return None


def record_engine_path(path: str, reason: str) -> None:
    ENGINE_PATH.labels(path=path, reason=reason).set(1)


def record_thread_restart(thread: str) -> None:
    """``handler.threads``' restart listener."""
    THREAD_RESTARTS.labels(thread=thread).inc()


def record_step(stats: EngineStats) -> None:
    """The engine's step listener (runs on the engine thread)."""
    RUNNING.set(stats.num_running)
    WAITING.set(stats.num_waiting)
    KV_CACHE_USED.set(stats.kv_cache_used_bytes)
    KV_CACHE_ALLOCATED.set(stats.kv_cache_allocated_bytes)
    KV_CACHE_BUDGET.set(stats.kv_cache_budget_bytes)
    if stats.prefix_cache_queries:
        PREFIX_CACHE_QUERIES.inc(stats.prefix_cache_queries)
        PREFIX_CACHE_HITS.inc(stats.prefix_cache_hits)
    if stats.num_preemptions:
        PREEMPTIONS.inc(stats.num_preemptions)
    if stats.num_draft_tokens:
        DRAFT_TOKENS.inc(stats.num_draft_tokens)
        ACCEPTED_TOKENS.inc(stats.num_accepted_tokens)
    if stats.batch_size:
        BATCH_SIZE.observe(stats.batch_size)
    if stats.num_sampled:
        ENGINE_TOKENS.inc(stats.num_sampled)
    _record_vllm_step(stats)


def record_request(route: str, schema: str, status: int, duration_s: float) -> None:
    REQUESTS.labels(route=route, schema=schema, status=str(status)).inc()
    REQUEST_DURATION.labels(route=route, schema=schema).observe(duration_s)


def record_generation(ttft_s: float | None, num_prompt_tokens: int, num_generated_tokens: int,
                      duration_s: float | None = None) -> None:
    """One request's token figures, once it has ended (``ttft_s`` is None when no token came; ``duration_s``: from
    its arrival to its end)."""
    if ttft_s is not None:
        TIME_TO_FIRST_TOKEN.observe(ttft_s)
        VLLM_TTFT.labels(_Served.model_name).observe(ttft_s)
    if duration_s is not None:
        VLLM_E2E.labels(_Served.model_name).observe(duration_s)
    PROMPT_TOKENS.observe(num_prompt_tokens)
    GENERATED_TOKENS.observe(num_generated_tokens)


def record_adapter_request(adapter: str, num_generated_tokens: int) -> None:
    ADAPTER_REQUESTS.labels(adapter=adapter).inc()
    ADAPTER_TOKENS.labels(adapter=adapter).inc(num_generated_tokens)


def record_adapter_event(adapter: str, event: str) -> None:
    """``event``: ``loaded`` or ``evicted``."""
    ADAPTER_EVENTS.labels(adapter=adapter, event=event).inc()


def record_token_gap(seconds: float) -> None:
    INTER_TOKEN_LATENCY.observe(seconds)
    VLLM_ITL.labels(_Served.model_name).observe(seconds)


def record_rejection() -> None:
    QUEUE_REJECTIONS.inc()


def record_timeout() -> None:
    REQUEST_TIMEOUTS.inc()


def record_image_fetch_failure(reason: str) -> None:
    """For the image fetcher: ``reason`` is a short fixed word (``timeout``, ``too_large``, ``blocked_address``...),
    never the URL, so the label set stays small."""
    IMAGE_FETCH_FAILURES.labels(reason=reason).inc()


def record_image_wait(resource: str) -> None:
    """``resource``: ``fetch_slot`` or ``memory``."""
    IMAGE_WAITS.labels(resource=resource).inc()


def record_image_rejection(reason: str) -> None:
    """``reason``: ``fetch_concurrency``, ``memory_budget`` or ``total_pixels``."""
    IMAGE_REJECTIONS.labels(reason=reason).inc()


def render() -> bytes:
    """The text exposition of every worker's metrics (multiprocess mode) or of this process's, with
    ``vllm:kv_cache_usage_perc`` computed from them all."""
    source = REGISTRY
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        source = multiprocess.MultiProcessCollector(None)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_WithKvUsage(source))
    return generate_latest(registry)


class _WithKvUsage:
    """A collector: what ``source`` collects, and ``vllm:kv_cache_usage_perc`` (by model name) as the blocks all
    workers' running sequences hold over all their blocks (0 while no engine has reported blocks)."""

    def __init__(self, source) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        families = list(self.source.collect())
        yield from families
        yield kv_usage_family(families, _Served.model_name)


def kv_usage_family(families: Iterable[Metric], model_name: str) -> GaugeMetricFamily:
    totals = {family.name: sum(sample.value for sample in family.samples) for family in families
              if family.name in (KV_BLOCKS_NAME, KV_BLOCKS_USED_NAME)}
    blocks, used = totals.get(KV_BLOCKS_NAME, 0.0), totals.get(KV_BLOCKS_USED_NAME, 0.0)
    family = GaugeMetricFamily(KV_USAGE_NAME, "KV-cache usage. 1 means 100 percent usage.", labels=["model_name"])
    family.add_metric([model_name], used / blocks if blocks else 0.0)
    return family

