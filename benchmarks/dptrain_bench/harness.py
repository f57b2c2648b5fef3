"""Benchmark harness: step time, peak memory and (on GPU) the largest batch, per model and clipping mode.

``run_benchmark`` runs what ``dptrain bench`` asks for (``cli.main``). For every
configuration (a model at a size and batch) it compares *arms*: non-private training, the
seven dptrain clipping modes and, when Opacus is installed, Opacus' ``hooks`` and ``ghost``
modes. Each measurement runs in a fresh subprocess:

- **memory**: one process per arm: build the model, take the baseline, run a warm-up step
  and one more step; the peak above the baseline. On CPU the peak is the kernel's resident
  high-water mark (``VmHWM``), reset to the current RSS (``/proc/self/clear_refs``) once the
  model, batches, optimizer and engine exist; on GPU ``torch.cuda.max_memory_allocated``.
  A crash (out of memory, an Opacus exception) then costs one arm, not the run.
- **time**: one process per configuration holds every arm that passed the memory stage, on
  the same batches; after warm-up the arms take their timed steps round-robin, in a shuffled
  order per round, so that load from other processes on a shared machine hits every arm
  alike. A step is forward + loss + backward + optimizer step + zero_grad; we report the
  median.
- **largest batch** (GPU only): one process per arm, doubling then bisecting the physical
  batch until CUDA runs out of memory; then the throughput at that batch.

Results are written as JSON (every figure, with hardware, versions and date), CSV, a
Markdown table and a PNG plot (memory and throughput per arm, as in the papers' figures);
see ``reports``. The measurements themselves run in ``workers``.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import workers
from .environment import environment, opacus_missing, wait_for_load
from .options import OPACUS_ARMS
from .reports import add_ratios, summarise_times
from .zoo import BenchConfig


def benchmark_config(config: BenchConfig, arms: Sequence[str], *, scale: str, device: torch.device, threads: int,
                     timeout: float, mem_limit_bytes: int | None, max_batch_cap: int | None,
                     warmup: int | None = None, steps: int | None = None, isolate: bool = True,
                     omp_wait_policy: str | None = None, log=print) -> dict:
    """Every arm of one configuration: memory (one process each), time (one process), largest batch (GPU)."""
    warmup = config.warmup if warmup is None else warmup
    steps = config.steps if steps is None else steps
    base = {"scale": scale, "config": config.name, "device": str(device), "threads": threads,
            "mem_limit_bytes": mem_limit_bytes, "omp_wait_policy": omp_wait_policy}
    entry: dict[str, Any] = {
        "config": config.name, "description": config.description, "batch_size": config.batch_size,
        "warmup": warmup, "steps": steps, "arms": {},
        "load_average_before": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    started = time.perf_counter()
    without_opacus = opacus_missing() if any(a in OPACUS_ARMS for a in arms) else None
    runnable = []
    for arm in arms:
        if arm in OPACUS_ARMS and without_opacus:
            entry["arms"][arm] = {"status": "skipped", "error": without_opacus}
            continue
        res = workers.run_worker({**base, "kind": "memory", "arm": arm}, timeout, isolate)
        if res["ok"]:
            entry["arms"][arm] = {"status": "ok", **res["result"]}
            runnable.append(arm)
            log(f"  {config.name} {arm}: peak {res['result']['peak_above_baseline_bytes'] / 2**20:.0f} MiB above baseline")
        else:
            entry["arms"][arm] = {"status": "failed", "stage": "memory", "error": res["error"],
                                  "traceback": res.get("traceback")}
            log(f"  {config.name} {arm}: FAILED ({res['error'][:160]})")
    if runnable:
        res = workers.run_worker({**base, "kind": "time", "arms": runnable, "warmup": warmup, "steps": steps,
                                  "mem_limit_bytes": 2 * mem_limit_bytes if mem_limit_bytes else None},
                                 timeout, isolate)
        for arm in runnable:
            rec = entry["arms"][arm]
            got = res["result"].get(arm, {}) if res["ok"] else {"error": res["error"]}
            if "error" in got:
                rec.update(status="failed", stage="time", error=got["error"])
                log(f"  {config.name} {arm}: timing FAILED ({got['error'][:160]})")
            else:
                rec.update(step_times_s=got["step_times_s"], cpu_times_s=got["cpu_times_s"],
                           **summarise_times(got["step_times_s"]),
                           cpu_median_s=statistics.median(got["cpu_times_s"]))
                rec["throughput"] = config.batch_size / rec["median_s"]
                log(f"  {config.name} {arm}: {rec['median_s'] * 1e3:.0f} ms/step")
    if device.type == "cuda" and max_batch_cap:
        for arm in runnable:
            rec = entry["arms"][arm]
            if rec["status"] != "ok":
                continue
            res = workers.run_worker({**base, "kind": "max-batch", "arm": arm, "cap": max_batch_cap}, timeout, isolate)
            if res["ok"]:
                rec.update(res["result"])
                log(f"  {config.name} {arm}: largest batch {res['result']['max_batch']}")
            else:
                rec["max_batch_error"] = res["error"]
    add_ratios(entry, device)
    entry["wall_s"] = time.perf_counter() - started
    entry["load_average_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return entry


def run_benchmark(configs: Sequence[BenchConfig], arms: Sequence[str], *, scale: str, device: torch.device,
                  threads: int, timeout: float = 3600, mem_limit_bytes: int | None = None,
                  max_batch_cap: int | None = None, warmup: int | None = None, steps: int | None = None,
                  previous: dict | None = None, on_config: Callable[[dict], None] | None = None,
                  isolate: bool = True, omp_wait_policy: str | None = None, max_load: float | None = None,
                  max_wait: float = 1800, log=print) -> dict:
    """Benchmark the configurations in order; ``on_config`` gets the results after each (to save progress)."""
    results = previous or {"scale": scale, "environment": environment(device, threads, omp_wait_policy),
                           "configs": {}}
    for config in configs:
        if config.name in results["configs"]:
            log(f"{config.name}: already in the results, skipped")
            continue
        if max_load is not None:
            wait_for_load(max_load, max_wait, log)
        log(f"{config.name}: {config.description}, batch {config.batch_size}")
        results["configs"][config.name] = benchmark_config(
            config, arms, scale=scale, device=device, threads=threads, timeout=timeout,
            mem_limit_bytes=mem_limit_bytes, max_batch_cap=max_batch_cap, warmup=warmup, steps=steps,
            isolate=isolate, omp_wait_policy=omp_wait_policy, log=log)
        if on_config:
            on_config(results)
    return results
