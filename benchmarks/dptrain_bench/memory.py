"""Memory probes: a process's peak memory above a baseline, a resident-memory cap, and the largest-batch search."""
from __future__ import annotations

import gc
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


def _proc_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


#: glibc settings for the CPU memory workers: blocks of 128 KiB and more are mapped and returned to
#: the kernel when freed (by default malloc keeps up to 32 MiB per freed block and trims lazily), so
#: the resident set follows the live bytes, as ``torch.cuda.max_memory_allocated`` does on a GPU:
#: without them an arm's peak depended on what the allocator happened to keep from earlier steps.
LIVE_BYTES_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _malloc_follows_live_bytes() -> bool:
    return all(os.environ.get(k) == v for k, v in LIVE_BYTES_MALLOC.items())


def _reset_rss_peak() -> bool:
    """Reset the kernel's resident high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory above a baseline taken at ``start()``, in bytes.

    CPU: resident set size. ``VmHWM`` after ``clear_refs`` is exact (the kernel tracks it at
    every page fault); without it, ``ru_maxrss`` is the process's lifetime peak, an upper
    bound (it may include model construction). GPU: ``torch.cuda.max_memory_allocated``.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.method = ""
        self.baseline = 0

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated"
        elif _reset_rss_peak() and _proc_status_kb("VmHWM") is not None:
            self.baseline = _proc_status_kb("VmRSS") * 1024
            self.method = "VmHWM after clear_refs (exact RSS peak)"
            if _malloc_follows_live_bytes():
                self.method += "; malloc returns freed blocks >= 128 KiB at once"
        else:
            self.baseline = _proc_status_kb("VmRSS") * 1024 if _proc_status_kb("VmRSS") else 0
            self.method = "ru_maxrss (lifetime RSS peak: an upper bound)"

    def peak(self) -> int:
        """The peak since ``start()``, in bytes (total, not above the baseline)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        hwm = _proc_status_kb("VmHWM")
        if hwm is not None and self.method.startswith("VmHWM"):
            return hwm * 1024
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def start_memory_watchdog(limit_bytes: int, marker: Path, period_s: float = 0.02) -> None:
    """Kill this worker once its resident memory passes ``limit_bytes`` above the current RSS.

    So that an arm needing too much fails alone (the parent reads the marker and records it
    as out of memory) instead of waking the kernel's OOM killer on a shared machine. RSS,
    not the address space: RLIMIT_AS also counts reserved, untouched memory.
    """
    start = (_proc_status_kb("VmRSS") or 0) * 1024

    def watch():
        while True:
            rss = (_proc_status_kb("VmRSS") or 0) * 1024
            if rss - start > limit_bytes:
                marker.write_text(f"resident memory passed the cap of {limit_bytes / 2**20:.0f} MiB above "
                                  f"the worker's start ({rss / 2**30:.1f} GiB resident); see --mem-limit-gb")
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(period_s)

    threading.Thread(target=watch, name="memory-watchdog", daemon=True).start()


def largest_batch(fits: Callable[[int], bool], start: int, cap: int) -> int:
    """Largest batch size b <= cap with ``fits(b)``, for a monotone ``fits``; 0 if even 1 does not fit.

    Doubling from ``start`` until a failure (or the cap), then bisection, as in the
    mixed-ghost paper's maximum-batch experiments.
    """
    return search_largest_batch(fits, start, cap).found


@dataclass(frozen=True)
class BatchSearch:
    """What a largest-batch search established: ``found`` fits; ``too_large`` (if known) does not."""

    found: int
    too_large: int | None
    stopped: str = ""  # why the bracket was left open: "time budget" or "tolerance"; "" if exact

    def describe(self) -> str:
        if not self.stopped:
            return str(self.found)
        upper = f", {self.too_large} does not" if self.too_large else ""
        return f"{self.found} fits{upper} (stopped by the {self.stopped})"


def search_largest_batch(fits: Callable[[int], bool], start: int, cap: int, *, deadline: float | None = None,
                         clock: Callable[[], float] = time.monotonic, rel_tolerance: float = 0.0) -> BatchSearch:
    """Doubling then bisection (see ``largest_batch``) that starts no new trial once ``clock()`` passes
    ``deadline``, and stops bisecting once the bracket is within ``rel_tolerance`` of the batch found."""
    lo, hi = 0, None  # fits(lo) (0 trivially); hi is the smallest size known not to fit
    b = max(1, min(start, cap))

    def out_of_time() -> bool:
        return deadline is not None and clock() >= deadline

    while hi is None:
        if lo and out_of_time():
            return BatchSearch(lo, None, "time budget")
        if fits(b):
            lo = b
            if b >= cap:
                return BatchSearch(b, None)
            b = min(2 * b, cap)
        else:
            hi = b
    while hi - lo > max(1, int(rel_tolerance * lo)):
        if out_of_time():
            return BatchSearch(lo, hi, "time budget")
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return BatchSearch(lo, hi, "" if hi - lo <= 1 else "tolerance")
