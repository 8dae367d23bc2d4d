"""What vLLM's scheduler says of its KV cache, prefix cache and adapters, gathered for the backend's ``EngineStats``.

vLLM hands its per-step figures (``SchedulerStats``) to stat loggers. ``stat_logger`` makes the one logger this
backend gives ``AsyncLLM``: a ``PrometheusStatLogger`` in type only, so that vLLM registers no Prometheus metrics of
its own (it adds its own Prometheus logger unless one of the given loggers is one): ``handler.metrics`` serves the
``vllm:*`` names for every backend, merged across gunicorn's workers like its ``llm_*`` metrics. The logger runs on
the backend's asyncio loop and keeps the figures in a ``SchedulerFigures``; ``StatsReport`` reads them with the
backend's requests in flight (``flight.InFlight``) into the ``EngineStats`` its listener gets. Imports: the engine's
``backend`` (``EngineStats``) and this package's ``flight`` and ``adapters``; vLLM only inside ``stat_logger``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from handler.engine.backend import EngineStats
from handler.engine.vllm.adapters import BASE_NAME
from handler.engine.vllm.flight import InFlight

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerFigures:
    """The latest of vLLM's scheduler figures, and the prefix-cache counts since the backend last took them."""

    kv_cache_usage: float = 0.0
    block_size: int = 0
    num_blocks: int = 0
    max_loras: int = 0                 # vLLM's adapter slots per batch (0: LoRA off)
    prefix_queries: int = 0
    prefix_hits: int = 0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()

    def take(self, scheduler_stats) -> None:
        """One ``vllm.v1.metrics.stats.SchedulerStats``."""
        self.kv_cache_usage = scheduler_stats.kv_cache_usage
        self.prefix_queries += scheduler_stats.prefix_cache_stats.queries
        self.prefix_hits += scheduler_stats.prefix_cache_stats.hits
        self.running_adapters = tuple(scheduler_stats.running_lora_adapters)
        self.waiting_adapters = tuple(scheduler_stats.waiting_lora_adapters)

    def take_cache_config(self, cache_config) -> None:
        self.block_size = int(cache_config.block_size or 0)
        self.num_blocks = int(cache_config.num_gpu_blocks or 0)

    def take_prefix_counts(self) -> tuple[int, int]:
        """The prefix-cache queries and hits (tokens) since the last call."""
        counts = self.prefix_queries, self.prefix_hits
        self.prefix_queries = self.prefix_hits = 0
        return counts


def stat_logger(figures: SchedulerFigures) -> type:
    """The stat logger class (vLLM's ``StatLoggerFactory``) that fills ``figures``."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class FiguresLogger(PrometheusStatLogger):
        """Takes the place of vLLM's Prometheus logger; its ``__init__`` does not call vLLM's, which registers
        vLLM's metrics."""

        def __init__(self, vllm_config, engine_indexes: list[int] | None = None) -> None:  # noqa: D107
            self.cache_config = vllm_config.cache_config
            figures.take_cache_config(self.cache_config)
            lora = getattr(vllm_config, "lora_config", None)
            figures.max_loras = lora.max_loras if lora is not None else 0

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                figures.take(scheduler_stats)

        def log_engine_initialized(self) -> None:
            figures.take_cache_config(self.cache_config)  # the block count is known once the engine has started

        def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
            pass

        def record_admission_rejection(self, reason: str) -> None:
            pass

        def log(self) -> None:
            pass

    return FiguresLogger


class StatsReport:
    """The backend's ``EngineStats`` for its listener, from its watcher's turns: sent when tokens were sampled or a
    figure changed (so gauges reach zero once, and an idle backend sends nothing)."""

    def __init__(self, on_stats: Callable[[EngineStats], None] | None) -> None:
        self.figures = SchedulerFigures()   # vLLM's scheduler figures (KV and prefix cache, adapters)
        self._on_stats = on_stats
        self._last: EngineStats | None = None

    def report(self, flight: InFlight) -> None:
        if self._on_stats is None:
            return
        running = flight.running
        figures = self.figures
        stats = EngineStats(num_running=len(running), num_waiting=len(flight.live) - len(running),
                            batch_size=sum(s.num_sequences if s.request.beam is not None and not s.choices_ended
                                           else sum(q.finish_reason is None for q in s.sequences) for s in running),
                            num_sampled=flight.num_sampled,
                            kv_cache_used_bytes=0, kv_cache_allocated_bytes=0,
                            prefix_cache_queries=figures.prefix_queries, prefix_cache_hits=figures.prefix_hits,
                            kv_cache_usage=figures.kv_cache_usage, kv_block_size=figures.block_size,
                            kv_num_blocks=figures.num_blocks, queue_times=tuple(flight.queue_times),
                            max_loras=max(0, figures.max_loras - 1),  # one slot is the base requests' (adapters)
                            running_adapters=tuple(a for a in figures.running_adapters if a != BASE_NAME),
                            waiting_adapters=tuple(a for a in figures.waiting_adapters if a != BASE_NAME))
        if stats.num_sampled == 0 and stats == self._last:
            return
        flight.mark_reported()
        figures.take_prefix_counts()
        self._last = stats
        try:
            self._on_stats(stats)
        except Exception:  # metrics must never stop the engine
            log.exception("engine stats listener failed")
