"""vLLM's metric names through the real server, as routers and autoscalers scrape them (``prometheus_client``'s text
parser): present, labelled with the served model's name, and moving under load; the ORCA load report a request asks
for; and, with two gunicorn workers (two engines), merged across them.

``test_vllm_named_metrics_move_under_load`` runs again in the vLLM contract (tests/vllm/test_contract.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import RunningServer, start_server, stop_server
from tests.e2e.test_metrics import wait_until

STREAM = {"messages": [{"role": "user", "content": "Tell me a story about a fox."}], "max_tokens": 24,
          "ignore_eos": True, "stream": True}
NUM_STREAMS = 4
TYPES = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
         "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
         "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
         "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
         "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
         "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram"}


def scrape(url: str) -> dict[str, object]:
    response = requests.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def value(families: dict, sample: str, **labels: str) -> float:
    family = families.get(sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum"))
    found = [s.value for s in (family.samples if family else ()) if s.name == sample
             and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(found)


def stream(url: str) -> int:
    """One chat stream to its end; its completion tokens."""
    body = {**STREAM, "stream_options": {"include_usage": True}}
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=300) as response:
        assert response.status_code == 200, response.text
        frames = [line for line in response.iter_lines(decode_unicode=True) if line.startswith("data: {")]
    return json.loads(frames[-1].removeprefix("data: "))["usage"]["completion_tokens"]


def test_vllm_named_metrics_move_under_load(url: str) -> None:
    model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    before = scrape(url)
    for name, kind in TYPES.items():
        assert before[name].type == kind, name
    seen_running: list[float] = []
    seen_usage: list[float] = []
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        streams = [pool.submit(stream, url) for _ in range(NUM_STREAMS)]

        def busy() -> bool:
            now = scrape(url)
            seen_running.append(value(now, "vllm:num_requests_running", model_name=model))
            seen_usage.append(value(now, "vllm:kv_cache_usage_perc", model_name=model))
            return seen_running[-1] > 0 and seen_usage[-1] > 0

        wait_until(busy, "the streams to run and hold KV cache")
        generated = sum(s.result() for s in streams)
    assert 0 < max(seen_usage) <= 1

    def settled() -> bool:
        now = scrape(url)
        return (value(now, "vllm:num_requests_running", model_name=model) == 0
                and value(now, "vllm:e2e_request_latency_seconds_count", model_name=model)
                == value(before, "vllm:e2e_request_latency_seconds_count", model_name=model) + NUM_STREAMS)

    wait_until(settled, "the streams to end and be counted")
    after = scrape(url)

    def grew(sample: str) -> float:
        return value(after, sample, model_name=model) - value(before, sample, model_name=model)

    assert grew("vllm:generation_tokens_total") >= generated > 0
    assert grew("vllm:prompt_tokens_total") > 0 and grew("vllm:prefix_cache_queries_total") > 0
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_queue_time_seconds"):
        assert grew(histogram + "_count") == NUM_STREAMS, histogram
    assert grew("vllm:inter_token_latency_seconds_count") >= generated - NUM_STREAMS  # each token after the first
    [config] = after["vllm:cache_config_info"].samples
    assert int(config.labels["block_size"]) > 0 and int(config.labels["num_gpu_blocks"]) > 0


@pytest.mark.parametrize("fmt", ["TEXT", "JSON"])
def test_a_request_that_asks_gets_an_orca_load_report(url: str, fmt: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                             headers={"endpoint-load-metrics-format": fmt})
    report = response.headers["endpoint-load-metrics"]
    if fmt == "TEXT":
        number = r"\d+(\.\d+)?(e-?\d+)?"
        assert re.fullmatch(rf"TEXT named_metrics\.kv_cache_usage_perc={number}, "
                            rf"named_metrics\.num_requests_waiting={number}", report), report
    else:
        assert set(json.loads(report.removeprefix("JSON "))["named_metrics"]) == {"kv_cache_usage_perc",
                                                                                   "num_requests_waiting"}
    plain = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert "endpoint-load-metrics" not in plain.headers


# ---- two workers, two engines ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("two-workers"), {"SAGEMAKER_MODEL_SERVER_WORKERS": "2"})
    try:  # /ping answered by one worker; the other may still be loading: both have reported their cache when ready
        wait_until(lambda: both_ready(running.url), "both workers' engines to be ready")
        yield running
    finally:
        stop_server(running)


def both_ready(url: str) -> bool:
    families = scrape(url)
    config = families.get("vllm:cache_config_info")
    # each engine says its own block count (each worker sizes its cache from the memory free at its start, so the
    # two may differ by a few blocks); the merged block count is their sum
    return config is not None and len(config.samples) in (1, 2) and \
        value(families, "llm_kv_cache_blocks") == _engine_blocks(config)


def _engine_blocks(config) -> int:
    """The two engines' blocks from cache_config_info: one series when they are equal (counted twice), else two."""
    blocks = [int(sample.labels["num_gpu_blocks"]) for sample in config.samples]
    return 2 * blocks[0] if len(blocks) == 1 else sum(blocks)


def test_two_workers_are_merged_as_one_server(two_workers: RunningServer) -> None:
    """Every request counts once whichever worker served it, and the KV usage is over both engines' blocks: the
    blocks summed are the engines' own counts in cache_config_info, added."""
    url = two_workers.url
    before = scrape(url)
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        generated = sum(pool.map(lambda _: stream(url), range(NUM_STREAMS)))

    def counted() -> bool:
        now = scrape(url)
        return value(now, "vllm:e2e_request_latency_seconds_count") - \
            value(before, "vllm:e2e_request_latency_seconds_count") == NUM_STREAMS

    wait_until(counted, "the streams to be counted")
    after = scrape(url)
    assert value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total") >= generated
    assert both_ready(url)  # the blocks summed: the engines' own counts, added
    assert 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1
    assert len(after["vllm:num_requests_running"].samples) == 1  # one series, the workers' sum
