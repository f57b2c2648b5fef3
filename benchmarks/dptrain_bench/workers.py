"""The measurements, each run in a fresh Python process (``python -m dptrain_bench --worker TASK RESULT``).

A task is a JSON dict; its ``kind`` picks the worker: ``memory`` (one arm's peak), ``time`` (every arm of a
configuration, round-robin), ``max-batch`` (one arm's largest batch) or ``arm`` (one arm's peak and step times).
"""
from __future__ import annotations

import copy
import gc
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from dptrain import _checks

from . import zoo
from .arms import Arm, make_arm
from .memory import LIVE_BYTES_MALLOC, PeakMemory, search_largest_batch, start_memory_watchdog
from .zoo import SEED, BenchConfig


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return "out of memory" in text or "can't allocate memory" in text or "cannot allocate memory" in text


def describe_error(exc: BaseException) -> str:
    if is_oom(exc):
        return "out of memory: " + first_line(exc)
    return f"{type(exc).__name__}: {first_line(exc)}"


def first_line(exc: BaseException) -> str:
    return _checks.first_line(exc)[:400]


def _setup_worker(task: dict) -> torch.device:
    device = torch.device(task["device"])
    if not task.get("isolated", True):
        return device  # in-process (tests): leave the caller's threads and limits alone
    torch.set_num_threads(task["threads"])
    if device.type == "cpu" and task.get("mem_limit_bytes") and task.get("oom_marker"):
        start_memory_watchdog(task["mem_limit_bytes"], Path(task["oom_marker"]))
    import warnings

    warnings.filterwarnings("ignore")
    return device


def build(config: BenchConfig, device: torch.device, batch_size: int, n_batches: int):
    """(task, model in training mode on ``device``, ``n_batches`` batches), seeded: what every arm of a row trains."""
    task = config.task()
    torch.manual_seed(SEED)
    if config.build_on_device:
        with torch.device(device):
            model = task.build().train()
    else:
        model = task.build().to(device).train()
    generator = torch.Generator().manual_seed(SEED + 1)
    batches = [{k: v.to(device) for k, v in task.make_batch(batch_size, generator).items()} for _ in range(n_batches)]
    return task, model, batches


def _worker_memory(task: dict) -> dict:
    device = _setup_worker(task)
    config = zoo.configs_for(task["scale"])[task["config"]]
    task_, model, batches = build(config, device, config.batch_size, 2)
    arm = make_arm(task["arm"], model, task_, config.batch_size, config.autocast_dtype())
    meter = PeakMemory(device)
    meter.start()
    baseline = meter.baseline
    step_peaks = []
    for k, batch in enumerate(batches):  # the first step (it reads the rows: one-time work counts) and one more
        if k:
            meter.start()  # (a fresh high-water mark for this step; the baseline stays the first one)
        arm.step(batch)
        step_peaks.append(meter.peak())
    peak = max(step_peaks)
    arm.close()
    return {"peak_bytes": peak, "baseline_bytes": baseline, "peak_above_baseline_bytes": peak - baseline,
            **_step_peaks(step_peaks, baseline, device), "memory_method": meter.method, "note": arm.note}


def _step_peaks(peaks: list[int], baseline: int, device: torch.device) -> dict:
    """The first step's peak and the largest of the later (steady) steps', as the memory figures count them: total on
    a GPU, above the baseline taken before the first step on a CPU. A user's largest batch is set by the worst."""
    shift = 0 if device.type == "cuda" else baseline
    out = {"first_step_peak_bytes": peaks[0] - shift}
    if len(peaks) > 1:
        out["steady_peak_bytes"] = max(peaks[1:]) - shift
    return out


def _discard(arm: Arm | None) -> None:
    """Release a failed arm's model and hooks; its own failure is already recorded."""
    if arm is not None:
        try:
            arm.close()
        except Exception:  # noqa: BLE001 - a half-done step may leave the engine mid-state
            pass
    gc.collect()


def _worker_time(task: dict) -> dict:
    device = _setup_worker(task)
    config = zoo.configs_for(task["scale"])[task["config"]]
    warmup, steps = task["warmup"], task["steps"]
    task_, reference, batches = build(config, device, config.batch_size, warmup + steps)
    arms: dict[str, Arm] = {}
    failures: dict[str, str] = {}
    for name in task["arms"]:
        arm = None
        try:
            arm = make_arm(name, copy.deepcopy(reference), task_, config.batch_size, config.autocast_dtype())
            for batch in batches[:warmup]:
                arm.step(batch)
            _sync(device)
            arms[name] = arm
        except Exception as exc:  # noqa: BLE001 - an arm's failure is a result, the others go on
            failures[name] = describe_error(exc)
        if name in failures:
            _discard(arm)
            arm = None
    del reference
    wall: dict[str, list[float]] = {name: [] for name in arms}
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    order = list(arms)
    rng = random.Random(SEED)
    for batch in batches[warmup:]:
        rng.shuffle(order)  # no arm always runs right after the same neighbour
        for name in list(order):
            if name in failures:
                continue
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                arms[name].step(batch)
                _sync(device)
            except Exception as exc:  # noqa: BLE001
                failures[name] = describe_error(exc)
            if name in failures:
                # drop the arm now: its model, engine and half-done step must not crowd out the others
                _discard(arms.pop(name))
                continue
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    out = {}
    for name in task["arms"]:
        if name in failures:
            out[name] = {"error": failures[name]}
        else:
            out[name] = {"step_times_s": wall[name], "cpu_times_s": cpu[name]}
    return out


def _worker_max_batch(task: dict) -> dict:
    """Largest batch of one arm; ``budget_s`` (optional) bounds the search: no trial starts after it."""
    device = _setup_worker(task)
    config = zoo.configs_for(task["scale"])[task["config"]]
    deadline = time.monotonic() + task["budget_s"] if task.get("budget_s") else None
    task_ = config.task()
    torch.manual_seed(SEED)
    reference = task_.build()  # built once, on the CPU: each trial trains a copy
    tried: dict[int, bool] = {}

    def trial(batch_size: int, n_steps: int) -> list[float] | None:
        """Step times at this batch size, or None when it runs out of memory."""
        times, oom = [], None
        model = batches = arm = None
        try:
            model = copy.deepcopy(reference).to(device).train()
            # drawn on the device: a batch of thousands of 224x224 images takes seconds on the CPU
            generator = torch.Generator(device).manual_seed(SEED + 1)
            batches = [task_.make_batch(batch_size, generator)]
            arm = make_arm(task["arm"], model, task_, batch_size, config.autocast_dtype())
            for _ in range(n_steps):
                _sync(device)
                t0 = time.perf_counter()
                arm.step(batches[0])
                _sync(device)
                times.append(time.perf_counter() - t0)
            arm.close()
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                raise
            oom = first_line(exc)
        # outside the except block, so the traceback no longer pins the failed step's tensors
        model = batches = arm = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        tried[batch_size] = oom is None
        return None if oom else times

    search = search_largest_batch(lambda b: trial(b, 2) is not None, config.batch_size, task["cap"],
                                  deadline=deadline, rel_tolerance=task.get("tolerance", 0.0))
    result: dict[str, Any] = {"max_batch": search.found, "cap": task["cap"], "max_batch_search": search.describe(),
                              "max_batch_trials": len(tried)}
    if search.found:
        warmup = task.get("final_warmup", config.warmup)
        times = trial(search.found, warmup + task.get("final_steps", config.steps))
        if times:
            median = statistics.median(times[warmup:] or times)
            result.update(max_batch_step_s=median, max_batch_throughput=search.found / median)
    return result


def _worker_arm(task: dict) -> dict:
    """One arm of one configuration, alone in its process: peak memory over the warm-up and timed steps,
    and the step times (the GPU preset: one process per arm, no round-robin needed on a GPU)."""
    device = _setup_worker(task)
    config = zoo.configs_for(task["scale"])[task["config"]]
    warmup, steps = task["warmup"], task["steps"]
    # Two batches, taken in turn: every arm's peak includes the batches it holds, so thirteen of them
    # (a GiB for ResNet-18 at batch 128) would dilute the ratios between arms.
    task_, model, batches = build(config, device, config.batch_size, min(2, warmup + steps))
    arm = make_arm(task["arm"], model, task_, config.batch_size, config.autocast_dtype())
    meter = PeakMemory(device)
    meter.start()
    baseline = meter.baseline
    wall, cpu, step_peaks = [], [], []
    first_step_s = None
    for i in range(warmup + steps):
        batch = batches[i % len(batches)]
        if i:
            meter.start()
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        arm.step(batch)
        _sync(device)
        step_peaks.append(meter.peak())
        if i == 0:
            first_step_s = time.perf_counter() - t0
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    peak = max(step_peaks)
    arm.close()
    return {"peak_bytes": peak, "baseline_bytes": baseline, "peak_above_baseline_bytes": peak - baseline,
            **_step_peaks(step_peaks, baseline, device), "first_step_s": first_step_s,
            "memory_method": meter.method, "note": arm.note, "step_times_s": wall, "cpu_times_s": cpu}


WORKERS = {"memory": _worker_memory, "time": _worker_time, "max-batch": _worker_max_batch, "arm": _worker_arm}


def run_task(task: dict) -> dict:
    try:
        return {"ok": True, "result": WORKERS[task["kind"]](task)}
    except Exception as exc:  # noqa: BLE001 - reported as the arm's failure
        return {"ok": False, "error": describe_error(exc), "traceback": traceback.format_exc()}


def worker_main(task_file: str, result_file: str) -> int:
    result = run_task(json.loads(Path(task_file).read_text()))
    Path(result_file).write_text(json.dumps(result))
    return 0


def run_worker(task: dict, timeout: float, isolate: bool = True) -> dict:
    """Run one measurement in a fresh Python process; a crash or timeout becomes an error entry.

    ``isolate=False`` runs it in this process instead (fast, for tests): no address-space cap,
    no thread setting, and the memory peak then includes whatever this process did before.
    """
    if not isolate:
        return run_task({**task, "isolated": False})
    with tempfile.TemporaryDirectory(prefix="dptrain-bench-") as tmp:
        task_file, result_file, marker = Path(tmp, "task.json"), Path(tmp, "result.json"), Path(tmp, "oom.txt")
        task_file.write_text(json.dumps({**task, "oom_marker": str(marker)}))
        env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(task["threads"])
        if task.get("omp_wait_policy"):
            env["OMP_WAIT_POLICY"] = task["omp_wait_policy"]
        if task["kind"] in ("memory", "arm") and task["device"] == "cpu":
            env.update(LIVE_BYTES_MALLOC)
        # the workers must import this very harness and this very dptrain (a checkout, a snapshot), not another install
        import dptrain

        roots = (str(Path(__file__).resolve().parents[1]), str(Path(dptrain.__file__).resolve().parents[1]))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (*roots, env.get("PYTHONPATH"))))
        cmd = [sys.executable, "-m", "dptrain_bench", "--worker", str(task_file), str(result_file)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
        if result_file.exists():
            return json.loads(result_file.read_text())
        if marker.exists():
            return {"ok": False, "error": "out of memory: " + marker.read_text()}
        if proc.returncode < 0:
            sig = signal.Signals(-proc.returncode).name
            why = " (likely out of memory)" if sig == "SIGKILL" else ""
            return {"ok": False, "error": f"worker killed by {sig}{why}"}
        tail = (proc.stderr or "").strip().splitlines()[-5:]
        return {"ok": False, "error": f"worker exited with status {proc.returncode}: " + " | ".join(tail)[-600:]}
