"""Gaussian noise for the private gradient, from a seeded or an OS-entropy generator."""
from __future__ import annotations

import os

import torch


class GaussianNoise:
    """Draws N(0, std^2 I) on any device, reproducibly from ``seed``, or securely.

    ``secure=True`` seeds every generator from the operating system's entropy
    (``os.urandom``) and refuses a fixed seed: the mode for production runs.
    One generator per device keeps the draws on the device (no host-device copy).
    """

    def __init__(self, seed: int | None = None, secure: bool = False):
        if secure and seed is not None:
            raise ValueError("secure_rng=True draws its seed from the operating system; do not pass a seed")
        self.secure = secure
        self._seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._generators: dict[torch.device, torch.Generator] = {}

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
        out = torch.randn(like.shape, generator=self._generator(like.device), device=like.device, dtype=dtype)
        return out.mul_(std)

    def state_dict(self) -> dict:
        if self.secure:
            return {"secure": True}
        return {
            "secure": False,
            "seed": self._seed,
            "generators": {str(d): g.get_state() for d, g in self._generators.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("secure") or self.secure:
            if state.get("secure") != self.secure:
                raise ValueError("cannot load a seeded noise state into a secure_rng engine or vice versa")
            return  # a secure generator is never restored: fresh OS entropy is the point
        self._seed = state["seed"]
        self._generators = {}
        for dev, gen_state in state["generators"].items():
            gen = torch.Generator(device=torch.device(dev))
            gen.set_state(gen_state)
            self._generators[torch.device(dev)] = gen
