"""What reading rows at every step costs, per class of forward (issue 42): the steady private step against non-private.

A 6-layer MLP of width 256 on a batch of 32 (one thread, CPU), bk-mixopt, in forms that differ only in what the row
check must do at each step:

- ``proven``: the layers and activations alone - the graph proves every row (no tag pass);
- ``frozen prefix``: a frozen linear layer and a normalisation by constants before the first trainable layer - the
  input is carried through the graph, proven, and back-propagated through the frozen part;
- ``coefficient 0``: a mixup of features written ``(1 - c) h + c h.flip(0)`` with ``c = 0`` - a flip has no rule, so
  every step reads its rows by tag passes (and is exact: nothing mixes at these values);
- ``data-dependent order``: the batch sorted by the data inside the forward, then put back - read at every step.

Arms alternate within each round. Printed: one JSON line per form (median ms of the steady steps, the ratio).

    PYTHONPATH=src python benchmarks/row_check_price.py [--rounds 15]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, BATCH, LAYERS = 256, 32, 6


class Form(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x):
        if self.form == "frozen prefix":
            x = (self.frozen(x) - 0.5) / 2.0
        h = x
        for k, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if k == 2 and self.form == "coefficient 0":
                h = (1 - 0.0) * h + 0.0 * h.flip(0)
            if k == 2 and self.form == "data-dependent order":
                order = h[:, 0].argsort()
                h = h[order][order.argsort()]
        return self.head(h)


def measure(form: str, rounds: int) -> dict:
    import dptrain

    torch.manual_seed(0)
    model = Form(form)
    plain = copy.deepcopy(model)
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    opt_plain = torch.optim.SGD(plain.parameters(), lr=1e-6)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    engine = dptrain.PrivacyEngine(model, batch_size=BATCH, sample_size=1000, noise_multiplier=1.0,
                                   max_grad_norm=1.0)
    engine.attach(opt)

    def private():
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
        opt.step()
        opt.zero_grad(set_to_none=True)

    def non_private():
        F.cross_entropy(plain(x), y).backward()
        opt_plain.step()
        opt_plain.zero_grad(set_to_none=True)

    times = {"private": [], "non_private": []}
    for round_ in range(rounds + 3):
        for arm, step in (("private", private), ("non_private", non_private)):
            start = time.perf_counter()
            step()
            if round_ >= 3:
                times[arm].append((time.perf_counter() - start) * 1e3)
    engine.detach()
    out = {"form": form, **{f"{arm}_ms": round(statistics.median(t), 3) for arm, t in times.items()}}
    out["ratio"] = round(out["private_ms"] / out["non_private_ms"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    for form in ("proven", "frozen prefix", "coefficient 0", "data-dependent order"):
        print(json.dumps(measure(form, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
