"""The metric names routers and autoscalers read: vLLM's, served beside ours from the engine's ``EngineStats``.

The Gateway API inference extension's model-server protocol (kubernetes-sigs/gateway-api-inference-extension,
``docs/proposals/003-model-server-protocol/README.md`` at 84436a96) names what its endpoint picker scrapes from a
vLLM server; each is checked here by name, type and labels in our exposition, as a scrape parses it
(``prometheus_client``'s text parser). The ORCA header is checked against vLLM's own writer
(``vllm/entrypoints/serve/utils/orca_metrics.py``).
"""

from __future__ import annotations

import json

import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from handler import metrics
from handler.engine.backend import EngineStats

MODEL = "test-model"

# The protocol's table: (its name, vLLM's metric, type, the labels it reads). "MUST provide": the first three;
# [Optional] BlockSize and NumGPUBlocks ("used by the prefix cache scorer"); the LoRA section's one gauge.
PROTOCOL = [
    ("TotalQueuedRequests", "vllm:num_requests_waiting", "gauge", ()),
    ("TotalRunningRequests", "vllm:num_requests_running", "gauge", ()),
    ("KVCacheUtilization", "vllm:kv_cache_usage_perc", "gauge", ()),
    ("BlockSize", "vllm:cache_config_info", "gauge", ("block_size",)),
    ("NumGPUBlocks", "vllm:cache_config_info", "gauge", ("num_gpu_blocks",)),
    ("LoRA adapters", "vllm:lora_requests_info", "gauge", ("max_lora", "running_lora_adapters",
                                                           "waiting_lora_adapters")),
]


def busy_stats(**changes) -> EngineStats:
    """A step of an engine with 3 running and 2 waiting requests, a quarter of 400 16-token blocks in use."""
    fields = dict(num_running=3, num_waiting=2, batch_size=3, num_sampled=3, kv_cache_used_bytes=0,
                  kv_cache_allocated_bytes=0, prefix_cache_queries=40, prefix_cache_hits=16, kv_cache_usage=0.25,
                  kv_block_size=16, kv_num_blocks=400, queue_times=(0.5,), max_loras=2,
                  running_adapters=("a", "b"), waiting_adapters=("c",))
    return EngineStats(**{**fields, **changes})


def scrape() -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(metrics.render().decode())}


@pytest.fixture()
def reported() -> dict[str, object]:
    metrics.set_model_name(MODEL)
    metrics.record_step(busy_stats())
    return scrape()


@pytest.mark.parametrize(("protocol_name", "name", "kind", "labels"), PROTOCOL, ids=[p[0] for p in PROTOCOL])
def test_each_metric_the_inference_extension_reads_is_served(reported, protocol_name, name, kind, labels) -> None:
    family = reported[name]
    assert family.type == kind, protocol_name
    assert family.samples, protocol_name
    assert all(set(labels) <= set(sample.labels) for sample in family.samples), protocol_name


def test_the_gauges_say_what_the_engine_reported(reported) -> None:
    def value(name: str) -> float:
        [sample] = [s for s in reported[name].samples if s.labels.get("model_name") == MODEL]
        return sample.value

    assert (value("vllm:num_requests_running"), value("vllm:num_requests_waiting")) == (3, 2)
    assert value("vllm:kv_cache_usage_perc") == pytest.approx(0.25)
    config = {(s.labels["block_size"], s.labels["num_gpu_blocks"]) for s in reported["vllm:cache_config_info"].samples}
    assert config == {("16", "400")}
    lora = max(reported["vllm:lora_requests_info"].samples, key=lambda s: s.value)  # the newest, as readers take
    assert (lora.labels["max_lora"], lora.labels["running_lora_adapters"], lora.labels["waiting_lora_adapters"]) == \
        ("2", "a,b", "c")


def test_counters_and_histograms_carry_vllms_names_and_model_label() -> None:
    metrics.set_model_name(MODEL)
    before = scrape()
    metrics.record_step(busy_stats(num_sampled=5, prefix_cache_queries=30, prefix_cache_hits=10, queue_times=(1, 2)))
    metrics.record_generation(0.2, 30, 5, 1.5)
    metrics.record_token_gap(0.05)
    after = scrape()

    def grew(family: str, sample: str) -> float:
        def get(scraped) -> float:
            found = [s.value for s in scraped[family].samples
                     if s.name == sample and s.labels.get("model_name") == MODEL]
            return found[0] if found else 0.0
        assert after[family].type in ("counter", "histogram"), family
        return get(after) - get(before)

    assert grew("vllm:generation_tokens", "vllm:generation_tokens_total") == 5
    assert grew("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 30
    assert grew("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 30
    assert grew("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 10
    assert grew("vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count") == 2
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:inter_token_latency_seconds"):
        assert grew(name, name + "_count") == 1, name


def test_kv_usage_is_every_workers_used_blocks_over_all_their_blocks() -> None:
    """Several workers, each with its own cache: their blocks are summed (the multiprocess files' livesum), and the
    usage is computed from the sums when scraped."""
    worker_a = Metric(metrics.KV_BLOCKS_NAME, "", "gauge")
    worker_a.add_sample(metrics.KV_BLOCKS_NAME, {"pid": "1"}, 400)
    worker_a.add_sample(metrics.KV_BLOCKS_NAME, {"pid": "2"}, 400)
    used = Metric(metrics.KV_BLOCKS_USED_NAME, "", "gauge")
    used.add_sample(metrics.KV_BLOCKS_USED_NAME, {"pid": "1"}, 100)
    used.add_sample(metrics.KV_BLOCKS_USED_NAME, {"pid": "2"}, 300)
    family = metrics.kv_usage_family([worker_a, used], MODEL)
    assert [(s.labels, s.value) for s in family.samples] == [({"model_name": MODEL}, 0.5)]
    assert metrics.kv_usage_family([], MODEL).samples[0].value == 0.0  # no engine has reported blocks yet


def test_the_orca_header_is_written_as_vllm_writes_it() -> None:
    metrics.set_model_name(MODEL)
    metrics.record_step(busy_stats(kv_cache_usage=0.4, num_waiting=7))
    assert metrics.orca_header("TEXT") == \
        "TEXT named_metrics.kv_cache_usage_perc=0.4, named_metrics.num_requests_waiting=7.0"
    kind, payload = metrics.orca_header("json").split(" ", 1)
    assert kind == "JSON"
    assert json.loads(payload) == {"named_metrics": {"kv_cache_usage_perc": 0.4, "num_requests_waiting": 7.0}}
    assert metrics.orca_header("yaml") is None
