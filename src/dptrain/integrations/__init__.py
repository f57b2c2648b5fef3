"""Integrations with training frameworks; each imports its framework only when used.

* :mod:`dptrain.integrations.hf_trainer` -- :class:`DPTrainer`, a Hugging Face ``transformers.Trainer`` that
  trains privately (``pip install 'dptrain[transformers]'``).
* :mod:`dptrain.integrations.accelerate` -- :func:`make_private`, the engine and the Poisson loader for a Hugging
  Face Accelerate loop (``pip install 'dptrain[accelerate]'``).
* :mod:`dptrain.integrations.lightning` -- :class:`DPCallback`, a PyTorch Lightning callback that makes ``fit``
  private (``pip install 'dptrain[lightning]'``).
* :mod:`dptrain.integrations.loaders` -- the Poisson loader they share: one draw per step, shared out to
  micro-batches and processes (no framework needed).

docs/frameworks.md says what works where. Built on the engine as a user's code is: the integrations may import
``engine`` and what is below it (``core``, ``data``, ``accounting``, ``losses``), never ``cli``, ``testing`` or
``audit``.
"""
from __future__ import annotations

__all__ = ["DPCallback", "DPTrainer", "make_private"]

_WHERE = {"DPTrainer": "hf_trainer", "make_private": "accelerate", "DPCallback": "lightning"}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
