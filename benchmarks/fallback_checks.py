"""The per-sample fallback's steady step: what checking every call costs (the checks that samples stay apart read
values, so they run at every call, not once per call signature).

A small transformer-like model whose norms and scales have no rule (the fallback replays them), on the CPU, one
thread. Three arms in one process, their steps interleaved in a shuffled order (load from other processes hits each
alike): bk-mixopt with the checks at every call ("checked"), bk-mixopt with the checks switched off after the warm-up
(what a steady step cost when they ran once per call signature: "unchecked"), and plain non-private training. Prints a
JSON line: each arm's first step, median and fastest step (forward, backward, optimizer step) after warm-up. Under the
PYTHONPATH of a checkout from before (612b47e), "checked" is that checkout's own steady step (checks once per call
signature); run both alternately to compare across checkouts.

    PYTHONPATH=src python benchmarks/fallback_checks.py batch-first
    PYTHONPATH=src python benchmarks/fallback_checks.py folded --steps 30
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import dptrain


class Norm(nn.Module):
    """A layer norm written out (no rule: the fallback replays it)."""

    def __init__(self, d):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * self.weight + self.bias


class Scale(nn.Module):
    """x * scale (no rule)."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.scale


class Block(nn.Module):
    def __init__(self, d, folded):
        super().__init__()
        self.folded = folded
        self.norm, self.up, self.down, self.scale = Norm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d), Scale(d)

    def forward(self, x):  # [B, T, d]
        B, T, d = x.shape
        h = self.norm(x.reshape(B * T, d)).reshape(B, T, d) if self.folded else self.norm(x)
        h = self.scale(self.down(F.gelu(self.up(h))))
        return x + h


class Model(nn.Module):
    def __init__(self, d=64, layers=4, vocab=128, classes=8, folded=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, folded) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


class _Unchecked:
    """The fallback's checks that samples stay apart switched off (the replays themselves kept): what a steady step cost
    when they ran once per call signature, for the A/B in one process."""

    def __enter__(self):
        from dptrain.layers.fallback.independence import _SampleChecks

        off = {"_check_independence": lambda *a, **k: None, "_check_gradient_sum": lambda *a, **k: None,
               "_whole_vjp": lambda *a, **k: (None, None), "_rows_reproduced": lambda *a, **k: True}
        # (a checkout from before the checks ran at every call has the first two only, and skips them itself)
        self.saved = {n: getattr(_SampleChecks, n) for n in off if hasattr(_SampleChecks, n)}
        for n in self.saved:
            setattr(_SampleChecks, n, off[n])
        return self

    def __exit__(self, *exc):
        from dptrain.layers.fallback.independence import _SampleChecks

        for n, f in self.saved.items():
            setattr(_SampleChecks, n, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layout", choices=["batch-first", "folded"],
                        help="the norms on [B, T, d] (one vmap over the samples) or on [B * T, d] (tokens folded "
                             "into the batch: each sample's rows replayed alone)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    folded = args.layout == "folded"
    model = Model(folded=folded)
    batches = [(torch.randint(0, 128, (args.batch, args.tokens)), torch.randint(0, 8, (args.batch,)))
               for _ in range(4)]
    arms = {}
    for arm in ("checked", "unchecked", "non-private"):  # one copy of the model each, the same weights
        trained = Model(folded=folded)
        trained.load_state_dict(model.state_dict())
        optimizer = torch.optim.SGD(trained.parameters(), lr=1e-3)
        engine = None
        if arm != "non-private":
            engine = dptrain.PrivacyEngine(trained, batch_size=args.batch, sample_size=10_000, max_grad_norm=1.0,
                                           noise_multiplier=1.0, clipping_mode="bk-mixopt")
            engine.attach(optimizer)
        arms[arm] = (trained, optimizer, engine, [])
    order = random.Random(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in range(args.warmup + args.steps):
            names = list(arms)
            order.shuffle(names)  # load from other processes hits every arm alike
            for name in names:
                trained, optimizer, engine, times = arms[name]
                ids, y = batches[k % len(batches)]
                switch = _Unchecked() if name == "unchecked" and k >= args.warmup else contextlib.nullcontext()
                with switch:
                    start = time.perf_counter()
                    losses = F.cross_entropy(trained(ids), y, reduction="none")
                    if engine is not None:
                        engine.backward(losses)
                    else:
                        losses.mean().backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    times.append(time.perf_counter() - start)
    result = {"layout": args.layout, "batch": args.batch, "tokens": args.tokens, "dptrain": dptrain.__file__}
    for name, (_, _, engine, times) in arms.items():
        if engine is not None:
            engine.detach()
        result[f"{name}_first_s"] = times[0]
        result[f"{name}_median_s"] = statistics.median(times[args.warmup:])
        result[f"{name}_min_s"] = min(times[args.warmup:])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
