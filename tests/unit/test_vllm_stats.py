"""vLLM's scheduler figures as the vLLM backend gathers them for its ``EngineStats`` (no vLLM needed: the figures
take vLLM's ``SchedulerStats`` and ``CacheConfig`` by their fields)."""

from __future__ import annotations

from types import SimpleNamespace

from handler.engine.vllm.stats import SchedulerFigures


def scheduler_stats(usage: float, queries: int, hits: int, running: dict, waiting: dict) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_usage=usage, prefix_cache_stats=SimpleNamespace(queries=queries, hits=hits),
                           running_lora_adapters=running, waiting_lora_adapters=waiting)


def test_the_latest_usage_and_adapters_and_the_prefix_counts_since_last_taken() -> None:
    figures = SchedulerFigures()
    figures.take_cache_config(SimpleNamespace(block_size=16, num_gpu_blocks=None))  # before the engine has started
    assert (figures.block_size, figures.num_blocks) == (16, 0)
    figures.take_cache_config(SimpleNamespace(block_size=16, num_gpu_blocks=1024))
    figures.take(scheduler_stats(0.5, 32, 16, {"a": 1}, {}))
    figures.take(scheduler_stats(0.25, 8, 0, {"a": 1, "b": 2}, {"c": 1}))
    assert (figures.kv_cache_usage, figures.num_blocks) == (0.25, 1024)
    assert (figures.running_adapters, figures.waiting_adapters) == (("a", "b"), ("c",))
    assert figures.take_prefix_counts() == (40, 16)
    assert figures.take_prefix_counts() == (0, 0)
