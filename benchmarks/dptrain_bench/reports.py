"""The figures derived from the measurements (summaries, ratios, targets) and the reports: JSON, CSV, Markdown, PNG."""
from __future__ import annotations

import csv
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from .options import NON_PRIVATE, OPACUS_ARMS


def summarise_times(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) >= 2 else [times[0]] * 3
    return {"median_s": statistics.median(times), "p25_s": q[0], "p75_s": q[2], "min_s": min(times)}


def memory_of(rec: dict, device: torch.device) -> float | None:
    """The figure compared across arms: total allocated on GPU (as the papers), RSS above baseline on CPU."""
    if "peak_bytes" not in rec:
        return None
    return rec["peak_bytes"] if device.type == "cuda" else rec["peak_above_baseline_bytes"]


def add_ratios(entry: dict, device: torch.device) -> None:
    ref = entry["arms"].get(NON_PRIVATE, {})
    for rec in entry["arms"].values():
        if "median_s" in rec and "median_s" in ref:
            rec["time_ratio"] = rec["median_s"] / ref["median_s"]
            rec["cpu_time_ratio"] = rec["cpu_median_s"] / ref["cpu_median_s"]
        mem, ref_mem = memory_of(rec, device), memory_of(ref, device)
        if mem is not None and ref_mem:
            rec["memory_ratio"] = mem / ref_mem
        # the first step (the engine reads which sample each row belongs to) and the steady ones, apart
        for step in ("first_step", "steady"):
            if rec.get(f"{step}_peak_bytes") and ref.get(f"{step}_peak_bytes"):
                rec[f"{step}_memory_ratio"] = rec[f"{step}_peak_bytes"] / ref[f"{step}_peak_bytes"]
        if rec.get("first_step_s") and rec.get("median_s"):
            rec["first_step_vs_steady"] = rec["first_step_s"] / rec["median_s"]


@dataclass(frozen=True)
class Target:
    device: str        # "cpu" or "cuda"
    config: str
    arm: str
    metric: str        # "time_ratio", "memory_ratio", "max_batch_vs_non_private" or "max_batch_vs_opacus_hooks"
    bound: float
    note: str = ""

    def evaluate(self, results: dict) -> tuple[float | None, bool | None, str]:
        entry = results["configs"].get(self.config)
        if entry is None:
            return None, None, "not run"
        rec = entry["arms"].get(self.arm, {})
        if rec.get("status") != "ok":
            return None, None, f"{self.arm}: {rec.get('error', 'not run')}"
        if self.metric.startswith("max_batch_vs_"):
            other = entry["arms"].get({"max_batch_vs_opacus_hooks": "opacus-hooks"}.get(self.metric, NON_PRIVATE), {})
            if not rec.get("max_batch") or not other.get("max_batch"):
                return None, None, "largest batch not measured for both"
            value = rec["max_batch"] / other["max_batch"]
            return value, value >= self.bound, ""
        value = rec.get(self.metric)
        if value is None:
            return None, None, "no figure"
        return value, value <= self.bound, ""


TARGETS = (
    # CPU (2 cores): keep the time ratios; peak memory of the 224x224 CNNs at most 1.3x non-private
    Target("cpu", "gpt2-t64", "bk-mixopt", "time_ratio", 1.15, "for comparison: Opacus ghost about 2.6x, the book-keeping paper's code 1.5x"),
    Target("cpu", "vgg11-gn-32", "bk-mixopt", "time_ratio", 1.1, "for comparison: Opacus hooks about 12x, the book-keeping paper's code 2.1x"),
    Target("cpu", "vgg11-gn-224", "bk-mixopt", "memory_ratio", 1.3),
    Target("cpu", "resnet18-gn-224", "bk-mixopt", "memory_ratio", 1.3),
    # the first step, the one that reads which sample each row belongs to (issue 30)
    Target("cpu", "gpt2-t100", "bk-mixopt", "first_step_memory_ratio", 1.05),
    Target("cpu", "resnet18-gn-224", "bk-mixopt", "first_step_memory_ratio", 1.2),
    Target("cpu", "vgg11-gn-224", "bk-mixopt", "first_step_memory_ratio", 1.2),
    # one GPU, each arm in its own process (the gpu-quick preset's rows)
    Target("cuda", "gpt2-t100", "bk-mixopt", "time_ratio", 1.12),
    Target("cuda", "gpt2-t100", "bk-mixopt", "memory_ratio", 1.02),
    Target("cuda", "gpt2-t100", "bk-mixopt", "first_step_memory_ratio", 1.05),
    Target("cuda", "resnet18-gn-224-b128", "bk-mixopt", "first_step_memory_ratio", 1.2),
    Target("cuda", "vgg11-gn-224", "bk-mixopt", "first_step_memory_ratio", 1.2),
    Target("cuda", "resnet18-gn-224-b128", "bk-mixopt", "time_ratio", 1.8),
    Target("cuda", "resnet18-gn-224-b128", "bk-mixopt", "memory_ratio", 1.3),
    Target("cuda", "vgg11-gn-224", "bk-mixopt", "time_ratio", 1.8),
    Target("cuda", "vgg11-gn-224", "bk-mixopt", "memory_ratio", 1.3),
    Target("cuda", "resnet18-gn-224", "bk-mixopt", "time_ratio", 2.5),
    Target("cuda", "vit-224", "bk-mixopt", "time_ratio", 1.2),
    Target("cuda", "vit-224", "bk-mixopt", "memory_ratio", 1.1),
    Target("cuda", "resnet18-gn-224-b128", "bk-mixopt", "max_batch_vs_non_private", 0.7),
    Target("cuda", "vgg11-gn-224", "bk-mixopt", "max_batch_vs_non_private", 0.7),
    Target("cuda", "resnet18-gn-224-b128", "bk-mixopt", "max_batch_vs_opacus_hooks", 2.0),
    Target("cuda", "vgg11-gn-224", "bk-mixopt", "max_batch_vs_opacus_hooks", 2.0),
)


def _targets_for(results: dict) -> list[Target]:
    device = "cuda" if results["environment"]["device"].startswith("cuda") else "cpu"
    scale_ok = results["scale"] == ("full" if device == "cuda" else "cpu")
    return [t for t in TARGETS if t.device == device and scale_ok]


CSV_FIELDS = ("config", "arm", "status", "batch_size", "median_s", "p25_s", "p75_s", "min_s", "cpu_median_s",
              "time_ratio", "cpu_time_ratio", "throughput", "peak_bytes", "baseline_bytes",
              "peak_above_baseline_bytes", "memory_ratio", "first_step_peak_bytes", "steady_peak_bytes",
              "first_step_memory_ratio", "steady_memory_ratio", "first_step_s", "first_step_vs_steady", "max_batch",
              "max_batch_throughput", "error", "note")


def write_csv(results: dict, path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for entry in results["configs"].values():
            for arm, rec in entry["arms"].items():
                row = {k: rec.get(k) for k in CSV_FIELDS}
                row.update(config=entry["config"], arm=arm, batch_size=entry["batch_size"])
                writer.writerow(row)


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "—" if value is None else format(value, spec) + suffix


def markdown(results: dict) -> str:
    env = results["environment"]
    cuda = env["device"].startswith("cuda")
    v = env["versions"]
    lines = [
        f"# dptrain benchmark — {results['scale']} scale on {env['device']}",
        "",
        f"- Date: {env['date']}",
        f"- Hardware: {env.get('gpu', 'no GPU') + ', ' if cuda else ''}CPU {env['cpu']}, "
        f"{env['cpu_cores_available']} cores available, {env['memory_total_gib']} GiB RAM; "
        f"torch threads: {env['torch_threads']}" + ("" if cuda else f", OMP_WAIT_POLICY={env.get('omp_wait_policy')}"),
        f"- Versions: python {env['python']}, torch {v['torch']}, torchvision {v['torchvision']}, transformers "
        f"{v['transformers']}, timm {v['timm']}, opacus {v['opacus']}; dptrain {env['dptrain']} "
        f"(commit {env['dptrain_commit']})",
        f"- Load average (1, 5, 15 min) at start: {env['load_average_at_start']}",
        f"- Memory: {'total `torch.cuda.max_memory_allocated`' if cuda else 'peak RSS above the baseline taken after the model, batches, optimizer and engine exist'}"
        f" ({_memory_method(results)}), over a warm-up step and one more, each arm in its own process; the first "
        "step (which reads which sample each row belongs to) and the later ones are also given apart.",
        "- Time: median wall-clock step (forward + loss + backward + optimizer step), after warm-up; all arms of "
        "a configuration in one process on the same batches, timed steps round-robin in shuffled order.",
    ]
    if not cuda:
        lines.append("- No GPU in this run: largest batch and GPU memory are not measured.")
    targets = _targets_for(results)
    if targets:
        lines += ["", "## Targets", "", "| configuration | arm | metric | measured | target | met | note |",
                  "|---|---|---|---|---|---|---|"]
        for t in targets:
            value, ok, why = t.evaluate(results)
            sign = "≥" if t.metric.startswith("max_batch") else "≤"
            met = "—" if ok is None else ("yes" if ok else "**no**")
            lines.append(f"| {t.config} | {t.arm} | {t.metric} | {_fmt(value, '.2f', '×')} | {sign} {t.bound}× | "
                         f"{met} | {why or t.note} |")
    run_method = _memory_method(results)
    for entry in results["configs"].values():
        lines += ["", f"## {entry['config']}", "",
                  f"{entry['description']}; batch {entry['batch_size']}; {entry['warmup']} warm-up + "
                  f"{entry['steps']} timed steps; load average before/after: {entry.get('load_average_before')} / "
                  f"{entry.get('load_average_after')}" + _separate_run(entry, env, run_method), ""]
        header = ("| arm | step time (ms) median [IQR] | × non-private | CPU time × | peak memory (MiB) | × non-private |"
                  " first step: memory × | steady: memory × |")
        rule = "|---|---|---|---|---|---|---|---|"
        if cuda:
            header += " largest batch | samples/s at largest |"
            rule += "---|---|"
        lines += [header + " note |", rule + "---|"]
        for arm, rec in entry["arms"].items():
            mem = memory_of(rec, torch.device(env["device"]))
            time_cell = "—" if "median_s" not in rec else (
                f"{rec['median_s'] * 1e3:.0f} [{rec['p25_s'] * 1e3:.0f}–{rec['p75_s'] * 1e3:.0f}]")
            row = (f"| {arm} | {time_cell} | {_fmt(rec.get('time_ratio'), '.2f', '×')} | "
                   f"{_fmt(rec.get('cpu_time_ratio'), '.2f', '×')} | {_fmt(mem and mem / 2**20, '.0f')} | "
                   f"{_fmt(rec.get('memory_ratio'), '.2f', '×')} | {_fmt(rec.get('first_step_memory_ratio'), '.2f', '×')} "
                   f"| {_fmt(rec.get('steady_memory_ratio'), '.2f', '×')} |")
            if cuda:
                row += f" {_fmt(rec.get('max_batch'), 'd')} | {_fmt(rec.get('max_batch_throughput'), '.1f')} |"
            search = rec.get("max_batch_search")
            partial = f"largest batch: {search}" if search and search != str(rec.get("max_batch")) else None
            note = "; ".join(filter(None, (rec.get("error") if rec.get("status") != "ok" else rec.get("max_batch_error"),
                                           partial, rec.get("note"))))
            lines.append(row + f" {note.replace('|', '/')} |")
    if results.get("notes"):
        lines += ["", "## Notes", "", results["notes"].strip()]
    return "\n".join(lines) + "\n"


def _separate_run(entry: dict, env: dict, run_method: str) -> str:
    """For a configuration merged in from another run (``entry["environment"]``): what differs from the header."""
    other = entry.get("environment")
    if not other:
        return ""
    method = next((r["memory_method"] for r in entry["arms"].values() if r.get("memory_method")), run_method)
    parts = [f"Measured in a separate run on {other['date'][:10]} at commit {other['dptrain_commit']}"]
    if method != run_method:
        parts.append(f"memory: {method}")
    return ". " + "; ".join(parts)


def _memory_method(results: dict) -> str:
    for entry in results["configs"].values():
        for rec in entry["arms"].values():
            if rec.get("memory_method"):
                return rec["memory_method"]
    return "not measured"


def plot(results: dict, path: Path) -> None:
    """Per configuration: peak memory and throughput per arm (the papers' Figure 3 layout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = list(results["configs"].values())
    device = torch.device(results["environment"]["device"])
    fig, axes = plt.subplots(len(entries), 2, figsize=(13, 2.9 * len(entries)), squeeze=False)
    for row, entry in zip(axes, entries):
        names = list(entry["arms"])
        recs = [entry["arms"][n] for n in names]
        mem = [(memory_of(r, device) or 0) / 2**20 for r in recs]
        thr = [r.get("throughput", 0) for r in recs]
        colors = ["0.5" if n == NON_PRIVATE else ("tab:red" if n in OPACUS_ARMS else "tab:blue") for n in names]
        for ax, values, label in ((row[0], mem, "peak memory (MiB)"), (row[1], thr, "samples / s")):
            bars = ax.bar(range(len(names)), values, color=colors)
            for bar, rec, value in zip(bars, recs, values):
                if rec.get("status") != "ok" or not value:
                    ax.text(bar.get_x() + bar.get_width() / 2, 0, "failed" if rec.get("status") == "failed" else "n/a",
                            rotation=90, ha="center", va="bottom", fontsize=7, color="tab:red")
            ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
            ax.set_ylabel(label, fontsize=8)
            ax.set_title(f"{entry['config']} (batch {entry['batch_size']})", fontsize=9)
            ax.tick_params(axis="y", labelsize=7)
    env = results["environment"]
    fig.suptitle(f"dptrain benchmark, {results['scale']} scale, {env.get('gpu') or env['cpu']}, "
                 f"{env['torch_threads']} threads, {env['date'][:10]}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(results: dict, out: Path, tag: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{tag}.json", out / f"{tag}.csv", out / f"{tag}.md", out / f"{tag}.png"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    write_csv(results, paths[1])
    paths[2].write_text(markdown(results))
    try:
        plot(results, paths[3])
    except ImportError:  # matplotlib is optional: the tables carry every figure
        paths.pop()
    return paths
