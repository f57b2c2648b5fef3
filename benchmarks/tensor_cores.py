"""The per-sample math of bf16 operands on tensor cores against the widened float32 products (issue 43, item 2).

For a Llama-like linear layer (B x T tokens, d -> p) in bf16: the two Gram matrices of the ghost norm
(``linear.gram_inner``) and book-keeping's clipped sum (``numerics.factor_weighted_sum``), each as the engine forms
it on this device (``numerics.takes_out_dtype``: tensor cores, float32 results) and as it is formed where it cannot
(both operands widened to float32 first), plus the non-private weight gradient (one bf16 product) for scale. Each
timing is the median of 20 after 3 warm-up calls; prints one JSON line per shape with the largest relative gap
between the two forms against the float64 value.

    PYTHONPATH=src python benchmarks/tensor_cores.py            # on a GPU (under 30 s)
    PYTHONPATH=src python benchmarks/tensor_cores.py --dry-run  # tiny shapes on the CPU: the script runs
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from dptrain.layers import linear, numerics

#: (name, B, T, d, p): a 1.1 B Llama's projections at T 256, its MLP, the same at T 4,096 (B 2), GPT-2's head
SHAPES = [("llama-qkvo-t256", 8, 256, 2048, 2048), ("llama-up-t256", 8, 256, 2048, 5632),
          ("llama-qkvo-t4096", 2, 4096, 2048, 2048), ("gpt2-head-t100", 32, 100, 768, 50257)]
DRY = [("tiny", 2, 8, 16, 24)]


def _timed(fn, sync) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _widened(fn):
    """``fn`` with the device's float32-result products turned off: both operands widened first, as on the CPU."""
    def run(*args):
        saved = dict(numerics._TAKES_OUT_DTYPE)
        numerics._TAKES_OUT_DTYPE.update({k: False for k in ("cuda", "cpu")})
        try:
            return fn(*args)
        finally:
            numerics._TAKES_OUT_DTYPE.clear()
            numerics._TAKES_OUT_DTYPE.update(saved)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    native = numerics.takes_out_dtype(device)
    for name, B, T, d, p in DRY if args.dry_run else SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(B, T, d, device=device, generator=gen).to(torch.bfloat16)
        g = torch.randn(B, T, p, device=device, generator=gen).to(torch.bfloat16) / p ** 0.5
        factor = torch.rand(B, device=device, generator=gen)
        row = {"shape": name, "B": B, "T": T, "d": d, "p": p, "device": torch.cuda.get_device_name(device)
               if device.type == "cuda" else "cpu", "torch": torch.__version__, "native_float32_results": native}
        row["weight_grad_bf16_ms"] = round(_timed(functools.partial(torch.mm, g.flatten(0, 1).t(), a.flatten(0, 1)), sync), 3)
        if T <= 1024:  # (the Gram matrices are [B, T, T]: the planner instantiates beyond)
            row["gram_ms"] = round(_timed(functools.partial(linear.gram_inner, a, g), sync), 3)
            row["gram_widened_ms"] = round(_timed(functools.partial(_widened(linear.gram_inner), a, g), sync), 3)
        row["clipped_sum_ms"] = round(_timed(functools.partial(numerics.factor_weighted_sum, a, g, factor), sync), 3)
        row["clipped_sum_widened_ms"] = round(
            _timed(functools.partial(_widened(numerics.factor_weighted_sum), a, g, factor), sync), 3)
        if B * T * max(d, p) <= 2**26:  # (the float64 value on the device, where it fits)
            exact = torch.einsum("b,btd,btp->dp", factor.double(), a.double(), g.double())
            scale = exact.abs().max()
            for key, fn in (("clipped_sum", numerics.factor_weighted_sum),
                            ("clipped_sum_widened", _widened(numerics.factor_weighted_sum))):
                got = fn(a, g, factor)
                row[f"{key}_relative_error"] = float((got.double() - exact).abs().max() / scale)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
