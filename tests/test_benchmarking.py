"""Smoke tests of the benchmark harness (dptrain.benchmarking): a tiny CNN, two arms, two timed steps.

The speed and memory targets are not asserted here (benchmarks are not tests); these check
that the harness measures what it says and reports every figure.
"""
from __future__ import annotations

import csv
import json

import pytest
import torch

from dptrain import benchmarking as bm

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
    return bm.run_benchmark([bm.smoke_config(batch_size=4, steps=2)], ARMS, scale="cpu", device=torch.device("cpu"),
                            threads=1, isolate=False, log=lambda *_: None)


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
    results = bm.run_benchmark([bm.smoke_config(batch_size=2, steps=1)], ["non-private", "no-such-mode"],
                               scale="cpu", device=torch.device("cpu"), threads=1,
                               isolate=False, log=lambda *_: None)
    arms = results["configs"]["smoke-cnn"]["arms"]
    assert arms["no-such-mode"]["status"] == "failed"
    assert "unknown arm" in arms["no-such-mode"]["error"]
    assert arms["non-private"]["status"] == "ok" and arms["non-private"]["median_s"] > 0


def test_reports_carry_every_figure(results, tmp_path):
    paths = bm.write_reports(results, tmp_path, "smoke")
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

    assert bm.largest_batch(fits, 8, 4096) == 37
    assert tried[:4] == [8, 16, 32, 64]
    assert len(tried) <= 4 + 5  # doubling, then log2(64 - 32) bisection steps
    assert bm.largest_batch(lambda b: True, 8, 100) == 100
    assert bm.largest_batch(lambda b: b <= 3, 8, 100) == 3
    assert bm.largest_batch(lambda b: False, 8, 100) == 0


def test_memory_worker_in_a_fresh_process():
    task = {"kind": "memory", "scale": "cpu", "config": "smoke-cnn", "arm": "bk", "device": "cpu", "threads": 1,
            "mem_limit_bytes": 2**30, "omp_wait_policy": "PASSIVE"}
    res = bm.run_worker(task, timeout=600)
    assert res["ok"], res.get("error")
    assert res["result"]["peak_above_baseline_bytes"] > 0
    assert res["result"]["peak_bytes"] == res["result"]["baseline_bytes"] + res["result"]["peak_above_baseline_bytes"]


def test_cli_lists_configurations_and_rejects_unknown_ones(capsys):
    assert bm.main(["--list", "--scale", "cpu"]) == 0
    listed = capsys.readouterr().out
    assert "gpt2-t64" in listed and "vgg11-gn-32" in listed
    assert bm.main(["--configs", "no-such-model", "--scale", "cpu"]) == 2
    assert "unknown configuration" in capsys.readouterr().err
