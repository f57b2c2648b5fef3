"""The ``dptrain bench`` command: parses the options, picks the output folder, runs, writes the reports."""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from . import zoo
from .environment import available_memory_bytes, opacus_missing
from .harness import run_benchmark
from .options import ALL_ARMS, NON_PRIVATE, OPACUS_ARMS, parser
from .presets import PRESETS, preset_plan, run_preset
from .reports import markdown, write_reports
from .workers import worker_main


def published_results_dir() -> Path:
    """The checkout's committed results, benchmarks/results/ (written only with --publish)."""
    return Path(__file__).resolve().parents[1] / "results"


def _fresh_output_dir(parent: Path) -> Path:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out, n = parent / f"dptrain-bench-{stamp}", 1
    while out.exists():
        n += 1
        out = parent / f"dptrain-bench-{stamp}-{n}"
    return out


def _output_dir(args) -> Path:
    """Where this run writes: --out, --publish, or a new folder under the current directory.

    Raises ValueError (the message is the one-line error) for a choice that could overwrite the
    committed results by accident, or that needs an existing folder."""
    published = published_results_dir()
    if args.publish and args.out is not None:
        raise ValueError("give --out DIR or --publish, not both")
    if args.publish:
        if not published.is_dir():
            raise ValueError(f"--publish writes into a checkout's benchmarks/results/, and {published} does not "
                             "exist (run from a checkout, or give --out DIR)")
        return published
    if args.out is not None:
        if args.out.resolve() == published.resolve():
            raise ValueError(f"{args.out} holds the committed results: add --publish (instead of --out) to "
                             "replace them on purpose")
        return args.out
    if args.resume or args.report_only:
        what = "--resume" if args.resume else "--report-only"
        raise ValueError(f"{what} reads an earlier run's <tag>.json: name its folder with --out DIR (or --publish)")
    return _fresh_output_dir(Path.cwd())


def _error(message: str) -> int:
    print(f"dptrain bench: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1], argv[2])
    args = parser().parse_args(argv)
    if args.dry_run and not args.preset:
        return _error("--dry-run goes with --preset NAME (it prints that preset's plan)")
    if args.preset:
        return _main_preset(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        return _error("--device cuda but CUDA is not available")
    scale = args.scale or ("full" if device.type == "cuda" else "cpu")
    tag = args.tag or ("gpu" if device.type == "cuda" else "cpu")
    available = zoo.configs_for(scale)
    if args.list:
        for c in available.values():
            print(f"{c.name:22s} batch {c.batch_size:4d}  {c.warmup}+{c.steps} steps  {c.description}")
        return 0
    try:
        out = _output_dir(args)
    except ValueError as exc:
        return _error(str(exc))
    json_path = out / f"{tag}.json"
    if args.report_only:
        if not json_path.exists():
            return _error(f"{json_path} does not exist")
        results = json.loads(json_path.read_text())
        if args.notes:
            results["notes"] = args.notes.read_text()
        for path in write_reports(results, out, tag):
            print(f"wrote {path}")
        return 0
    requested_arms = args.arms or list(ALL_ARMS)
    unknown = [n for n in (args.configs or []) if n not in available]
    bad_arms = [a for a in requested_arms if a not in ALL_ARMS]
    if unknown or bad_arms:
        return _error(f"unknown configuration(s) {unknown}; valid: {', '.join(available)}" if unknown
                      else f"unknown arm(s) {bad_arms}; valid: {', '.join(ALL_ARMS)}")
    configs = [available[n] for n in args.configs] if args.configs else [
        c for c in available.values() if c.name not in ("smoke-cnn", "resnet18-gn-224-b128")]
    arms = [a for a in requested_arms if not (args.no_opacus and a in OPACUS_ARMS)]
    if NON_PRIVATE not in arms:
        arms.insert(0, NON_PRIVATE)  # every ratio is relative to it
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    mem_limit = None
    if device.type == "cpu":
        avail = available_memory_bytes()
        mem_limit = int(args.mem_limit_gb * 2**30) if args.mem_limit_gb else (avail // 2 if avail else None)
    previous = json.loads(json_path.read_text()) if args.resume and json_path.exists() else None
    notes = args.notes.read_text() if args.notes else None
    print(f"dptrain bench: results go to {out}/{tag}.{{json,csv,md,png}}")
    written: list[Path] = []

    def save(results):
        if notes:
            results["notes"] = notes
        written[:] = write_reports(results, out, tag)

    results = run_benchmark(
        configs, arms, scale=scale, device=device, threads=threads, timeout=args.timeout,
        mem_limit_bytes=mem_limit, max_batch_cap=None if args.no_max_batch else args.max_batch_cap,
        warmup=args.warmup, steps=args.steps, previous=previous, on_config=save,
        omp_wait_policy=None if device.type == "cuda" or args.omp_wait_policy == "default" else args.omp_wait_policy,
        max_load=args.max_load, max_wait=args.max_wait)
    save(results)
    print(markdown(results))
    for path in written:
        print(f"wrote {path}")
    return 0


def _main_preset(args) -> int:
    preset = PRESETS[args.preset]
    fixed = [name for name, value in (("--arms", args.arms), ("--scale", args.scale), ("--warmup", args.warmup),
                                      ("--steps", args.steps)) if value is not None]
    if fixed:
        return _error(f"--preset {preset.name} fixes its arms, scale and steps: leave out {', '.join(fixed)}")
    if args.configs:  # a subset of the rows, e.g. to finish the rows a first call had no time for
        others = [c for c in args.configs if c not in preset.rows]
        if others:
            return _error(f"--configs {' '.join(others)}: not rows of --preset {preset.name} "
                          f"(its rows: {', '.join(preset.rows)})")
        preset = dataclasses.replace(preset, rows=tuple(r for r in preset.rows if r in args.configs),
                                     max_batch_rows=tuple(r for r in preset.max_batch_rows if r in args.configs))
    arms = [a for a in preset.arms if not (a in OPACUS_ARMS and (args.no_opacus or opacus_missing()))]
    if args.dry_run:
        print(preset_plan(preset, arms), end="")
        return 0
    device = torch.device(args.device or "cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        return _error(f"--preset {preset.name} runs on a CUDA GPU and none is available here "
                      "(--dry-run prints its plan)")
    try:
        out = _output_dir(args)
    except ValueError as exc:
        return _error(str(exc))
    tag = args.tag or "gpu"
    notes = args.notes.read_text() if args.notes else None
    print(f"dptrain bench: preset {preset.name}, results go to {out}/{tag}.{{json,csv,md,png}}")
    written: list[Path] = []

    def save(results):
        if notes:
            results["notes"] = notes
        written[:] = write_reports(results, out, tag)

    results = run_preset(preset, arms, device=device, threads=args.threads or torch.get_num_threads(),
                         on_config=save)
    save(results)
    print(markdown(results))
    print(f"preset {preset.name}: {results['wall_s']:.0f} s of a {preset.budget_s:.0f} s budget")
    for path in written:
        print(f"wrote {path}")
    return 0
