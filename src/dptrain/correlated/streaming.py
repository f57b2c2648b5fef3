"""The correlated noise of a run, one step at a time: ``sigma R kappa (C^{-1} z)_t`` per parameter, streamed.

``C^{-1} z`` is never formed: the banded strategy's inverse is a recurrence over the last ``b - 1`` noise
vectors, the BLT's over ``d`` decaying buffers (``strategies``). Each parameter (each parameter's local shard
under FSDP2) keeps its own buffers, ``buffers`` tensors of its own size in float32 (or its dtype, if wider):
the noise state of a model is ``buffers`` model-sized tensors, what ``plan_noise`` reports.

A parameter's stream belongs to the steps it was noised at, in order. When a parameter is not noised at a
step (frozen, or a skipped step that applies nothing), its stream restarts at the next step it is noised:
its noise is then that of ``C`` restarted there, ``C[s:, s:]``, which has the same columns, bands and
sensitivity as before (lower-triangular Toeplitz), and whose steps keep the run's own numbering, so the
cyclic groups stay ``g`` steps apart. A stream that merely continued over a gap would put two participations
of a unit closer than ``g`` steps in the noise's time, which the amplification argument does not allow.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .privacy import CorrelatedMechanism
from .strategies import BandedToeplitz

__all__ = ["CorrelatedNoise", "NoisePlan", "plan_noise"]


class IidGaussian(Protocol):
    """The i.i.d. Gaussian draws correlated noise is made of: the engine's ``core.noise.GaussianNoise`` (seeded or
    secure). A protocol, so that this package needs nothing of the engine's."""

    secure: bool

    def sample(self, like: torch.Tensor, std: float) -> torch.Tensor: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict, keep_stream: bool = False) -> None: ...


@dataclass
class _Stream:
    step: int  # the last step this parameter was noised at
    head: int  # banded: where the newest noise vector is in ``values`` (a ring)
    values: torch.Tensor  # [buffers, *shape]


class CorrelatedNoise:
    """The engine's noise source for ``noise="bandmf"`` / ``"blt"``: i.i.d. Gaussian draws ``z`` from ``gaussian``
    (seeded or secure, as for DP-SGD), turned into ``kappa (C^{-1} z)_t`` per parameter.

    ``sampler(step)`` gives the function the private step calls once per parameter (its name from
    ``param_name``), ``(p, sum, std) -> noise``; ``std = sigma R``.
    """

    def __init__(self, mechanism: CorrelatedMechanism, gaussian: IidGaussian,
                 param_name: Callable[[nn.Parameter], str]):
        self.mechanism, self.gaussian, self.param_name = mechanism, gaussian, param_name
        self.secure = gaussian.secure
        self._kappa = mechanism.noise_scale
        strategy = mechanism.strategy
        if isinstance(strategy, BandedToeplitz):
            self._lags = [float(c) for c in strategy.coefficients[1:]]
            self._lead = float(strategy.coefficients[0])
        else:
            self._decay, self._scale = [float(v) for v in strategy.decay], [float(v) for v in strategy.scale]
        self._buffers = strategy.buffers
        self._streams: dict[str, _Stream] = {}

    # ------------------------------------------------------------------ drawing
    def sampler(self, step: int) -> Callable[[nn.Parameter, torch.Tensor, float], torch.Tensor]:
        """The noise of step ``step`` (0-based, the engine's count), for each parameter noised at it."""
        # streams not continued at the last step restart anyway: drop them now (their memory too)
        self._streams = {name: s for name, s in self._streams.items() if s.step == step - 1}
        return lambda p, like, std: self._next(self.param_name(p), like, std, step)

    def _next(self, name: str, like: torch.Tensor, std: float, step: int) -> torch.Tensor:
        z = self.gaussian.sample(like, 1.0)
        stream = self._streams.get(name)
        if (stream is None or stream.step != step - 1 or stream.values.shape[1:] != z.shape
                or stream.values.dtype != z.dtype):
            stream = _Stream(step - 1, 0, z.new_zeros((self._buffers, *z.shape)))
        elif stream.values.device != z.device:
            stream.values = stream.values.to(z.device)
        w = self._banded(z, stream) if hasattr(self, "_lags") else self._blt(z, stream)
        stream.step = step
        self._streams[name] = stream
        return w.mul_(std * self._kappa)

    def _banded(self, z: torch.Tensor, stream: _Stream) -> torch.Tensor:
        """``w_t = (z_t - sum_j c_j w_{t-j}) / c_0``; the ring keeps ``w_{t-1}, ..., w_{t-b+1}``."""
        values, k = stream.values, self._buffers
        w = z
        for j, c in enumerate(self._lags, start=1):
            w.sub_(values[(stream.head - (j - 1)) % k], alpha=c)
        w.div_(self._lead)
        if k:
            stream.head = (stream.head + 1) % k
            values[stream.head].copy_(w)
        return w

    def _blt(self, z: torch.Tensor, stream: _Stream) -> torch.Tensor:
        """``w_t = z_t - sum_i scale_i buf_i``, then ``buf_i <- decay_i buf_i + w_t``."""
        values, w = stream.values, z
        for i, scale in enumerate(self._scale):
            w.sub_(values[i], alpha=scale)
        for i, decay in enumerate(self._decay):
            values[i].mul_(decay).add_(w)
        return w

    # ------------------------------------------------------------------ reports and checkpoints
    def memory_bytes(self) -> int:
        """Bytes the noise state holds now (every parameter's buffers)."""
        return sum(s.values.numel() * s.values.element_size() for s in self._streams.values())

    def state_dict(self) -> dict:
        """The mechanism, every parameter's buffers (always: the noise of the next steps depends on them, so a
        resumed run needs them to be this mechanism at all) and the Gaussian generator's state (as
        ``GaussianNoise.state_dict``). The buffers are past noise: keep checkpoints as private as the data."""
        return {
            "mechanism": self.mechanism.as_dict(),
            # copies on the CPU: the live buffers change in place at every step (a checkpoint must not), and a copy
            # on the accelerator would double their memory there; they move back to the device at their next use
            "streams": {name: {"step": s.step, "head": s.head, "values": s.values.to("cpu", copy=True)}
                        for name, s in self._streams.items()},
            "gaussian": self.gaussian.state_dict(),
        }

    def load_state_dict(self, state: dict, keep_stream: bool = False) -> None:
        """Restore the buffers (a resumed run continues the correlated noise where it stopped); the i.i.d. draws
        are fresh unless ``keep_stream`` (``GaussianNoise.load_state_dict``): fresh draws continue the same
        mechanism, only the saved generator would repeat the stopped run number for number."""
        saved = state.get("mechanism") if isinstance(state, dict) else None
        if saved is None:
            raise ValueError(f"this noise state was saved by a run with independent Gaussian noise (DP-SGD); it "
                             f"cannot be resumed with noise={self.mechanism.noise!r}")
        if CorrelatedMechanism.from_dict(saved) != self.mechanism:
            raise ValueError(f"this noise state was saved by the mechanism {saved}, but this engine runs "
                             f"{self.mechanism.as_dict()}: build the engine as the saved run was built")
        self.gaussian.load_state_dict(state["gaussian"], keep_stream=keep_stream)
        self._streams = {name: _Stream(int(s["step"]), int(s["head"]), s["values"].clone())
                         for name, s in state["streams"].items()}


@dataclass(frozen=True)
class NoisePlan:
    """What a mechanism's noise state costs for a model: ``buffers`` tensors of ``numbers_per_buffer`` numbers
    (every trainable parameter, in float32 unless wider), ``bytes`` in all."""

    noise: str
    buffers: int
    numbers_per_buffer: int
    bytes: int

    def as_dict(self) -> dict:
        return {"noise": self.noise, "buffers": self.buffers, "numbers_per_buffer": self.numbers_per_buffer,
                "bytes": self.bytes}


def plan_noise(model: nn.Module, noise: str = "gaussian", *, bands: int | None = None,
               buffers: int | None = None) -> NoisePlan:
    """The memory of the noise state ``noise`` keeps for ``model``'s trainable parameters: none for ``"gaussian"``,
    ``bands - 1`` model-sized buffers for ``"bandmf"``, ``buffers`` for ``"blt"`` (default 4, as the engine).
    No strategy is optimized: the size does not depend on it."""
    from .. import _checks

    _checks.choice("noise", noise, ("gaussian", "bandmf", "blt"))
    if noise == "gaussian":
        count = 0
    elif noise == "bandmf":
        if bands is None:
            raise ValueError("noise='bandmf' needs bands: the number of bands of the strategy")
        count = _checks.positive_int("bands", bands) - 1
    else:
        count = _checks.positive_int("buffers", 4 if buffers is None else buffers)
    params = [p for p in model.parameters() if p.requires_grad]
    numbers = sum(p.numel() for p in params)
    width = sum(p.numel() * max(4, p.element_size() if p.is_floating_point() else 4) for p in params)
    return NoisePlan(noise, count, numbers, count * width)
