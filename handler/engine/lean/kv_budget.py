"""The KV cache's byte budget at load: from ``option.kv_cache_memory`` (bytes, or a fraction of the memory
available once the weights are in), on CUDA ``option.gpu_memory_utilization``, else a default share of what the
machine (or its cgroup) has left, never more than ``max_running`` full-length sequences take (``kv_budget``); and the
start error when the budget cannot hold one sequence of the context length (``check_budget``).

May import: ``handler.config`` (the amount's parser), ``handler.errors``, the lean load's options and the runners'
KV spaces (which it budgets)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from handler.config import memory_amount
from handler.engine.lean.options import LoadOptions
from handler.engine.runners.kv_space import KVSpace
from handler.engine.runners.own_caches import OwnCaches
from handler.errors import ConfigError

log = logging.getLogger(__name__)

# option.kv_cache_memory's default on CPU: this much of the memory available once the weights are in, shared by
# the workers; on CUDA, vLLM's default gpu_memory_utilization
DEFAULT_KV_FRACTION = 0.4
DEFAULT_GPU_UTILIZATION = 0.9
# bytes a CUDA step's activations may need beside the KV cache
ACTIVATION_RESERVE = 1 << 30


def kv_budget(options: LoadOptions, full_sequence: int) -> tuple[int, str]:
    """The KV cache's byte budget and where it comes from (``full_sequence``: the bytes one sequence of the
    context length takes). The default never exceeds what ``max_running`` full-length sequences would take."""
    kv = options.kv_memory
    ceiling = options.max_running * full_sequence
    amount, fraction = memory_amount(kv.amount) if kv.amount is not None else (None, None)
    if amount is not None:
        budget, how = amount, "option.kv_cache_memory"
    elif options.device == "cuda":
        import torch

        utilization = kv.gpu_memory_utilization or fraction or DEFAULT_GPU_UTILIZATION
        total = torch.cuda.get_device_properties(0).total_memory
        budget = int(total * utilization) - torch.cuda.memory_reserved() - ACTIVATION_RESERVE
        how = f"{utilization:g} of the GPU's {total / 2**30:.1f} GiB less the weights"
        budget = budget if fraction or kv.gpu_memory_utilization else min(budget, ceiling)
    else:
        share = (fraction or DEFAULT_KV_FRACTION) / kv.workers
        available = available_memory()
        budget, how = int(available * share), f"{share:.2g} of the {available / 2**30:.1f} GiB available"
        if fraction is None:
            budget, how = min(budget, ceiling), how + f", at most {options.max_running} full-length sequences"
    return budget, how


def check_budget(space: KVSpace | OwnCaches, max_model_len: int, how: str) -> None:
    """Log the budget; a start error (one line) when it cannot hold one sequence of the context length."""
    one = space.bytes_for(max_model_len)
    if space.budget < one:
        raise ConfigError(f"the KV cache budget ({space.budget / 2**20:.0f} MiB: {how}) cannot hold one sequence of "
                          f"option.max_model_len={max_model_len} tokens ({one / 2**20:.0f} MiB); raise "
                          "option.kv_cache_memory or lower option.max_model_len")
    if space.bytes_per_token:
        log.info("KV cache budget %.0f MiB (%s): %d tokens at %d bytes each", space.budget / 2**20, how,
                 space.budget // space.bytes_per_token, space.bytes_per_token)
    elif not one:
        log.info("KV cache budget: none needed (the model keeps no cache between steps)")
    else:  # a recurrent state, the same size at every length
        log.info("KV cache budget %.0f MiB (%s): %d sequences at %d bytes each, whatever their length",
                 space.budget / 2**20, how, space.budget // max(one, 1), one)


def available_memory() -> int:
    """Bytes this process may still take: the kernel's MemAvailable, or the cgroup's limit less its usage when a
    container limit is lower (SageMaker and docker set one)."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit, usage = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            available = min(available, max(int(limit) - int(usage), 0))
        break
    return available
