"""A/B of one engine step on the CPU benchmark models: the first (verifying) step and the steady state.

Runs one arm (bk-mixopt through engine.backward, or non-private) of one configuration in this process and
prints a JSON line: ``first_s`` (the first step: the tag passes that read each layer call's rows), ``median_s``
(median of the timed steps after warm-up) and the version of dptrain imported. Run it under the PYTHONPATH of
each checkout, alternately, to compare two commits on a busy machine (see benchmarks/results/ab-notes.md).

    PYTHONPATH=src:benchmarks python benchmarks/ab_step.py gpt2-t64 bk-mixopt --steps 20
    PYTHONPATH=src:benchmarks python benchmarks/ab_step.py gpt2-t100 bk-mixopt --device cuda   # a GPU configuration
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import dptrain
from dptrain_bench import zoo
from dptrain_bench.arms import make_arm
from dptrain_bench.workers import build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("arm", choices=["bk-mixopt", "non-private"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu (the CPU configurations, one thread) or cuda (the GPU ones)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    config = zoo.configs_for("cpu" if device.type == "cpu" else "gpu")[args.config]
    task, model, batches = build(config, device, config.batch_size, 4)
    arm = make_arm(args.arm, model, task, config.batch_size)
    times = []
    for k in range(args.warmup + args.steps):
        start = time.perf_counter()
        arm.step(batches[k % len(batches)])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    print(json.dumps({"config": args.config, "arm": args.arm, "device": str(device), "first_s": times[0],
                      "median_s": statistics.median(times[args.warmup:]), "dptrain": dptrain.__file__}))


if __name__ == "__main__":
    main()
