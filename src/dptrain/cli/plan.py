"""``dptrain plan``: per trainable layer, what each clipping mode does and what it costs."""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..model_specs import parse_spec
from .output import CLIError, one_line

if TYPE_CHECKING:
    from torch import nn

    from ..planning import LayerDecision


def run(args: argparse.Namespace) -> int:
    source, _ = parse_spec(args.model)  # before torch: a misspelt model answers at once
    import torch

    from ..layers.registry import layer_params
    from ..models import build_image_model, build_text_model
    from ..validation import find_problems

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
        "noise_state": _noise_state(model, args),
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


def _noise_state(model, args) -> dict:
    """What --noise keeps between steps: model-sized buffers (dptrain.correlated.plan_noise)."""
    from ..correlated import plan_noise

    if args.noise != "bandmf" and args.bands is not None:
        raise CLIError("--bands is for --noise bandmf")
    if args.noise != "blt" and args.buffers is not None:
        raise CLIError("--buffers is for --noise blt")
    if args.noise == "bandmf" and args.bands is None:
        raise CLIError("--noise bandmf needs --bands B (the bands of the strategy)")
    return plan_noise(model, args.noise, bands=args.bands, buffers=args.buffers).as_dict()


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
            raise CLIError(f"{args.model} fails on an input of shape {shape}: {one_line(err)}") from None
    raise AssertionError("unreachable: the CPU attempt returns or raises")


def _run_plans(model: nn.Module, example: tuple[tuple, dict], args) -> tuple[list[LayerDecision], list[bool]]:
    from ..planning import plan

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
    from ..planning import fallback_costs

    # Layers without a rule: the per-sample fallback instantiates their per-sample gradients in every mode.
    fallback = fallback_costs(list(decisions))
    for layer in layers:
        layer["fallback_cost"] = fallback.get(layer["name"], 0)
    return {"layers": layers, "totals": totals, "mode_total": mode_total,
            "fallback": {"layers": fallback, "per_sample": sum(fallback.values())}}


_GRADIENT_WORDS = {"book-keeping": "book-keeping", "weighted-sum": "weighted sum", "second-pass": "2nd backward"}


def _short(value: int) -> str:
    """Costs as the papers print them, 1728 or 5.04e9 (the exact values are in --json)."""
    if value < 10_000:
        return str(value)
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"


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
    fallback = report.get("fallback", {}).get("layers", {})
    if fallback:
        names = ", ".join(f"{name or '<root>'} {_short(cost)}" for name, cost in list(fallback.items())[:8])
        more = f" and {len(fallback) - 8} more" if len(fallback) > 8 else ""
        print(f"fallback: {len(fallback)} layer(s) have no rule ({names}{more}): the per-sample fallback instantiates "
              f"their per-sample gradients in every mode, {_short(report['fallback']['per_sample'])} per sample "
              "(B times that for a batch of B)")
    print("(per-sample and fast-grad-clip instantiate every layer; ghost and bk use the ghost norm wherever a "
          "layer has one; the mix modes take the cheaper per layer)")
    noise = report.get("noise_state")
    if noise and noise["buffers"]:
        print(f"noise state ({noise['noise']}): {noise['buffers']} buffer(s) of {noise['numbers_per_buffer']:,} "
              f"numbers (one model-sized tensor each, float32), {_bytes(noise['bytes'])} kept between steps")
    if report["problems"]:
        print(f"note: the engine refuses this model as built ({len(report['problems'])} problems, first: "
              f"{report['problems'][0]}). dptrain train applies dptrain.fixer.fix first (BatchNorm -> GroupNorm, "
              "torch RNN/attention -> dptrain.nn; dptrain plan --fix shows that model); modules without a rule "
              "are not listed above")
