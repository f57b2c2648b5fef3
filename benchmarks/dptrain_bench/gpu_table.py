"""Issue 43's GPU table in one device call of at most 6 minutes: every row, each arm in its own process.

    python -m dptrain_bench.gpu_table --out DIR                 # on a GPU (benchmarks/gpu_table.sh runs this)
    python -m dptrain_bench.gpu_table --dry-run --out DIR       # on the CPU, tiny stand-ins: every code path
    python -m dptrain_bench.gpu_table --list [--dry-run]        # the jobs in the order they run, their time estimates
    python -m dptrain_bench.gpu_table --only 'vgg11-gn-224-b32/*' --out DIR   # some jobs (a second call)
    python -m dptrain_bench.gpu_table --report-from A/gpu-table.json B/gpu-table.json --out DIR  # one table of both

The rows, the arms and the order of the jobs: ``gpu_table_rows``. What one job measures: ``gpu_table_measure``.
The figures, the ratios and the Markdown: ``gpu_table_report``.

Each job runs in a process of its own: forked from this one, which has imported torch, transformers, peft, timm and
torchvision but never touched CUDA (so each job gets a fresh CUDA context, its own allocator and its own peak,
without paying seconds of imports), or with ``--fresh-interpreters`` (and automatically where a forked process
cannot use the GPU) a new Python interpreter. The time budget counts from ``GPU_TABLE_T0`` (the shell script's
start, so the wheels' install and the imports count) or else from this process's start: a job starts only while
the time it is expected to take is left, and is killed at the end of the budget, so the run never outlasts it; what
did not run, or ran in part, is reported with the reason.
"""
from __future__ import annotations

import os

# any torch.cuda.is_available() that an import makes asks NVML, which leaves forked processes free to use CUDA
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from .gpu_table_measure import child_exit, read_events, run_job  # noqa: E402
from .gpu_table_report import add_ratios, markdown, merge, summarise_arm, summarise_search, write_reports  # noqa: E402
from .gpu_table_rows import SEARCH_CAP, Job, plan_jobs, row_config, select_jobs, table_rows  # noqa: E402
from .options import FASTDP_ARM, OPACUS_ARMS  # noqa: E402

DEFAULT_BUDGET_S = 330.0   # the device call's timeout_s: 360 (benchmarks/README.md)
REPORT_RESERVE_S = 6.0     # kept back from the jobs for the reports and the kill of the last one
SPAWN_START_S = 8.0        # a fresh interpreter's imports (torch, transformers, peft, timm): added to each job's times
PROBE_TIMEOUT_S = 45.0  # about 3 s on a GPU (a CUDA context); a hang must not eat the budget


def preimport() -> None:
    """What the jobs import, imported once here so that forked jobs start at once. None of it may touch CUDA."""
    import dptrain  # noqa: F401
    import dptrain.engine  # noqa: F401
    from dptrain_bench import arms, zoo  # noqa: F401

    for name in ("transformers", "peft", "timm", "torchvision", "opacus"):
        if importlib.util.find_spec(name):
            __import__(name)
    from transformers import GPT2LMHeadModel, LlamaForCausalLM  # noqa: F401


def arm_unavailable(arm: str) -> str | None:
    """Why an arm cannot run on this machine (a missing package), decided here without starting a process."""
    if arm in OPACUS_ARMS and not importlib.util.find_spec("opacus"):
        return "opacus not installed (it travels as wheels in .whl/: benchmarks/README.md)"
    if arm == FASTDP_ARM:
        folder = os.environ.get("FASTDP_DIR")
        if not folder:
            return "fastDP not provided: FASTDP_DIR is not set (its source, awslabs/fast-differential-privacy)"
        if not (Path(folder) / "fastDP" / "__init__.py").is_file():
            return f"fastDP not provided: FASTDP_DIR={folder} holds no fastDP/__init__.py"
    return None


class JobRunner:
    """Runs one job in its own process and waits for it at most ``timeout_s``; returns its events and how it ended.

    ``mode`` "fork": a child of this process (which must not have touched CUDA); "spawn": a fresh interpreter.
    The children's output goes to ``child_log``, one header line per job."""

    def __init__(self, mode: str, child_log: Path, work_dir: Path):
        self.mode, self.child_log, self.work_dir = mode, child_log, work_dir
        self.count = 0

    def run(self, spec: dict, timeout_s: float, label: str) -> tuple[list[dict], dict]:
        self.count += 1
        events_path = self.work_dir / f"job-{self.count}.jsonl"
        start = time.monotonic()
        if self.mode == "fork":
            exit_text, killed = self._fork(spec, events_path, timeout_s, label)
        else:
            exit_text, killed = self._spawn(spec, events_path, timeout_s, label)
        outcome = {"exit": exit_text, "killed": killed, "wall_s": time.monotonic() - start, "timeout_s": timeout_s}
        return read_events(events_path), outcome

    def _fork(self, spec, events_path, timeout_s, label):
        if torch.cuda.is_initialized():
            raise RuntimeError("CUDA was initialised in the parent process: forked jobs could not use it")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the job
            code = 2
            try:
                log = open(self.child_log, "a", buffering=1)  # the job's output, Python's and the libraries'
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                sys.stdout = sys.stderr = log
                print(f"=== {label} (forked, pid {os.getpid()})", flush=True)
                code = run_job(spec, str(events_path))
            finally:
                child_exit(code)
        deadline = time.monotonic() + timeout_s
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return _exit_text(os.waitstatus_to_exitcode(status)), False
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "SIGKILL (timeout)", True
            time.sleep(0.05)

    def _spawn(self, spec, events_path, timeout_s, label):
        benchmarks = str(Path(__file__).resolve().parents[1])
        import dptrain

        roots = (benchmarks, str(Path(dptrain.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, roots))}
        cmd = [sys.executable, "-m", "dptrain_bench.gpu_table", "--job", json.dumps(spec), "--events", str(events_path)]
        with open(self.child_log, "a") as log:
            log.write(f"=== {label} (fresh interpreter)\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                return _exit_text(proc.wait(timeout=timeout_s)), False
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return "SIGKILL (timeout)", True


def _exit_text(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


def _probe(runner: JobRunner, device: torch.device, timeout_s: float, log) -> dict:
    """The environment, from a job: the first use of the GPU. Where a forked job cannot use it, the runner
    switches to fresh interpreters and asks again."""
    spec = {"kind": "probe", "device": str(device), "threads": 1 if device.type == "cpu" else None}
    events, outcome = runner.run(spec, timeout_s, "probe")
    found = next((e for e in events if e["event"] == "environment"), None)
    if found is None and runner.mode == "fork":
        error = next((e["error"] for e in events if e["event"] == "error"), outcome["exit"])
        log(f"a forked process could not use {device} ({error}): every job runs in a fresh interpreter instead")
        runner.mode = "spawn"
        events, outcome = runner.run(spec, timeout_s, "probe")
        found = next((e for e in events if e["event"] == "environment"), None)
    if found is None:
        error = next((e["error"] for e in events if e["event"] == "error"), outcome["exit"])
        raise RuntimeError(f"no usable {device} here ({error}); on a machine without a GPU, --dry-run runs the "
                           "table's code paths on tiny stand-ins")
    return found["environment"]


def _fastdp_version() -> str | None:
    folder = os.environ.get("FASTDP_DIR")
    init = Path(folder, "fastDP", "__init__.py") if folder else None
    if not init or not init.is_file():
        return None
    version = next((line.split("=")[1].strip().strip("'\"") for line in init.read_text().splitlines()
                    if line.startswith("__version__")), "unknown")
    return f"{version} (from {folder})"


def run_table(jobs: list[Job], *, dry_run: bool, out: Path, budget_s: float, started: float, runner_mode: str,
              log=print, runner=None, clock=time.time) -> dict:
    """Run ``jobs`` in order within ``budget_s`` seconds from ``started`` (a ``clock()`` time); write the reports
    after every job. Returns the results. ``runner`` and ``clock`` replace the processes and the time in tests."""
    device = torch.device("cpu" if dry_run else "cuda")
    out.mkdir(parents=True, exist_ok=True)
    rows = {row.key: row for row in table_rows(dry_run)}

    def left() -> float:
        return budget_s - (clock() - started)

    if dry_run:  # tiny models on a shared CPU: one thread each (two spinning OpenMP threads crawl there)
        torch.set_num_threads(1)
    if runner_mode == "fork" and runner is None:
        preimport()
    with tempfile.TemporaryDirectory(prefix="gpu-table-") as work:
        runner = runner or JobRunner(runner_mode, out / "jobs-log.txt", Path(work))
        environment = _probe(runner, device, min(PROBE_TIMEOUT_S, max(left(), 1.0)), log)
        results = {"title": "issue 43's GPU table", "dry_run": dry_run, "environment": environment,
                   "fastdp": _fastdp_version(), "runner": runner.mode, "budget_s": budget_s, "wall_s": None,
                   "rows": {}, "jobs": []}
        for key in dict.fromkeys(job.row for job in jobs):
            config = row_config(rows[key], dry_run)
            results["rows"][key] = {"title": rows[key].title, "description": config.description,
                                    "batch_size": config.batch_size, "warmup": config.warmup, "steps": config.steps,
                                    "autocast": config.autocast, "arms": {}}
        log(f"{device}: {environment.get('gpu') or environment.get('cpu')}, torch {environment.get('torch_full')}; "
            f"{len(jobs)} jobs, {left():.0f} s of the {budget_s:.0f} s budget left")
        for job in jobs:
            record = {"id": job.id, "tier": job.tier, "expected_s": job.expected_s, "timeout_s": job.timeout_s}
            arm_rec = results["rows"][job.row]["arms"].setdefault(
                job.arm, {"status": "not run", "error": "not among this run's jobs"})
            reason, status = arm_unavailable(job.arm), "unavailable"
            available = left() - REPORT_RESERVE_S
            start = SPAWN_START_S if runner.mode == "spawn" else 0.0
            if reason is None and available < job.expected_s + start:
                reason = f"not started: {max(available, 0):.0f} s of the budget left, it is expected to take " \
                         f"{job.expected_s + start:.0f} s"
                status = "skipped"
            if reason is not None:
                record.update(status=status, reason=reason)
                if job.kind == "arm":
                    arm_rec.update(status=status, error=reason)
                else:
                    arm_rec["largest_batch"] = {"status": status, "error": reason, "described": f"{status}"}
                log(f"  {job.id}: {status}: {reason}")
            else:
                record.update(_run_one(job, runner, device, dry_run, min(job.timeout_s + start, available), results,
                                       log))
            results["jobs"].append(record)
            add_ratios(results["rows"][job.row])
            results["wall_s"] = clock() - started
            write_reports(results, out)
    results["wall_s"] = clock() - started
    write_reports(results, out)
    return results


def _run_one(job: Job, runner: JobRunner, device, dry_run: bool, timeout_s: float, results: dict, log) -> dict:
    spec = {"kind": job.kind, "row": job.row, "arm": job.arm, "device": str(device), "dry_run": dry_run,
            "search_s": job.search_s, "cap": 4 if dry_run else SEARCH_CAP, "threads": 1 if dry_run else None}
    events, outcome = runner.run(spec, timeout_s, job.id)
    arms = results["rows"][job.row]["arms"]
    if job.kind == "arm":
        rec = summarise_arm(events, outcome)
        keep = arms[job.arm].get("largest_batch")
        arms[job.arm] = {**rec, **({"largest_batch": keep} if keep else {})}
        if rec["status"] in ("ok", "partial"):
            log(f"  {job.id}: first step {rec['first_step_s'] * 1e3:.1f} ms, steady "
                f"{rec['steady_median_s'] * 1e3:.1f} ms, peak {rec['peak_bytes'] / 2**30:.2f} GiB "
                f"({outcome['wall_s']:.1f} s){'; ' + rec['error'] if rec['status'] == 'partial' else ''}")
        else:
            log(f"  {job.id}: {rec['status']}: {rec.get('error')} ({outcome['wall_s']:.1f} s)")
    else:
        rec = summarise_search(events, outcome)
        arms[job.arm]["largest_batch"] = rec
        log(f"  {job.id}: {rec['described']} ({len(rec['trials'])} trials, {outcome['wall_s']:.1f} s)")
    return {"status": rec["status"], "reason": rec.get("error", ""), "wall_s": round(outcome["wall_s"], 2),
            "exit": outcome["exit"]}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dptrain_bench.gpu_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="the folder for gpu-table.json, gpu-table.md and jobs-log.txt")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, tiny stand-ins, batch 2, two steps per arm")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"seconds for the whole run (default {DEFAULT_BUDGET_S:.0f}; the dry run 900)")
    p.add_argument("--only", nargs="+", metavar="JOB", help="run only these jobs (shell-style patterns; see --list)")
    p.add_argument("--list", action="store_true", help="print the jobs in the order they run, and exit")
    p.add_argument("--fresh-interpreters", action="store_true",
                   help="run each job in a new Python interpreter instead of a forked process")
    p.add_argument("--report-from", nargs="+", type=Path, metavar="JSON",
                   help="rewrite the table from these results (merged, later ones first-hand) into --out")
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--events", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.job:  # a job in a fresh interpreter (JobRunner's spawn mode)
        return run_job(json.loads(args.job), args.events)
    if args.report_from:
        if not args.out:
            return _error("--report-from needs --out DIR")
        try:
            merged = merge([json.loads(p.read_text()) for p in args.report_from])
        except (OSError, ValueError, KeyError) as exc:
            return _error(f"cannot merge {' '.join(map(str, args.report_from))}: {exc}")
        for path in write_reports(merged, args.out):
            print(f"wrote {path}")
        return 0
    try:
        jobs = select_jobs(plan_jobs(table_rows(args.dry_run), args.dry_run), args.only)
    except ValueError as exc:
        return _error(str(exc))
    budget = args.budget_s or (900.0 if args.dry_run else DEFAULT_BUDGET_S)
    if args.list:
        print(plan_text(jobs, budget))
        return 0
    if not args.out:
        return _error("--out DIR is needed (where the table goes)")
    started = float(os.environ.get("GPU_TABLE_T0") or time.time())
    try:
        results = run_table(jobs, dry_run=args.dry_run, out=args.out, budget_s=budget, started=started,
                            runner_mode="spawn" if args.fresh_interpreters else "fork")
    except RuntimeError as exc:
        return _error(str(exc))
    print()
    print(markdown(results))
    print(f"wrote {args.out / 'gpu-table.json'}, {args.out / 'gpu-table.md'}, {args.out / 'jobs-log.txt'}")
    return 0


def plan_text(jobs: list[Job], budget_s: float) -> str:
    lines = [f"{'job':48s} {'tier':>4s} {'expected':>9s} {'timeout':>8s}   cumulative"]
    total = 0.0
    for job in jobs:
        total += job.expected_s
        lines.append(f"{job.id:48s} {job.tier:4d} {job.expected_s:8.0f}s {job.timeout_s:7.0f}s   {total:6.0f} s")
    lines.append(f"{len(jobs)} jobs, {total:.0f} s expected in all, for a budget of {budget_s:.0f} s (the process "
                 f"start, imports and the probe come first; {REPORT_RESERVE_S:.0f} s stay for the reports): a job "
                 "starts only while its expected time is left, in this order")
    return "\n".join(lines)


def _error(message: str) -> int:
    print(f"gpu_table: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
