"""Where the host time of a training forward goes with a PrivacyEngine attached (issue 36: GPT-2's GPU step is bound
by the host).

A 12-layer GPT-2 of width 32 (random weights), so that the arithmetic is negligible and what is measured is Python
and torch's dispatch. After three private steps (the forward then follows a verified trace, as every steady step
does), training forwards (gradients enabled, no backward) are timed in rounds, three arms alternating within each
round so that load from other processes hits them alike:

- ``plain``: a copy of the model, made before the engine was attached;
- ``hooks``: the engine attached, its watch's ``__torch_function__`` replaced by a pass-through (the layer hooks, the
  mode's dispatch into Python at every operation, and the watch's entry and exit remain);
- ``watch``: the engine as it is.

``watch - hooks`` is the watch's own logic per forward (the figure its optimizations move), ``hooks - plain`` the
rest. Printed as one JSON line: the median over rounds of each arm's mean forward time (ms) and of the paired
differences, with the number of operations the watch saw in one forward.

    PYTHONPATH=src python benchmarks/host_cost.py [--rounds 40] [--device cuda]
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
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--forwards", type=int, default=10, help="forwards per arm per round")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    import transformers

    import dptrain
    from dptrain.rows import watch

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=12, n_embd=32, n_head=4, vocab_size=256, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).to(device)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 256, (4, 16), device=device)

    def losses():
        logits = model(input_ids=ids).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = dptrain.PrivacyEngine(model, batch_size=4, sample_size=1000, noise_multiplier=1.0, max_grad_norm=1.0)
    engine.attach(optimizer)
    for _ in range(3):
        engine.backward(losses())
        optimizer.step()
        optimizer.zero_grad()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def forwards(net) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(args.forwards):
            net(input_ids=ids)
        sync()
        return (time.perf_counter() - start) / args.forwards * 1e3

    watched = watch.ForwardWatch.__torch_function__

    def passthrough(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

    counted = []
    original_enter = watch.ForwardWatch.__enter__

    def counting_enter(self):
        counted.append(self)
        return original_enter(self)

    watch.ForwardWatch.__enter__ = counting_enter
    model(input_ids=ids)
    watch.ForwardWatch.__enter__ = original_enter
    operations = counted[-1].operations
    followed = counted[-1].verified_record() is not None

    times = {"plain": [], "hooks": [], "watch": []}
    for round_ in range(args.rounds + 1):
        for arm in ("watch", "hooks", "plain"):
            watch.ForwardWatch.__torch_function__ = passthrough if arm == "hooks" else watched
            elapsed = forwards(plain if arm == "plain" else model)
            if round_:  # (the first round warms each arm up)
                times[arm].append(elapsed)
    watch.ForwardWatch.__torch_function__ = watched
    engine.detach()

    def paired(a: str, b: str) -> float:
        return round(statistics.median(x - y for x, y in zip(times[a], times[b])), 2)

    print(json.dumps({
        "device": str(device), "dptrain": dptrain.__file__, "torch": torch.__version__,
        "operations_per_forward": operations, "followed_a_verified_trace": followed,
        **{f"{arm}_ms": round(statistics.median(t), 2) for arm, t in times.items()},
        "watch_logic_ms": paired("watch", "hooks"), "hooks_and_dispatch_ms": paired("hooks", "plain"),
    }))


if __name__ == "__main__":
    main()
