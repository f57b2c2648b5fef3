"""Integrations with training frameworks; each imports its framework only when used.

* :mod:`dptrain.integrations.hf_trainer` -- :class:`DPTrainer`, a Hugging Face
  ``transformers.Trainer`` that trains privately (needs ``pip install 'dptrain[transformers]'``).
"""
from __future__ import annotations

__all__ = ["DPTrainer"]


def __getattr__(name: str):
    if name == "DPTrainer":
        from .hf_trainer import DPTrainer

        return DPTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
