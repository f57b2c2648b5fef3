"""The examples run end to end on tiny settings (seconds each), as in CI."""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name: str, argv: list[str]) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _load(name).main(argv)


def test_gpt2_trainer_example_trains_privately():
    pytest.importorskip("transformers")
    out = _run("gpt2_trainer", ["--tiny", "--max-steps", "3", "--epsilon", "8"])
    assert out["steps"] == 3
    assert out["epsilon"] == pytest.approx(8.0, rel=0.05)  # the noise was calibrated to the 3 planned steps
    assert out["loss"] > 0


@pytest.mark.parametrize("model", ["vit", "convnext"])
def test_timm_classification_example_trains_privately(model):
    pytest.importorskip("timm")
    out = _run("timm_classification", ["--tiny", "--epochs", "1", "--model", model])
    assert out["steps"] == 8  # one epoch of Poisson batches with q = 32 / 256
    assert out["epsilon"] == pytest.approx(8.0, rel=0.05)
    assert 0.0 <= out["accuracy"] <= 1.0


def test_lora_example_trains_only_the_adapters_privately():
    pytest.importorskip("peft")
    out = _run("lora_finetune", ["--tiny", "--epochs", "1"])
    assert out["steps"] == 8
    assert out["epsilon"] == pytest.approx(8.0, rel=0.05)
    assert 0 < out["trainable"] < 1000


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_ddp_example_runs_under_torchrun(engine):
    """`torchrun --nproc_per_node=2 examples/ddp_train.py` (gloo on CPU), as the README shows it."""
    import subprocess
    import sys

    args = ["--epochs", "0.5"] + (["--fsdp"] if engine == "fsdp" else [])
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(EXAMPLES / "ddp_train.py"), *args],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{'FSDP2' if engine == 'fsdp' else 'DDP'} on 2 processes: 6 steps" in run.stdout
