"""Gaussian noise for the private gradient, from a seeded or an OS-entropy generator."""
from __future__ import annotations

import math
import os

import torch


class GaussianNoise:
    """Draws N(0, std^2 I) on any device, reproducibly from ``seed``, or securely.

    ``secure=True`` seeds every generator from the operating system's entropy
    (``os.urandom``) and refuses a fixed seed: the mode for production runs.
    One generator per device keeps the draws on the device (no host-device copy).

    torch's CPU generator keeps only the low 32 bits of a seed, too few to stop a search
    over seeds that would recover the noise; secure noise is therefore the sum of
    ``SECURE_STREAMS`` independent streams, each seeded with fresh OS entropy, divided by
    the square root of their number: exactly Gaussian, with 4 x 32 seed bits on any device.
    """

    SECURE_STREAMS = 4

    def __init__(self, seed: int | None = None, secure: bool = False):
        if secure and seed is not None:
            raise ValueError("secure_rng=True draws its seed from the operating system; do not pass a seed")
        self.secure = secure
        self._seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._generators: dict[torch.device, torch.Generator] = {}
        self._secure_streams: dict[torch.device, list[torch.Generator]] = {}

    def _secure_generators(self, device: torch.device) -> list[torch.Generator]:
        gens = self._secure_streams.get(device)
        if gens is None:
            gens = []
            for _ in range(self.SECURE_STREAMS):
                gen = torch.Generator(device=device)
                gen.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
                gens.append(gen)
            self._secure_streams[device] = gens
        return gens

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            seed = int.from_bytes(os.urandom(8), "little") >> 1 if self.secure else self._seed + len(self._generators)
            gen.manual_seed(seed)
            self._generators[device] = gen
        return gen

    def sample(self, like: torch.Tensor, std: float) -> torch.Tensor:
        """Noise shaped like ``like`` (float32 or wider), times ``std``."""
        dtype = like.dtype if like.dtype in (torch.float32, torch.float64) else torch.float32
        if self.secure:
            gens = self._secure_generators(like.device)
            out = torch.randn(like.shape, generator=gens[0], device=like.device, dtype=dtype)
            for gen in gens[1:]:
                out.add_(torch.randn(like.shape, generator=gen, device=like.device, dtype=dtype))
            return out.mul_(std / math.sqrt(len(gens)))
        out = torch.randn(like.shape, generator=self._generator(like.device), device=like.device, dtype=dtype)
        return out if std == 1.0 else out.mul_(std)

    def sampler(self, step: int):
        """The noise of one private step, ``(parameter, sum, std) -> N(0, std^2)`` shaped like the sum: independent
        of the parameter and the step (correlated noise, ``dptrain.correlated.streaming``, uses both)."""
        return lambda p, like, std: self.sample(like, std)

    def state_dict(self) -> dict:
        """The generators' state, for ``load_state_dict(..., keep_stream=True)`` only; nothing of a secure one."""
        if self.secure:
            return {"secure": True}
        return {
            "secure": False,
            "seed": self._seed,
            "generators": {str(d): g.get_state() for d, g in self._generators.items()},
        }

    def reseed(self) -> None:
        """Fresh noise from the operating system's entropy: no earlier stream continues."""
        self._seed = int.from_bytes(os.urandom(8), "little") >> 1
        self._generators = {}
        self._secure_streams = {}

    def load_state_dict(self, state: dict, keep_stream: bool = False) -> None:
        """Fresh noise by default: a checkpoint can be resumed more than once, or on other batches, and its
        saved stream would then add the same noise to different data (steps k..n of a run reused).
        ``keep_stream=True`` continues the saved stream (reproducible, and safe only for a single resume on
        the same batches); a secure generator never keeps one."""
        if "mechanism" in state:
            raise ValueError("this noise state was saved by a run with correlated noise (noise='bandmf' or 'blt'); "
                             "resume it with the same noise, not with independent Gaussian noise")
        if state.get("secure") or self.secure:
            if state.get("secure") != self.secure:
                raise ValueError("cannot load a seeded noise state into a secure_rng engine or vice versa")
            if keep_stream:
                raise ValueError("secure_rng=True never saves its noise stream: it cannot be continued reproducibly")
            self.reseed()
            return
        if not keep_stream:
            self.reseed()
            return
        if "generators" not in state:
            raise ValueError("this noise state holds no stream to continue")
        self._seed = state["seed"]
        self._generators = {}
        for dev, gen_state in state["generators"].items():
            gen = torch.Generator(device=torch.device(dev))
            gen.set_state(gen_state)
            self._generators[torch.device(dev)] = gen
