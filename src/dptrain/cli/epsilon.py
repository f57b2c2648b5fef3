"""``dptrain epsilon``: the epsilon of a run per accountant, or the noise multiplier a target epsilon needs."""
from __future__ import annotations

import argparse
import warnings

from .. import accounting
from .output import CLIError


def run(args: argparse.Namespace) -> int:
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
    k = args.max_batch_size
    if k is not None and args.sample_size is None:
        raise CLIError("--max-batch-size needs --sample-size (the truncation term depends on the dataset size)")
    delta = _delta(args)
    if args.sample_size is not None and delta >= 1 / args.sample_size:
        warnings.warn(f"delta {delta:.3g} >= 1/sample size: such a guarantee allows publishing a whole record; "
                      f"use delta well below {1 / args.sample_size:.2g}", stacklevel=2)
    chosen = k == "auto"
    if chosen:  # as dptrain train resolves it: the smallest K whose truncation costs at most a tenth of delta
        k = accounting.default_max_batch_size(args.sample_size, q, delta, steps)
    truncation = {"sample_size": args.sample_size, "max_batch_size": k} if k is not None else {}
    if k is not None:
        length_text += (f", batches truncated to {k} rows ({'auto: ' if chosen else ''}truncation term "
                        f"{accounting.truncation_delta(args.sample_size, q, k, steps):.3g} of delta)")
    names = args.accountant or list(accounting.ACCOUNTANTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", accounting.GDPApproximationWarning)  # said once, in the output
        if args.sigma is not None:
            print(f"noise multiplier {args.sigma:g}, {rate_text}, {length_text}, delta {delta:.3g}")
            results = {n: accounting.compute_epsilon(args.sigma, q, steps, delta, accountant=n, **truncation)
                       for n in names}
            label = "epsilon"
        else:
            print(f"target epsilon {args.target_epsilon:g} at delta {delta:.3g}, {rate_text}, {length_text}")
            results = {n: accounting.calibrate_noise_multiplier(args.target_epsilon, delta, q, steps, accountant=n,
                                                                **truncation)
                       for n in names}
            label = "noise multiplier"
    for name, value in results.items():
        note = "  (central-limit approximation, not a guarantee)" if name == "gdp" else ""
        print(f"  {name}  {label} = {value:.4g}{note}")
    return 0


def _delta(args: argparse.Namespace) -> float:
    """--delta, or the engine's default ``accounting.default_delta(sample size)``, 1 / (10 N), as dptrain train."""
    if args.delta is not None:
        return args.delta
    if args.sample_size is None:
        raise CLIError("the default delta is 1/(10 x sample size), as the engine's and dptrain train's: give "
                       "--sample-size N, or --delta D")
    return accounting.default_delta(args.sample_size)
