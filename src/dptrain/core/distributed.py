"""Data-parallel training on PyTorch's own engines: DistributedDataParallel and FSDP2.

Every clipping mode uses ghost differentiation, so autograd never accumulates a parameter
gradient and the engines' own gradient reduction (DDP's reducer, FSDP2's reduce-scatter
after each module's backward) has nothing to reduce. Each rank clips its own samples into
a local sum; once per logical step the summed clipped gradients are reduced across ranks
with the engine's process group or device mesh, and Gaussian noise enters exactly once:

* DDP — rank 0 adds ``N(0, sigma^2 R^2 I)`` to its local sum, then one ``all_reduce``
  per bucket of parameters; every rank gets the same noisy sum. DDP's per-backward
  synchronisation stays off while the engine is attached (its ``no_sync`` context).
* FSDP2 (``fully_shard``) — the local sums are reduced *and* sharded (a DTensor
  redistribution from ``Partial`` to the parameter's ``Shard`` placement, i.e. a
  reduce-scatter); each rank adds the noise of the coordinates it owns, so every
  coordinate gets one draw, from the rank that owns it.

Norms need no communication: a rank holds the full activations and output gradients of
its own samples (the unsharded parameters are in place during each module's forward and
backward), so every clipping style is exact under both engines.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# One all_reduce carries at most this many bytes (DDP's default bucket is 25 MiB).
_BUCKET_BYTES = 25 * 2**20


def _qualified_names(obj) -> list[str]:
    return [f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__]


def is_dtensor(t) -> TypeGuard[DTensor]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return False
    return isinstance(t, DTensor)


def refuse_deepspeed(obj) -> None:
    """DeepSpeed engines and optimizers, recognised by their classes' module (deepspeed is not imported)."""
    if any(n.startswith("deepspeed.") for n in _qualified_names(obj)):
        raise NotImplementedError(
            f"DeepSpeed ({type(obj).__name__}) is not supported yet: dptrain clips inside the model's backward "
            "and DeepSpeed's ZeRO stages own the gradient buffers. Train with torch DistributedDataParallel "
            "or FSDP2 (torch.distributed.fsdp.fully_shard) instead"
        )


def _is_zero(optimizer) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def zero_inner(optimizer) -> torch.optim.Optimizer | None:
    """The local optimizer of a ``torch.distributed.optim.ZeroRedundancyOptimizer`` (this rank's shard of the
    parameters, stepped by the wrapper's ``step()``, which then broadcasts each shard), or None."""
    return getattr(optimizer, "optim", None) if _is_zero(optimizer) else None


def refuse_unsupported_optimizer(optimizer) -> None:
    """DeepSpeed's optimizers, and ZeroRedundancyOptimizer's mode that steps inside DDP's communication hook."""
    refuse_deepspeed(optimizer)
    if _is_zero(optimizer) and getattr(optimizer, "_overlap_with_ddp", False):
        raise NotImplementedError(
            "ZeroRedundancyOptimizer(overlap_with_ddp=True) steps inside DDP's gradient communication hook, which "
            "never runs while the engine is attached (the engine reduces the clipped sums itself, once per step): "
            "build it with overlap_with_ddp=False (the default), and call its step() as usual"
        )


def refuse_unsupported(model: nn.Module) -> None:
    """Clear errors for wrappers whose gradient handling the engine cannot take over."""
    refuse_deepspeed(model)
    if isinstance(model, nn.DataParallel):
        raise NotImplementedError(
            "nn.DataParallel runs replicas of the model on threads, which the engine's hooks cannot follow: "
            "use torch.nn.parallel.DistributedDataParallel (one process per device, e.g. launched by torchrun)"
        )
    for name, module in model.named_modules():
        if any(n.startswith("torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel")
               for n in _qualified_names(module)):
            raise NotImplementedError(
                f"{name or 'the model'} is wrapped in FSDP1 (FullyShardedDataParallel), whose flat parameters "
                "hide the layers' weights: use FSDP2, torch.distributed.fsdp.fully_shard(module), instead"
            )


class DataParallel:
    """What the engine needs from a data-parallel engine: its rank and the noisy global sum."""

    rank = 0
    group: dist.ProcessGroup | None = None  # the process group of the collectives (None: the default group)

    def attach(self) -> None:
        """Called by ``PrivacyEngine.attach``."""

    def detach(self) -> None:
        """Called by ``PrivacyEngine.detach``."""

    def noisy_sum(self, params: Sequence[nn.Parameter], local: list[torch.Tensor],
                  add_noise: Callable[[nn.Parameter, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """Sum of the ranks' ``local`` clipped sums plus noise once; one tensor per parameter
        (the parameter's local shard under FSDP2). ``add_noise(p, t)``: the parameter's noise into ``t``."""
        raise NotImplementedError

    def as_grad(self, p: nn.Parameter, value: torch.Tensor) -> torch.Tensor:
        """``value`` in the form ``p.grad`` must take."""
        return value

    def maximum(self, values: list[float], device: torch.device) -> list[float]:
        """Each value's maximum over the ranks (one collective)."""
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def total(self, values: list[float], device: torch.device) -> list[float]:
        """Each value's sum over the ranks (one collective)."""
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t.tolist()

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when ``flag`` is true on some rank."""
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item() > 0)


class DDPGradients(DataParallel):
    """DistributedDataParallel: noise on rank 0, one all_reduce per bucket of the flattened sums."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel):
        if getattr(ddp, "static_graph", False):
            raise NotImplementedError(
                "DistributedDataParallel(static_graph=True) expects its reducer to see every gradient: "
                "build DDP without static_graph for private training"
            )
        self.ddp = ddp
        self.group = ddp.process_group
        self.rank = dist.get_rank(self.group)
        self._no_sync: contextlib.AbstractContextManager | None = None

    def attach(self) -> None:
        # DDP's reducer waits for autograd to accumulate gradients, which ghost differentiation
        # never does; with its sync on, the next forward would fail ("Expected to have finished
        # reduction in the prior iteration"). The engine reduces the clipped sums itself.
        self._no_sync = self.ddp.no_sync()
        self._no_sync.__enter__()

    def detach(self) -> None:
        if self._no_sync is not None:
            self._no_sync.__exit__(None, None, None)
            self._no_sync = None

    def noisy_sum(self, params, local, add_noise):
        if self.rank == 0:
            local = [add_noise(p, t) for p, t in zip(params, local)]
        for bucket in _buckets(local):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return local


class FSDP2Gradients(DataParallel):
    """fully_shard: reduce-scatter of each local sum to the parameter's shard; noise per owned coordinate."""

    def __init__(self, params: Sequence[nn.Parameter]):
        from torch.distributed.tensor import Shard

        sharded = [p for p in params if is_dtensor(p)]
        plain = [p for p in params if not is_dtensor(p)]
        if plain:
            raise NotImplementedError(
                f"{len(plain)} trainable parameter(s) are not sharded by fully_shard while others are: apply "
                "fully_shard to the root module too (it shards every parameter not sharded by a nested call)"
            )
        mesh = sharded[0].device_mesh
        if any(p.device_mesh != mesh for p in sharded):  # each fully_shard builds an equal default mesh
            raise NotImplementedError("parameters sharded over different device meshes are not supported")
        for p in sharded:
            if not all(isinstance(pl, Shard) for pl in p.placements):
                raise NotImplementedError(
                    f"a parameter has placements {p.placements}: only fully sharded parameters are supported "
                    "(HSDP replicates shards, and each replica would draw its own noise)"
                )
        self.mesh = mesh
        self.group = mesh.get_group() if mesh.ndim == 1 else None
        self.rank = dist.get_rank()

    def noisy_sum(self, params, local, add_noise):
        from torch.distributed.tensor import DTensor, Partial

        out = []
        for p, t in zip(params, local):
            partial = DTensor.from_local(t, p.device_mesh, [Partial()] * p.device_mesh.ndim, run_check=False)
            shard = partial.redistribute(p.device_mesh, p.placements).to_local()
            out.append(add_noise(p, shard))
        return out

    def as_grad(self, p, value):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())



def data_parallel(model: nn.Module) -> tuple[nn.Module, DataParallel | None]:
    """The module whose layers the engine hooks, and the data-parallel engine around it (or None)."""
    refuse_unsupported(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        inner = model.module
        refuse_unsupported(inner)
        if any(is_dtensor(p) for p in inner.parameters()):
            raise NotImplementedError("DDP around a fully_shard model is not supported: use fully_shard alone")
        return inner, DDPGradients(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if any(is_dtensor(p) for p in trainable):
        return model, FSDP2Gradients(trainable)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        warnings.warn(
            f"torch.distributed runs {dist.get_world_size()} processes but the model given to the engine is "
            "neither DistributedDataParallel nor fully_shard: every process trains alone, with its own noise. "
            "Pass the wrapped model (PrivacyEngine(DDP(model), ...)) for data-parallel private training",
            stacklevel=3,
        )
    return model, None


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one device and dtype, about ``_BUCKET_BYTES`` per bucket."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        last = buckets[-1] if buckets else None
        if (last is None or size + t.numel() * t.element_size() > _BUCKET_BYTES
                or (last[0].device, last[0].dtype) != (t.device, t.dtype)):
            buckets.append([t])
            size = t.numel() * t.element_size()
        else:
            last.append(t)
            size += t.numel() * t.element_size()
    return buckets
