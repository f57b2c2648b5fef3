"""What the parts of the fallback (the mixins that ``rule.FallbackRule`` assembles: ``_CallArguments``,
``_BatchAxes``, ``_SampleChecks``...) read of one another, declared for the type check. Each part is a base of
``FallbackRule`` alone and calls methods another part defines; ``_FallbackParts`` declares them, with the state
``FallbackRule.__init__`` sets, so that each part is checked against them. At run time it is an empty class."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .records import FallbackCall


class _FallbackParts:
    """The base of every part of ``FallbackRule``: what the parts use of one another (declarations only)."""

    if TYPE_CHECKING:
        # FallbackRule.__init__
        param_names: tuple[str, ...]
        label: str
        swapped: bool
        _channels: list

        # rule.FallbackRule: the replay
        def _replay(self, module, args, kwargs, params=None): ...

        def _replay_out(self, module, call: FallbackCall, args, kwargs, params=None): ...

        @staticmethod
        def _cotangent(call: FallbackCall, out, g: torch.Tensor): ...

        @staticmethod
        def _joined(call: FallbackCall, out) -> torch.Tensor: ...

        def _cannot_replay(self, module, err: BaseException, how: str = "") -> RuntimeError: ...

        def _name(self, module) -> str: ...

        # arguments._CallArguments
        def _keep_call(self, module, args, kwargs, device: torch.device) -> FallbackCall: ...

        @staticmethod
        def _set_rows(module, args, kwargs, call: FallbackCall, batch: int) -> None: ...

        # independence._SampleChecks (its refusals are SampleMixingError)
        def _whole_vjp(self, module, call, primals): ...

        def _check_independence(self, module, call, output, every_row: bool = False, again=None): ...

        def _check_gradient_sum(self, module, call, g, primals, per_sample, whole=None): ...

        def _rows_reproduced(self, call, outs, whole, order=None) -> bool: ...

        def _not_reproduced(self, module) -> RuntimeError: ...

        # one_by_one._OneSampleAtATime
        def _split_refusal(self, module, one_by_one: bool) -> RuntimeError: ...

        # guarded_outputs._GuardedOutputs
        def _guard_escaped(self, module) -> None: ...

        def _guard_hidden(self, module, leaf, path: str) -> None: ...

        def _hidden_refusal(self, module, leaf, k, path, used: bool = False) -> ValueError: ...

        # batch_axes._BatchAxes
        def _axes_after_refusal(self, module, call: FallbackCall, leaves: list, depends: tuple[int, ...],
                                paths: tuple[str, ...], batch: int | None, err: Any) -> Any: ...
