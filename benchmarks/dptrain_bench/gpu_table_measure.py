"""The measurements of issue 43's GPU table, each run in a process of its own (forked, or a fresh interpreter).

A job writes what it measured as JSON lines, one event at a time, to a file that the parent reads when the
process ends: a job stopped by the time budget (killed) still leaves its first step, the steps it timed and the
batches it tried. Events: ``environment`` (the probe), ``built``, ``step`` (one per step: its wall time and its peak
memory), ``done``; ``trial`` and ``search`` (largest batch); ``error`` (with the traceback).
"""
from __future__ import annotations

import gc
import json
import os
import time
import traceback
from pathlib import Path

import torch

from .arms import make_arm
from .environment import environment
from .gpu_table_rows import SEARCH_TOLERANCE, TableRow, row_config, rows_by_key
from .memory import PeakMemory, search_largest_batch
from .workers import describe_error, first_line, is_oom
from .zoo import SEED


class EventLog:
    """Appends one JSON object per line to ``path``, flushed at once (the process may be killed at any time)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def write(self, event: str, **fields) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
            f.flush()


def read_events(path: str | Path) -> list[dict]:
    """The events a job wrote; a last line cut short by a kill is left out."""
    events = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return events
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return events


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def torch_defaults() -> dict:
    """The settings that decide TF32 and kernel choice: recorded, never changed (the table is at torch's defaults)."""
    return {"cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn.benchmark": torch.backends.cudnn.benchmark,
            "cudnn.deterministic": torch.backends.cudnn.deterministic}


def probe(device: torch.device, events: EventLog) -> None:
    """Where the table runs: the device, the versions, the commit, torch's settings. It is the first job, so that a
    machine without a usable GPU (or where a forked process cannot use CUDA) fails here, before anything else."""
    if device.type == "cuda":
        torch.zeros(1, device=device)  # create the CUDA context: the check that this process can use the GPU
    env = environment(device, torch.get_num_threads())
    import importlib.metadata

    for name in ("peft", "scipy"):
        try:
            env["versions"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env["versions"][name] = None
    env["torch_full"] = torch.__version__
    env["cudnn"] = torch.backends.cudnn.version() if device.type == "cuda" else None
    env["torch_defaults"] = torch_defaults()
    events.write("environment", environment=env)


def _build(row: TableRow, dry_run: bool, device: torch.device, batch_size: int, n_batches: int):
    """(config, task, model, batches): the model built on the device from the same seed in every arm, the batches
    drawn there."""
    config = row_config(row, dry_run)
    task = config.task()
    torch.manual_seed(SEED)
    with torch.device(device):
        model = task.build().train()
    generator = torch.Generator(device).manual_seed(SEED + 1)
    batches = [task.make_batch(batch_size, generator) for _ in range(n_batches)]
    return config, task, model, batches


def measure_arm(row: TableRow, arm_name: str, dry_run: bool, device: torch.device, events: EventLog) -> None:
    """One arm of one row: ``warmup`` steps (the first of them reported apart), then ``steps`` timed steps; every
    step's wall time (between two device synchronisations) and its peak memory, the first step's included."""
    t0 = time.perf_counter()
    config, task, model, batches = _build(row, dry_run, device, row_config(row, dry_run).batch_size, 2)
    arm = make_arm(arm_name, model, task, config.batch_size, config.autocast_dtype())
    _sync(device)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    meter = PeakMemory(device)
    events.write("built", build_s=time.perf_counter() - t0, parameters=params, trainable_parameters=trainable,
                 note=arm.note, batch_size=config.batch_size, warmup=config.warmup, steps=config.steps,
                 autocast=config.autocast)
    for i in range(config.warmup + config.steps):
        meter.start()  # a fresh high-water mark for this step (on a GPU: everything allocated now, model included)
        baseline = meter.baseline
        _sync(device)
        start = time.perf_counter()
        arm.step(batches[i % len(batches)])
        _sync(device)
        elapsed = time.perf_counter() - start
        events.write("step", i=i, s=elapsed, peak_bytes=meter.peak(), baseline_bytes=baseline,
                     memory_method=meter.method)
    arm.close()
    events.write("done", wall_s=time.perf_counter() - t0)


def search_batch(row: TableRow, arm_name: str, dry_run: bool, device: torch.device, search_s: float,
                 cap: int, events: EventLog) -> None:
    """The largest batch this arm trains: doubling from the row's batch, then bisection to within SEARCH_TOLERANCE,
    up to ``cap``; no trial starts after ``search_s`` seconds. A trial is a fresh model and two steps (the first
    step's peak counts); it fails only by running out of memory (any other error ends the job)."""
    deadline = time.monotonic() + search_s
    start_batch = row_config(row, dry_run).batch_size

    def fits(batch_size: int) -> bool:
        t = time.perf_counter()
        oom, peak = None, None
        model = batches = arm = None
        try:
            config, task, model, batches = _build(row, dry_run, device, batch_size, 1)
            arm = make_arm(arm_name, model, task, batch_size, config.autocast_dtype())
            meter = PeakMemory(device)
            meter.start()
            for _ in range(2):
                arm.step(batches[0])
            peak = meter.peak()
            arm.close()
        except Exception as exc:  # noqa: BLE001 - out of memory is the answer; anything else is the job's error
            if not is_oom(exc):
                raise
            oom = first_line(exc)
        model = batches = arm = None  # outside the except block: the traceback no longer pins the step's tensors
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        events.write("trial", batch=batch_size, fits=oom is None, s=time.perf_counter() - t, peak_bytes=peak,
                     out_of_memory=oom, allocated_after_bytes=left)
        return oom is None

    search = search_largest_batch(fits, start_batch, cap, deadline=deadline, rel_tolerance=SEARCH_TOLERANCE)
    events.write("search", found=search.found, too_large=search.too_large, stopped=search.stopped,
                 described=search.describe(), cap=cap)


def run_job(spec: dict, events_path: str) -> int:
    """A job's body, in its own process: ``spec`` names the kind, the row, the arm and the device. Returns the exit
    status (0, or 1 after an ``error`` event)."""
    events = EventLog(events_path)
    try:
        import warnings

        warnings.filterwarnings("ignore")
        device = torch.device(spec["device"])
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        if spec["kind"] == "probe":
            probe(device, events)
            return 0
        row = rows_by_key(spec["dry_run"])[spec["row"]]
        if spec["kind"] == "arm":
            measure_arm(row, spec["arm"], spec["dry_run"], device, events)
        elif spec["kind"] == "largest-batch":
            search_batch(row, spec["arm"], spec["dry_run"], device, spec["search_s"], spec["cap"], events)
        else:
            raise ValueError(f"unknown job kind {spec['kind']!r}")
        return 0
    except BaseException as exc:  # noqa: BLE001 - written down for the parent, which records it as the job's error
        events.write("error", error=describe_error(exc), traceback=traceback.format_exc()[-4000:])
        return 1


def child_exit(code: int) -> None:
    """End a forked child without running the parent's exit handlers (pytest's, the parent's temporary folders)."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

