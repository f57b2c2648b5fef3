"""Smoke tests of the benchmark harness (benchmarks/dptrain_bench): a tiny CNN, two arms, two timed steps.

The speed and memory targets are not asserted here (benchmarks are not tests); these check
that the harness measures what it says and reports every figure.
"""
from __future__ import annotations

import copy
import csv
import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the harness lives in the checkout's benchmarks/, not in the package

from dptrain_bench import (  # noqa: E402  (after the path above)
    cli,
    gpu_table,
    gpu_table_report,
    gpu_table_rows,
    harness,
    memory,
    options,
    presets,
    reports,
    workers,
    zoo,
)

ARMS = ["non-private", "bk"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny ops gain nothing from threads, and spinning OpenMP threads crawl on a busy machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def results(one_thread):
    # In-process (isolate=False) to stay fast; the subprocess path is covered below.
    return harness.run_benchmark([zoo.smoke_config(batch_size=4, steps=2)], ARMS, scale="cpu",
                                 device=torch.device("cpu"), threads=1, isolate=False, log=lambda *_: None)


def test_one_row_per_arm_with_positive_times_and_memory(results):
    entry = results["configs"]["smoke-cnn"]
    assert list(entry["arms"]) == ARMS
    assert (entry["batch_size"], entry["warmup"], entry["steps"]) == (4, 1, 2)
    for rec in entry["arms"].values():
        assert rec["status"] == "ok"
        assert len(rec["step_times_s"]) == 2 and all(t > 0 for t in rec["step_times_s"])
        assert rec["min_s"] <= rec["median_s"] <= max(rec["step_times_s"])
        assert rec["throughput"] == pytest.approx(4 / rec["median_s"])
        assert rec["peak_bytes"] > 0 and rec["baseline_bytes"] > 0
    np_, bk = entry["arms"]["non-private"], entry["arms"]["bk"]
    assert np_["time_ratio"] == 1.0
    assert bk["time_ratio"] == pytest.approx(bk["median_s"] / np_["median_s"])


def test_failed_arm_is_recorded_and_the_others_still_run():
    results = harness.run_benchmark([zoo.smoke_config(batch_size=2, steps=1)], ["non-private", "no-such-mode"],
                                    scale="cpu", device=torch.device("cpu"), threads=1,
                                    isolate=False, log=lambda *_: None)
    arms = results["configs"]["smoke-cnn"]["arms"]
    assert arms["no-such-mode"]["status"] == "failed"
    assert "unknown arm" in arms["no-such-mode"]["error"]
    assert arms["non-private"]["status"] == "ok" and arms["non-private"]["median_s"] > 0


def test_an_opacus_arm_without_opacus_is_recorded_skipped_and_the_others_still_run(monkeypatch):
    """The harness asks once whether Opacus is installed; the name of that question was shadowed by its answer, and
    any Opacus arm crashed the whole configuration (UnboundLocalError)."""
    monkeypatch.setattr(harness, "opacus_missing", lambda: "opacus not installed (pip install opacus)")
    results = harness.run_benchmark([zoo.smoke_config(batch_size=2, steps=1)], ["non-private", options.OPACUS_ARMS[0]],
                                    scale="cpu", device=torch.device("cpu"), threads=1,
                                    isolate=False, log=lambda *_: None)
    arms = results["configs"]["smoke-cnn"]["arms"]
    assert arms[options.OPACUS_ARMS[0]] == {"status": "skipped", "error": "opacus not installed (pip install opacus)"}
    assert arms["non-private"]["status"] == "ok"


def test_reports_carry_every_figure(results, tmp_path):
    paths = reports.write_reports(results, tmp_path, "smoke")
    assert json.loads(paths[0].read_text()) == json.loads(json.dumps(results))
    with open(paths[1]) as f:
        rows = list(csv.DictReader(f))
    assert [r["arm"] for r in rows] == ARMS
    assert all(float(r["median_s"]) > 0 and int(r["peak_bytes"]) > 0 for r in rows)
    text = paths[2].read_text()
    assert "## smoke-cnn" in text and "| non-private |" in text and "| bk |" in text
    assert results["environment"]["cpu"] in text and results["environment"]["versions"]["torch"] in text
    if len(paths) == 4:
        assert paths[3].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_largest_batch_doubles_then_bisects():
    tried = []

    def fits(b):
        tried.append(b)
        return b <= 37

    assert memory.largest_batch(fits, 8, 4096) == 37
    assert tried[:4] == [8, 16, 32, 64]
    assert len(tried) <= 4 + 5  # doubling, then log2(64 - 32) bisection steps
    assert memory.largest_batch(lambda b: True, 8, 100) == 100
    assert memory.largest_batch(lambda b: b <= 3, 8, 100) == 3
    assert memory.largest_batch(lambda b: False, 8, 100) == 0


@pytest.mark.slow
def test_memory_worker_in_a_fresh_process():
    task = {"kind": "memory", "scale": "cpu", "config": "smoke-cnn", "arm": "bk", "device": "cpu", "threads": 1,
            "mem_limit_bytes": 2**30, "omp_wait_policy": "PASSIVE"}
    res = workers.run_worker(task, timeout=600)
    assert res["ok"], res.get("error")
    assert res["result"]["peak_above_baseline_bytes"] > 0
    assert "malloc returns freed blocks" in res["result"]["memory_method"]  # the peak follows live bytes
    assert res["result"]["peak_bytes"] == res["result"]["baseline_bytes"] + res["result"]["peak_above_baseline_bytes"]


def test_cli_lists_configurations_and_rejects_unknown_ones(capsys):
    assert cli.main(["--list", "--scale", "cpu"]) == 0
    listed = capsys.readouterr().out
    assert "gpt2-t64" in listed and "vgg11-gn-32" in listed
    assert cli.main(["--configs", "no-such-model", "--scale", "cpu"]) == 2
    assert "unknown configuration" in capsys.readouterr().err


# --------------------------------------------------------------------------- where results go


@pytest.fixture
def in_process_workers(monkeypatch):
    """Workers run in this process: the command's own logic is under test, not the subprocesses."""
    monkeypatch.setattr(workers, "run_worker",
                        lambda task, timeout, isolate=True: workers.run_task({**task, "isolated": False}))


SMOKE_RUN = ["--scale", "cpu", "--configs", "smoke-cnn", "--arms", "non-private", "--no-opacus", "--warmup", "0",
             "--steps", "1", "--threads", "1"]


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.is_dir() else {}


def test_default_output_is_a_fresh_folder_and_every_path_is_printed(tmp_path, monkeypatch, capsys, in_process_workers):
    published = tmp_path / "checkout" / "benchmarks" / "results"
    published.mkdir(parents=True)
    (published / "cpu.json").write_text("{\"committed\": true}\n")
    monkeypatch.setattr(cli, "published_results_dir", lambda: published)
    monkeypatch.chdir(tmp_path)
    before = _snapshot(published)
    assert cli.main(SMOKE_RUN) == 0
    assert cli.main(SMOKE_RUN) == 0  # a second run gets its own folder too
    assert _snapshot(published) == before
    out = capsys.readouterr().out
    written = [line.removeprefix("wrote ") for line in out.splitlines() if line.startswith("wrote ")]
    folders = sorted({str(Path(p).parent) for p in written})
    assert len(folders) == 2 and all(Path(f).parent == tmp_path and Path(f).name.startswith("dptrain-bench-")
                                     for f in folders)
    assert {Path(p).name for p in written} >= {"cpu.json", "cpu.csv", "cpu.md"}
    assert all(Path(p).is_file() for p in written)
    assert set(written) == {str(p) for f in folders for p in Path(f).iterdir()}  # nothing written unannounced


def test_publish_is_the_one_way_into_the_committed_results(tmp_path, monkeypatch, capsys, in_process_workers):
    published = tmp_path / "benchmarks" / "results"
    published.mkdir(parents=True)
    monkeypatch.setattr(cli, "published_results_dir", lambda: published)
    monkeypatch.chdir(tmp_path)
    assert cli.main([*SMOKE_RUN, "--out", str(published)]) == 2
    assert "--publish" in capsys.readouterr().err and not any(published.iterdir())
    assert cli.main([*SMOKE_RUN, "--publish", "--out", str(tmp_path / "x")]) == 2
    assert "not both" in capsys.readouterr().err
    for option in ("--resume", "--report-only"):
        assert cli.main([*SMOKE_RUN, option]) == 2
        assert "--out DIR" in capsys.readouterr().err
    assert cli.main([*SMOKE_RUN, "--publish"]) == 0
    assert f"wrote {published / 'cpu.json'}" in capsys.readouterr().out
    assert "smoke-cnn" in json.loads((published / "cpu.json").read_text())["configs"]
    assert cli.main(["--report-only", "--publish", "--tag", "cpu"]) == 0
    assert f"wrote {published / 'cpu.md'}" in capsys.readouterr().out


def test_publish_outside_a_checkout_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "published_results_dir", lambda: tmp_path / "no-such" / "results")
    assert cli.main([*SMOKE_RUN, "--publish"]) == 2
    assert "does not exist" in capsys.readouterr().err


# --------------------------------------------------------------------------- the GPU preset


def test_gpu_quick_plan_names_the_gpu_table_rows_and_its_budget(capsys):
    assert cli.main(["--preset", "gpu-quick", "--dry-run"]) == 0
    plan = capsys.readouterr().out
    preset = presets.PRESETS["gpu-quick"]
    configs = zoo.configs_for(preset.scale)
    batches = {row: configs[row].batch_size for row in preset.rows}
    assert batches == {"gpt2-t100": 32, "resnet18-gn-224-b128": 128, "vgg11-gn-224": 32, "vit-224": 32,
                       "resnet18-gn-224": 32}
    assert "vit_base_patch16_224" in configs["vit-224"].description and "T=100" in configs["gpt2-t100"].description
    for row in preset.rows:
        assert row in plan
    assert f"{preset.budget_s:.0f} s in all" in plan and preset.budget_s < 6 * 60
    assert cli.main(["--preset", "gpu-quick", "--arms", "bk", "--dry-run"]) == 2
    assert "leave out --arms" in capsys.readouterr().err
    assert cli.main(["--preset", "gpu-quick", "--configs", "gpt2-t64", "--dry-run"]) == 2
    assert "not rows of --preset gpu-quick" in capsys.readouterr().err
    assert cli.main(["--preset", "gpu-quick", "--configs", "vgg11-gn-224", "vit-224", "--dry-run"]) == 0
    subset = capsys.readouterr().out
    assert "vit-224" in subset and "gpt2-t100" not in subset and "resnet18-gn-224-b128" not in subset
    assert cli.main(["--dry-run"]) == 2


def _fake_runner(clock, spend):
    """A worker that takes ``spend(task, timeout)`` seconds of the fake clock and succeeds."""
    tasks = []

    def run(task, timeout):
        tasks.append((task, timeout))
        clock[0] += spend(task, timeout)
        if task["kind"] == "arm":
            return {"ok": True, "result": {"peak_bytes": 2**30, "baseline_bytes": 2**29,
                                           "peak_above_baseline_bytes": 2**29, "memory_method": "fake", "note": "",
                                           "step_times_s": [0.01, 0.02, 0.03], "cpu_times_s": [0.01] * 3}}
        return {"ok": True, "result": {"max_batch": 256, "cap": task["cap"], "max_batch_search": "256"}}

    return run, tasks


@pytest.mark.parametrize("worst_case", [False, True])
def test_gpu_quick_never_outlasts_its_budget(worst_case):
    """Every worker taking its whole timeout still ends within the budget; what did not fit is marked skipped."""
    preset = presets.PRESETS["gpu-quick"]
    clock = [0.0]
    spend = (lambda task, timeout: timeout) if worst_case else (lambda task, timeout: 1.0)
    runner, tasks = _fake_runner(clock, spend)
    results = presets.run_preset(preset, list(preset.arms), device=torch.device("cpu"), threads=1, runner=runner,
                                 clock=lambda: clock[0], log=lambda *_: None)
    assert clock[0] <= preset.budget_s
    assert list(results["configs"]) == list(preset.rows)
    recs = [rec for entry in results["configs"].values() for rec in entry["arms"].values()]
    searched = [t for t, _ in tasks if t["kind"] == "max-batch"]
    if worst_case:
        assert any(rec["status"] == "skipped" and "time budget" in rec["error"] for rec in recs)
        assert all(t["budget_s"] >= preset.min_search_s for t in searched)
    else:
        assert all(rec["status"] == "ok" for rec in recs) and len(recs) == len(preset.rows) * len(preset.arms)
        assert len(searched) == len(preset.searches()) and all(t["budget_s"] == preset.search_s for t in searched)
        entry = results["configs"]["vgg11-gn-224"]
        assert entry["arms"]["bk-mixopt"]["max_batch"] == 256 and entry["arms"]["bk-mixopt"]["memory_ratio"] == 1.0
    assert all(timeout == preset.arm_timeout_s for t, timeout in tasks if t["kind"] == "arm")


def test_gpu_quick_plan_runs_end_to_end_on_tiny_stand_ins(monkeypatch):
    """The preset's own workers (one process kind per arm, then the largest-batch search) on the CPU."""
    preset = dataclasses.replace(presets.PRESETS["gpu-quick"], rows=("gpt2-t100", "vgg11-gn-224"),
                                 max_batch_rows=("vgg11-gn-224",), max_batch_cap=4, warmup=1, steps=2)
    stand_ins = {row: dataclasses.replace(zoo.smoke_config(batch_size=2, steps=2), name=row) for row in preset.rows}
    monkeypatch.setattr(zoo, "configs_for", lambda scale: stand_ins)
    arms = [options.NON_PRIVATE, "bk-mixopt"]
    results = presets.run_preset(preset, arms, device=torch.device("cpu"), threads=1,
                                 runner=lambda task, timeout: workers.run_worker(task, timeout, isolate=False),
                                 log=lambda *_: None)
    for row in preset.rows:
        for arm in arms:
            rec = results["configs"][row]["arms"][arm]
            assert rec["status"] == "ok", rec.get("error")
            assert len(rec["step_times_s"]) == 2 and rec["peak_bytes"] > 0
    searched = results["configs"]["vgg11-gn-224"]["arms"]
    assert [searched[a]["max_batch"] for a in arms] == [4, 4]  # no out-of-memory on the CPU: the cap
    assert searched["bk-mixopt"]["max_batch_throughput"] > 0
    assert "max_batch" not in results["configs"]["gpt2-t100"]["arms"]["bk-mixopt"]


def test_largest_batch_search_stops_at_its_deadline():
    now = [0.0]

    def fits(b):
        now[0] += 10.0  # each trial takes 10 s
        return b <= 300

    search = memory.search_largest_batch(fits, 32, 4096, deadline=35.0, clock=lambda: now[0])
    # four trials start before the deadline of 35 s: 32, 64, 128 and 256
    assert (search.found, search.too_large, search.stopped) == (256, None, "time budget")
    assert "256 fits" in search.describe() and "time budget" in search.describe()
    now[0] = 0.0
    search = memory.search_largest_batch(fits, 32, 4096, deadline=1000.0, clock=lambda: now[0], rel_tolerance=1 / 16)
    assert search.found <= 300 < search.too_large and search.too_large - search.found <= 300 / 16
    assert memory.search_largest_batch(lambda b: b <= 37, 8, 4096) == memory.BatchSearch(37, 38)


def test_a_configuration_merged_from_another_run_names_its_commit_and_method(results):
    merged = json.loads(json.dumps(results))
    entry = copy.deepcopy(merged["configs"]["smoke-cnn"])
    entry["config"] = "smoke-cnn-later"
    entry["environment"] = {**merged["environment"], "date": "2031-01-02T03:04:05+00:00", "dptrain_commit": "abc1234"}
    for rec in entry["arms"].values():
        rec["memory_method"] = "another method"
    merged["configs"]["smoke-cnn-later"] = entry
    text = reports.markdown(merged)
    later = text[text.index("## smoke-cnn-later"):]
    assert "Measured in a separate run on 2031-01-02 at commit abc1234; memory: another method" in later
    assert "separate run" not in text[:text.index("## smoke-cnn-later")]


def test_the_committed_results_are_the_checkouts_benchmarks_results():
    assert cli.published_results_dir() == BENCHMARKS / "results"
    assert cli.published_results_dir().is_dir()


def test_host_cost_times_the_forward_and_the_step_against_non_private_training():
    """benchmarks/host_cost.py (the host's share of the private step, issue 43's CPU yardstick): one round of each
    measure, in a fresh process. The engine dispatches no aten operation of its own in a training forward of GPT-2
    (whose input is ids: nothing is carried), and a step's figures come with their ratios."""
    pytest.importorskip("transformers")
    outs = []
    for what in ("forward", "step"):
        run = subprocess.run([sys.executable, str(BENCHMARKS / "host_cost.py"), "--what", what, "--models", "gpt2",
                              "--rounds", "1"], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        outs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    forward, step = outs
    assert forward["private_operations"] == forward["non_private_operations"] > 500  # (12 GPT-2 blocks)
    assert forward["non_private_forward_ms"] > 0 and forward["forward_ratio"] > 0
    for phase in ("forward", "backward", "update", "step"):
        assert step[f"private_{phase}_ms"] > 0 and step[f"{phase}_ratio"] > 0
    assert step["private_operations"] > step["non_private_operations"]  # (the norms and clipped sums)


def test_forward_parts_splits_the_private_forward_and_puts_the_record_back():
    """benchmarks/forward_parts.py (where the private forward's host time goes): one round on GPT-2 gives each
    variant's ratio, and the engine's own record is back in place afterwards (the variants replace it meanwhile)."""
    pytest.importorskip("transformers")
    from dptrain.core.layer_hooks import LayerHooks

    forward_parts = importlib.import_module("forward_parts")
    record = LayerHooks._record
    row = forward_parts.measure("gpt2", rounds=1)
    assert LayerHooks._record is record
    for key in ("engine_ratio", "bare_hook_ratio", "no_record_ratio"):
        assert row[key] > 0, key


# --------------------------------------------------------------------------- issue 43's GPU table (gpu_table.sh)


TABLE_ROWS = {  # key: (batch, sequence length or image side, autocast), as issue 43 lists them, in the order they run
    "llama-1b-t256": (8, 256, "bfloat16"), "llama-1b-lora-t256": (8, 256, "bfloat16"),
    "llama-1b-t4096": (2, 4096, "bfloat16"), "gpt2-small-t100": (32, 100, None), "vit-b16-224": (32, 224, None),
    "resnet18-gn-224-b128": (128, 224, None), "resnet18-gn-224-b128-bf16": (128, 224, "bfloat16"),
    "resnet18-gn-224-b32": (32, 224, None), "vgg11-gn-224-b32": (32, 224, None)}


def test_gpu_table_has_issue_43s_rows_and_runs_the_most_informative_jobs_first():
    rows = gpu_table_rows.table_rows()
    assert list(gpu_table_rows.rows_by_key()) == list(TABLE_ROWS)
    for row in rows:
        task = row.config.task()
        side = task.seq_len if task.kind == "lm" else task.image_size
        assert (row.config.batch_size, side, row.config.autocast) == TABLE_ROWS[row.key]
        assert row.config.build_on_device and set(row.arms()) <= set(row.step_s)
    assert zoo.LLAMA_1B == dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                                num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
    by_key = gpu_table_rows.rows_by_key()
    assert "bk" in by_key["llama-1b-t256"].arms() and "opacus-ghost" in by_key["llama-1b-lora-t256"].arms()
    jobs = gpu_table_rows.plan_jobs(rows)
    assert len({job.id for job in jobs}) == len(jobs)
    first_tier = [(job.row, job.arm) for job in jobs if job.tier == 1]
    assert first_tier == [(key, arm) for key in TABLE_ROWS for arm in ("non-private", "bk-mixopt")]
    assert jobs[:len(first_tier)] == [job for job in jobs if job.tier == 1]  # tier 1 runs first
    assert [job.tier for job in jobs] == sorted(job.tier for job in jobs)
    searched = {(job.row, job.arm) for job in jobs if job.kind == "largest-batch"}
    assert {("resnet18-gn-224-b128", "non-private"), ("resnet18-gn-224-b128", "bk-mixopt"),
            ("vgg11-gn-224-b32", "non-private"), ("vgg11-gn-224-b32", "bk-mixopt")} <= searched
    assert {row for row, _ in searched} == {"resnet18-gn-224-b128", "vgg11-gn-224-b32"}
    assert all(job.timeout_s >= job.expected_s > 0 for job in jobs)
    # the core of the table (tiers 1-3) is expected to fit the default budget with room for the processes' starts
    core = sum(job.expected_s for job in jobs if job.tier <= 3)
    assert core + 30 < gpu_table.DEFAULT_BUDGET_S <= 330
    stand_ins = gpu_table_rows.table_rows(dry_run=True)
    assert [r.key for r in stand_ins] == list(TABLE_ROWS)
    assert all(r.stand_in.batch_size == 2 and r.stand_in.autocast == r.config.autocast for r in stand_ins)
    assert gpu_table_rows.select_jobs(jobs, ["vgg11-gn-224-b32/*"]) == [j for j in jobs if j.row == "vgg11-gn-224-b32"]
    with pytest.raises(ValueError, match="matches no job"):
        gpu_table_rows.select_jobs(jobs, ["no-such-row/*"])


@pytest.mark.slow
def test_gpu_table_full_size_models_are_the_issues_built_on_the_meta_device():
    """The GPU's models, checked here without their memory: the Llama's shape and size (issue 43 calls it 1.1 B; its
    configuration has 852.6 M parameters), LoRA on every linear layer, GPT-2 untied with its position table frozen,
    and the CNNs without in-place operations, VGG-11 with its GroupNorms."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    pytest.importorskip("timm")
    models = {}
    for row in gpu_table_rows.table_rows():
        with torch.device("meta"):
            models[row.key] = row.config.task().build()

    def count(model, trainable=False):
        return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)

    assert count(models["llama-1b-t256"]) == count(models["llama-1b-t4096"]) == 852_559_872
    assert models["llama-1b-t256"].config.num_hidden_layers == 16
    linear_shapes = [(2048, 2048), (2048, 512), (2048, 512), (2048, 2048), (2048, 5632), (2048, 5632), (5632, 2048)]
    lora_per_layer = sum(16 * (n_in + n_out) for n_in, n_out in linear_shapes)  # q k v o gate up down, r 16
    assert count(models["llama-1b-lora-t256"], trainable=True) == 16 * lora_per_layer
    gpt2 = models["gpt2-small-t100"]
    assert not gpt2.transformer.wpe.weight.requires_grad and gpt2.lm_head.weight is not gpt2.transformer.wte.weight
    assert 85e6 < count(models["vit-b16-224"]) < 88e6
    for key in ("resnet18-gn-224-b128", "vgg11-gn-224-b32"):
        assert not any(getattr(m, "inplace", False) for m in models[key].modules())
        assert any(isinstance(m, torch.nn.GroupNorm) for m in models[key].modules())
        assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in models[key].modules())


def _fake_events(spec, clock_s):
    if spec["kind"] == "probe":
        return [{"event": "environment", "environment": {"gpu": "Fake GPU", "versions": {}, "torch_defaults": {}}}]
    if spec["kind"] == "arm":
        steps = [{"event": "step", "i": i, "s": 0.1 + 0.01 * i, "peak_bytes": 2**30 + i} for i in range(13)]
        return [{"event": "built", "warmup": 3, "steps": 10}, *steps, {"event": "done"}]
    return [{"event": "trial", "batch": 128, "fits": True}, {"event": "trial", "batch": 256, "fits": False},
            {"event": "search", "found": 128, "too_large": 256, "stopped": "", "described": "128", "cap": 4096}]


class _FakeRunner:
    """Jobs that take ``spend(job timeout)`` seconds of a fake clock; a forked probe can be made to fail."""

    def __init__(self, clock, spend, fork_fails=False):
        self.clock, self.spend, self.fork_fails = clock, spend, fork_fails
        self.mode, self.specs = "fork", []

    def run(self, spec, timeout_s, label):
        self.specs.append((spec, timeout_s))
        taken = self.spend(timeout_s)
        self.clock[0] += taken
        if spec["kind"] == "probe" and self.fork_fails and self.mode == "fork":
            return [{"event": "error", "error": "RuntimeError: CUDA error: initialization error"}], \
                {"exit": "exit status 1", "killed": False, "wall_s": taken, "timeout_s": timeout_s}
        return _fake_events(spec, self.clock[0]), {"exit": "exit status 0", "killed": False, "wall_s": taken,
                                                   "timeout_s": timeout_s}


@pytest.mark.parametrize("worst_case", [False, True])
def test_gpu_table_never_outlasts_its_budget_and_says_what_it_left_out(tmp_path, monkeypatch, worst_case):
    monkeypatch.delenv("FASTDP_DIR", raising=False)
    clock = [1000.0]
    runner = _FakeRunner(clock, (lambda timeout: timeout) if worst_case else (lambda timeout: 2.0))
    jobs = gpu_table_rows.plan_jobs(gpu_table_rows.table_rows())
    results = gpu_table.run_table(jobs, dry_run=False, out=tmp_path, budget_s=330, started=1000.0,
                                  runner_mode="fork", runner=runner, clock=lambda: clock[0], log=lambda *_: None)
    assert clock[0] - 1000.0 <= 330 - gpu_table.REPORT_RESERVE_S
    assert [job["id"] for job in results["jobs"]] == [job.id for job in jobs]
    statuses = {job["id"]: job["status"] for job in results["jobs"]}
    assert all(status == "unavailable" for job_id, status in statuses.items() if "fastdp" in job_id)
    assert not any("fastdp" in spec.get("arm", "") for spec, _ in runner.specs)  # no process for a missing arm
    if worst_case:
        assert "skipped" in statuses.values()
        assert all("not started" in job["reason"] for job in results["jobs"] if job["status"] == "skipped")
    else:
        assert {s for job_id, s in statuses.items() if "fastdp" not in job_id} <= {"ok", "unavailable"}
        llama = results["rows"]["llama-1b-t256"]["arms"]
        assert llama["non-private"]["first_step_s"] == 0.1
        assert llama["non-private"]["steady_median_s"] == pytest.approx(0.175)  # the median of steps 3 to 12
        vgg = results["rows"]["vgg11-gn-224-b32"]["arms"]["bk-mixopt"]
        assert vgg["largest_batch"]["found"] == 128 and vgg["largest_batch_ratio"] == 1.0
    text = (tmp_path / "gpu-table.md").read_text()
    assert "Fake GPU" in text and "fastDP not provided" in text
    assert json.loads((tmp_path / "gpu-table.json").read_text())["rows"].keys() == TABLE_ROWS.keys()


def test_gpu_table_runs_its_jobs_in_fresh_interpreters_where_a_forked_one_cannot_use_the_gpu(tmp_path):
    clock = [0.0]
    runner = _FakeRunner(clock, lambda timeout: 1.0, fork_fails=True)
    jobs = gpu_table_rows.select_jobs(gpu_table_rows.plan_jobs(gpu_table_rows.table_rows()), ["gpt2-small-t100/*"])
    results = gpu_table.run_table(jobs, dry_run=False, out=tmp_path, budget_s=330, started=0.0, runner_mode="fork",
                                  runner=runner, clock=lambda: clock[0], log=lambda *_: None)
    assert runner.mode == "spawn" and results["runner"] == "spawn"
    assert [spec["kind"] for spec, _ in runner.specs[:2]] == ["probe", "probe"]
    assert results["rows"]["gpt2-small-t100"]["arms"]["non-private"]["status"] == "ok"


def test_gpu_table_figures_from_a_job_stopped_by_the_budget():
    built = {"event": "built", "warmup": 3, "steps": 10}
    steps = [{"event": "step", "i": i, "s": s, "peak_bytes": p}
             for i, (s, p) in enumerate([(2.0, 300), (0.5, 200), (0.4, 210), (0.3, 220), (0.2, 205), (0.4, 200)])]
    killed = {"exit": "SIGKILL (timeout)", "killed": True, "wall_s": 40.0, "timeout_s": 40.0}
    rec = gpu_table_report.summarise_arm([built, *steps], killed)
    assert rec["status"] == "partial" and "3 of 10 timed steps" in rec["error"] and "time budget" in rec["error"]
    assert rec["first_step_s"] == 2.0 and rec["steady_median_s"] == 0.3  # the timed steps: 0.3, 0.2, 0.4
    assert (rec["first_step_peak_bytes"], rec["steady_peak_bytes"], rec["peak_bytes"]) == (300, 220, 300)
    assert gpu_table_report.summarise_arm([built], killed)["status"] == "stopped"
    trials = [{"event": "trial", "batch": b, "fits": b <= 512} for b in (128, 256, 512, 1024)]
    search = gpu_table_report.summarise_search(trials, killed)
    assert (search["found"], search["too_large"], search["status"]) == (512, 1024, "partial")
    assert "512 fits, 1024 does not" in search["described"]


def test_gpu_table_job_killed_at_its_timeout_leaves_its_events(tmp_path):
    """A real forked job, killed by its timeout (a second, less than the tiny VGG's build and two steps take here)."""
    runner = gpu_table.JobRunner("fork", tmp_path / "jobs-log.txt", tmp_path)
    spec = {"kind": "arm", "row": "vgg11-gn-224-b32", "arm": "non-private", "device": "cpu", "dry_run": True,
            "threads": 1}
    events, outcome = runner.run(spec, 1.0, "killed-job")
    assert outcome["killed"] and outcome["exit"] == "SIGKILL (timeout)" and 1.0 <= outcome["wall_s"] < 30
    assert gpu_table_report.summarise_arm(events, outcome)["status"] in ("stopped", "partial")
    assert "killed-job (forked" in (tmp_path / "jobs-log.txt").read_text()


def test_gpu_table_reports_of_two_calls_merge_into_one_table(tmp_path, capsys):
    def run(arms, date, gpu="Fake GPU"):
        rows = {"r": {"title": "a row", "description": "d", "batch_size": 8, "warmup": 3, "steps": 10,
                      "autocast": None, "arms": arms}}
        jobs = [{"id": f"r/{a}", "tier": 1, "status": rec["status"]} for a, rec in arms.items()]
        return {"environment": {"gpu": gpu, "date": date}, "rows": rows, "jobs": jobs, "budget_s": 330,
                "wall_s": 300}

    first = run({"non-private": {"status": "ok", "steady_median_s": 0.1, "peak_bytes": 100},
                 "bk-mixopt": {"status": "skipped", "error": "not started"}}, "day 1")
    second = run({"non-private": {"status": "not run"}, "bk-mixopt": {"status": "ok", "steady_median_s": 0.15,
                                                                       "peak_bytes": 110}}, "day 1, later")
    merged = gpu_table_report.merge([first, second])
    arms = merged["rows"]["r"]["arms"]
    assert arms["non-private"]["steady_median_s"] == 0.1 and arms["bk-mixopt"]["steady_ratio"] == pytest.approx(1.5)
    assert {job["id"]: job["status"] for job in merged["jobs"]} == {"r/non-private": "ok", "r/bk-mixopt": "ok"}
    with pytest.raises(ValueError, match="different devices"):
        gpu_table_report.merge([first, run({}, "day 2", gpu="Other GPU")])
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, res in zip(paths, (first, second)):
        path.write_text(json.dumps(res))
    assert gpu_table.main(["--report-from", *map(str, paths), "--out", str(tmp_path / "merged")]) == 0
    assert "1.50×" in (tmp_path / "merged" / "gpu-table.md").read_text()


DRY_RUN_JOBS = ["llama-1b-lora-t256/*", "llama-1b-t256/bk", "gpt2-small-t100/non-private",
                "gpt2-small-t100/fastdp-mixopt", "vit-b16-224/bk-mixopt", "resnet18-gn-224-b128-bf16/bk-mixopt",
                "vgg11-gn-224-b32/non-private", "vgg11-gn-224-b32/non-private/largest-batch"]


@pytest.mark.slow
def test_gpu_table_dry_run_end_to_end(tmp_path):
    """``--dry-run`` as benchmarks/gpu_table.sh runs it, on jobs that take every code path (LoRA, bf16 autocast, dptrain
    and Opacus where installed, fastDP missing, a largest-batch search, the reports); the whole dry run (every job,
    about 2-3 minutes on two shared cores) is the check to run by hand before a GPU call."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    pytest.importorskip("timm")
    env = {k: v for k, v in os.environ.items() if k != "FASTDP_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCHMARKS.parent / "src"), str(BENCHMARKS), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "dptrain_bench.gpu_table", "--dry-run", "--out", str(tmp_path),
                          "--only", *DRY_RUN_JOBS], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "gpu-table.json").read_text())
    assert results["dry_run"] and results["runner"] == "fork" and results["environment"]["device"] == "cpu"
    statuses = {job["id"]: job["status"] for job in results["jobs"]}
    assert statuses.pop("gpt2-small-t100/fastdp-mixopt") == "unavailable"
    assert statuses.pop("llama-1b-lora-t256/opacus-ghost") in ("ok", "unavailable")  # opacus is optional here
    assert set(statuses.values()) == {"ok"}, results["jobs"]
    lora = results["rows"]["llama-1b-lora-t256"]["arms"]["bk-mixopt"]
    assert lora["autocast"] == "bfloat16" and 0 < lora["trainable_parameters"] < lora["parameters"]
    assert lora["first_step_s"] > 0 and lora["steady_median_s"] > 0 and lora["timed_steps"] == 1
    assert lora["peak_bytes"] >= lora["first_step_peak_bytes"] > 0 and lora["steady_ratio"] > 0
    search = results["rows"]["vgg11-gn-224-b32"]["arms"]["non-private"]["largest_batch"]
    assert search["found"] == 4 and [t["batch"] for t in search["trials"]] == [2, 4]  # the dry run's cap: 4
    text = (tmp_path / "gpu-table.md").read_text()
    assert "DRY RUN" in text and f"| {gpu_table_rows.rows_by_key()['llama-1b-lora-t256'].title} | non-private |" in text
    assert "fastDP not provided" in text
    assert list(results["rows"]["gpt2-small-t100"]["arms"]) == ["non-private", "fastdp-mixopt"]  # what --only chose
    assert text in run.stdout and (tmp_path / "jobs-log.txt").is_file()


@pytest.mark.slow
def test_gpu_table_job_in_a_fresh_interpreter(tmp_path):
    runner = gpu_table.JobRunner("spawn", tmp_path / "jobs-log.txt", tmp_path)
    events, outcome = runner.run({"kind": "probe", "device": "cpu", "threads": 1}, 300, "probe")
    assert outcome["exit"] == "exit status 0" and not outcome["killed"], (tmp_path / "jobs-log.txt").read_text()
    env = next(e["environment"] for e in events if e["event"] == "environment")
    assert env["device"] == "cpu" and env["torch_defaults"]["cudnn.benchmark"] is False


def test_tensor_cores_benchmark_runs_its_dry_run():
    """``benchmarks/tensor_cores.py --dry-run``: every figure of a row, and the clipped sum's error against float64
    within float32's, on the CPU (the GPU run has none to compare with here)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "tensor_cores.py"), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    row = json.loads(out.splitlines()[0])
    for key in ("weight_grad_bf16_ms", "gram_ms", "gram_widened_ms", "clipped_sum_ms", "clipped_sum_widened_ms"):
        assert row[key] > 0, key
    assert row["clipped_sum_relative_error"] < 1e-6 and row["clipped_sum_widened_relative_error"] < 1e-6
