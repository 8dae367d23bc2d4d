"""One progress line at a steady interval for the whole download (bytes, rate, ETA), not a bar per file: a
SageMaker log is a file, where bars become thousands of lines.

Bytes are read from the disk (the folder the source writes into, partial files included), so the same reporter
serves the Hub's and S3's downloads whichever library writes them.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

INTERVAL_S = 5.0


class Progress:
    def __init__(self, name: str, interval_s: float = INTERVAL_S) -> None:
        self.name, self.interval_s = name, interval_s
        self.status = "resolving what to download"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def track(self, total: int, measure: Callable[[], int], num_files: int, where: str) -> None:
        """Start reporting: ``measure()`` is the bytes on disk now; what was there before does not count."""
        from handler.download.files import gigabytes

        self.total, self.measure, self.baseline = total, measure, measure()
        self.started = time.monotonic()
        say(f"downloading {self.name}: {num_files} files, {gigabytes(total)} to {where}")
        self._thread = threading.Thread(target=self._report, name="download-progress", daemon=True)
        self._thread.start()

    def done(self, completed: bool = True) -> None:
        """Stop reporting; a completed download's last line says what it took."""
        from handler.download.files import gigabytes

        self._stop.set()
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if not completed:
            return
        elapsed = time.monotonic() - self.started
        rate = self.total / elapsed if elapsed > 0 else 0.0
        say(f"downloaded {self.name}: {gigabytes(self.total)} in {elapsed:.1f} s ({gigabytes(rate)}/s)")

    def line(self) -> str:
        from handler.download.files import gigabytes

        got = max(0, self.measure() - self.baseline)
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = got / elapsed
        eta = f"{(self.total - got) / rate:.0f} s" if rate > 0 and got < self.total else "-"
        percent = 100.0 * got / self.total if self.total else 100.0
        return f"{gigabytes(got)} of {gigabytes(self.total)} ({percent:.0f}%), {gigabytes(rate)}/s, ETA {eta}"

    def _report(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.status = self.line()
            say(f"downloading {self.name}: {self.status}")


def say(line: str) -> None:
    print(f"download: {line}", file=sys.stderr, flush=True)


def fetch_reported(source, progress: Progress) -> Path:
    """``source.fetch(progress)`` with the progress ended either way: completed, or not (a failure, SIGTERM)."""
    try:
        folder = source.fetch(progress)
    except BaseException:
        progress.done(completed=False)
        raise
    progress.done()
    return folder
