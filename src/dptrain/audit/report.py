"""What ``dptrain audit`` prints: the text report of a result (:func:`format_report`), the warnings of a
deliberately broken run, and the command itself (:func:`run_command`)."""
from __future__ import annotations

import json
import sys

import torch

from .run import AUDIT_DEFAULTS, AuditResult, run_audit


def format_report(result: AuditResult) -> str:
    """The text output of ``dptrain audit``: the two numbers and what they mean."""
    r = result
    warnings_ = _broken_promise_warnings(r)
    samples = "images" if r.data == "digits" else "samples"
    if r.privacy_unit == "user":
        real = f"{r.train_size} {samples} of {r.train_users} users"
        planted = (f"{r.canaries} canary users of {r.examples_per_canary} "
                   f"example{'s' if r.examples_per_canary != 1 else ''} each")
        who = "one user (all of their examples together)"
    else:
        real, planted, who = f"{r.train_size} {samples}", f"{r.canaries} gradient canaries", "one training example"
    lines = list(warnings_)
    lines += [
        f"audit: {r.model} on {r.data} ({real}) + {planted} "
        f"({r.included_canaries} included at random), {r.steps} steps at sample rate {r.sample_rate:.4g}"
        f"{' per user' if r.privacy_unit == 'user' else ''}"
        f"{f' within {r.bands} cyclic groups, banded correlated noise (bandmf)' if r.noise == 'bandmf' else ''}, "
        f"clipping {r.clipping_mode}, max grad norm {r.max_grad_norm:g}",
        f"claimed:  epsilon = {r.epsilon:.3f} at delta = {r.delta:g}{' per user' if r.privacy_unit == 'user' else ''} "
        f"({r.accountant} accountant, noise multiplier {r.noise_multiplier:.4g})",
        f"measured: epsilon >= {r.epsilon_lower_bound:.3f} with {r.confidence:.0%} confidence "
        f"({r.correct_guesses} of {r.guesses_in + r.guesses_out} guesses right: {r.guesses_in} 'in', "
        f"{r.guesses_out} 'out', {r.canaries - r.guesses_in - r.guesses_out} abstentions)",
        f"The claimed epsilon is what the accountant promises for this run: no attack may learn more about any "
        f"{who} than it allows.",
        "The measured epsilon is what an attack on this very run proves, from the noisy gradients: above the "
        "claim it would show that the implementation breaks its promise; below it, the gap is the looseness of "
        "a one-run audit, not spare privacy.",
    ]
    if r.consistent:
        lines.append(f"verdict: consistent (lower bound {r.epsilon_lower_bound:.3f} <= epsilon {r.epsilon:.3f})")
    else:
        lines.append(f"verdict: PROMISE BROKEN (lower bound {r.epsilon_lower_bound:.3f} > epsilon "
                     f"{r.epsilon:.3f}, at {r.confidence:.0%} confidence)")
    lines += warnings_
    return "\n".join(lines)


def _broken_promise_warnings(result: AuditResult) -> list[str]:
    """One warning per deliberate break of the promise that the result records (none for an honest run)."""
    found = []
    if result.noise_scale != 1:
        found.append(_broken_promise_warning(result.noise_scale))
    if result.clipped_unit != result.privacy_unit:
        found.append(f"WARNING: clip_per_example: this run clips each example instead of each user, so a user of "
                     f"{result.examples_per_canary} examples moves the update by up to {result.examples_per_canary} "
                     "x the clipping norm; it DELIBERATELY BREAKS ITS PRIVACY PROMISE and exists only to show that "
                     "the audit catches a broken promise. Never train a real model this way.")
    return found


def _broken_promise_warning(noise_scale: float) -> str:
    return (f"WARNING: --noise-scale {noise_scale:g}: this run draws {noise_scale:g} x the noise its accountant "
            "charges for, so it DELIBERATELY BREAKS ITS PRIVACY PROMISE; it exists only to show that the audit "
            "catches a broken promise. Never train a real model this way.")


def run_command(options: dict, *, json_output: bool = False) -> int:
    """`dptrain audit`: run :func:`run_audit` with ``options`` and print its report (or JSON)."""
    from tqdm import tqdm

    noise_scale = options.get("noise_scale", AUDIT_DEFAULTS["noise_scale"])
    if noise_scale != 1:
        print(_broken_promise_warning(noise_scale), file=sys.stderr)
    threads = torch.get_num_threads()
    # The digits CNN is many tiny operations per step: one thread is faster (as in dptrain train).
    torch.set_num_threads(1)
    bars: list = []  # opened at the first step, so that a configuration error shows no bar

    def progress(step: int, steps: int) -> None:
        if not bars:
            bars.append(tqdm(total=steps, desc="audit", unit="step", file=sys.stderr, leave=False,
                             dynamic_ncols=True))
        bars[0].update(1)

    try:
        result = run_audit(**options, progress=progress)
    except KeyboardInterrupt:
        print("dptrain audit: interrupted", file=sys.stderr)
        return 130
    finally:
        for bar in bars:
            bar.close()
        torch.set_num_threads(threads)  # main() may run in-process
    if json_output:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_report(result))
    if noise_scale != 1:
        print(_broken_promise_warning(noise_scale), file=sys.stderr)
    return 0
