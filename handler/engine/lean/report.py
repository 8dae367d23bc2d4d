"""What the lean engine's step loop tells the stats listener (``StepReport``): an ``EngineStats`` with its gauges
read now (requests running and waiting, KV memory, adapters) and its counters since the last report (tokens
sampled, prefix-cache queries and hits, preemptions, drafted and accepted tokens, queue times).

The engine thread asks for it after a step and marks it reported once the listener has it. Imports: the backend's
``EngineStats``, the step loop's parts it reads (the lean scheduler and speculator, ``emit.Emitter``'s count) and
``runners.kv_space``'s block size; the runner's own counters it reads by name, whichever runner it is.
"""

from __future__ import annotations

from handler.engine.backend import EngineStats
from handler.engine.lean.emit import Emitter
from handler.engine.lean.scheduler import Scheduler
from handler.engine.lean.speculate import Speculator
from handler.engine.runners.kv_space import PREFIX_BLOCK


class StepReport:
    """The step loop's ``EngineStats``; ``reported``: the runner's prefix-cache queries and hits, and the scheduler's
    preemptions, at the last report (the counters count from there)."""

    def __init__(self, runner, scheduler: Scheduler, speculator: Speculator | None, emitter: Emitter) -> None:
        self.runner, self.scheduler, self.speculator, self.emitter = runner, scheduler, speculator, emitter
        self.reported = (0, 0, 0)

    def stats(self, batch_size: int, num_queued: int) -> EngineStats:
        """``num_queued``: requests submitted but not yet taken into the scheduler."""
        runner, space, scheduler, speculator = self.runner, self.scheduler.space, self.scheduler, self.speculator
        queries, hits = getattr(runner, "num_prefix_queries", 0), getattr(runner, "num_prefix_hits", 0)
        token_bytes, budget = getattr(space, "bytes_per_token", 0), getattr(space, "budget", 0)
        used = token_bytes * scheduler.num_cached_tokens
        running = scheduler.running_requests()
        store = getattr(runner, "adapters", None)
        return EngineStats(
            num_running=len(running),
            num_waiting=scheduler.num_waiting + num_queued,
            batch_size=batch_size, num_sampled=self.emitter.num_sampled,
            kv_cache_used_bytes=used, kv_cache_allocated_bytes=getattr(space, "num_bytes", 0),
            kv_cache_budget_bytes=budget,
            prefix_cache_queries=queries - self.reported[0], prefix_cache_hits=hits - self.reported[1],
            num_preemptions=scheduler.num_preemptions - self.reported[2],
            num_draft_tokens=speculator.num_drafted if speculator else 0,
            num_accepted_tokens=speculator.num_accepted if speculator else 0,
            kv_cache_usage=min(1.0, used / budget) if budget else 0.0,
            kv_block_size=PREFIX_BLOCK if budget else 0,
            kv_num_blocks=budget // (token_bytes * PREFIX_BLOCK) if budget and token_bytes else 0,
            queue_times=tuple(scheduler.queue_times),
            max_loras=store.max_loaded if store is not None else 0,
            running_adapters=_adapters(running), waiting_adapters=_adapters(scheduler.waiting))

    def mark_reported(self) -> None:
        """The stats so far went to the listener: the next report counts from here."""
        self.emitter.num_sampled = 0
        self.scheduler.queue_times.clear()
        if self.speculator is not None:
            self.speculator.num_drafted = self.speculator.num_accepted = 0
        self.reported = (getattr(self.runner, "num_prefix_queries", 0), getattr(self.runner, "num_prefix_hits", 0),
                         self.scheduler.num_preemptions)


def _adapters(states) -> tuple[str, ...]:
    """The LoRA adapters ``states`` generate with, each once, in order."""
    return tuple(dict.fromkeys(s.request.adapter for s in states if s.request.adapter is not None))
