"""Resident memory of this process while a benchmark phase runs: ``rss_now`` and the sampling context ``Peak``."""

from __future__ import annotations

import os
import threading
import time


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """Context manager: the peak resident memory while it is open (a thread reading RSS every 10 ms)."""

    def __enter__(self):
        self.start = self.peak = rss_now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_now())
            self._stop.wait(0.01)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_now())

    @property
    def working(self) -> int:
        """The peak over the resident memory at entry (bytes): what the phase added."""
        return self.peak - self.start
