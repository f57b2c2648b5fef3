"""``dptrain train``: private training of an image classifier, with checkpoints, a report and a plot."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ..models.specs import parse_image_spec
from .datasets import load_dataset
from .options import (
    CHECKPOINT_NAME,
    OPTIMIZERS,
    PLOT_NAME,
    REPORT_NAME,
    RESUME_MAY_CHANGE,
    SMALL_MODEL_PARAMETERS,
    TRAIN_DEFAULTS,
)
from .output import CLIError, one_line, plural
from .train_report import TrainingReport, plot_run, print_summary

if TYPE_CHECKING:
    import torch


def _resolve_device(spec: str) -> torch.device:
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise CLIError(f"unknown device {spec!r}; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {spec}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise CLIError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _checkpoint_path(resume: str) -> Path:
    path = Path(resume)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise CLIError(f"no checkpoint at {str(path)!r}; --resume takes a {CHECKPOINT_NAME} or the --output "
                       "folder of an earlier run")
    return path


def _readable_reason(err: BaseException, path: Path) -> str:
    """Why torch.load failed, in words, or "" where its message is a bare detail (a pickle's opcode, a key)."""
    if path.stat().st_size == 0:
        return "the file is empty"
    text = re.sub(r"\x1b\[[0-9;]*m", "", one_line(err))  # torch's messages may carry terminal colours
    first = re.split(r"(?<=[a-z])\. ", text)[0].rstrip(".")  # the first sentence: torch adds paragraphs of advice
    return first if re.search(r"[A-Za-z]{2,}\W+[A-Za-z]{2,}", first) else ""


def _check_output(output: str | None, resumed_from: Path | None) -> None:
    """Before any work: --output is a folder, or a path where one can be made, and holds no other run (whose
    checkpoint this run would overwrite): only the run resumed from its own checkpoint there continues in it."""
    if not output:
        return
    folder = Path(output)
    for path in (folder, *folder.parents):
        if path.exists() and not path.is_dir():
            where = "" if path == folder else f"{str(path)!r} in it "
            raise CLIError(f"--output {output!r}: {where}is a file, not a folder; choose a folder (it is created if "
                           "missing)")
    checkpoint, report = folder / CHECKPOINT_NAME, folder / REPORT_NAME
    if checkpoint.exists():
        if resumed_from is not None and resumed_from.resolve() == checkpoint.resolve():
            return
        raise CLIError(f"--output {output!r} holds an earlier run ({checkpoint}); continue it with --resume "
                       f"{checkpoint}, choose another --output, or remove it")
    if report.exists():
        raise CLIError(f"--output {output!r} holds an earlier run ({report}); choose another --output, or remove it")


def _train_config(args: argparse.Namespace) -> tuple[dict, dict | None]:
    """The run's configuration (defaults < checkpoint < command line) and the checkpoint, if resuming."""
    import torch

    given = {k: v for k, v in vars(args).items() if k != "command"}
    checkpoint = path = None
    config = dict(TRAIN_DEFAULTS)
    if "resume" in given:
        path = _checkpoint_path(given["resume"])
        expects = f"--resume takes the {CHECKPOINT_NAME} of a dptrain train --output folder, or that folder"
        try:
            with warnings.catch_warnings():  # torch's remark on a foreign pickle's protocol, before it fails
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                # weights_only: a checkpoint is plain data, and loading it must not run pickled code.
                checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # a truncated or foreign file: say which, not a pickle traceback
            reason = _readable_reason(err, path)
            raise CLIError(f"{str(path)!r} is not a dptrain checkpoint (torch.load could not read it); {expects}"
                           + (f" ({reason})" if reason else "")) from None
        if not isinstance(checkpoint, dict) or checkpoint.get("format") != "dptrain-train-checkpoint":
            raise CLIError(f"{str(path)!r} is not a dptrain train checkpoint; {expects}")
        config.update(checkpoint["config"])
        for key, value in given.items():
            if key not in RESUME_MAY_CHANGE and value != config[key]:
                option = "--" + key.replace("_", "-")
                raise CLIError(
                    f"{option} differs from the checkpoint's ({config[key]!r}); a resumed run keeps its "
                    f"configuration (only --epochs, --device, --threads, --data-dir and --output may change)"
                )
        given.setdefault("output", str(path.parent))
        if given.get("epochs", config["epochs"]) <= checkpoint["epoch"]:
            raise CLIError(
                f"the checkpoint has already trained {checkpoint['epoch']} of {config['epochs']} epochs; "
                f"pass --epochs N with N > {checkpoint['epoch']} to train further"
            )
    if given.get("non_private") and "delta" in given:
        raise CLIError("--delta has no meaning with --non-private")
    config.update({k: v for k, v in given.items() if k != "resume"})
    _check_output(config.get("output"), path)
    if config["non_private"] or config["noise_multiplier"] is not None:
        config["epsilon"] = None  # no target: the run's epsilon is reported, not aimed at
    return config, checkpoint


def run(args: argparse.Namespace) -> int:
    if hasattr(args, "model"):  # before torch: a misspelt model answers at once
        parse_image_spec(args.model)
    import torch

    config, checkpoint = _train_config(args)
    if not config["non_private"] and config["noise_multiplier"] == 0:
        print("dptrain train: warning: --noise-multiplier 0 adds no noise: the run has no privacy guarantee "
              "(epsilon is infinite)", file=sys.stderr)
    run = TrainingRun(config, checkpoint)
    threads = torch.get_num_threads()
    try:
        report = run.train()
    except KeyboardInterrupt:
        saved = run.saved_epoch if run.output else 0
        written = run.write_finished_epochs()
        shown = f"{REPORT_NAME} and {PLOT_NAME} in {run.output} show" if run.plotted \
            else f"{REPORT_NAME} in {run.output} shows"
        hint = (f"; {shown} the finished epochs" if written else "")
        hint += (f"; continue from the checkpoint ({plural(saved, 'epoch')} done) with: dptrain train --resume "
                 f"{run.output}" if saved else "")
        print(f"\ndptrain train: interrupted{hint}", file=sys.stderr)
        return 130
    finally:
        torch.set_num_threads(threads)  # the run may have changed it; main() can be called in-process
    print_summary(report)
    return 0


class TrainingRun(TrainingReport):
    """One `dptrain train` run: data, model, optimizer, engine, loop, checkpoints and report."""

    def __init__(self, config: dict, checkpoint: dict | None):
        self.config = config
        self.checkpoint = checkpoint
        self.output = Path(config["output"]) if config.get("output") else None
        self.private = not config["non_private"]
        self.epoch = checkpoint["epoch"] if checkpoint else 0  # epochs whose steps have run
        self.saved_epoch = self.epoch  # epochs in the checkpoint on disk, what --resume continues from
        self.plotted = True  # (False where the plot was skipped: no matplotlib)

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        import torch

        from ..models.build import build_image_model
        from ..models.validation import find_problems

        c = self.config
        self.device = _resolve_device(c["device"])
        self.data = load_dataset(c["dataset"], c["data_dir"])
        n = len(self.data.train)
        if self.private and c["delta"] is None:  # resolved once: the checkpoint keeps the value
            from .. import accounting

            c["delta"] = accounting.default_delta(n)
        if c["batch_size"] > n:
            raise CLIError(f"--batch-size {c['batch_size']} is larger than the {n} training examples of "
                           f"{c['dataset']}")
        torch.manual_seed(c["seed"])
        channels, height, _ = self.data.shape
        built = build_image_model(c["model"], channels, self.data.num_classes, height)
        self.model = built.model.to(self.device)
        self.notes, self.fixed = list(built.notes), built.fixed
        self._check_forward()
        problems = find_problems(self.model) if self.private else []
        if problems:
            raise CLIError(f"model {c['model']} cannot be trained privately: " + "; ".join(problems))
        self.num_params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        if c["threads"] is not None:
            torch.set_num_threads(c["threads"])
        elif self.device.type == "cpu" and self.num_params < SMALL_MODEL_PARAMETERS:
            torch.set_num_threads(1)

        generator = None if c["secure_rng"] else torch.Generator().manual_seed(c["seed"])
        from .. import accounting
        from ..data import poisson_loader  # local: keeps `dptrain plan` / `epsilon` light to start

        self.sample_rate = c["batch_size"] / n
        self.steps_per_epoch = max(1, round(1.0 / self.sample_rate))  # as the loader runs an epoch
        self.total_steps = c["epochs"] * self.steps_per_epoch
        # The noise was calibrated for the first run's length; a resumed run may go further.
        self.planned_steps = self.checkpoint["planned_steps"] if self.checkpoint else self.total_steps
        # Fixed-shape batches: K is resolved once (auto: for the planned steps) and kept by a resumed run.
        self.max_batch_size = c["max_batch_size"]
        if self.checkpoint is not None:
            self.max_batch_size = self.checkpoint.get("max_batch_size")
        elif self.max_batch_size == "auto":
            self.max_batch_size = accounting.default_max_batch_size(n, self.sample_rate, c["delta"],
                                                                    self.planned_steps)
        self.noise_args = self._noise_args()
        self.loader = poisson_loader(self.data.train, batch_size=c["batch_size"], generator=generator,
                                     max_batch_size=self.max_batch_size, cyclic_groups=self.cyclic_groups)
        assert len(self.loader) == self.steps_per_epoch
        if self.private and self.max_batch_size is not None:
            try:
                self._poisson_delta(self.total_steps)  # truncation must leave some delta to the accountant
            except ValueError as err:
                raise CLIError(f"--max-batch-size {self.max_batch_size}: {err}") from None

        optimizer_cls = getattr(torch.optim, OPTIMIZERS[c["optimizer"]])
        self.optimizer = optimizer_cls(self.model.parameters(), lr=c["lr"])
        self.engine = None
        if self.private:
            from ..engine import PrivacyEngine

            # correlated noise: its strategy is built for the planned steps, whatever sets the noise
            length = {"steps": self.planned_steps} if c["noise"] != "gaussian" else {}
            if self.checkpoint is not None:
                privacy = {"noise_multiplier": self.checkpoint["engine"]["noise_multiplier"], **length}
            elif c["noise_multiplier"] is not None:
                privacy = {"noise_multiplier": c["noise_multiplier"], **length}
            else:
                # Calibrate for the steps the loader really runs (round(1/q) per epoch), so the
                # final epsilon meets the target exactly rather than for an approximate step count.
                # With fixed-shape batches the engine calibrates at the delta that truncation leaves.
                privacy = {"target_epsilon": c["epsilon"], "target_delta": c["delta"], "steps": self.total_steps}
            self.engine = PrivacyEngine(
                self.model, batch_size=c["batch_size"], sample_size=n, max_grad_norm=c["max_grad_norm"],
                clipping_mode=c["clipping_mode"], clipping_fn=c["clipping_fn"], accountant=c["accountant"],
                secure_rng=c["secure_rng"], seed=None if c["secure_rng"] else c["seed"],
                max_batch_size=self.max_batch_size, **self.noise_args, **privacy,
            )
            self.engine.attach(self.optimizer, data_loader=self.loader)

        self.history: dict[str, list] = {"step_loss": [], "epochs": []}
        self.previous_wall_time = 0.0
        if self.checkpoint is not None:
            self._restore(self.checkpoint)

    def _noise_args(self) -> dict:
        """--noise, --bands, --buffers, --cyclic-groups as the engine's arguments (checked by it); sets
        ``self.cyclic_groups``, what the loader samples with."""
        c = self.config
        if c["noise"] == "gaussian" and any(c[k] is not None for k in ("bands", "buffers", "cyclic_groups")):
            raise CLIError("--bands, --buffers and --cyclic-groups are for correlated noise (--noise bandmf or blt)")
        if c["noise"] != "gaussian" and c["non_private"]:
            raise CLIError(f"--noise {c['noise']} has no meaning with --non-private")
        if c["noise"] == "bandmf" and c["bands"] is None:
            raise CLIError("--noise bandmf needs --bands B (the bands of the strategy, and of the cyclic groups)")
        if c["noise"] != "bandmf" and c["bands"] is not None:
            raise CLIError("--bands is for --noise bandmf")
        if c["noise"] != "blt" and c["buffers"] is not None:
            raise CLIError("--buffers is for --noise blt")
        if c["bands"] == "auto":  # chosen once, for the planned run; a resumed run keeps the number
            if c["epsilon"] is None:
                raise CLIError("--bands auto chooses the bands for a target: give --epsilon, not --noise-multiplier")
            if c["cyclic_groups"] is not None:
                raise CLIError("--bands auto chooses the cyclic groups too: leave --cyclic-groups out")
            from ..correlated.resolve import choose_bands

            c["bands"] = choose_bands(self.planned_steps, c["batch_size"], len(self.data.train), c["epsilon"],
                                      c["delta"])
            self.notes.append(f"--bands auto: {c['bands']} band(s) have the least expected error at epsilon "
                              f"{c['epsilon']:g}" + (" (1 band: DP-SGD)" if c["bands"] == 1 else ""))
        groups = c["cyclic_groups"] or (c["bands"] if c["noise"] == "bandmf" else 1)
        self.cyclic_groups = groups if groups > 1 else None
        if groups * c["batch_size"] > len(self.data.train):
            raise CLIError(f"--batch-size {c['batch_size']} with {groups} cyclic groups needs batch size x groups <= "
                           f"{len(self.data.train)} training examples (each group supplies a whole batch at its steps)")
        if c["noise"] == "gaussian":
            return {}
        args = {"noise": c["noise"], "cyclic_groups": groups}
        return {**args, "bands": c["bands"]} if c["noise"] == "bandmf" else {**args, "buffers": c["buffers"]}

    def _poisson_delta(self, steps: int) -> float:
        """The delta at which the accountant's epsilon holds at --delta for ``steps`` steps: all of it,
        less the truncation term with --max-batch-size (dptrain.accounting.poisson_delta)."""
        from .. import accounting

        return accounting.poisson_delta(self.config["delta"], len(self.data.train), self.sample_rate,
                                        self.max_batch_size, steps)

    def _epsilon(self) -> float:
        """Epsilon spent so far, at --delta (the engine includes the truncation term of fixed-shape batches)."""
        assert self.engine is not None  # (private runs only)
        return self.engine.get_epsilon(self.config["delta"])

    def _check_forward(self) -> None:
        """One test image through the model: a model that cannot take this image size is one line."""
        import torch

        was_training = self.model.training
        try:
            with torch.no_grad():
                self.model.eval()(self.data.preprocess(self.data.test_x[:1].to(self.device)))
        except (RuntimeError, ValueError, AssertionError, IndexError) as err:
            shape = "x".join(map(str, self.data.shape))
            raise CLIError(f"model {self.config['model']} cannot take the {shape} images of {self.config['dataset']}: "
                           f"{one_line(err)}") from None
        finally:
            self.model.train(was_training)

    def _restore(self, ckpt: dict) -> None:
        import torch

        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.loader.load_state_dict(ckpt["loader"])
        if self.engine is not None:
            self.engine.load_state_dict(ckpt["engine"])
        torch.set_rng_state(ckpt["torch_rng"])
        self.history = ckpt["history"]
        self.previous_wall_time = ckpt["wall_time_s"]

    def _save_checkpoint(self, wall_time: float) -> None:
        import torch

        state = {
            "format": "dptrain-train-checkpoint",
            "config": {k: v for k, v in self.config.items() if k not in ("output", "resume")},
            "epoch": self.epoch,
            "planned_steps": self.planned_steps,
            "max_batch_size": self.max_batch_size,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "loader": self.loader.state_dict(),
            "engine": self.engine.state_dict() if self.engine is not None else None,
            "torch_rng": torch.get_rng_state(),
            "history": self.history,
            "wall_time_s": wall_time,
        }
        assert self.output is not None  # (saved only where the run has an output directory)
        partial = self.output / (CHECKPOINT_NAME + ".partial")
        torch.save(state, partial)
        os.replace(partial, self.output / CHECKPOINT_NAME)  # never leave a half-written checkpoint

    # ------------------------------------------------------------------ loop
    def train(self) -> dict:
        started = self.started = time.perf_counter()  # wall time counts the setup (data, model, calibration) too
        self._setup()
        if self.output is not None:
            self.output.mkdir(parents=True, exist_ok=True)
        self._print_header()
        c = self.config
        step = self.epoch * self.steps_per_epoch
        epsilon = self.history["epochs"][-1]["epsilon"] if self.history["epochs"] else 0.0
        from tqdm import tqdm

        from ..data import split_batches

        while self.epoch < c["epochs"]:
            self.model.train()
            bar = tqdm(total=self.steps_per_epoch, desc=f"epoch {self.epoch + 1}/{c['epochs']}", unit="step",
                       leave=True, file=sys.stderr, dynamic_ncols=True)
            try:
                epoch_started, seen, loss_sum = time.perf_counter(), 0, 0.0
                if c["physical_batch_size"]:
                    logical_batches = split_batches(self.loader, c["physical_batch_size"])
                else:
                    logical_batches = ([batch] for batch in self.loader)
                for logical in logical_batches:
                    size, batch_loss = self._step(logical)
                    step += 1
                    seen += size
                    if size:
                        self.history["step_loss"].append((step, batch_loss))
                        loss_sum += batch_loss * size
                    postfix = {"loss": f"{loss_sum / max(seen, 1):.3f}"}
                    if self.private:
                        postfix["eps"] = f"{epsilon:.2f}"  # as of the last epoch's end: see below
                    postfix["img/s"] = f"{seen / max(time.perf_counter() - epoch_started, 1e-9):.0f}"
                    bar.set_postfix(postfix, refresh=False)
                    bar.update(1)
                self.epoch += 1
                # Epsilon once per epoch: an exact accountant costs ~0.1-0.5 s per evaluation.
                epsilon = self._epsilon() if self.private else None
                accuracy = self.evaluate()
                if self.private:
                    postfix["eps"] = f"{epsilon:.2f}"
                bar.set_postfix({**postfix, "test acc": f"{accuracy:.3f}"})
            finally:
                bar.close()
            self.history["epochs"].append({
                "epoch": self.epoch, "step": step, "train_loss": loss_sum / max(seen, 1),
                "test_accuracy": accuracy, "epsilon": epsilon,
            })
            if self.output is not None:
                self._save_checkpoint(self.previous_wall_time + time.perf_counter() - started)
                self.saved_epoch = self.epoch
        wall_time = self.previous_wall_time + time.perf_counter() - started
        report = self._report(step, wall_time)
        if self.output is not None:
            (self.output / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
            self._plot(self.history, report)
        return report

    def _plot(self, history: dict, report: dict) -> bool:
        """The plot, written after the report and checkpoint: without matplotlib a warning, not a failed run;
        True if written."""
        assert self.output is not None
        try:
            plot_run(history, report, self.output / PLOT_NAME)
        except ImportError as err:
            if (err.name or "").partition(".")[0] != "matplotlib":
                raise
            print(f"dptrain train: warning: {PLOT_NAME} skipped: it needs matplotlib (pip install 'dptrain[cli]'); "
                  f"{REPORT_NAME} and {CHECKPOINT_NAME} are written in {self.output}", file=sys.stderr)
            return False
        return True

    def write_finished_epochs(self) -> bool:
        """After an interruption: the report and plot of the epochs in the checkpoint (what --resume
        continues from); True if written."""
        history = getattr(self, "history", None)
        if self.output is None or not history or not self.output.is_dir():
            return False
        epochs = [e for e in history["epochs"] if e["epoch"] <= self.saved_epoch]
        if not epochs:
            return False
        last_step = epochs[-1]["step"]
        report = self._report(last_step, self.previous_wall_time + time.perf_counter() - self.started, epochs)
        report.update(interrupted=True, finished_epochs=epochs[-1]["epoch"])
        (self.output / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
        finished = {"step_loss": [sl for sl in history["step_loss"] if sl[0] <= last_step], "epochs": epochs}
        self.plotted = self._plot(finished, report)
        return True

    def _step(self, logical: list) -> tuple[int, float]:
        """One optimizer step on a logical batch (a list of physical batches); (batch size, mean loss)."""
        import torch
        import torch.nn.functional as F

        from ..data import masked_losses

        if self.max_batch_size is None:  # batches of varying size, every row real
            logical = [((x, y), torch.ones(len(y), dtype=torch.bool)) for x, y in logical]
        size = sum(int(mask.sum()) for _, mask in logical)
        loss_total = 0.0
        for (x, y), mask in logical:
            x, y = self.data.preprocess(x.to(self.device)), y.to(self.device)
            losses = F.cross_entropy(self.model(x), y, reduction="none")
            padded = self.max_batch_size is not None  # padded rows count as a loss of exactly 0: they add nothing
            loss_total += float(masked_losses(losses, mask).detach().sum() if padded else losses.detach().sum())
            if self.private:  # (an empty batch still gets its noise at the step)
                assert self.engine is not None
                self.engine.backward(losses, mask=mask if padded else None)
            elif size:
                (masked_losses(losses, mask).sum() / size).backward()
        if self.private or size:  # DP steps on empty batches too: Poisson sampling's analysis counts them
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return size, loss_total / max(size, 1)

    def evaluate(self) -> float:
        import torch

        self.model.eval()
        correct = 0
        for start in range(0, len(self.data.test_y), 1024):
            x = self.data.preprocess(self.data.test_x[start:start + 1024].to(self.device))
            y = self.data.test_y[start:start + 1024].to(self.device)
            with torch.no_grad():
                correct += int((self.model(x).argmax(1) == y).sum())
        self.model.train()
        return correct / len(self.data.test_y)
