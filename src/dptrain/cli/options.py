"""The ``dptrain`` argument parser: every subcommand's options, checked before torch is imported."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from .. import _checks, accounting  # light: dp_accounting is imported when an accountant first runs
from ..core.algorithms import CLIPPING_MODES, DEFAULT_CLIPPING_MODE
from ..models.specs import HF_HEADS
from .datasets import DATASETS


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


def _number(kind: type, check: Callable[[str, Any], Any]):
    """An argparse type: ``kind`` (int or float) of the text, checked by a ``dptrain._checks`` function."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:  # not a number of this kind: what the check says of a value that is none
            value = math.nan if kind is float else text
        try:
            return check("value", value)
        except _checks.CheckError as err:
            raise argparse.ArgumentTypeError(f"must be {err.requirement}, got {text}") from None

    return parse


positive_float = _number(float, _checks.positive)
non_negative_float = _number(float, _checks.non_negative)
positive_int = _number(int, _checks.positive_int)
probability = _number(float, _checks.open_unit)
sample_rate_type = _number(float, _checks.rate)


def bands_type(text: str):
    """``--bands``: a positive integer b, or ``auto`` (dptrain.correlated.resolve.choose_bands)."""
    return "auto" if text == "auto" else _number(int, lambda name, value: _checks.positive_int(
        name, value, "or auto"))(text)


def max_batch_size_type(text: str):
    """``--max-batch-size``: a positive integer K, or ``auto`` (accounting.default_max_batch_size)."""
    return "auto" if text == "auto" else _number(int, lambda name, value: _checks.positive_int(
        name, value, "or auto"))(text)


# Defaults of `dptrain train`, tuned on digits at epsilon = 3 (over seeds 0-2: 93-95 % test
# accuracy; 30 epochs or batch 512 are no better) in well under a minute on two CPU cores.
TRAIN_DEFAULTS: dict[str, Any] = {
    "epsilon": 3.0,
    "noise_multiplier": None,
    "delta": None,  # accounting.default_delta(training examples), 1 / (10 N): the engine's default
    "epochs": 15,
    "batch_size": 256,
    "physical_batch_size": None,
    "max_batch_size": None,
    "max_grad_norm": 1.0,
    "lr": 1e-2,
    "optimizer": "adam",
    "clipping_mode": DEFAULT_CLIPPING_MODE,
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
    "noise": "gaussian",
    "bands": None,
    "buffers": None,
    "cyclic_groups": None,
}
# What a resumed run may change; everything else comes from the checkpoint, since changing
# it mid-run would make the model, the data order or the privacy accounting inconsistent.
RESUME_MAY_CHANGE = ("epochs", "device", "threads", "data_dir", "output", "resume")
# Below this size a CPU step is many tiny operations, where handing work between threads
# costs more than it saves (and stalls badly on a busy machine): one thread is faster.
SMALL_MODEL_PARAMETERS = 1_000_000
# Choices the parser needs before torch is imported; tests/test_startup.py checks that they are the
# library's own (dptrain.core.clipping.CLIPPING_FNS, dptrain.core.planning.DECISION_RULES).
CLIPPING_FNS = ("abadi", "automatic", "global")
DECISION_RULES = ("memory", "space", "time")
OPTIMIZERS = {"adam": "Adam", "sgd": "SGD"}  # --optimizer -> the torch.optim class
NOISES = ("gaussian", "bandmf", "blt")  # dptrain.correlated.resolve.NOISES (tests/test_startup.py checks)
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
        "clipping. Without arguments: a small CNN on scikit-learn's digits at epsilon = 3, delta = 1/(10 N) for "
        "N training examples (the engine's default).",
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
    train.add_argument("--delta", type=probability,
                       help="target delta (default 1/(10 N) for N training examples, as the engine's)")
    train.add_argument("--epochs", type=positive_int, help=f"passes over the data (default {d['epochs']})")
    train.add_argument("--batch-size", type=positive_int,
                       help=f"expected logical batch size; sample rate = batch size / dataset size (default "
                       f"{d['batch_size']})")
    train.add_argument("--physical-batch-size", type=positive_int,
                       help="largest batch sent through the model at once (memory); the optimizer still "
                       "steps once per logical batch (default: the whole logical batch)")
    train.add_argument("--max-batch-size", type=max_batch_size_type, metavar="K|auto",
                       help="fixed-shape batches: every batch has exactly K rows (a larger Poisson draw keeps a "
                       "random K, a smaller one is padded and masked); the privacy guarantee then also covers "
                       "the chance of truncation, steps * P[Binomial(N, q) >= K], taken from delta. auto: the "
                       "smallest K whose truncation costs at most delta / 10 (default: no truncation, batches "
                       "of varying size)")
    train.add_argument("--max-grad-norm", type=positive_float,
                       help=f"per-sample clipping threshold R (default {d['max_grad_norm']:g})")
    train.add_argument("--noise", choices=NOISES,
                       help="gaussian: DP-SGD's independent noise; bandmf: banded matrix factorization, a strategy "
                       "of --bands bands (the noise is correlated beyond them, with every earlier step) with cyclic "
                       "Poisson sampling (amplified); blt: buffered linear Toeplitz noise, not amplified: for runs "
                       "where each example takes part a few times, with --cyclic-groups near dataset size / batch "
                       "size (docs/correlated-noise.md) (default gaussian)")
    train.add_argument("--bands", type=bands_type, metavar="B|auto",
                       help="--noise bandmf: bands b of the strategy; the data is split into b cyclic groups. auto: "
                       "the b (1 = DP-SGD included) of least expected error at --epsilon")
    train.add_argument("--buffers", type=positive_int, help="--noise blt: noise buffers of the strategy (default 4)")
    train.add_argument("--cyclic-groups", type=positive_int,
                       help="cyclic Poisson sampling over G groups, step t samples group t mod G (default: --bands "
                       "with bandmf, 1 otherwise; with blt, G close to dataset size / batch size makes every example "
                       "take part about once per epoch, the setting BLTs are made for)")
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
                          help="classifier outputs (default: 10 for the built-in models, the model's own otherwise; "
                          "hf: models with a classification --head)")
    plan_cmd.add_argument("--head", choices=HF_HEADS, default=None,
                          help="hf: models: the task head to build (default auto: the model type's language-model "
                          "head, seq2seq, masked or causal, an untied lm_head included; none: the bare AutoModel)")
    plan_cmd.add_argument("--lora", type=positive_int, metavar="R",
                          help="plan LoRA fine-tuning: adapters of rank R (peft, pip install 'dptrain[peft]'), the "
                          "original weights frozen")
    plan_cmd.add_argument("--lora-targets", nargs="+", metavar="NAME",
                          help="with --lora: the modules to adapt, by name (default: peft's for a Hugging Face model "
                          "type, e.g. c_attn for GPT-2, query and value for BERT; needed for other models)")
    plan_cmd.add_argument("--clipping-mode", choices=CLIPPING_MODES, default=DEFAULT_CLIPPING_MODE,
                          help=f"(default {DEFAULT_CLIPPING_MODE})")
    plan_cmd.add_argument("--decision-rule", choices=DECISION_RULES, default="memory",
                          help="how the mixed modes choose: by memory (space, plus what BK-MixOpt keeps alive), "
                          "space (2T^2 < p*d) or time (default memory, as the engine)")
    plan_cmd.add_argument("--fix", action="store_true",
                          help="plan the model as dptrain train trains it, after dptrain.fix (BatchNorm -> GroupNorm, "
                          "torch RNN/attention -> dptrain.nn); without it, the model as published")
    plan_cmd.add_argument("--noise", choices=NOISES, default="gaussian",
                          help="also report the memory of this noise's state (bandmf: bands - 1 model-sized buffers, "
                          "blt: --buffers)")
    plan_cmd.add_argument("--bands", type=positive_int, help="--noise bandmf: bands of the strategy")
    plan_cmd.add_argument("--buffers", type=positive_int, help="--noise blt: buffers of the strategy (default 4)")
    plan_cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")

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
                     help="delta (default 1/(10 x --sample-size), as the engine and dptrain train)")
    eps.add_argument("--accountant", choices=accounting.ACCOUNTANTS, action="append",
                     help="only this accountant (repeatable; default: all)")
    eps.add_argument("--max-batch-size", type=max_batch_size_type, metavar="K|auto",
                     help="fixed-shape batches of K rows (with --sample-size): epsilon holds at --delta including "
                          "the truncation term steps * P[Binomial(N, q) >= K]. auto: the smallest K whose truncation "
                          "costs at most delta / 10, as dptrain train")

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
                       help="Poisson sample rate over real samples and all canaries, or over real and canary "
                       "users (default 0.5)")
    audit.add_argument("--clipping-mode", choices=CLIPPING_MODES, help=f"(default {DEFAULT_CLIPPING_MODE})")
    audit.add_argument("--confidence", type=probability, help="confidence of the lower bound (default 0.95)")
    audit.add_argument("--noise-scale", type=non_negative_float,
                       help="draw this multiple of the accounted noise: a deliberately broken run, only to show "
                       "that the audit catches it (default 1)")
    audit.add_argument("--privacy-unit", choices=("example", "user"),
                       help="what a canary is and epsilon protects: one example, or a user of several examples, "
                       "clipped and sampled as a unit (default example)")
    audit.add_argument("--examples-per-canary", type=positive_int, metavar="K",
                       help="with --privacy-unit user: the examples of each canary user; the digits are dealt to "
                       "real users of K examples too (default 4)")
    audit.add_argument("--noise", choices=("gaussian", "bandmf"),
                       help="audit DP-SGD's noise or banded correlated noise with cyclic Poisson sampling (the "
                       "auditor applies the strategy C to the released gradients; default gaussian)")
    audit.add_argument("--bands", type=positive_int, help="--noise bandmf: bands of the strategy (default 2)")
    audit.add_argument("--seed", type=int, help="seed of the coins, batches and noise (default: fresh entropy)")
    audit.add_argument("--json", action="store_true", help="print JSON instead of text")

    # `dptrain bench ...` is handed whole to the checkout's harness, benchmarks/dptrain_bench (dptrain bench --help)
    commands.add_parser("bench", add_help=False,
                        help="time and memory of every clipping mode against non-private training and Opacus")
    return parser
