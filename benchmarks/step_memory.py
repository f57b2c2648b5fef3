"""Peak memory and time of each step of a short run, each arm in a fresh process (issue 30's table).

The first step of a private run is the one that reads which sample each row belongs to; a user's largest batch is set
by the worst step, that one included. This runs one arm for a few steps and prints, per step, the peak resident
memory above the baseline taken before the first step and the step's wall time (CPU: glibc returns freed blocks at
once, so the resident set follows the live bytes, as on a GPU).

    python benchmarks/step_memory.py --model gpt2 --batch 8 --arm bk-mixopt [--steps 3] [--src other/checkout/src]
    python benchmarks/step_memory.py --table results.jsonl          # the issue's table: every row, both arms

``--src`` runs another checkout's dptrain (an A/B against an earlier commit). ``--table`` appends one JSON line per
arm to the file and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = [("gpt2", 8), ("gpt2", 32), ("resnet", 8), ("resnet", 32), ("resnet", 64), ("vgg", 8)]
LIVE_BYTES = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072", "OMP_WAIT_POLICY": "PASSIVE"}


def _task(model: str):
    from dptrain_bench import zoo

    if model == "gpt2":  # GPT-2's width, 4 layers, its tied 50k vocabulary, T = 100
        return zoo.Task("lm", lambda: zoo.gpt2(4, 768, 12), seq_len=100, vocab=50257)
    if model == "resnet":
        return zoo.Task("image", zoo.resnet18_gn, image_size=224)
    if model == "vgg":
        return zoo.Task("image", lambda: zoo.vgg11_gn(head="imagenet", hidden=512), image_size=224)
    raise SystemExit(f"--model must be gpt2, resnet or vgg, got {model!r}")


def run_arm(model_name: str, batch: int, arm: str, steps: int, threads: int) -> dict:
    import warnings

    import torch

    from dptrain_bench.memory import PeakMemory

    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    task = _task(model_name)
    torch.manual_seed(0)
    model = task.build()
    generator = torch.Generator().manual_seed(0)
    batches = [task.make_batch(batch, generator) for _ in range(steps)]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine = None
    if arm != "non-private":
        import dptrain

        engine = dptrain.PrivacyEngine(model, batch_size=batch, sample_size=100 * batch, noise_multiplier=1.0,
                                       max_grad_norm=1.0, clipping_mode=arm)
        engine.attach(optimizer)
    meter = PeakMemory(torch.device("cpu"))
    meter.start()
    baseline = meter.baseline
    peaks, seconds = [], []
    for k, data in enumerate(batches):
        if k:
            meter.start()
        t0 = time.perf_counter()
        losses = task.per_sample_loss(task.forward(model, data), data)
        if engine is None:
            losses.mean().backward()
        else:
            engine.backward(losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del losses
        seconds.append(time.perf_counter() - t0)
        peaks.append((meter.peak() - baseline) / 2**20)
    import dptrain

    return {"model": model_name, "batch": batch, "arm": arm, "peaks_mib": [round(p, 1) for p in peaks],
            "step_s": [round(t, 3) for t in seconds], "dptrain": str(Path(dptrain.__file__).parent)}


def _spawn(model: str, batch: int, arm: str, steps: int, threads: int, src: str | None) -> dict:
    env = dict(os.environ, **LIVE_BYTES)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src or str(HERE.parent / "src"), str(HERE), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, __file__, "--model", model, "--batch", str(batch), "--arm", arm,
                          "--steps", str(steps), "--threads", str(threads), "--json"],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--arm", default="bk-mixopt")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--src", help="another checkout's src directory (its dptrain is measured)")
    parser.add_argument("--table", help="run every row of the table, both arms, appending JSON lines to this file")
    parser.add_argument("--label", default="", help="a label for the rows of this run (--table), e.g. the commit")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.json:
        print(json.dumps(run_arm(args.model, args.batch, args.arm, args.steps, args.threads)))
        return
    if not args.table:
        print(json.dumps(_spawn(args.model, args.batch, args.arm, args.steps, args.threads, args.src)))
        return
    for model, batch in ROWS:
        for arm in ("non-private", args.arm):
            row = _spawn(model, batch, arm, args.steps, args.threads, args.src)
            row["label"] = args.label
            with open(args.table, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
