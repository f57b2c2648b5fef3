"""``dptrain plan``: per trainable layer, what each clipping mode does and what it costs."""
from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from ..core.plan_report import Plan, plan_report  # noqa: F401  (plan_report: dptrain.cli's, as before)
from ..models.specs import parse_spec
from .output import CLIError, one_line

if TYPE_CHECKING:
    from torch import nn


def run(args: argparse.Namespace) -> int:
    source, _ = parse_spec(args.model)  # before torch: a misspelt model answers at once
    import torch

    from ..models.build import build_image_model, build_text_model, with_lora
    from ..models.validation import find_problems

    if args.lora_targets and args.lora is None:
        raise CLIError("--lora-targets names the modules of --lora R: give --lora R too")
    if source == "hf":
        if args.input_size:
            raise CLIError("hf: models take --seq-len T, not --input-size")
        seq_len = args.seq_len or 128
        build_model = lambda: build_text_model(args.model, head=args.head or "auto",  # noqa: E731
                                               num_classes=args.num_classes, for_training=args.fix)
        input_text = f"sequence length {seq_len}"
        input_shape = [seq_len]
    else:
        if args.seq_len:
            raise CLIError(f"--seq-len is for hf: models; {args.model} takes --input-size C H W")
        if args.head:
            raise CLIError(f"--head is for hf: models; {args.model} is planned with its classifier")
        channels, height, width = args.input_size or ((1, 8, 8) if source == "builtin" else (3, 224, 224))
        num_classes = args.num_classes or (10 if source == "builtin" else 1000)
        build_model = lambda: build_image_model(args.model, channels, num_classes, height,  # noqa: E731
                                                for_training=args.fix)
        input_text = f"input {channels}x{height}x{width}"
        input_shape = [channels, height, width]

    def build():
        built = build_model()
        return built if args.lora is None else with_lora(built, args.lora, args.lora_targets)

    def example(model, device):
        """The forward's arguments for one sample; an encoder-decoder also gets its decoder's tokens."""
        if source != "hf":
            return (torch.zeros(1, channels, height, width, device=device),), {}
        ids = torch.zeros(1, seq_len, dtype=torch.long, device=device)
        decoder = {"decoder_input_ids": ids} if getattr(model.config, "is_encoder_decoder", False) else {}
        return (), {"input_ids": ids, **decoder}

    model, notes, planned = _plan_decisions(build, example, args)
    report = {"model": args.model, "input": input_shape, **planned.report(), "problems": find_problems(model),
              "noise_state": _noise_state(model, args)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_plan(planned, report, f"{args.model}, {input_text}", notes)
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


def _plan_decisions(build, example, args) -> tuple[nn.Module, list[str], Plan]:
    """(model, notes, the plan of --clipping-mode).

    The model is built on the meta device when possible: plan() needs only shapes, so
    VGG-11's 133M weights then cost neither memory nor initialisation time. A model that
    computes with values while building or in its forward (``.item()``, data-dependent
    branches) cannot run on meta tensors and is built on the CPU instead.
    """
    import torch

    from ..core.planning import plan

    for device in (torch.device("meta"), torch.device("cpu")):
        try:
            with device:
                built = build()
            model = built.model.eval()
            example_args, example_kwargs = example(model, device)
            planned = plan(model, *example_args, clipping_mode=args.clipping_mode, decision_rule=args.decision_rule,
                           **example_kwargs)
            return model, built.notes, planned
        except ValueError:
            raise  # a bad model spec or input: the same on any device
        except (NotImplementedError, RuntimeError) as err:
            if device.type == "meta":
                # Something only real tensors can do (.item(), an autocast check, a kernel without a meta
                # version), or a real error: the CPU tells which, and its message is the one to show.
                continue
            example_args, example_kwargs = example(built.model, device)  # a real error, e.g. an image too small
            shape = tuple((example_args or tuple(example_kwargs.values()))[0].shape)
            raise CLIError(f"{args.model} fails on an input of shape {shape}: {one_line(err)}") from None
    raise AssertionError("unreachable: the CPU attempt returns or raises")


def _print_plan(planned: Plan, report: dict, title: str, notes: list[str]) -> None:
    """The plan's table, then what only the command knows: the noise state and the engine's refusals."""
    print(planned.table(title, notes))
    noise = report.get("noise_state")
    if noise and noise["buffers"]:
        print(f"noise state ({noise['noise']}): {noise['buffers']} buffer(s) of {noise['numbers_per_buffer']:,} "
              f"numbers (one model-sized tensor each, float32), {_bytes(noise['bytes'])} kept between steps")
    if report["problems"]:
        print(f"note: the engine refuses this model as built ({len(report['problems'])} problems, first: "
              f"{report['problems'][0]}). dptrain train applies dptrain.fixer.fix first (BatchNorm -> GroupNorm, "
              "torch RNN/attention -> dptrain.nn; dptrain plan --fix shows that model); modules without a rule "
              "are not listed above")


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"
