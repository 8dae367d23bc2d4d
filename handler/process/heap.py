"""The worker's heap: glibc tuned so that engine steps reuse their activations, and freed memory handed back to the
OS on a schedule, so that the worker's RSS tracks what it holds rather than the most it ever held.

Every engine step allocates the same few MB of activations and logits. With glibc's defaults each large block is a
fresh mmap, page-faulted in and unmapped again, which on a VM whose memory is backed lazily dominates a step; so
``keep_freed_memory`` keeps blocks up to 32 MiB in the heap and stops glibc trimming it. The price is that memory
freed there stays with the process: in every arena the worker's threads have used, and in the middle of a heap
as well as at its top. ``start_trimming`` hands it back every ``TRIM_EVERY_S`` (``malloc_trim(0)``), which costs
the next step a page fault per page it reuses, once per period instead of once per step.

May import: ``handler.threads`` and the standard library. Not glibc (musl, macOS): every call here does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time

from handler.threads import start_supervised

log = logging.getLogger(__name__)

TRIM_EVERY_S = 30.0
THREAD_NAME = "heap-trim"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, loaded once (None elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def keep_freed_memory() -> None:
    """Blocks up to 32 MiB (activations, logits) come from the heap and are reused; larger ones (weights, the KV
    cache's slabs) are still mmapped, so what they free goes back to the OS at once."""
    libc = _libc()
    if libc is None:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)


def give_back() -> float:
    """Hand the heap's free pages back to the OS now (every arena, not only a heap's top); the seconds it took."""
    libc = _libc()
    started = time.monotonic()
    if libc is not None:
        libc.malloc_trim(0)
    return time.monotonic() - started


def start_trimming(every_s: float = TRIM_EVERY_S, stop: threading.Event | None = None) -> threading.Thread:
    """A supervised daemon thread calling ``give_back`` every ``every_s`` seconds, until ``stop`` is set."""
    stop = stop or threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            seconds = give_back()
            log.debug("heap trimmed in %.1f ms", seconds * 1000)

    return start_supervised(THREAD_NAME, run)
