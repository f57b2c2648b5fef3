"""The frameworks' own data-parallel paths, 2 gloo processes on the CPU: the Trainer (DDP through its
Accelerate), Accelerate (MULTI_CPU DDP) and Lightning (strategy="ddp").

Each trains 2 logical steps, each step's batch shared out to 2 micro-batches on each of 2 processes; the final
parameters must equal, to 1e-10 in float64, SGD on the single-process oracle's private gradient over the
specified batches (tests/framework_helpers.py: the seeded single-process draw), on every process, with the same
steps and epsilon everywhere. The process bodies are in tests/framework_workers.py.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import framework_workers as W
from framework_helpers import build_classifier, classifier_columns, classifier_losses, logical_batches, oracle_sgd, take
from helpers import free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")]


def _launch(fn, out, R) -> list[dict]:
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    mp.start_processes(fn, args=(W.WORLD, free_port(), str(out), R), nprocs=W.WORLD, start_method=method)
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(W.WORLD)]


def _check(ranks: list[dict], model, losses_fn, columns, R, parallel="DDPGradients") -> None:
    K = ranks[0]["K"]
    assert K % (W.ACCUMULATION * W.WORLD) == 0
    batches = logical_batches(len(columns[0]), W.BATCH, K, W.SEED, W.STEPS)
    assert all(batches) and all(len(b) < len(columns[0]) for b in batches)
    expected = oracle_sgd(model, losses_fn, columns, batches, R, W.BATCH, W.LR)
    initial = dict(model.named_parameters())
    for rank in ranks:
        assert rank["steps"] == W.STEPS and rank["epsilon"] == ranks[0]["epsilon"] and rank["parallel"] == parallel
        for name, ref in expected.items():
            assert not torch.equal(ref, initial[name])  # training moved it
            torch.testing.assert_close(rank["params"][name], ref, rtol=1e-10, atol=1e-12)


def _threshold(model, losses_fn, columns) -> float:
    """A clipping norm between the first specified batch's per-sample norms (K does not change that draw here)."""
    from dptrain.testing import threshold_between

    first = logical_batches(len(columns[0]), W.BATCH, None, W.SEED, 1)[0]
    return threshold_between(model, losses_fn, take(columns, first))


def test_trainer_under_ddp_is_the_oracle_on_the_whole_batch(tmp_path):
    pytest.importorskip("transformers")
    from test_hf_trainer import _gpt2, _lm_data, _lm_losses

    model, columns = _gpt2().double(), _lm_data(n=16)
    R = _threshold(model, _lm_losses, columns)
    _check(_launch(W.run_trainer, tmp_path / "trainer", R), model, _lm_losses, columns, R)
    for r in range(W.WORLD):  # no false alarm from the engine built before the Trainer wraps the model
        assert torch.load(f"{tmp_path / 'trainer'}.alone{r}") == []


def test_accelerate_under_ddp_is_the_oracle_on_the_whole_batch(tmp_path):
    pytest.importorskip("accelerate")
    model, columns = build_classifier(), classifier_columns()
    R = _threshold(model, classifier_losses, columns)
    _check(_launch(W.run_accelerate, tmp_path / "accelerate", R), model, classifier_losses, columns, R)
    seeds = [torch.load(f"{tmp_path / 'accelerate'}.seed{r}") for r in range(W.WORLD)]
    assert seeds[0] == seeds[1]  # the secret sampling seed, agreed by the processes


def test_lightning_under_ddp_is_the_oracle_on_the_whole_batch(tmp_path):
    pytest.importorskip("lightning")
    model, columns = build_classifier(), classifier_columns()
    R = _threshold(model, classifier_losses, columns)
    _check(_launch(W.run_lightning, tmp_path / "lightning", R), model, classifier_losses, columns, R)
