"""Where one steady step's GPU time goes: torch's profiler over a few steps of one arm of one configuration.

Runs in its own process (one arm, one configuration), after warm-up steps. Prints and appends to ``--out``
a summary: the median step time of ``--steps`` timed steps, then over ``--profile-steps`` profiled steps the
kernels per step, the GPU's busy time against the wall time (a step whose GPU is idle most of the time is
bound by the launches and the Python that issues them), the synchronizations and host copies with the Python
line that caused them, and the GPU time and kernel count per dptrain function (the innermost frame of
``dptrain`` in the stack that launched the kernel) and per kernel name. ``--trace`` also writes the
profiler's Chrome trace, gzipped, for a closer look.

    PYTHONPATH=src:benchmarks python benchmarks/gpu_profile.py resnet18-gn-224-b128 bk-mixopt --out prof.txt
    PYTHONPATH=src:benchmarks python benchmarks/gpu_profile.py gpt2-t64 bk-mixopt --device cpu --out prof.txt
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

import dptrain
from dptrain_bench import zoo
from dptrain_bench.arms import make_arm
from dptrain_bench.workers import build

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def innermost(stack: list[str], marker: str) -> str:
    """The innermost frame of the stack inside ``marker``'s files ("file.py(line): function" → "file.py:function")."""
    for frame in stack:  # the profiler lists the innermost frame first
        if frame.startswith(marker) or "/" + marker in frame:
            path, _, function = frame.partition(": ")
            return f"{path.split(marker)[-1].split('(')[0]}:{function}"
    return "(model, loss, autograd)"


def summarize(prof, steps: int, wall_s: float, device: str) -> list[str]:
    by_function: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    by_kernel: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    syncs: collections.Counter = collections.Counter()
    busy_us = 0.0
    kernels = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CPU:
            if "): " in event.name or event.name.startswith("<built-in"):
                continue  # a Python frame, not an op
            if any(event.name.startswith(s) for s in SYNC_CALLS):
                syncs[(event.name, innermost(_stack_of(event), "dptrain/"))] += 1
            device_us = getattr(event, "self_device_time_total", None)
            if device_us is None:
                device_us = getattr(event, "self_cuda_time_total", 0.0)
            launched = sum(1 for k in event.kernels) if hasattr(event, "kernels") else 0
            if device == "cpu":  # on a CPU the aten ops are the work: count leaf ops and their own CPU time
                if event.cpu_children or not event.name.startswith("aten::"):
                    continue
                device_us, launched = event.self_cpu_time_total, 1
            if device_us or launched:
                where = innermost(_stack_of(event), "dptrain/")
                by_function[where][0] += device_us
                by_function[where][1] += launched
        else:
            busy_us += event.time_range.elapsed_us()
            kernels += 1
            entry = by_kernel[event.name[:90]]
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
    if device == "cpu":
        busy_us = sum(v[0] for v in by_function.values())
        kernels = sum(v[1] for v in by_function.values())
    lines = [f"profiled steps: {steps}, wall {1e3 * wall_s / steps:.2f} ms/step, "
             f"{'GPU busy' if device != 'cpu' else 'aten ops (own CPU time)'} {busy_us / 1e3 / steps:.2f} ms/step "
             f"({100 * busy_us / 1e6 / max(wall_s, 1e-9):.0f}% of the wall time), "
             f"{kernels / steps:.0f} {'kernels' if device != 'cpu' else 'ops'}/step"]
    lines.append("synchronizations and copies per step (call, dptrain function):")
    lines += [f"  {n / steps:6.1f}  {name}  {where}" for (name, where), n in syncs.most_common(12)] or ["  none"]
    lines.append("GPU time per dptrain function (ms/step, kernels/step):")
    for where, (us, n) in sorted(by_function.items(), key=lambda kv: -kv[1][0])[:30]:
        lines.append(f"  {us / 1e3 / steps:8.3f} ms {n / steps:6.0f}  {where}")
    if device != "cpu":
        lines.append("kernels by name (ms/step, launches/step):")
        for name, (us, n) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:25]:
            lines.append(f"  {us / 1e3 / steps:8.3f} ms {n / steps:6.0f}  {name}")
    return lines


def _stack_of(event) -> list[str]:
    """The Python frames above an event, innermost first: the profiler records each frame as an event of its own
    (older versions: as the op's ``stack``)."""
    if event.stack:
        return list(event.stack)
    frames = []
    parent = event.cpu_parent
    while parent is not None:
        if "(" in parent.name and "): " in parent.name:
            frames.append(parent.name)
        parent = parent.cpu_parent
    return frames


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("arm", choices=["bk-mixopt", "non-private", "ghost", "mix-ghost", "bk", "bk-mix-ghost"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--amp", choices=["none", "bf16"], default="none", help="bf16 autocast of forward and loss")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--out", help="append the summary to this file")
    parser.add_argument("--trace", help="also write the Chrome trace here (gzipped)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    config = zoo.configs_for("cpu" if device.type == "cpu" else "gpu")[args.config]
    task, model, batches = build(config, device, config.batch_size, 4)
    arm = make_arm(args.arm, model, task, config.batch_size, torch.bfloat16 if args.amp == "bf16" else None)

    def step(k: int) -> None:
        arm.step(batches[k % len(batches)])

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for k in range(args.warmup + args.steps):
        start = time.perf_counter()
        step(k)
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    head = (f"== {args.config} {args.arm} amp={args.amp} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
            f" (torch {torch.__version__}, dptrain {os.path.dirname(dptrain.__file__)})\n"
            f"first step {times[0] * 1e3:.1f} ms, steady median {statistics.median(times[args.warmup:]) * 1e3:.2f} ms "
            f"over {args.steps} steps, peak memory {peak:.0f} MiB")
    summary = []
    if args.profile_steps:  # (0: the timings alone)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities, with_stack=True) as prof:
            start = time.perf_counter()
            for k in range(args.profile_steps):
                step(k)
            sync()
            wall = time.perf_counter() - start
        summary = summarize(prof, args.profile_steps, wall, device.type)
    text = "\n".join([head, *summary]) + "\n"
    print(text, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    if args.trace and args.profile_steps:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as raw:
            name = raw.name
        prof.export_chrome_trace(name)
        with open(name, "rb") as src, gzip.open(args.trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.unlink(name)
    print(json.dumps({"config": args.config, "arm": args.arm, "amp": args.amp,
                      "median_s": statistics.median(times[args.warmup:]), "first_s": times[0], "peak_mib": peak}))


if __name__ == "__main__":
    main()
