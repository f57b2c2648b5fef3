"""Presets: fixed plans that fit a time budget (``dptrain bench --preset NAME``)."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import workers, zoo
from .environment import environment, opacus_missing
from .options import NON_PRIVATE, OPACUS_ARMS, PRESET_NAMES
from .reports import add_ratios, memory_of, summarise_times
from .zoo import BenchConfig


@dataclass(frozen=True)
class Preset:
    """A fixed plan that fits a time budget: rows (configurations), arms, and which largest batches to search.

    The run is in two phases. Phase 1: one process per (row, arm) measures peak memory and step
    time; a process starts only while its timeout fits in the budget left after the reserve of
    phase 2. Phase 2: the largest-batch searches split what is left, each at most ``search_s``
    (and at least ``min_search_s``, else it is skipped), plus ``search_grace_s`` for its process
    to start and time the batch it found. So the run never outlasts ``budget_s``, whatever
    the machine; what did not fit is reported as skipped.
    """

    name: str
    description: str
    scale: str
    rows: tuple[str, ...]
    arms: tuple[str, ...]
    max_batch_rows: tuple[str, ...]
    max_batch_arms: tuple[str, ...]
    budget_s: float
    arm_timeout_s: float
    search_s: float
    min_search_s: float
    search_grace_s: float
    warmup: int = 3
    steps: int = 10
    max_batch_cap: int = 4096
    tolerance: float = 1 / 16  # the bisection stops once the bracket is within this fraction of the batch found

    def searches(self, arms: Sequence[str] | None = None) -> list[tuple[str, str]]:
        arms = self.arms if arms is None else arms
        return [(row, arm) for row in self.max_batch_rows for arm in self.max_batch_arms if arm in arms]

    def search_reserve_s(self, arms: Sequence[str] | None = None) -> float:
        return len(self.searches(arms)) * (self.min_search_s + self.search_grace_s)


PRESETS = {
    "gpu-quick": Preset(
        "gpu-quick",
        "the GPU speed-and-memory table in under 6 minutes on one GPU: GPT-2 small T=100 batch 32, "
        "ResNet-18 GN 224 batch 128 and 32, VGG-11 GN 224 batch 32, ViT-B/16 224 batch 32; "
        "largest batch of the two CNNs for non-private, bk-mixopt and Opacus hooks",
        scale="full",
        rows=("gpt2-t100", "resnet18-gn-224-b128", "vgg11-gn-224", "vit-224", "resnet18-gn-224"),
        arms=(NON_PRIVATE, "bk-mixopt", *OPACUS_ARMS),
        max_batch_rows=("resnet18-gn-224-b128", "vgg11-gn-224"),
        max_batch_arms=(NON_PRIVATE, "bk-mixopt", "opacus-hooks"),
        budget_s=340, arm_timeout_s=60, search_s=30, min_search_s=8, search_grace_s=16,
    ),
}


assert tuple(PRESETS) == PRESET_NAMES, "options.PRESET_NAMES names the presets, for a torch-free --help"


def preset_plan(preset: Preset, arms: Sequence[str]) -> str:
    """The plan and its time budget, as ``--dry-run`` prints it."""
    configs = zoo.configs_for(preset.scale)
    unknown = [r for r in preset.rows if r not in configs]
    if unknown:
        raise ValueError(f"preset {preset.name!r} names unknown configurations {unknown}")
    searches = preset.searches(arms)
    lines = [f"preset {preset.name}: {preset.description}", "",
             f"rows ({preset.warmup} warm-up + {preset.steps} timed steps each, one process per arm):"]
    for row in preset.rows:
        c = configs[row]
        lines.append(f"  {row:22s} batch {c.batch_size:4d}  {c.description}")
    lines += ["", f"arms: {', '.join(arms)}"]
    left_out = [a for a in preset.arms if a not in arms]
    if left_out:
        lines.append(f"left out: {', '.join(left_out)} ({opacus_missing() or 'not asked for'})")
    phase1 = len(preset.rows) * len(arms)
    lines += [
        f"largest batch (doubling from the row's batch, then bisection to within {preset.tolerance:.0%}, "
        f"up to {preset.max_batch_cap}): " + ", ".join(f"{r} {a}" for r, a in searches),
        "",
        f"time budget: {preset.budget_s:.0f} s in all, never exceeded:",
        f"  phase 1: {phase1} processes of at most {preset.arm_timeout_s:.0f} s each, started only while "
        f"{preset.search_reserve_s(arms):.0f} s stay reserved for phase 2",
        f"  phase 2: {len(searches)} searches sharing what is left, each {preset.min_search_s:.0f}-"
        f"{preset.search_s:.0f} s of trials + {preset.search_grace_s:.0f} s to start and time the batch found",
    ]
    return "\n".join(lines) + "\n"


def run_preset(preset: Preset, arms: Sequence[str], *, device: torch.device, threads: int,
               configs: dict[str, BenchConfig] | None = None, runner: Callable[[dict, float], dict] | None = None,
               clock: Callable[[], float] = time.monotonic, on_config: Callable[[dict], None] | None = None,
               log=print) -> dict:
    """Run a preset within its time budget (see :class:`Preset`).

    ``configs`` replaces the preset's configurations (tests run the plan on tiny stand-ins),
    ``runner(task, timeout)`` replaces the worker processes and ``clock`` the time (tests of the budget).
    """
    configs = configs or zoo.configs_for(preset.scale)
    runner = runner or (lambda task, timeout: workers.run_worker(task, timeout))
    started = clock()

    def left() -> float:
        return preset.budget_s - (clock() - started)

    results = {"scale": preset.scale, "preset": preset.name, "environment": environment(device, threads),
               "configs": {}}
    base = {"scale": preset.scale, "device": str(device), "threads": threads, "mem_limit_bytes": None}
    reserve = preset.search_reserve_s(arms)
    for row in preset.rows:
        config = configs[row]
        entry: dict[str, Any] = {"config": row, "description": config.description, "batch_size": config.batch_size,
                                 "warmup": preset.warmup, "steps": preset.steps, "arms": {}}
        log(f"{row}: {config.description}, batch {config.batch_size}")
        t0 = clock()
        for arm in arms:
            if left() - reserve < preset.arm_timeout_s:
                entry["arms"][arm] = {"status": "skipped", "error": "not started: the preset's time budget was spent"}
                continue
            res = runner({**base, "kind": "arm", "config": row, "arm": arm, "warmup": preset.warmup,
                          "steps": preset.steps}, preset.arm_timeout_s)
            if res["ok"]:
                rec = {"status": "ok", **res["result"], **summarise_times(res["result"]["step_times_s"]),
                       "cpu_median_s": statistics.median(res["result"]["cpu_times_s"])}
                rec["throughput"] = config.batch_size / rec["median_s"]
                log(f"  {row} {arm}: {rec['median_s'] * 1e3:.1f} ms/step, peak {memory_of(rec, device) / 2**20:.0f} MiB")
            else:
                rec = {"status": "failed", "stage": "arm", "error": res["error"], "traceback": res.get("traceback")}
                log(f"  {row} {arm}: FAILED ({res['error'][:160]})")
            entry["arms"][arm] = rec
        add_ratios(entry, device)
        entry["wall_s"] = clock() - t0
        results["configs"][row] = entry
        if on_config:
            on_config(results)
    searches = [(r, a) for r, a in preset.searches(arms) if results["configs"][r]["arms"][a].get("status") == "ok"]
    for i, (row, arm) in enumerate(searches):
        rec = results["configs"][row]["arms"][arm]
        share = left() / (len(searches) - i) - preset.search_grace_s
        search_s = min(preset.search_s, share)
        if search_s < preset.min_search_s:
            rec["max_batch_error"] = "not searched: the preset's time budget was spent"
            continue
        res = runner({**base, "kind": "max-batch", "config": row, "arm": arm, "cap": preset.max_batch_cap,
                      "budget_s": search_s, "tolerance": preset.tolerance, "final_warmup": 1, "final_steps": 3},
                     search_s + preset.search_grace_s)
        if res["ok"]:
            rec.update(res["result"])
            log(f"  {row} {arm}: largest batch {res['result']['max_batch_search']}")
        else:
            rec["max_batch_error"] = res["error"]
        if on_config:
            on_config(results)
    results["wall_s"] = clock() - started
    return results
