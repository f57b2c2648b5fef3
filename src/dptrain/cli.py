"""The ``dptrain`` command: ``train`` (private training), ``plan`` (per-layer decisions), ``epsilon``.

``main(argv)`` returns the exit status, so everything here can be run in-process by tests.
An invalid value ends the command with one line on stderr and a non-zero status, never a
traceback; an exception that is not a user error (a bug) still shows its traceback.

torch and the parts of the library built on it are imported inside the functions that use
them: ``dptrain --help`` and a usage error answer at once, without loading torch.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import accounting  # light: dp_accounting is imported when an accountant first runs
from .algorithms import CLIPPING_MODES
from .model_specs import parse_image_spec, parse_spec

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .planning import LayerDecision


class CLIError(Exception):
    """A user error: printed as one line, exit status 1."""


# ====================================================================== argument parsing


class _Parser(argparse.ArgumentParser):
    """argparse prints the whole usage before an error; one line with a pointer to --help is enough."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _OtherCommandsOption(argparse.Action):
    """An option that belongs to another subcommand: the error names the one meant here."""

    def __init__(self, option_strings, dest, hint: str, **kwargs):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not an option of {parser.prog}; {self.hint}")


def _number(kind: Callable[[str], Any], check: Callable[[Any], bool], requirement: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value

    return parse


positive_float = _number(float, lambda v: v > 0 and math.isfinite(v), "a positive number")
non_negative_float = _number(float, lambda v: v >= 0 and math.isfinite(v), "a number >= 0")
positive_int = _number(int, lambda v: v > 0, "a positive integer")
probability = _number(float, lambda v: 0 < v < 1, "a number in (0, 1)")
sample_rate_type = _number(float, lambda v: 0 < v <= 1, "a sample rate in (0, 1]")


# Defaults of `dptrain train`, tuned on digits at epsilon = 3 (over seeds 0-2: 93-95 % test
# accuracy; 30 epochs or batch 512 are no better) in well under a minute on two CPU cores.
TRAIN_DEFAULTS: dict[str, Any] = {
    "epsilon": 3.0,
    "noise_multiplier": None,
    "delta": 1e-5,
    "epochs": 15,
    "batch_size": 256,
    "physical_batch_size": None,
    "max_grad_norm": 1.0,
    "lr": 1e-2,
    "optimizer": "adam",
    "clipping_mode": "bk-mixopt",
    "clipping_fn": "abadi",
    "accountant": "pld",
    "model": "cnn",
    "dataset": "digits",
    "data_dir": "data",
    "device": "auto",
    "threads": None,
    "seed": 0,
    "secure_rng": False,
    "non_private": False,
}
# What a resumed run may change; everything else comes from the checkpoint, since changing
# it mid-run would make the model, the data order or the privacy accounting inconsistent.
RESUME_MAY_CHANGE = ("epochs", "device", "threads", "data_dir", "output", "resume")
# Below this size a CPU step is many tiny operations, where handing work between threads
# costs more than it saves (and stalls badly on a busy machine): one thread is faster.
SMALL_MODEL_PARAMETERS = 1_000_000
# Choices the parser needs before torch is imported; tests/test_startup.py checks that they are the
# library's own (dptrain.clipping.CLIPPING_FNS, dptrain.planning.DECISION_RULES).
CLIPPING_FNS = ("abadi", "automatic", "global")
DECISION_RULES = ("memory", "space", "time")
OPTIMIZERS = {"adam": "Adam", "sgd": "SGD"}  # --optimizer -> the torch.optim class
IMAGE_MODELS_HELP = ("cnn, mlp, torchvision:NAME or timm:NAME (random weights; a model with a fixed input "
                     "size is built for the dataset's)")
PLAN_MODELS_HELP = "cnn, mlp, torchvision:NAME or timm:NAME (with --input-size), or hf:NAME (with --seq-len)"
CHECKPOINT_NAME = "checkpoint.pt"
REPORT_NAME = "report.json"
PLOT_NAME = "training.png"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dptrain",
        description="Differentially private training for PyTorch: train, plan a run, compute epsilon.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="train a model with DP (default: a small CNN on scikit-learn's digits at epsilon 3)",
        description="Train an image classifier with DP-Adam (or DP-SGD), Poisson sampling and per-sample "
        "clipping. Without arguments: a small CNN on scikit-learn's digits at epsilon = 3, delta = 1e-5.",
        argument_default=argparse.SUPPRESS,  # absent options fall back to TRAIN_DEFAULTS or the checkpoint
    )
    d = TRAIN_DEFAULTS
    privacy = train.add_mutually_exclusive_group()
    privacy.add_argument("--epsilon", type=positive_float, help=f"target epsilon (default {d['epsilon']:g})")
    privacy.add_argument("--noise-multiplier", type=non_negative_float,
                         help="fixed noise multiplier sigma instead of a target epsilon")
    privacy.add_argument("--non-private", action="store_true",
                         help="the same run without DP (no clipping, no noise), for comparison")
    train.add_argument("--target-epsilon", "--sigma", action=_OtherCommandsOption, dest="other_commands_option",
                       hint="here the target is --epsilon E and a fixed noise is --noise-multiplier S")
    train.add_argument("--delta", type=probability, help=f"target delta (default {d['delta']:g})")
    train.add_argument("--epochs", type=positive_int, help=f"passes over the data (default {d['epochs']})")
    train.add_argument("--batch-size", type=positive_int,
                       help=f"expected logical batch size; sample rate = batch size / dataset size (default "
                       f"{d['batch_size']})")
    train.add_argument("--physical-batch-size", type=positive_int,
                       help="largest batch sent through the model at once (memory); the optimizer still "
                       "steps once per logical batch (default: the whole logical batch)")
    train.add_argument("--max-grad-norm", type=positive_float,
                       help=f"per-sample clipping threshold R (default {d['max_grad_norm']:g})")
    train.add_argument("--lr", type=positive_float, help=f"learning rate (default {d['lr']:g})")
    train.add_argument("--optimizer", choices=tuple(OPTIMIZERS), help=f"(default {d['optimizer']})")
    train.add_argument("--clipping-mode", choices=CLIPPING_MODES, help=f"(default {d['clipping_mode']})")
    train.add_argument("--clipping-fn", choices=CLIPPING_FNS, help=f"(default {d['clipping_fn']})")
    train.add_argument("--accountant", choices=accounting.ACCOUNTANTS, help=f"(default {d['accountant']})")
    train.add_argument("--model", help=f"{IMAGE_MODELS_HELP} (default {d['model']})")
    train.add_argument("--dataset", choices=DATASETS,
                       help=f"(default {d['dataset']}); all but digits are read from --data-dir, never "
                       "downloaded")
    train.add_argument("--data-dir", help=f"folder of torchvision datasets (default ./{d['data_dir']})")
    train.add_argument("--device", help="cpu, cuda, cuda:N, ... (default: cuda if available, else cpu)")
    train.add_argument("--threads", type=positive_int,
                       help=f"CPU threads for torch (default: 1 for models under {SMALL_MODEL_PARAMETERS:,} "
                       "parameters on the CPU, else torch's default)")
    train.add_argument("--seed", type=int, help=f"seed of the model, the batches and the noise (default {d['seed']})")
    train.add_argument("--secure-rng", action="store_true",
                       help="draw the batches and the noise from OS entropy (for real deployments; not "
                       "reproducible)")
    train.add_argument("--output", help=f"folder for {REPORT_NAME}, {PLOT_NAME} and a {CHECKPOINT_NAME} "
                       "written after every epoch")
    train.add_argument("--resume", metavar="CHECKPOINT",
                       help=f"continue from a {CHECKPOINT_NAME} (or the --output folder holding it); "
                       "--epochs sets the new total")
    train.set_defaults(handler=_cmd_train)

    plan_cmd = commands.add_parser(
        "plan",
        help="show what each clipping mode does per layer, and its memory cost",
        description="Per trainable layer: T (positions), p (outputs), d (inputs), the per-sample space of the "
        "ghost norm (2T^2) and of instantiating the gradient (p*d), and the primitive --clipping-mode picks.",
    )
    plan_cmd.add_argument("--model", default="cnn", help=f"{PLAN_MODELS_HELP} (default cnn)")
    shape = plan_cmd.add_mutually_exclusive_group()
    shape.add_argument("--input-size", type=positive_int, nargs=3, metavar=("C", "H", "W"),
                       help="image input size (default: 1 8 8 for the built-in models, 3 224 224 otherwise)")
    shape.add_argument("--seq-len", type=positive_int, help="sequence length T for hf: models (default 128)")
    plan_cmd.add_argument("--num-classes", type=positive_int, default=None,
                          help="classifier outputs (default: 10 for the built-in models, the model's own otherwise)")
    plan_cmd.add_argument("--clipping-mode", choices=CLIPPING_MODES, default="bk-mixopt", help="(default bk-mixopt)")
    plan_cmd.add_argument("--decision-rule", choices=DECISION_RULES, default="memory",
                          help="how the mixed modes choose: by memory (space, plus what BK-MixOpt keeps alive), "
                          "space (2T^2 < p*d) or time (default memory, as the engine)")
    plan_cmd.add_argument("--fix", action="store_true",
                          help="plan the model as dptrain train trains it, after dptrain.fix (BatchNorm -> GroupNorm, "
                          "torch RNN/attention -> dptrain.nn); without it, the model as published")
    plan_cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan_cmd.set_defaults(handler=_cmd_plan)

    eps = commands.add_parser(
        "epsilon",
        help="epsilon of a run, or the noise multiplier needed for a target epsilon",
        description="With --sigma: epsilon for each accountant. With --target-epsilon: the noise multiplier "
        "needed. Give the sample rate as --sample-rate or --batch-size with --sample-size, and the length as "
        "--steps or --epochs.",
    )
    what = eps.add_mutually_exclusive_group(required=True)
    what.add_argument("--sigma", "--noise-multiplier", dest="sigma", type=non_negative_float,
                      help="noise multiplier: print epsilon")
    what.add_argument("--target-epsilon", type=positive_float, help="print the noise multiplier needed")
    eps.add_argument("--epsilon", action=_OtherCommandsOption, dest="other_commands_option",
                     hint="here it is --target-epsilon E (the noise multiplier needed), or --sigma S (the epsilon "
                     "of a run)")
    eps.add_argument("--sample-rate", type=sample_rate_type, help="Poisson sample rate q")
    eps.add_argument("--batch-size", type=positive_int, help="expected batch size (with --sample-size)")
    eps.add_argument("--sample-size", type=positive_int, help="dataset size")
    eps.add_argument("--steps", type=positive_int, help="number of steps")
    eps.add_argument("--epochs", type=positive_float, help="epochs of round(1/q) steps each, as dptrain train runs")
    eps.add_argument("--delta", type=probability,
                     help=f"delta (default {TRAIN_DEFAULTS['delta']:g}, as dptrain train)")
    eps.add_argument("--accountant", choices=accounting.ACCOUNTANTS, action="append",
                     help="only this accountant (repeatable; default: all)")
    eps.set_defaults(handler=_cmd_epsilon)

    # Defaults live in dptrain.audit.AUDIT_DEFAULTS (absent options fall back to them); the help
    # repeats them so that `dptrain --help` need not import torch (tests/test_audit.py checks both agree).
    audit = commands.add_parser(
        "audit",
        help="check the privacy promise empirically: a lower bound on epsilon from one training run",
        description="Train the digits CNN privately with gradient canaries, each in the training set with "
        "probability 1/2, guess from the noisy gradients which were in, and turn the right guesses into a "
        "lower bound on epsilon (Steinke, Nasr & Jagielski 2023). An honest run gives a bound below the "
        "accountant's epsilon; see docs/audit.md.",
        argument_default=argparse.SUPPRESS,
    )
    audit.add_argument("--epsilon", type=positive_float, help="the accountant's target epsilon (default 2)")
    audit.add_argument("--delta", type=probability, help="delta (default 1e-05)")
    audit.add_argument("--canaries", type=positive_int, help="gradient canaries (default 10000)")
    audit.add_argument("--steps", type=positive_int, help="training steps (default 10)")
    audit.add_argument("--sample-rate", type=sample_rate_type,
                       help="Poisson sample rate over real samples and all canaries (default 0.5)")
    audit.add_argument("--clipping-mode", choices=CLIPPING_MODES, help="(default bk-mixopt)")
    audit.add_argument("--confidence", type=probability, help="confidence of the lower bound (default 0.95)")
    audit.add_argument("--noise-scale", type=non_negative_float,
                       help="draw this multiple of the accounted noise: a deliberately broken run, only to show "
                       "that the audit catches it (default 1)")
    audit.add_argument("--seed", type=int, help="seed of the coins, batches and noise (default: fresh entropy)")
    audit.add_argument("--json", action="store_true", help="print JSON instead of text")
    audit.set_defaults(handler=_cmd_audit)

    # `dptrain bench ...` is handed whole to the checkout's harness, benchmarks/dptrain_bench (dptrain bench --help)
    commands.add_parser("bench", add_help=False,
                        help="time and memory of every clipping mode against non-private training and Opacus")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dptrain`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed on one line
        return exit_.code if isinstance(exit_.code, int) else 1
    if args.command is None:
        parser.print_help()
        return 2
    # dp_accounting logs (through absl) every RDP order it skips; that is noise on a terminal.
    absl_logger = logging.getLogger("absl")
    absl_level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning(args.command)
        try:
            return args.handler(args)
        except (CLIError, ValueError) as err:  # ValueError: the library's validation of a user value
            print(f"dptrain {args.command}: error: {_one_line(err)}", file=sys.stderr)
            return 1
        except BrokenPipeError:  # the reader closed the pipe (`dptrain plan --json | head`): not our error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
            return 141
        finally:
            absl_logger.setLevel(absl_level)  # main() may run in-process: leave the caller's logging as it was


def find_benchmarks() -> Path | None:
    """A checkout's ``benchmarks/`` folder (the harness is not installed with the package): the one next to this
    package's ``src/``, else the current directory's."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / "benchmarks" / "dptrain_bench" / "__init__.py").is_file():
            return root / "benchmarks"
    return None


def _bench(argv: list[str]) -> int:
    """``dptrain bench``: hand the arguments whole to the harness of a checkout (its own options: --help)."""
    folder = find_benchmarks()
    if folder is None:
        print("dptrain bench: error: the benchmark harness is not installed with the package; run it from a clone "
              "of dptrain's repository: `dptrain bench` or `python benchmarks/run.py`", file=sys.stderr)
        return 1
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    from dptrain_bench import main as bench_main

    return bench_main(argv)


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    rest = [line.lstrip("- ") for line in lines[1:]]  # validate() lists problems as "- ..." lines
    return " ".join([lines[0], "; ".join(rest)]) if rest else lines[0]


def _one_line_warning(command: str):
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"dptrain {command}: warning: {_one_line(Exception(str(message)))}", file=sys.stderr)

    return show


# ====================================================================== datasets

DATASETS = ("digits", "mnist", "fashion-mnist", "kmnist", "cifar10", "cifar100", "svhn")

# Fixed, published per-channel statistics: normalising with statistics of the private
# training set would be a data-dependent release that no accountant covers.
_NORMALISATION = {
    "digits": ((0.5,), (0.5,)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "kmnist": ((0.1918,), (0.3483,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}


@dataclass
class ImageData:
    """Images kept in their compact stored form (uint8 for torchvision); scaled per batch on the device."""

    name: str
    train: torch.utils.data.TensorDataset
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    scale: float  # stored value * scale is in [0, 1]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.test_x.shape[1:])

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        mean = torch.tensor(self.mean, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, -1, 1, 1)
        return (x.float() * self.scale - mean) / std


def load_dataset(name: str, data_dir: str) -> ImageData:
    import torch

    mean, std = _NORMALISATION[name]
    if name == "digits":
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)  # [1797, 1, 8, 8], 0..16
        labels = torch.tensor(digits.target, dtype=torch.long)
        # A fixed split, independent of --seed, so runs with different seeds share one test set.
        train_idx, test_idx = train_test_split(
            torch.arange(len(labels)).numpy(), test_size=0.2, random_state=0, stratify=digits.target
        )
        train_idx, test_idx = torch.as_tensor(train_idx), torch.as_tensor(test_idx)
        return ImageData(name, torch.utils.data.TensorDataset(images[train_idx], labels[train_idx]),
                         images[test_idx], labels[test_idx], 10, 1 / 16, mean, std)
    train_x, train_y, num_classes = _read_torchvision(name, data_dir, train=True)
    test_x, test_y, _ = _read_torchvision(name, data_dir, train=False)
    return ImageData(name, torch.utils.data.TensorDataset(train_x, train_y), test_x, test_y, num_classes,
                     1 / 255, mean, std)


def _read_torchvision(name: str, data_dir: str, train: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    import torch

    try:
        import torchvision.datasets as tvd
    except ImportError:
        raise CLIError(f"--dataset {name} needs torchvision: pip install 'dptrain[vision]'") from None
    classes = {"mnist": tvd.MNIST, "fashion-mnist": tvd.FashionMNIST, "kmnist": tvd.KMNIST,
               "cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100, "svhn": tvd.SVHN}
    cls = classes[name]
    root = os.path.expanduser(data_dir)
    try:
        if name == "svhn":
            ds = cls(root, split="train" if train else "test", download=False)
        else:
            ds = cls(root, train=train, download=False)
    except RuntimeError:  # torchvision's "Dataset not found or corrupted"
        raise CLIError(
            f"dataset {name} not found in {root!r} (dptrain never downloads); fetch it once with "
            f"torchvision.datasets.{cls.__name__}({root!r}, download=True) or point --data-dir at it"
        ) from None
    if name == "svhn":
        x, y = torch.as_tensor(ds.data), torch.as_tensor(ds.labels)  # [N, 3, 32, 32]
        num_classes = 10
    elif name in ("cifar10", "cifar100"):
        x, y = torch.as_tensor(ds.data).permute(0, 3, 1, 2).contiguous(), torch.as_tensor(ds.targets)
        num_classes = len(ds.classes)
    else:
        x, y = ds.data.unsqueeze(1), torch.as_tensor(ds.targets)  # [N, 1, 28, 28] uint8
        num_classes = len(ds.classes)
    return x, y.long(), num_classes


# ====================================================================== train


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


def _train_config(args: argparse.Namespace) -> tuple[dict, dict | None]:
    """The run's configuration (defaults < checkpoint < command line) and the checkpoint, if resuming."""
    import torch

    given = {k: v for k, v in vars(args).items() if k not in ("command", "handler")}
    checkpoint = None
    config = dict(TRAIN_DEFAULTS)
    if "resume" in given:
        path = _checkpoint_path(given["resume"])
        try:
            # weights_only: a checkpoint is plain data, and loading it must not run pickled code.
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # a truncated or foreign file: say which, not a pickle traceback
            raise CLIError(f"cannot read the checkpoint {str(path)!r}: {_one_line(err)}") from None
        if not isinstance(checkpoint, dict) or checkpoint.get("format") != "dptrain-train-checkpoint":
            raise CLIError(f"{str(path)!r} is not a dptrain train checkpoint")
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
    if config["non_private"] or config["noise_multiplier"] is not None:
        config["epsilon"] = None  # no target: the run's epsilon is reported, not aimed at
    return config, checkpoint


def _cmd_train(args: argparse.Namespace) -> int:
    if hasattr(args, "model"):  # before torch: a misspelt model answers at once
        parse_image_spec(args.model)
    import torch

    config, checkpoint = _train_config(args)
    run = TrainingRun(config, checkpoint)
    threads = torch.get_num_threads()
    try:
        report = run.train()
    except KeyboardInterrupt:
        saved = run.saved_epoch if run.output else 0
        written = run.write_finished_epochs()
        hint = (f"; {REPORT_NAME} and {PLOT_NAME} in {run.output} show the finished epochs" if written else "")
        hint += (f"; continue from the checkpoint ({_plural(saved, 'epoch')} done) with: dptrain train --resume "
                 f"{run.output}" if saved else "")
        print(f"\ndptrain train: interrupted{hint}", file=sys.stderr)
        return 130
    finally:
        torch.set_num_threads(threads)  # the run may have changed it; main() can be called in-process
    _print_summary(report)
    return 0


class TrainingRun:
    """One `dptrain train` run: data, model, optimizer, engine, loop, checkpoints and report."""

    def __init__(self, config: dict, checkpoint: dict | None):
        self.config = config
        self.checkpoint = checkpoint
        self.output = Path(config["output"]) if config.get("output") else None
        self.private = not config["non_private"]
        self.epoch = checkpoint["epoch"] if checkpoint else 0  # epochs whose steps have run
        self.saved_epoch = self.epoch  # epochs in the checkpoint on disk, what --resume continues from

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        import torch

        from .models import build_image_model
        from .validation import find_problems

        c = self.config
        self.device = _resolve_device(c["device"])
        self.data = load_dataset(c["dataset"], c["data_dir"])
        n = len(self.data.train)
        if c["batch_size"] > n:
            raise CLIError(f"--batch-size {c['batch_size']} is larger than the {n} training examples of "
                           f"{c['dataset']}")
        torch.manual_seed(c["seed"])
        channels, height, _ = self.data.shape
        built = build_image_model(c["model"], channels, self.data.num_classes, height)
        self.model = built.model.to(self.device)
        self.notes, self.fixed = built.notes, built.fixed
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
        from .data import poisson_loader  # local: keeps `dptrain plan` / `epsilon` light to start

        self.loader = poisson_loader(self.data.train, batch_size=c["batch_size"], generator=generator)
        self.steps_per_epoch = len(self.loader)
        self.total_steps = c["epochs"] * self.steps_per_epoch
        # The noise was calibrated for the first run's length; a resumed run may go further.
        self.planned_steps = self.checkpoint["planned_steps"] if self.checkpoint else self.total_steps

        optimizer_cls = getattr(torch.optim, OPTIMIZERS[c["optimizer"]])
        self.optimizer = optimizer_cls(self.model.parameters(), lr=c["lr"])
        self.engine = None
        if self.private:
            from .engine import PrivacyEngine

            if self.checkpoint is not None:
                privacy = {"noise_multiplier": self.checkpoint["engine"]["noise_multiplier"]}
            elif c["noise_multiplier"] is not None:
                privacy = {"noise_multiplier": c["noise_multiplier"]}
            else:
                # Calibrate for the steps the loader really runs (round(1/q) per epoch), so the
                # final epsilon meets the target exactly rather than for an approximate step count.
                privacy = {"target_epsilon": c["epsilon"], "target_delta": c["delta"], "steps": self.total_steps}
            self.engine = PrivacyEngine(
                self.model, batch_size=c["batch_size"], sample_size=n, max_grad_norm=c["max_grad_norm"],
                clipping_mode=c["clipping_mode"], clipping_fn=c["clipping_fn"], accountant=c["accountant"],
                secure_rng=c["secure_rng"], seed=None if c["secure_rng"] else c["seed"], **privacy,
            )
            self.engine.attach(self.optimizer)

        self.history: dict[str, list] = {"step_loss": [], "epochs": []}
        self.previous_wall_time = 0.0
        if self.checkpoint is not None:
            self._restore(self.checkpoint)

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
                           f"{_one_line(err)}") from None
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
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "loader": self.loader.state_dict(),
            "engine": self.engine.state_dict() if self.engine is not None else None,
            "torch_rng": torch.get_rng_state(),
            "history": self.history,
            "wall_time_s": wall_time,
        }
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

        from .data import split_batches

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
                epsilon = self.engine.get_epsilon(c["delta"]) if self.private else None
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
            _plot(self.history, report, self.output / PLOT_NAME)
        return report

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
        _plot(finished, report, self.output / PLOT_NAME)
        return True

    def _step(self, logical: list) -> tuple[int, float]:
        """One optimizer step on a logical batch (a list of physical batches); (batch size, mean loss)."""
        import torch.nn.functional as F

        size = sum(len(y) for _, y in logical)
        loss_total = 0.0
        for x, y in logical:
            x, y = self.data.preprocess(x.to(self.device)), y.to(self.device)
            losses = F.cross_entropy(self.model(x), y, reduction="none")
            loss_total += float(losses.detach().sum())
            if self.private:
                self.engine.backward(losses)  # an empty batch still gets its noise at the step
            elif size:
                (losses.sum() / size).backward()
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

    # ------------------------------------------------------------------ reporting
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
        print(f"training: {optimizer}, lr {c['lr']:g}, {_plural(c['epochs'], 'epoch')} x "
              f"{_plural(self.steps_per_epoch, 'step')}, "
              f"Poisson sampling with rate {q:.4g} (expected batch {c['batch_size']})"
              + (f", physical batches of at most {c['physical_batch_size']}" if c["physical_batch_size"] else ""))
        if self.checkpoint is not None:
            print(f"resuming after epoch {self.epoch} (step {self.epoch * self.steps_per_epoch})")
        if not self.private:
            print("privacy: none (--non-private: no clipping, no noise)")
            return
        e = self.engine
        if c["epsilon"] is not None:
            target = f"target epsilon {c['epsilon']:g} at delta {c['delta']:g} -> noise multiplier " \
                     f"{e.noise_multiplier:.4g}"
        else:
            target = f"noise multiplier {e.noise_multiplier:.4g}"
        print(f"privacy: {target} ({c['accountant']} accountant), max grad norm {c['max_grad_norm']:g}, "
              f"clipping {c['clipping_mode']}/{c['clipping_fn']}")
        if c["epsilon"] is not None and self.total_steps > self.planned_steps:
            warnings.warn(f"training {c['epochs']} epochs goes past the {self.planned_steps} steps the noise was "
                          f"calibrated for: epsilon will exceed the target {c['epsilon']:g}")
        decisions = self._layer_decisions()
        ghost = sum(d.norm == "ghost" for d in decisions)
        classes = "" if parse_spec(c["model"])[0] == "builtin" else f" --num-classes {data.num_classes}"
        fix = " --fix" if self.fixed else ""  # plan the model this run trains, not the one as published
        print(f"per-layer norms ({c['clipping_mode']}): {ghost} by ghost norm, {len(decisions) - ghost} "
              f"instantiated, of {len(decisions)} layers (details: dptrain plan --model {c['model']} "
              f"--input-size {' '.join(map(str, data.shape))}{classes}{fix})")

    def _layer_decisions(self) -> list[LayerDecision]:
        from .planning import plan

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
            "noise_multiplier": self.engine.noise_multiplier if self.private else None,
            "steps": steps,
            "clipping_mode": c["clipping_mode"] if self.private else None,
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


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _print_summary(report: dict) -> None:
    print(f"test accuracy: {report['test_accuracy']:.4f} ({report['test_size']} test images)")
    if report["private"]:
        print(f"privacy spent: epsilon = {report['epsilon']:.3f} at delta = {report['delta']:g} "
              f"({report['accountant']} accountant)")
        print(f"noise multiplier: {report['noise_multiplier']:.4g}, steps: {report['steps']}, "
              f"sample rate: {report['sample_rate']:.4g}")
    else:
        print(f"privacy: none (non-private run), steps: {report['steps']}")
    print(f"wall time: {report['wall_time_s']:.1f} s")


def _plot(history: dict, report: dict, path: Path) -> None:
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
        eps_ax.set_title(f"privacy spent (delta = {report['delta']:g}, {report['accountant']})")
    else:
        eps_ax.text(0.5, 0.5, "non-private run:\nno privacy guarantee", ha="center", va="center",
                    transform=eps_ax.transAxes)
        eps_ax.set_title("privacy spent")
    eps_ax.set_xlabel("step")
    eps_ax.set_ylabel("epsilon")
    fig.savefig(path, dpi=100)


# ====================================================================== plan


def _cmd_plan(args: argparse.Namespace) -> int:
    source, _ = parse_spec(args.model)  # before torch: a misspelt model answers at once
    import torch

    from .layers.base import layer_params
    from .models import build_image_model, build_text_model
    from .validation import find_problems

    if source == "hf":
        if args.input_size:
            raise CLIError("hf: models take --seq-len T, not --input-size")
        seq_len = args.seq_len or 128
        build = lambda: build_text_model(args.model, for_training=args.fix)  # noqa: E731
        example = lambda device: ((), {"input_ids": torch.zeros(1, seq_len, dtype=torch.long, device=device)})  # noqa: E731
        input_text = f"sequence length {seq_len}"
        input_shape = [seq_len]
    else:
        if args.seq_len:
            raise CLIError(f"--seq-len is for hf: models; {args.model} takes --input-size C H W")
        channels, height, width = args.input_size or ((1, 8, 8) if source == "builtin" else (3, 224, 224))
        num_classes = args.num_classes or (10 if source == "builtin" else 1000)
        build = lambda: build_image_model(args.model, channels, num_classes, height, for_training=args.fix)  # noqa: E731
        example = lambda device: ((torch.zeros(1, channels, height, width, device=device),), {})  # noqa: E731
        input_text = f"input {channels}x{height}x{width}"
        input_shape = [channels, height, width]
    model, notes, decisions, ghost_available = _plan_decisions(build, example, args)
    report = {
        "model": args.model,
        "input": input_shape,
        "clipping_mode": args.clipping_mode,
        "decision_rule": args.decision_rule,
        **plan_report(decisions, ghost_available),
        "problems": find_problems(model),
    }
    # Name what each row trains: the root's own parameters (a ViT's cls_token, pos_embed) have no module name.
    covered, modules = layer_params(model), dict(model.named_modules())
    for layer in report["layers"]:
        layer["parameters"] = sorted(covered.get(modules.get(layer["name"]), {}))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_plan(report, input_text, notes)
    return 0


def _plan_decisions(build, example, args):
    """(model, notes, decisions for --clipping-mode, ghost norm available per layer).

    The model is built on the meta device when possible: plan() needs only shapes, so
    VGG-11's 133M weights then cost neither memory nor initialisation time. A model that
    computes with values while building or in its forward (``.item()``, data-dependent
    branches) cannot run on meta tensors and is built on the CPU instead.
    """
    import torch

    for device in (torch.device("meta"), torch.device("cpu")):
        try:
            with device:
                built = build()
            return (built.model, built.notes, *_run_plans(built.model.eval(), example(device), args))
        except ValueError:
            raise  # a bad model spec or input: the same on any device
        except (NotImplementedError, RuntimeError) as err:
            if device.type == "meta":
                # Something only real tensors can do (.item(), an autocast check, a kernel without a meta
                # version), or a real error: the CPU tells which, and its message is the one to show.
                continue
            args_, kwargs = example(device)  # a real error, e.g. an image too small for the model's pooling
            shape = tuple((args_ or tuple(kwargs.values()))[0].shape)
            raise CLIError(f"{args.model} fails on an input of shape {shape}: {_one_line(err)}") from None
    raise AssertionError("unreachable: the CPU attempt returns or raises")


def _run_plans(model: nn.Module, example: tuple[tuple, dict], args) -> tuple[list[LayerDecision], list[bool]]:
    from .planning import plan

    example_args, example_kwargs = example
    decisions = plan(model, *example_args, clipping_mode=args.clipping_mode, decision_rule=args.decision_rule,
                     **example_kwargs)
    # The "ghost" recipe uses the ghost norm wherever a layer has one: that tells which layers
    # can use it at all (norm layers cannot; they are always instantiated).
    ghost_everywhere = plan(model, *example_args, clipping_mode="ghost", **example_kwargs)
    return decisions, [d.norm == "ghost" for d in ghost_everywhere]


def plan_report(decisions: Sequence[LayerDecision], ghost_available: Sequence[bool]) -> dict:
    """Per-layer costs and choices, and the totals of `dptrain plan --json`.

    Costs are per sample (batch of one), in numbers stored: the ghost norm's two T x T Gram
    matrices (2T^2) and one instantiated weight gradient (p*d). Each total is what that mode
    does: ``ghost`` takes the ghost norm where a layer has one and instantiates the rest
    (biases-only layers, norms, position embeddings), ``instantiate`` instantiates everything,
    ``mixed`` takes each layer's cheaper primitive where it has a choice.
    """
    layers = [
        {"name": d.name, "type": d.type, "T": d.T, "p": d.p, "d": d.d, "ghost_cost": d.ghost_cost,
         "instantiate_cost": d.instantiate_cost, "choice": d.norm, "gradient": d.grad, "ghost_available": available}
        for d, available in zip(decisions, ghost_available)
    ]
    totals = {
        "ghost": sum(d.ghost_cost if available else d.instantiate_cost
                     for d, available in zip(decisions, ghost_available)),
        "instantiate": sum(d.instantiate_cost for d in decisions),
        "mixed": sum(
            min(d.ghost_cost, d.instantiate_cost) if available else d.instantiate_cost
            for d, available in zip(decisions, ghost_available)
        ),
    }
    # What the chosen mode itself stores (its decision rule may be "time", not the space minimum).
    mode_total = sum(d.ghost_cost if d.norm == "ghost" else d.instantiate_cost for d in decisions)
    return {"layers": layers, "totals": totals, "mode_total": mode_total}


_GRADIENT_WORDS = {"book-keeping": "book-keeping", "weighted-sum": "weighted sum", "second-pass": "2nd backward"}


def _short(value: int) -> str:
    """Costs as the papers print them, 1728 or 5.04e9 (the exact values are in --json)."""
    if value < 10_000:
        return str(value)
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _print_plan(report: dict, input_text: str, notes: list[str]) -> None:
    mode = report["clipping_mode"]
    print(f"{report['model']}, {input_text}, per sample; clipping mode {mode} "
          f"(mixed modes decide by {report['decision_rule']})")
    for note in notes:
        print(f"note: {note}")
    rows = [("layer", "type", "T", "p", "d", "ghost 2T^2", "inst p*d", f"{mode} does")]
    for layer in report["layers"]:
        label = layer["name"] or ", ".join(layer.get("parameters", ())) or "<root>"
        rows.append((label, layer["type"], f"{layer['T']:,}", f"{layer['p']:,}",
                     f"{layer['d']:,}", _short(layer["ghost_cost"]), _short(layer["instantiate_cost"]),
                     f"{layer['choice']} norm, {_GRADIENT_WORDS[layer['gradient']]}"
                     + ("" if layer["ghost_available"] else " (has no ghost norm)")))
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    right = {2, 3, 4, 5, 6}
    for row in rows:
        print("  ".join(cell.rjust(w) if k in right else cell.ljust(w)
                        for k, (cell, w) in enumerate(zip(row, widths))).rstrip())
    totals = report["totals"]
    print(f"totals: ghost mode {_short(totals['ghost'])}, instantiation everywhere "
          f"{_short(totals['instantiate'])}, per-layer minimum (mixed) {_short(totals['mixed'])}")
    ghost = sum(layer["choice"] == "ghost" for layer in report["layers"])
    print(f"{mode}: ghost norm on {ghost} of {len(report['layers'])} layers, "
          f"{_short(report['mode_total'])} per sample for the norms")
    print("(per-sample and fast-grad-clip instantiate every layer; ghost and bk use the ghost norm wherever a "
          "layer has one; the mix modes take the cheaper per layer)")
    if report["problems"]:
        print(f"note: the engine refuses this model as built ({len(report['problems'])} problems, first: "
              f"{report['problems'][0]}). dptrain train applies dptrain.fixer.fix first (BatchNorm -> GroupNorm, "
              "torch RNN/attention -> dptrain.nn; dptrain plan --fix shows that model); modules without a rule "
              "are not listed above")


# ====================================================================== epsilon


def _cmd_epsilon(args: argparse.Namespace) -> int:
    if args.sample_rate is not None:
        if args.batch_size is not None:
            raise CLIError("give --sample-rate or --batch-size (with --sample-size), not both")
        q = args.sample_rate
        rate_text = f"sample rate {q:g}"
    elif args.batch_size is not None and args.sample_size is not None:
        if args.batch_size > args.sample_size:
            raise CLIError(f"--batch-size {args.batch_size} is larger than --sample-size {args.sample_size}")
        q = args.batch_size / args.sample_size
        rate_text = f"sample rate {q:.4g} (batch {args.batch_size} of {args.sample_size})"
    else:
        raise CLIError("give --sample-rate, or --batch-size with --sample-size")
    if (args.steps is None) == (args.epochs is None):
        raise CLIError("give exactly one of --steps or --epochs")
    if args.steps is not None:
        steps, length_text = args.steps, f"{args.steps} steps"
    else:
        steps_per_epoch = max(1, round(1 / q))  # as dptrain train's Poisson loader runs an epoch
        steps = max(1, round(args.epochs * steps_per_epoch))
        length_text = f"{args.epochs:g} epochs = {steps} steps ({steps_per_epoch} per epoch)"
    delta = args.delta if args.delta is not None else TRAIN_DEFAULTS["delta"]
    if args.sample_size is not None and delta >= 1 / args.sample_size:
        warnings.warn(f"delta {delta:g} >= 1/sample size: such a guarantee allows publishing a whole record; "
                      f"use delta well below {1 / args.sample_size:.2g}")
    names = args.accountant or list(accounting.ACCOUNTANTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", accounting.GDPApproximationWarning)  # said once, in the output
        if args.sigma is not None:
            print(f"noise multiplier {args.sigma:g}, {rate_text}, {length_text}, delta {delta:g}")
            results = {n: accounting.compute_epsilon(args.sigma, q, steps, delta, accountant=n) for n in names}
            label = "epsilon"
        else:
            print(f"target epsilon {args.target_epsilon:g} at delta {delta:g}, {rate_text}, {length_text}")
            results = {n: accounting.calibrate_noise_multiplier(args.target_epsilon, delta, q, steps, accountant=n)
                       for n in names}
            label = "noise multiplier"
    for name, value in results.items():
        note = "  (central-limit approximation, not a guarantee)" if name == "gdp" else ""
        print(f"  {name}  {label} = {value:.4g}{note}")
    return 0


# ====================================================================== audit


def _cmd_audit(args: argparse.Namespace) -> int:
    from .audit import run_command  # torch and scipy: imported only when an audit runs

    options = {k: v for k, v in vars(args).items() if k not in ("command", "handler", "json")}
    return run_command(options, json_output=getattr(args, "json", False))
