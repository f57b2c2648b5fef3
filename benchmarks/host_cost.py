"""The host's share of a private step: Python and dispatch, measured where the arithmetic is negligible (issues 42, 43).

Models of width 64 or less on one CPU thread (or on a GPU, ``--device cuda``, whose host then bounds the step), the
arms alternating within each round so that load from other processes hits them alike:

- ``--what forward``: a training forward (gradients enabled, no backward) of the model alone and of the model with an
  engine attached, after three private steps;
- ``--what step`` (default): the whole step - forward, backward, ``optimizer.step()`` and ``zero_grad()`` -
  non-private (the mean of the losses, ``backward()``, AdamW) and private (``engine.backward`` of the per-sample
  losses, the same AdamW), each phase timed.

Also the aten operations each arm dispatches in a forward or a step (non-view operations, counted by a
``TorchDispatchMode`` in one extra run). Printed: one JSON line per model, with the medians over rounds (ms) and the
private/non-private ratios.

Models (``--models``, comma-separated):

- ``gpt2``: a 12-layer GPT-2 of width 32 (4 heads, vocabulary 256), batch 4, 16 tokens;
- ``llama``: a 16-layer Llama of width 64 (4 heads, 2 key-value heads: grouped-query attention; SwiGLU), batch 4,
  16 tokens; ``llama-lora``: the same with LoRA of rank 4 on every linear layer (peft);
- ``resnet18-gn``: torchvision's ResNet-18 with GroupNorm at its full width, 32 x 32 images, batch 4. Its noise is 11 M
  numbers, arithmetic on one thread (about 44 ms): its private arm runs at noise 0, and the draw is timed apart
  (``noise_draw_ms``), outside the ratio.

    PYTHONPATH=src python benchmarks/host_cost.py [--what step] [--models gpt2,llama] [--rounds 20] [--device cpu]
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

MODELS = ("gpt2", "llama", "llama-lora", "resnet18-gn")


class _Counting(TorchDispatchMode):
    """Counts the aten operations dispatched, views apart (they compute nothing)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _build(name: str, device: torch.device):
    """(model, batch, per-sample losses function) of one model of the yardstick."""
    torch.manual_seed(0)
    if name == "resnet18-gn":
        import torchvision

        model = torchvision.models.resnet18(weights=None, num_classes=10,
                                            norm_layer=lambda c: torch.nn.GroupNorm(32, c)).to(device)
        batch = (torch.randn(4, 3, 32, 32, device=device), torch.randint(0, 10, (4,), device=device))
        return model, batch, lambda m, x, y: F.cross_entropy(m(x), y, reduction="none")
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=12, n_embd=32, n_head=4, vocab_size=256, n_positions=64)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=16,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                          max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(config)
        if name == "llama-lora":
            import peft

            targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                               target_modules=targets))
    model = model.to(device)
    ids = torch.randint(0, 256, (4, 16), device=device)

    def losses(m, ids):
        logits = m(input_ids=ids).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)

    return model, (ids,), losses


class _Arm:
    """One arm: a model, its optimizer, and for the private arm its engine."""

    def __init__(self, model, losses_fn, batch, private: bool, noise: float):
        import dptrain

        self.model, self.losses_fn, self.batch, self.private = model, losses_fn, batch, private
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-6)
        self.engine = None
        if private:
            self.engine = dptrain.PrivacyEngine(model, batch_size=batch[0].shape[0], sample_size=1000,
                                                noise_multiplier=noise, max_grad_norm=1.0)
            self.engine.attach(self.optimizer)

    def forward(self):
        return self.losses_fn(self.model, *self.batch)

    def backward(self, losses):
        if self.private:
            self.engine.backward(losses)
        else:
            losses.mean().backward()

    def update(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self):
        self.backward(self.forward())
        self.update()


def _timed(sync, fn):
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - start) * 1e3


def _count(fn) -> int:
    with _Counting() as counting:
        fn()
    return counting.count


def measure(name: str, what: str, rounds: int, device: torch.device) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model, batch, losses_fn = _build(name, device)
    noise = 0.0 if name == "resnet18-gn" else 1.0
    arms = {"non_private": _Arm(copy.deepcopy(model), losses_fn, batch, False, noise),
            "private": _Arm(model, losses_fn, batch, True, noise)}
    for arm in arms.values():  # (warm-up: the first steps build caches, the private one proves its graph in full)
        for _ in range(3):
            arm.step()
    times = {arm: {"forward": [], "backward": [], "update": [], "step": []} for arm in arms}
    for round_ in range(rounds + 1):
        for key, arm in arms.items():
            if what == "forward":
                with torch.enable_grad():
                    _, t = _timed(sync, arm.forward)
                if round_:
                    times[key]["forward"].append(t)
                continue
            losses, t_fwd = _timed(sync, arm.forward)
            _, t_bwd = _timed(sync, functools.partial(arm.backward, losses))
            del losses
            _, t_upd = _timed(sync, arm.update)
            if round_:
                for phase, t in (("forward", t_fwd), ("backward", t_bwd), ("update", t_upd),
                                 ("step", t_fwd + t_bwd + t_upd)):
                    times[key][phase].append(t)
    phases = ("forward",) if what == "forward" else ("forward", "backward", "update", "step")
    out = {"model": name, "what": what, "device": str(device), "torch": torch.__version__, "rounds": rounds}
    for phase in phases:
        for key in arms:
            out[f"{key}_{phase}_ms"] = round(statistics.median(times[key][phase]), 3)
        out[f"{phase}_ratio"] = round(out[f"private_{phase}_ms"] / out[f"non_private_{phase}_ms"], 3)
    for key, arm in arms.items():
        out[f"{key}_operations"] = _count(arm.forward if what == "forward" else arm.step)
    out["operations_ratio"] = round(out["private_operations"] / out["non_private_operations"], 3)
    if name == "resnet18-gn":  # (left out of the private arm: arithmetic on one thread)
        numel = sum(p.numel() for p in model.parameters())
        _, out["noise_draw_ms"] = _timed(sync, lambda: torch.randn(numel, device=device))
    arms["private"].engine.detach()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=("forward", "step"), default="step")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"--models: {name!r} is none of {', '.join(MODELS)}")
        print(json.dumps(measure(name, args.what, args.rounds, device)), flush=True)


if __name__ == "__main__":
    main()
