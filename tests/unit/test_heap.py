"""The worker's heap (``handler.process.heap``): with glibc tuned as the worker tunes it, freed memory stays with the
process until ``give_back``, and the trimming thread calls it on its period and stops when asked."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading

import pytest

from handler.process import heap

# In a process of its own (mallopt is process-wide): 256 blocks of 1 MiB malloc'ed and written by several threads
# (each gets its own arena, as the worker's request threads do), then freed: RSS before give_back, and after, in MiB.
CHILD = """
import ctypes, threading
from handler.process import heap

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 // 2**20

heap.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = []
def take():
    mine = [libc.malloc(1 << 20) for _ in range(64)]
    for block in mine:
        ctypes.memset(block, 1, 1 << 20)
    blocks.extend(mine)
threads = [threading.Thread(target=take) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
for block in blocks[:-1]:  # the last one stays: the heaps' tops are held, so glibc's own trimming would not run
    libc.free(block)
kept = rss()
heap.give_back()
print(kept, rss())
"""


def glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "malloc_trim")
    except OSError:
        return False


@pytest.mark.skipif(not glibc(), reason="malloc_trim is glibc's")
def test_freed_heap_memory_stays_until_given_back() -> None:
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    kept, after = map(int, run.stdout.split())
    assert kept - after >= 64, f"RSS {kept} MiB with 255 MiB freed, {after} MiB after give_back"


def test_the_trimming_thread_gives_back_on_its_period_until_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    three = threading.Event()

    def counted() -> float:
        calls.append(1)
        if len(calls) == 3:
            three.set()
        return 0.0

    monkeypatch.setattr(heap, "give_back", counted)
    stop = threading.Event()
    thread = heap.start_trimming(every_s=0.01, stop=stop)
    assert three.wait(60)
    stop.set()
    thread.join(60)
    assert not thread.is_alive() and thread.name == heap.THREAD_NAME
