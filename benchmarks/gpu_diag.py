"""What the engine does differently on a GPU: the open questions of issue 36's runs, one call each, on the GPU machine.

    PYTHONPATH=src:benchmarks:tests python benchmarks/gpu_diag.py steps resnet18-gn-224-b128 --amp bf16
    PYTHONPATH=src:benchmarks:tests python benchmarks/gpu_diag.py case transformer ghost
    PYTHONPATH=src:benchmarks:tests python benchmarks/gpu_diag.py oom bk-mixopt

- ``steps CONFIG``: per step of a benchmark configuration (bk-mixopt), the tag passes it ran, where its forward left
  the verified traces (the operation, and what the trace expected there), and where the graph proof stopped. On an
  H200 (2026-11-27) ResNet-18-GN at batch 128 under bf16 autocast ran 4 tag passes at *every* step although the
  proof was complete, and the first step under torch's profiler verified anew (fp32 steady steps did not).
- ``case NAME MODE``: a test case (``tests/helpers.py``) in float32 on CUDA against the float64 oracle, with each
  layer call's row map as the backward read it. The two-pass modes (ghost, mix-ghost, fast-grad-clip) were wrong
  on the ``transformer`` case there (which of them varied between runs), exact on the CPU in float32 and float64.
- ``oom MODE``: the out-of-memory test's batch (``tests/test_cuda.py``), then the largest CUDA tensors still alive
  after it, with what refers to them: 52 GB stayed allocated on the H200.
"""
from __future__ import annotations

import argparse
import copy
import gc
import sys

import torch


def _patch_log(log: list[str]) -> None:
    import dptrain.core.backward as backward
    import dptrain.rows.reader as reader
    import dptrain.rows.watch as watch

    tag_pass = backward.Backward._tag_pass

    def logged_tag_pass(self, losses, factor, passes):
        log.append(f"  tag passes: {passes}")
        return tag_pass(self, losses, factor, passes)

    backward.Backward._tag_pass = logged_tag_pass
    prove = reader.prove

    def logged_prove(roots, batch, *args, **kwargs):
        proof = prove(roots, batch, *args, **kwargs)
        log.append(f"  proof: stopped at {proof.stopped_at}, {len(proof.unproven)} unproven of {len(proof.edges)} edges")
        return proof

    reader.prove = logged_prove
    reader_prove = reader.RowReader.prove

    def logged_reader_prove(self, roots, batch, calls):
        unread = [(state.path, call.forward_id) for state, call in calls if call.unread and call.rowmap is None]
        complete = reader_prove(self, roots, batch, calls)
        left = [(state.path, call.forward_id) for state, call in calls if call.unread and call.rowmap is None]
        log.append(f"  reader.prove: complete={complete}, unread before {len(unread)}, left without a map "
                   f"{left[:6]}{' ...' if len(left) > 6 else ''}")
        return complete

    reader.RowReader.prove = logged_reader_prove
    note = watch.ForwardWatch.note

    def logged_note(self, key, where):
        before = self.node
        note(self, key, where)
        if before is not None and self.node is None:
            log.append(f"  left the verified trace at {where}: {str(key)[:300]}\n"
                       f"    expected one of {str(list(before.keys())[:3])[:600]}")

    watch.ForwardWatch.note = logged_note
    resolve = reader.BackwardRows.resolve

    def logged_resolve(self, state, call, batch):
        rowmap = resolve(self, state, call, batch)
        log.append(f"  rows of {state.path} {tuple(call.shape)}: {str(rowmap)[:200]}")
        return rowmap

    if "--rowmaps" in sys.argv:
        reader.BackwardRows.resolve = logged_resolve


def steps(args) -> None:
    from dptrain_bench import zoo
    from dptrain_bench.arms import make_arm
    from dptrain_bench.workers import build

    log: list[str] = []
    _patch_log(log)
    config = zoo.configs_for("gpu")[args.config]
    task, model, batches = build(config, torch.device("cuda"), config.batch_size, 2)
    arm = make_arm("bk-mixopt", model, task, config.batch_size, torch.bfloat16 if args.amp == "bf16" else None)

    def step(k: int, what: str) -> None:
        log.clear()
        arm.step(batches[k % 2])
        print(f"{args.config} {args.amp} {what} {k}:", "\n".join(log) or "  nothing", flush=True)

    for k in range(args.steps):
        step(k, "step")
    if args.profiled:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True):
            for k in range(2):
                step(k, "profiled step")


def case(args) -> None:
    """The test case in float32 on the CPU, then on CUDA ``--repeat`` times (``--deterministic``: torch's deterministic
    algorithms), each against the float64 oracle, with the per-sample gradient norms the engine read (the squared norms
    ``finish`` summed, per group) next to the oracle's: wrong norms mean wrong clipping factors."""
    from dptrain.core.backward import Backward
    from dptrain.testing import clipped_gradient, per_sample_gradients, reference_clipped_gradient
    from helpers import assert_matches, get_case, split_max_grad_norm

    log: list[str] = []
    _patch_log(log)
    torch.set_default_dtype(torch.float64)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.deterministic:
        import os
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    test_case = get_case(args.name)
    R = split_max_grad_norm(test_case, "all-layer")
    oracle = reference_clipped_gradient(test_case.model, test_case.losses_fn, test_case.batch, max_grad_norm=R)
    per_sample = per_sample_gradients(test_case.model, test_case.losses_fn, test_case.batch)
    oracle_norms = torch.stack([g.flatten(1).square().sum(1) for g in per_sample.values()]).sum(0).sqrt()
    norms: list = []
    finish = Backward.finish

    def noted_finish(self, expected, scale):
        group_sq = {}
        for work in self._works.values():
            group_sq[work.group] = group_sq.get(work.group, 0) + work.sq_norm.detach().double().cpu()
        norms.append(sum(group_sq.values()).sqrt() if group_sq else None)
        return finish(self, expected, scale)

    Backward.finish = noted_finish
    runs = [("cpu", 0)] + ([("cuda", k) for k in range(args.repeat)] if torch.cuda.is_available() else [])
    for device, k in runs:
        model = copy.deepcopy(test_case.model).float().to(device)
        batch = tuple(b.to(device, torch.float32) if b.is_floating_point() else b.to(device) for b in test_case.batch)
        log.clear()
        norms.clear()
        got = clipped_gradient(model, test_case.losses_fn, batch, mode=args.mode, max_grad_norm=R)
        print(f"== {args.name} / {args.mode} in float32 on {device} (run {k}):\n" + "\n".join(log))
        print(f"  per-sample norms read: {[None if n is None else [round(float(v), 5) for v in n] for n in norms]}")
        print(f"  the oracle's:          {[round(float(v), 5) for v in oracle_norms]}")
        try:
            assert_matches({n: g.double().cpu() for n, g in got.items()}, oracle, rtol=1e-4, what=device)
            print("  exact")
        except AssertionError as err:
            print("  WRONG:", str(err)[:1500])


def oom(args) -> None:
    import torch.nn.functional as F
    from torch import nn

    from dptrain.testing import attached_engine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(),
                          nn.Conv2d(64, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).cuda()
    engine, _ = attached_engine(model, mode=args.mode, max_grad_norm=0.5, loss_reduction="sum")
    baseline = torch.cuda.memory_allocated()
    free, _ = torch.cuda.mem_get_info()
    batch = max(8, int(free / (64 * 64 * 64 * 4 * 3)) + 1)
    try:
        x = torch.randn(batch, 3, 64, 64, device="cuda")
        y = torch.randint(0, 10, (batch,), device="cuda")
        losses = F.cross_entropy(model(x), y, reduction="none")
        engine.backward(losses)
        print("the batch fit")
    except torch.cuda.OutOfMemoryError as err:
        print("out of memory:", str(err)[:200])
    x = y = losses = None
    gc.collect()
    torch.cuda.empty_cache()
    print(f"allocated after: {torch.cuda.memory_allocated() / 2**30:.2f} GiB (baseline {baseline / 2**30:.3f})")
    alive = sorted((o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda),
                   key=lambda t: -t.numel())[:4]
    for t in alive:
        print(f"  alive: {tuple(t.shape)} {t.dtype}, {t.numel() * t.element_size() / 2**30:.2f} GiB")
        for r in gc.get_referrers(t)[:6]:
            if r is alive:
                continue
            what = type(r).__name__
            detail = list(r.keys())[:8] if isinstance(r, dict) else str(r)[:160]
            print(f"    referred to by {what}: {detail}")
            for rr in gc.get_referrers(r)[:3]:
                if rr is not alive and type(rr).__name__ not in ("frame", "list"):
                    print(f"      which {type(rr).__name__} holds: {str(rr)[:160]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("steps")
    p.add_argument("config")
    p.add_argument("--amp", choices=["none", "bf16"], default="none")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profiled", action="store_true")
    p = sub.add_parser("case")
    p.add_argument("name")
    p.add_argument("mode")
    p.add_argument("--rowmaps", action="store_true", help="each layer call's row map as read")
    p.add_argument("--repeat", type=int, default=1, help="CUDA runs in this process (the failures varied)")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    p = sub.add_parser("oom")
    p.add_argument("mode")
    args = parser.parse_args()
    {"steps": steps, "case": case, "oom": oom}[args.what](args)


if __name__ == "__main__":
    main()
