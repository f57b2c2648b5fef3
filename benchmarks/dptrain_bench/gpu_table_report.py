"""Issue 43's GPU table from its jobs' events: each arm's figures, the ratios to non-private, JSON and Markdown."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .options import FASTDP_ARM, NON_PRIVATE

ARM_NAMES = {NON_PRIVATE: "non-private", "bk-mixopt": "dptrain bk-mixopt", "bk": "dptrain bk",
             "opacus-ghost": "Opacus ghost", "opacus-hooks": "Opacus hooks", FASTDP_ARM: "fastDP MixOpt"}
MEASURED = ("ok", "partial")  # the statuses of a record with figures (partial: stopped by the budget, some steps)


def _ended(outcome: dict) -> str:
    """How the process ended, in words, where it did not end cleanly."""
    if outcome["killed"]:
        return f"stopped by the time budget after {outcome['wall_s']:.0f} s (its timeout: {outcome['timeout_s']:.0f} s)"
    return f"the process ended with {outcome['exit']} and no error written (crashed?)"


def summarise_arm(events: list[dict], outcome: dict) -> dict:
    """An arm's figures from its events: the first step apart, the steady step (median of the timed steps after the
    warm-up), the peak memory of the first step, of the later steps and of all. A job stopped by the time budget
    keeps what it measured ("partial")."""
    built = next((e for e in events if e["event"] == "built"), {})
    steps = [e for e in events if e["event"] == "step"]
    error = next((e for e in events if e["event"] == "error"), None)
    rec: dict = {"wall_s": round(outcome["wall_s"], 2)}
    for key in ("build_s", "parameters", "trainable_parameters", "note", "batch_size", "warmup", "steps", "autocast"):
        if key in built:
            rec[key] = built[key]
    if steps:
        warmup = built.get("warmup", 1)
        timed = [e["s"] for e in steps if e["i"] >= warmup]
        rec["first_step_s"] = steps[0]["s"]
        rec["first_step_peak_bytes"] = steps[0]["peak_bytes"]
        rec["memory_method"] = steps[0].get("memory_method")
        if len(steps) > 1:
            rec["steady_peak_bytes"] = max(e["peak_bytes"] for e in steps[1:])
        rec["peak_bytes"] = max(e["peak_bytes"] for e in steps)
        rec["step_times_s"] = [e["s"] for e in steps]
        if timed:
            rec["steady_median_s"] = statistics.median(timed)
            rec["steady_min_s"], rec["steady_max_s"] = min(timed), max(timed)
            rec["timed_steps"] = len(timed)
    if error:
        rec.update(status="error", error=error["error"], traceback=error.get("traceback"))
    elif any(e["event"] == "done" for e in events):
        rec["status"] = "ok"
    else:
        rec.update(status="partial" if "steady_median_s" in rec else "stopped", error=_ended(outcome))
        if "steady_median_s" in rec:
            rec["error"] += f"; {rec['timed_steps']} of {built.get('steps')} timed steps"
    return rec


def summarise_search(events: list[dict], outcome: dict) -> dict:
    """A largest-batch search from its events; stopped early, it reports the bracket its trials reached."""
    trials = [{k: e.get(k) for k in ("batch", "fits", "s", "peak_bytes", "out_of_memory", "allocated_after_bytes")}
              for e in events if e["event"] == "trial"]
    search = next((e for e in events if e["event"] == "search"), None)
    error = next((e for e in events if e["event"] == "error"), None)
    rec: dict = {"trials": trials, "wall_s": round(outcome["wall_s"], 2)}
    fitted = [t["batch"] for t in trials if t["fits"]]
    failed = [t["batch"] for t in trials if not t["fits"]]
    rec["found"] = search["found"] if search else max(fitted, default=0)
    rec["too_large"] = search["too_large"] if search else min(failed, default=None)
    if search:
        rec.update(status="ok", stopped=search["stopped"], described=search["described"], cap=search["cap"])
    else:
        why = error["error"] if error else _ended(outcome)
        rec.update(status="error" if error else "partial", error=why,
                   described=f"{rec['found']} fits" + (f", {rec['too_large']} does not" if rec["too_large"] else "")
                   + f" (stopped: {why})")
        if error:
            rec["traceback"] = error.get("traceback")
    return rec


def add_ratios(row: dict) -> None:
    """Each arm against non-private on the same row (the same run, the same device)."""
    ref = row["arms"].get(NON_PRIVATE, {})
    for rec in row["arms"].values():
        for key, ratio in (("steady_median_s", "steady_ratio"), ("first_step_s", "first_step_ratio"),
                           ("peak_bytes", "peak_ratio"), ("first_step_peak_bytes", "first_step_peak_ratio"),
                           ("steady_peak_bytes", "steady_peak_ratio")):
            if rec.get(key) and ref.get(key):
                rec[ratio] = rec[key] / ref[key]
        mine, theirs = rec.get("largest_batch", {}), ref.get("largest_batch", {})
        if mine.get("found") and theirs.get("found"):
            rec["largest_batch_ratio"] = mine["found"] / theirs["found"]


def _time(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**30:.2f}"


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}×"


def _header(results: dict) -> list[str]:
    env = results.get("environment") or {}
    v = env.get("versions", {})
    where = (f"{env.get('gpu')} ({env.get('gpu_memory_gib')} GiB), CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}"
             if env.get("gpu") else f"the CPU ({env.get('cpu', 'unknown')})")
    lines = [f"# Issue 43's GPU table{' — DRY RUN' if results.get('dry_run') else ''}", ""]
    if results.get("dry_run"):
        lines += ["**A dry run on the CPU with tiny stand-in models (batch 2, the first step and one timed step): it "
                  "checks that every code path runs. Its figures say nothing about speed or memory on a GPU.**", ""]
    defaults = env.get("torch_defaults", {})
    lines += [
        f"Device: {where}. torch {env.get('torch_full') or v.get('torch')}, transformers {v.get('transformers')}, "
        f"timm {v.get('timm')}, torchvision {v.get('torchvision')}, peft {v.get('peft')}, "
        f"opacus {v.get('opacus') or 'not installed'}, "
        f"fastDP {results.get('fastdp') or 'not provided'}. dptrain {env.get('dptrain')} at commit "
        f"{env.get('dptrain_commit')}, {env.get('date')}.",
        "",
        "Torch's default settings, unchanged: " + ", ".join(f"`{k}` {val}" for k, val in defaults.items()) + ". "
        "Each arm in its own process (" + str(results.get("runner")) + "); the model built on the device from the same "
        "seed in every arm; SGD without momentum, noise multiplier 1, clipping norm 1. **first step**: the first "
        "step's wall time (dptrain reads every layer's rows there); **steady**: the median of the timed steps after "
        "the warm-up steps (each step between two device synchronisations); **peak**: "
        "`torch.cuda.max_memory_allocated` (model, batches and all) over the first step / over every later step; "
        "**largest batch**: doubling from the row's batch, then bisection to within 1/8, up to 4,096 (a fresh model "
        "and two steps per trial). Ratios are to non-private on the same row of the same run.",
        "",
    ]
    return lines


def markdown(results: dict) -> str:
    lines = _header(results)
    lines += ["| model | arm | first step | steady | × non-private | peak GiB (first / steady) | × non-private "
              "| largest batch | × non-private |", "|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"].values():
        first = True
        for arm, rec in row["arms"].items():
            title = row["title"] if first else ""
            first = False
            name = ARM_NAMES.get(arm, arm)
            search = rec.get("largest_batch", {})
            batch = search.get("described", "") if search else ""
            if rec.get("status") not in MEASURED:
                lines.append(f"| {title} | {name} | {rec.get('status')}: {_cell(rec.get('error', ''))} | | | | | "
                             f"{batch} | |")
                continue
            steady = _time(rec.get("steady_median_s")) + (" (partial)" if rec["status"] == "partial" else "")
            peaks = " / ".join(x for x in (_gib(rec.get("first_step_peak_bytes")), _gib(rec.get("steady_peak_bytes")))
                               if x)
            ref = arm == NON_PRIVATE
            lines.append(f"| {title} | {name} | {_time(rec.get('first_step_s'))} | {steady} | "
                         f"{'' if ref else _ratio(rec.get('steady_ratio'))} | {peaks} | "
                         f"{'' if ref else _ratio(rec.get('peak_ratio'))} | {batch} | "
                         f"{'' if ref else _ratio(rec.get('largest_batch_ratio'))} |")
    lines += ["", "Rows: " + "; ".join(f"**{r['title']}**: {r['description']}, batch {r['batch_size']}, "
                                        f"{r['warmup']} warm-up + {r['steps']} timed steps" for r in
                                        results["rows"].values()), ""]
    notes = sorted({f"{ARM_NAMES.get(a, a)}: {rec['note']}" for r in results["rows"].values()
                    for a, rec in r["arms"].items() if rec.get("note")})
    if notes:
        lines += ["Arm notes: " + "; ".join(notes) + ".", ""]
    lines += _not_measured(results)
    if results.get("merged_from"):
        lines.append(f"Merged from {len(results['merged_from'])} runs on the same device, started "
                     + ", ".join(map(str, results["merged_from"])) + ".")
    if results.get("wall_s") is not None:
        lines.append(f"Time: {results['wall_s']:.0f} s of a {results['budget_s']:.0f} s budget (from the start of "
                     "the call, wheel install and imports included).")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:220]


def _not_measured(results: dict) -> list[str]:
    missing = [j for j in results.get("jobs", []) if j["status"] != "ok"]
    if not missing:
        return ["Every job ran to its end.", ""]
    lines = ["Not measured in full:", ""]
    for job in missing:
        lines.append(f"- `{job['id']}` (tier {job['tier']}): {job['status']}: {_cell(job.get('reason', ''))}")
    again = [j["id"] for j in missing if j["status"] in ("skipped", "stopped", "partial")]
    if again:
        lines += ["", "Those the budget left out can run in a second call (with the non-private arms of their rows, "
                      "for the ratios): `bash benchmarks/gpu_table.sh $OUT --only "
                  + " ".join(f"'{j}'" for j in again) + "`"]
    return lines + [""]


def write_reports(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "gpu-table.json", out / "gpu-table.md"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    md_path.write_text(markdown(results))
    return [json_path, md_path]


def _better(new: dict | None, old: dict | None) -> bool:
    """Whether a later run's record replaces an earlier one's: a measurement always does, a skip never replaces a
    measurement."""
    if not new:
        return False
    return new.get("status") in MEASURED or not old or old.get("status") not in MEASURED


def merge(runs: list[dict]) -> dict:
    """Several runs' results as one table (a second call that ran what the first had no time for): a later run's
    arm, or largest batch, replaces an earlier one's unless it was not measured there. Runs on different devices are
    refused: their ratios would compare two machines."""
    devices = {(r.get("environment") or {}).get("gpu") or "cpu" for r in runs}
    if len(devices) > 1:
        raise ValueError(f"these runs are from different devices ({', '.join(sorted(devices))}): not one table")
    merged = json.loads(json.dumps(runs[0]))
    for run in runs[1:]:
        for key, row in run["rows"].items():
            target = merged["rows"].setdefault(key, {**row, "arms": {}})
            for arm, rec in row["arms"].items():
                old = target["arms"].get(arm, {})
                new = {k: v for k, v in rec.items() if k != "largest_batch"} if _better(rec, old) else \
                    {k: v for k, v in old.items() if k != "largest_batch"}
                search = rec.get("largest_batch") if _better(rec.get("largest_batch"), old.get("largest_batch")) \
                    else old.get("largest_batch")
                target["arms"][arm] = {**new, **({"largest_batch": search} if search else {})}
        jobs = {job["id"]: job for job in merged["jobs"]}
        for job in run["jobs"]:
            if _better(job, jobs.get(job["id"])):
                jobs[job["id"]] = job
        merged["jobs"] = list(jobs.values())
    for row in merged["rows"].values():
        add_ratios(row)
    merged["merged_from"] = [(r.get("environment") or {}).get("date") for r in runs]
    merged["wall_s"] = None
    return merged
