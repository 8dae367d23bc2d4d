"""Prometheus metrics, served on ``GET /metrics``; every name starts with ``llm_``.

gunicorn runs several worker processes and a scrape reaches only one of them, so in production the metrics live in
files shared through ``PROMETHEUS_MULTIPROC_DIR`` (set up by the master before it forks, see ``__main__``) and the
route merges every worker's files with ``MultiProcessCollector``. Without that variable (tests, one process) the
default registry is served. prometheus-client picks the mode when it is first imported, so this module is imported
in the workers only (the master's part, which touches no metric, is in ``__main__``).

The engine knows nothing of Prometheus: it reports an ``EngineStats`` after its steps, and ``record_step`` turns
that into the gauges and the batch-size histogram. Request-level figures come from the server's ``RequestRecord``.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

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


def record_request(route: str, schema: str, status: int, duration_s: float) -> None:
    REQUESTS.labels(route=route, schema=schema, status=str(status)).inc()
    REQUEST_DURATION.labels(route=route, schema=schema).observe(duration_s)


def record_generation(ttft_s: float | None, num_prompt_tokens: int, num_generated_tokens: int) -> None:
    """One request's token figures, once it has ended (``ttft_s`` is None when no token came)."""
    if ttft_s is not None:
        TIME_TO_FIRST_TOKEN.observe(ttft_s)
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
    """The text exposition of every worker's metrics (multiprocess mode) or of this process's."""
    if not os.environ.get(MULTIPROC_ENV):
        return generate_latest(REGISTRY)
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return generate_latest(registry)

