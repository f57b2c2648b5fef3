"""Where the private forward's host time goes (issue 42): the engine's forward, against the same forward with parts of
each layer call's record taken away, each over the model's own forward.

``host_cost.py``'s models (width <= 64, one CPU thread, where the time is the host's). Each round times the model
alone and then the engine's forward in every variant, one after the other, and takes each variant's ratio to the
model alone of the same round, so that load from other processes hits them alike; the median over rounds is printed.
The variants replace ``LayerHooks._record`` (a diagnostic: the parameters are switched off and on, the model's hooks
run, and a call whose output has no history - an embedding given token ids - is still recorded by the engine, so that
the autograd graph the forward builds is the engine's in every variant):

- ``engine``: the engine as it is;
- ``bare_hook``: no record; a node pre-hook that does nothing is registered on each output's node;
- ``no_record``: no record and no hook: the layer hooks' switching, the model's hooks and the graph alone.

A variant that builds no autograd graph (a layer's output without history left as it is) is no floor: the rest of the
forward then records nothing either, and reads about 1.2x where the graph costs its share.

    PYTHONPATH=src python benchmarks/forward_parts.py [--models gpt2,llama] [--rounds 30]
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import time
import warnings

import torch

import host_cost


def _no_op_hook(grad_outputs):
    return None


def _variants(record):
    def bare_hook(self, state, module, inputs, tensor, site=None):
        if tensor.grad_fn is None:
            return record(self, state, module, inputs, tensor, site)
        tensor.grad_fn.register_prehook(_no_op_hook)
        return tensor

    def no_record(self, state, module, inputs, tensor, site=None):
        if tensor.grad_fn is None:
            return record(self, state, module, inputs, tensor, site)
        return tensor

    return {"engine": record, "bare_hook": bare_hook, "no_record": no_record}


def _forward_ms(arm) -> float:
    start = time.thread_time()
    with torch.enable_grad():
        out = arm.forward()
    elapsed = time.thread_time() - start
    del out
    return elapsed * 1e3


def measure(name: str, rounds: int) -> dict:
    from dptrain.core.layer_hooks import LayerHooks

    model, batch, losses_fn = host_cost._build(name, torch.device("cpu"))
    plain = host_cost._Arm(copy.deepcopy(model), losses_fn, batch, False, 1.0)
    private = host_cost._Arm(model, losses_fn, batch, True, 1.0)
    for arm in (plain, private):
        for _ in range(3):
            arm.step()
    record = LayerHooks._record
    variants = _variants(record)
    ratios: dict[str, list[float]] = {key: [] for key in variants}
    try:
        for _ in range(rounds):
            for key, variant in variants.items():
                alone = _forward_ms(plain)
                LayerHooks._record = variant
                ratios[key].append(_forward_ms(private) / alone)
                LayerHooks._record = record
    finally:
        LayerHooks._record = record
        private.engine.detach()
    return {"model": name, "rounds": rounds, "torch": torch.__version__,
            **{f"{key}_ratio": round(statistics.median(values), 3) for key, values in ratios.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2,llama,llama-lora")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    for name in args.models.split(","):
        if name not in host_cost.MODELS:
            raise SystemExit(f"--models: {name!r} is none of {', '.join(host_cost.MODELS)}")
        print(json.dumps(measure(name, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
