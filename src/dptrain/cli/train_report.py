"""What ``dptrain train`` prints and writes about its run: the header (data, model, training, privacy, the layers'
norms), the report (``report.json``), the summary and the plot. ``TrainingReport`` is a mixin of
``train.TrainingRun``, whose state it reads."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ..models.specs import parse_spec
from .options import OPTIMIZERS
from .output import plural

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..core.planning import LayerDecision
    from ..engine import PrivacyEngine
    from .datasets import ImageData


class TrainingReport:
    """The reporting half of a training run (``train.TrainingRun``)."""

    # The run's state, which ``train.TrainingRun`` sets (its constructor and ``_setup``)
    config: dict
    checkpoint: dict | None
    private: bool
    epoch: int
    device: torch.device
    data: ImageData
    model: nn.Module
    notes: list[str]
    fixed: bool
    num_params: int
    sample_rate: float
    steps_per_epoch: int
    total_steps: int
    planned_steps: int
    max_batch_size: int | None
    cyclic_groups: int | None
    engine: PrivacyEngine | None  # None where the run is not private
    history: dict[str, list]

    def _print_header(self) -> None:
        import torch

        c, data = self.config, self.data
        n, shape = len(data.train), "x".join(map(str, data.shape))
        print(f"data: {c['dataset']}, {n} training / {len(data.test_y)} test images of {shape}, "
              f"{data.num_classes} classes")
        count = torch.get_num_threads()
        threads = f" ({count} thread{'s' if count > 1 else ''})" if self.device.type == "cpu" else ""
        print(f"model: {c['model']}, {self.num_params:,} trainable parameters, on {self.device}{threads}")
        for note in self.notes:
            print(f"  note: {note}")
        q = c["batch_size"] / n
        optimizer = ("DP-" if self.private else "") + OPTIMIZERS[c["optimizer"]]
        print(f"training: {optimizer}, lr {c['lr']:g}, {plural(c['epochs'], 'epoch')} x "
              f"{plural(self.steps_per_epoch, 'step')}, "
              + (f"cyclic Poisson sampling over {self.cyclic_groups} groups" if self.cyclic_groups else
                 f"Poisson sampling with rate {q:.4g}") + f" (expected batch {c['batch_size']})"
              + (f", fixed-shape batches of {self.max_batch_size} rows" if self.max_batch_size else "")
              + (f", physical batches of at most {c['physical_batch_size']}" if c["physical_batch_size"] else ""))
        if self.checkpoint is not None:
            print(f"resuming after epoch {self.epoch} (step {self.epoch * self.steps_per_epoch})"
                  + ("; fresh noise from here on, never the checkpoint's stream" if self.private else ""))
        if not self.private:
            print("privacy: none (--non-private: no clipping, no noise)")
            return
        e = self.engine
        assert e is not None  # a private run has its engine
        if c["epsilon"] is not None:
            target = f"target epsilon {c['epsilon']:g} at delta {c['delta']:.3g} -> noise multiplier " \
                     f"{e.noise_multiplier:.4g}"
        else:
            target = f"noise multiplier {e.noise_multiplier:.4g}"
        print(f"privacy: {target} ({c['accountant']} accountant), max grad norm {c['max_grad_norm']:g}, "
              f"clipping {c['clipping_mode']}/{c['clipping_fn']}")
        mechanism = e.config.mechanism
        if mechanism is not None:
            what = (f"{mechanism.strategy.bands} bands, amplified" if c["noise"] == "bandmf"
                    else f"{mechanism.buffers} buffers, sensitivity {mechanism.sensitivity(self.planned_steps):.3g} "
                    "x one step's, not amplified")
            print(f"  correlated noise: {c['noise']} ({what}), optimized for {plural(self.planned_steps, 'step')}; "
                  f"cyclic Poisson sampling over {e.cyclic_groups} group(s), rate {e.sample_rate:.4g} within a group; "
                  f"{mechanism.buffers} model-sized noise buffer(s)")
        if self.max_batch_size:
            extra = self._truncation_delta(self.total_steps)
            print(f"  truncation to {self.max_batch_size} rows: {extra:.3g} of delta {c['delta']:.3g} over "
                  f"{plural(self.total_steps, 'step')} (the chance that a Poisson draw reaches it)")
        if c["epsilon"] is not None and self.total_steps > self.planned_steps:
            warnings.warn(f"training {c['epochs']} epochs goes past the {self.planned_steps} steps the noise was "
                          f"calibrated for: epsilon will exceed the target {c['epsilon']:g}", stacklevel=2)
        decisions = self._layer_decisions()
        ghost = sum(d.norm == "ghost" for d in decisions)
        classes = "" if parse_spec(c["model"])[0] == "builtin" else f" --num-classes {data.num_classes}"
        fix = " --fix" if self.fixed else ""  # plan the model this run trains, not the one as published
        print(f"per-layer norms ({c['clipping_mode']}): {ghost} by ghost norm, {len(decisions) - ghost} "
              f"instantiated, of {len(decisions)} layers (details: dptrain plan --model {c['model']} "
              f"--input-size {' '.join(map(str, data.shape))}{classes}{fix})")

    def _truncation_delta(self, steps: int) -> float | None:
        if self.max_batch_size is None:
            return None
        from .. import accounting

        return accounting.truncation_delta(len(self.data.train), self.sample_rate, self.max_batch_size, steps)

    def _layer_decisions(self) -> list[LayerDecision]:
        from ..core.planning import plan

        example = self.data.preprocess(self.data.test_x[:1].to(self.device))
        return plan(self.model, example, clipping_mode=self.config["clipping_mode"])

    def _report(self, steps: int, wall_time: float, epochs: list[dict] | None = None) -> dict:
        c = self.config
        epochs = self.history["epochs"] if epochs is None else epochs
        last = epochs[-1]
        report = {
            "test_accuracy": last["test_accuracy"],
            "epsilon": last["epsilon"],
            "delta": c["delta"] if self.private else None,
            "noise_multiplier": self.engine.noise_multiplier if self.engine is not None else None,  # (private)
            "steps": steps,
            "clipping_mode": c["clipping_mode"] if self.private else None,
            "noise": c["noise"] if self.private else None,
            "bands": c["bands"],
            "buffers": None if self.engine is None or self.engine.config.mechanism is None
            else self.engine.config.mechanism.buffers,
            "cyclic_groups": self.cyclic_groups or 1,
            "wall_time_s": round(wall_time, 3),
            "private": self.private,
            "target_epsilon": c["epsilon"],
            "accountant": c["accountant"] if self.private else None,
            "max_grad_norm": c["max_grad_norm"] if self.private else None,
            "clipping_fn": c["clipping_fn"] if self.private else None,
            "sample_rate": c["batch_size"] / len(self.data.train),
            "epochs": c["epochs"],
            "batch_size": c["batch_size"],
            "physical_batch_size": c["physical_batch_size"],
            "max_batch_size": self.max_batch_size,
            "truncation_delta": self._truncation_delta(steps) if self.private else None,
            "lr": c["lr"],
            "optimizer": c["optimizer"],
            "model": c["model"],
            "trainable_parameters": self.num_params,
            "dataset": c["dataset"],
            "train_size": len(self.data.train),
            "test_size": len(self.data.test_y),
            "seed": None if c["secure_rng"] else c["seed"],
            "device": str(self.device),
            "history": epochs,
        }
        return report


def print_summary(report: dict) -> None:
    print(f"test accuracy: {report['test_accuracy']:.4f} ({report['test_size']} test images)")
    if report["private"]:
        print(f"privacy spent: epsilon = {report['epsilon']:.3f} at delta = {report['delta']:.3g} "
              f"({report['accountant']} accountant)")
        print(f"noise multiplier: {report['noise_multiplier']:.4g}, steps: {report['steps']}, "
              f"sample rate: {report['sample_rate']:.4g}")
    else:
        print(f"privacy: none (non-private run), steps: {report['steps']}")
    print(f"wall time: {report['wall_time_s']:.1f} s")


def plot_run(history: dict, report: dict, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend, works without a display

    fig = Figure(figsize=(11, 4), layout="constrained")
    loss_ax, eps_ax = fig.subplots(1, 2)
    if history["step_loss"]:
        steps, losses = zip(*history["step_loss"])
        loss_ax.plot(steps, losses, color="tab:blue", alpha=0.6, linewidth=1, label="training loss (batch)")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("training loss", color="tab:blue")
    acc_ax = loss_ax.twinx()
    epoch_steps = [0] + [e["step"] for e in history["epochs"]]
    acc_ax.plot(epoch_steps[1:], [e["test_accuracy"] for e in history["epochs"]], "o-", color="tab:orange",
                label="test accuracy")
    acc_ax.set_ylabel("test accuracy", color="tab:orange")
    acc_ax.set_ylim(0, 1)
    loss_ax.set_title(f"{report['model']} on {report['dataset']}")
    if report["private"]:
        eps_ax.plot(epoch_steps, [0.0] + [e["epsilon"] for e in history["epochs"]], "o-", color="tab:red")
        if report["target_epsilon"] is not None:
            eps_ax.axhline(report["target_epsilon"], color="gray", linestyle="--", label="target")
            eps_ax.legend(loc="lower right")
        eps_ax.set_title(f"privacy spent (delta = {report['delta']:.3g}, {report['accountant']})")
    else:
        eps_ax.text(0.5, 0.5, "non-private run:\nno privacy guarantee", ha="center", va="center",
                    transform=eps_ax.transAxes)
        eps_ax.set_title("privacy spent")
    eps_ax.set_xlabel("step")
    eps_ax.set_ylabel("epsilon")
    fig.savefig(path, dpi=100)
