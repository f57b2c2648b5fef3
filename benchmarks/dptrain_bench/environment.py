"""What a run records about where it ran: hardware, versions, commit, load; and the waits of a shared machine."""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def opacus_missing() -> str | None:
    return None if importlib.util.find_spec("opacus") else "opacus not installed (pip install opacus)"


def _version(distribution: str) -> str | None:
    try:  # from the installed metadata: importing transformers or timm just for this takes seconds
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    import dptrain

    named = os.environ.get("DPTRAIN_BENCH_COMMIT")
    if named:  # the caller names the tree it sent (a GPU machine's copy may carry a stale .git)
        return named
    root = Path(dptrain.__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "src"], capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("DPTRAIN_BENCH_COMMIT")
    if head.returncode != 0:  # not a checkout (a copy of the tree on a GPU machine): the caller may name it
        return os.environ.get("DPTRAIN_BENCH_COMMIT")
    return head.stdout.strip() + (" (src/ has uncommitted changes)" if dirty.stdout.strip() else "")


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def wait_for_load(max_load: float, max_wait: float, log) -> None:
    """On a shared machine: wait (up to ``max_wait`` s) until the 1-minute load average is at most ``max_load``."""
    if not hasattr(os, "getloadavg"):
        return
    deadline = time.monotonic() + max_wait
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        log(f"  load average {os.getloadavg()[0]:.1f} > {max_load}: waiting")
        time.sleep(60)


def environment(device: torch.device, threads: int, omp_wait_policy: str | None = None) -> dict:
    from dptrain import __version__

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "cpu": _cpu_model(),
        "cpu_cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": threads,
        "omp_wait_policy": omp_wait_policy or os.environ.get("OMP_WAIT_POLICY") or "default",
        "memory_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        if hasattr(os, "sysconf") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in ("torch", "torchvision", "transformers", "timm", "opacus", "numpy")},
        "dptrain": __version__,
        "dptrain_commit": _git_commit(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        env["cuda"] = torch.version.cuda
    return env


def available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
