"""Process bodies for tests/test_distributed.py (spawned processes import them from here).

Each worker joins a gloo process group, trains the same seeded model on its rank's share
of the same global batches, and saves what the parent test compares: the final (full)
parameters, and for the noise test the private gradient of one step.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dptrain

FEATURES, CLASSES, GLOBAL_BATCH, SAMPLE_SIZE = 6, 4, 8, 64


class Net(nn.Module):
    """Embedding, linear, LayerNorm, conv and GroupNorm: every rule family the engines shard."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, FEATURES)
        self.conv = nn.Conv1d(FEATURES, 8, kernel_size=3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.fc1 = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, CLASSES)

    def forward(self, tokens):
        h = self.embed(tokens).transpose(1, 2)          # [B, F, T]
        h = torch.tanh(self.gn(self.conv(h))).mean(2)   # [B, 8]
        return self.fc2(torch.tanh(self.ln(self.fc1(h))))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Net().double()


def global_batches(steps: int, micro: int = 1):
    """The same global batches in every process: [(tokens, labels)] per micro-batch per step."""
    g = torch.Generator().manual_seed(1)
    return [
        [(torch.randint(0, 10, (GLOBAL_BATCH, 5), generator=g), torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g))
         for _ in range(micro)]
        for _ in range(steps)
    ]


def losses_fn(model, tokens, labels):
    return F.cross_entropy(model(tokens), labels, reduction="none")


def train(model, engine_model, mode: str, style, steps: int, micro: int, sigma: float, rank: int, world: int,
          max_grad_norm: float = 0.05, seed: int = 0, use_engine_backward: bool = True, empty_first: int = -1):
    """Train; rank r takes rows r, r + world, ... of every global micro-batch.

    ``empty_first``: the rank whose first micro-batch is empty (its rows drop out of the
    global batch); with ``world == 1`` the rows of that rank's share are dropped instead.
    """
    engine = dptrain.PrivacyEngine(
        engine_model, batch_size=GLOBAL_BATCH, sample_size=SAMPLE_SIZE, max_grad_norm=max_grad_norm,
        noise_multiplier=sigma, clipping_mode=mode, clipping_style=style, seed=seed,
    )
    opt = torch.optim.SGD(model.parameters() if engine_model is model else engine_model.parameters(), lr=0.5)
    engine.attach(opt)
    for k, step in enumerate(global_batches(steps, micro)):
        for j, (tokens, labels) in enumerate(step):
            local = (tokens[rank::world], labels[rank::world])
            if k == j == 0 and empty_first >= 0:
                if world > 1 and rank == empty_first:
                    local = (tokens[:0], labels[:0])
                elif world == 1:
                    keep = torch.arange(len(labels)) % 2 != empty_first
                    local = (tokens[keep], labels[keep])
            if use_engine_backward:
                engine.backward(losses_fn(engine_model, *local))
            else:
                F.cross_entropy(engine_model(local[0]), local[1]).backward()
        opt.step()
        opt.zero_grad()
    return engine


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name.removeprefix("module.")] = t.clone()
    return out


def _init(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _wrap(model: nn.Module, engine_kind: str, parts: tuple[str, ...]) -> nn.Module:
    """The model under DDP, or under FSDP2 with each of ``parts`` (its children) sharded apart."""
    if engine_kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for name in parts:
        fully_shard(getattr(model, name))
    return fully_shard(model)


def run_training(rank: int, world: int, port: int, engine_kind: str, mode: str, style, steps: int, micro: int,
                 sigma: float, out: str, plain_backward: bool = False, empty_first: int = -1) -> None:
    """Train under DDP or FSDP2 and save the final full parameters (from every rank)."""
    _init(rank, world, port)
    try:
        model = build_model()
        wrapped = _wrap(model, engine_kind, ("conv", "fc1", "fc2"))
        engine = train(wrapped, wrapped, mode, style, steps, micro, sigma, rank, world,
                       use_engine_backward=not plain_backward, empty_first=empty_first)
        torch.save({"params": full_params(wrapped), "steps": engine.steps_taken, "epsilon": engine.get_epsilon()},
                   f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


def run_training_cuda(rank: int, world: int, port: int, mode: str, out: str) -> None:
    """DDP over NCCL, one GPU per rank (spawned): 3 steps of 2 micro-batches, noise 0."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        model = build_model().cuda(rank)
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[rank])
        engine = dptrain.PrivacyEngine(wrapped, batch_size=GLOBAL_BATCH, sample_size=SAMPLE_SIZE, max_grad_norm=0.05,
                                       noise_multiplier=0.0, clipping_mode=mode)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
        engine.attach(opt)
        for step in global_batches(3, 2):
            for tokens, labels in step:
                engine.backward(losses_fn(wrapped, tokens[rank::world].cuda(rank), labels[rank::world].cuda(rank)))
            opt.step()
            opt.zero_grad()
        torch.save({"params": {k: v.cpu() for k, v in full_params(wrapped).items()}}, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


class Wide(nn.Module):
    """Many coordinates for a statistical test of the noise."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(40, 50)
        self.fc2 = nn.Linear(50, 40)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def run_noise(rank: int, world: int, port: int, engine_kind: str, sigma: float, max_grad_norm: float,
              out: str) -> None:
    """One noisy step; save the private gradient (as full tensors) and the clipped sum from the oracle."""
    _init(rank, world, port)
    try:
        torch.manual_seed(0)
        model = Wide().double()
        reference = {n: p.detach().clone() for n, p in model.named_parameters()}
        g = torch.Generator().manual_seed(3)
        x = torch.randn(GLOBAL_BATCH, 40, generator=g, dtype=torch.float64)
        y = torch.randint(0, 40, (GLOBAL_BATCH,), generator=g)
        wrapped = _wrap(model, engine_kind, ("fc1", "fc2"))
        engine = dptrain.PrivacyEngine(wrapped, batch_size=GLOBAL_BATCH, sample_size=SAMPLE_SIZE,
                                       max_grad_norm=max_grad_norm, noise_multiplier=sigma, seed=1234)
        opt = torch.optim.SGD(wrapped.parameters(), lr=1.0)
        engine.attach(opt)
        engine.backward(F.cross_entropy(wrapped(x[rank::world]), y[rank::world], reduction="none"))
        opt.step()
        grads = {}
        for name, p in wrapped.named_parameters():
            t = p.grad
            grads[name.removeprefix("module.")] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
        torch.save({"grads": grads, "params": full_params(wrapped), "initial": reference, "x": x, "y": y},
                   f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


def run_correlated_noise(rank: int, world: int, port: int, engine_kind: str, steps: int, out: str) -> None:
    """``steps`` empty steps with banded correlated noise (pure noise); save each step's private gradient."""
    _init(rank, world, port)
    try:
        import warnings

        from dptrain.correlated import BandedToeplitz

        torch.manual_seed(0)
        model = Wide()
        wrapped = _wrap(model, engine_kind, ("fc1", "fc2"))
        engine = dptrain.PrivacyEngine(wrapped, batch_size=1, sample_size=SAMPLE_SIZE, noise_multiplier=1.0,
                                       noise=BandedToeplitz((0.8, 0.6)), steps=steps, seed=1234)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no loader to check
            engine.attach(opt)
        grads = []
        for _ in range(steps):
            opt.step()
            grads.append(torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten()
                                    for p in wrapped.parameters()]).clone())
            opt.zero_grad()
        torch.save({"grads": torch.stack(grads, 1)}, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


def run_wrong_use(rank: int, world: int, port: int, out: str) -> None:
    """Errors that must be raised on every rank, saved as their messages."""
    _init(rank, world, port)
    messages = {}
    try:
        model = build_model()
        try:
            dptrain.PrivacyEngine(nn.parallel.DistributedDataParallel(model, static_graph=True), batch_size=8,
                                  sample_size=64, noise_multiplier=1.0)
        except NotImplementedError as e:
            messages["static_graph"] = str(e)
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dptrain.PrivacyEngine(build_model(), batch_size=8, sample_size=64, noise_multiplier=1.0)
        messages["unwrapped"] = " | ".join(str(w.message) for w in caught)
        torch.save(messages, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


def run_scaler_overflow(rank: int, world: int, port: int, out: str) -> None:
    """DDP + GradScaler where only rank 1's batch overflows: every rank skips the step, and counts it."""
    _init(rank, world, port)
    try:
        model = build_model().float()
        initial = full_params(model)
        ddp = nn.parallel.DistributedDataParallel(model)
        engine = dptrain.PrivacyEngine(ddp, batch_size=GLOBAL_BATCH, sample_size=SAMPLE_SIZE, noise_multiplier=1.0,
                                       seed=0)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        engine.attach(opt, grad_scaler=scaler)
        (tokens, labels), = global_batches(1)[0]
        losses = F.cross_entropy(ddp(tokens[rank::world]), labels[rank::world], reduction="none")
        if rank == 1:
            losses = losses * float("inf")  # an fp16 overflow on this rank only
        engine.backward(scaler.scale(losses))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        unchanged = all(torch.equal(full_params(ddp)[n], initial[n]) for n in initial)
        torch.save({"unchanged": unchanged, "steps": engine.steps_taken, "scale": scaler.get_scale()},
                   f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


class Leaky(nn.Module):
    """Uses fc2's weight a second time outside fc2's own call: its gradient would escape clipping."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc2(torch.tanh(self.fc1(x)))
        return h + F.linear(h, self.fc2.weight)


def run_leak(rank: int, world: int, port: int, out: str) -> None:
    """FSDP2 with a parameter used outside its layer: refused on every rank, nothing applied."""
    _init(rank, world, port)
    try:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = fully_shard(Leaky().double())  # root only: every weight is unsharded during the forward
        initial = full_params(model)
        engine = dptrain.PrivacyEngine(model, batch_size=GLOBAL_BATCH, sample_size=SAMPLE_SIZE, noise_multiplier=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        engine.attach(opt)
        x = torch.randn(GLOBAL_BATCH, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        message = ""
        try:  # FSDP2 calls the parameter's post-accumulate-grad hooks after its reduce-scatter
            engine.backward(model(x[rank::world]).square().sum(1))
            opt.step()
        except RuntimeError as e:
            message = str(e)
        unchanged = all(torch.equal(full_params(model)[n], initial[n]) for n in initial)
        torch.save({"message": message, "unchanged": unchanged}, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


def train_zero(model, wrapped, optimizer, engine, rank: int, world: int, steps: int = 3) -> None:
    for step in global_batches(steps, micro=2):
        for tokens, labels in step:
            engine.backward(losses_fn(wrapped, tokens[rank::world], labels[rank::world]))
        optimizer.step()
        optimizer.zero_grad()


def run_zero(rank: int, world: int, port: int, out: str) -> None:
    """ZeroRedundancyOptimizer (Adam, sharded state) under DDP: trained with the engine attached to it (noise 0);
    the messages when the engine is attached to its local optimizer, when that is stepped on its own, and for
    overlap_with_ddp=True."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    _init(rank, world, port)
    messages = {}
    try:
        def setup():
            model = build_model()
            ddp = nn.parallel.DistributedDataParallel(model)
            engine = dptrain.PrivacyEngine(ddp, batch_size=GLOBAL_BATCH, sample_size=SAMPLE_SIZE, max_grad_norm=0.05,
                                           noise_multiplier=0.0)
            zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.05)
            return ddp, engine, zero

        ddp, engine, zero = setup()
        engine.attach(zero)
        train_zero(ddp, ddp, zero, engine, rank, world)
        params, steps = full_params(ddp), engine.steps_taken
        engine.backward(losses_fn(ddp, *[t[rank::world] for t in global_batches(1)[0][0]]))
        try:
            zero.optim.step()
        except RuntimeError as e:
            messages["inner stepped"] = str(e)
        engine.detach()

        ddp, engine, zero = setup()
        engine.attach(zero.optim)
        initial = full_params(ddp)
        engine.backward(losses_fn(ddp, *[t[rank::world] for t in global_batches(1)[0][0]]))
        try:
            zero.step()
        except RuntimeError as e:
            messages["attached to inner"] = str(e)
        messages["unchanged"] = all(torch.equal(full_params(ddp)[n], initial[n]) for n in initial)
        engine.detach()

        ddp, engine, _ = setup()
        overlapping = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1,
                                              overlap_with_ddp=True)
        try:
            engine.attach(overlapping)
        except NotImplementedError as e:
            messages["overlap"] = str(e)
        torch.save({"params": params, "steps": steps, "messages": messages}, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


def run_sampling_check(rank: int, world: int, port: int, out: str) -> None:
    """The sampling check sums the ranks' counts: fixed-size local batches (the same global size every step) are
    found on every rank at the same step; each rank's shard of a Poisson sample (poisson_loader(distributed=True))
    is not."""
    import warnings

    from torch.utils.data import TensorDataset

    _init(rank, world, port)
    found = {}
    try:
        for kind in ("fixed", "poisson"):
            ddp = nn.parallel.DistributedDataParallel(build_model())
            engine = dptrain.PrivacyEngine(ddp, batch_size=GLOBAL_BATCH, sample_size=SAMPLE_SIZE, noise_multiplier=0.0)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            engine.attach(opt)
            g = torch.Generator().manual_seed(5)
            data = TensorDataset(torch.randint(0, 10, (SAMPLE_SIZE, 5), generator=g),
                                 torch.randint(0, CLASSES, (SAMPLE_SIZE,), generator=g))
            if kind == "fixed":
                batches = [data[(torch.arange(GLOBAL_BATCH // world) + 3 * k + rank * 40) % SAMPLE_SIZE]
                           for k in range(30)]
            else:
                batches = dptrain.data.poisson_loader(data, batch_size=GLOBAL_BATCH, steps=40, distributed=True,
                                                      generator=torch.Generator().manual_seed(6))
            seen = []
            for tokens, labels in batches:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    engine.backward(losses_fn(ddp, tokens, labels))
                    opt.step()
                    opt.zero_grad()
                seen += [(engine.steps_taken, str(w.message)) for w in caught if "Poisson" in str(w.message)]
            found[kind] = seen
            engine.detach()
        torch.save(found, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()
