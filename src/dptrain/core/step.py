"""The private step: the step's clipped sums, the Gaussian noise and the divisor, into the optimizer's ``p.grad``;
the step's lifecycle around it (``PrivateStep``: zero_grad, closures, the GradScaler's skip, the count).

Also what the step refuses: trainable parameters the optimizer does not hold (their private gradient
would be lost), parameters it holds that carry a gradient the engine did not give (unclipped), and a
gradient left on a parameter frozen since.
"""
from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..layers.numerics import outside_autocast
from ..privacy import sampling
from ..privacy.budget import PrivacyBudgetExceeded
from ..privacy.sampling import SamplingMismatch
from . import distributed
from .pipeline import StepSums, sum_dtype
from .trainable import TrainableSet

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .precision import LossScaling
    from .runner import BackwardRunner


def held_trainable(optimizer: torch.optim.Optimizer, trainable: TrainableSet) -> list[nn.Parameter]:
    """The covered trainable parameters the optimizer holds; refuses trainable ones it does not hold."""
    held = [p for group in optimizer.param_groups for p in group["params"]]
    users = trainable.users
    # (a parameter no longer in the model, without a gradient, is harmless: the optimizer skips it)
    foreign = [p for p in held if p.requires_grad and p not in users and p.grad is not None]
    if foreign:
        for p in foreign:
            p.grad = None  # never a raw gradient into the optimizer
        raise RuntimeError(
            f"the optimizer holds {len(foreign)} parameter(s) with a gradient (shapes "
            f"{[tuple(p.shape) for p in foreign[:3]]}) that are not part of the model the engine makes private "
            "(added with add_param_group, e.g. a learnable loss parameter): their gradients are not clipped. "
            "They were dropped; nothing was applied. Make them parameters of a module inside the model, or "
            "freeze them"
        )
    held_set = set(held)
    missing = [trainable.param_name(p) for p in users if p.requires_grad and p not in held_set]
    if missing:
        raise RuntimeError(
            f"trainable parameters {missing[:5]}{' ...' if len(missing) > 5 else ''} are not held by the optimizer "
            "the engine is attached to: their private gradients would be lost (a second optimizer never "
            "receives any). Put every trainable parameter into this optimizer (parameter groups can set their "
            "own learning rates), or freeze them"
        )
    return [p for p in held if p in users and p.requires_grad]


class GivenGradients:
    """The gradients the engine gave at the last step, held weakly (a strong reference would keep a model's
    worth of gradients alive after ``zero_grad()``)."""

    def __init__(self) -> None:
        self._given: dict[nn.Parameter, weakref.ref] = {}

    def clear(self) -> None:
        self._given = {}

    def record(self, p: nn.Parameter) -> None:
        self._given[p] = weakref.ref(p.grad)

    def gave(self, p: nn.Parameter) -> bool:
        """Whether ``p.grad`` is the gradient the engine gave."""
        given = self._given.get(p)
        return given is not None and given() is p.grad

    def leave_frozen_untouched(self, optimizer: torch.optim.Optimizer, marker: torch.Tensor | None) -> None:
        """A parameter frozen after the engine gave it gradients keeps none (the optimizer then skips it)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad and p.grad is not None and (self.gave(p) or p.grad is marker):
                    p.grad = None

    def refuse_foreign(self, step_params: list[nn.Parameter], trainable: TrainableSet,
                       marker: torch.Tensor | None) -> None:
        """Backstop under data parallelism: a gradient the engine did not give came from a use of the
        parameter outside its layer's call. (FSDP2 writes autograd's gradients to the sharded ``p.grad``
        by its reduce-scatter; recent torch then runs the post-accumulate-grad hook, which refuses them
        during the backward, but nothing guarantees every version does.) Without data parallelism the
        step replaces every covered parameter's gradient, and ``held_trainable`` refuses the others'."""
        for p in step_params:
            if p.grad is not None and not self.gave(p) and p.grad is not marker:
                p.grad = None
                raise RuntimeError(
                    f"parameter {trainable.param_name(p)!r} holds a gradient the engine did not give: autograd's "
                    "own, unclipped (the parameter was used outside the forward call of its own layer, or the layer "
                    "was replaced outside a model call). It was dropped; nothing was applied. Use the layer module "
                    "itself, call the model itself, or freeze the parameter"
                )


def apply_private_gradient(step_params: list[nn.Parameter], sums: StepSums, sample_noise: Callable, std: float,
                           batch_size: int, parallel, given: GivenGradients) -> None:
    """``p.grad = (sum_i C_i g_i + noise) / batch_size`` for every parameter of the step; ``sample_noise(p, sum,
    std)`` draws the parameter's noise (``N(0, std^2)``, or the correlated noise of ``dptrain.correlated``).

    The sum, the noise and the division are in float32 (or the parameter's dtype if wider,
    ``pipeline.sum_dtype``); a bf16/fp16 parameter's gradient is rounded once, at the end.

    In place on the engine's own sums, in buckets of parameters: the noise of a bucket is drawn parameter by
    parameter at std 1, in the parameters' order (correlated noise and DP-SGD draw alike), then scaled and added,
    and the sums divided, by one ``foreach`` operation each: a few kernels for the bucket where there were three per
    parameter. The step needs no more memory than the gradients themselves, plus a bucket's noise
    (``NOISE_BUCKET_BYTES``, or one parameter's).
    Under data parallelism the ranks' sums are reduced first and the noise is added once (``distributed``).
    """

    def add_noise(p: nn.Parameter, t: torch.Tensor) -> torch.Tensor:
        return t.add_(sample_noise(p, t, std)) if std > 0 else t

    def take_sum(p: nn.Parameter) -> torch.Tensor:
        summed = sums.pop(p)
        return summed if summed is not None else torch.zeros(p.shape, dtype=sum_dtype(p), device=p.device)

    def set_grad(p: nn.Parameter, t: torch.Tensor) -> None:
        # the one rounding to a low-precision parameter's dtype, after the noise and the division
        grad = t.to(p.dtype)
        p.grad = parallel.as_grad(p, grad) if parallel is not None else grad
        given.record(p)

    given.clear()
    if parallel is None:
        for bucket in _buckets(step_params):
            summed = [take_sum(p) for p in bucket]
            if std > 0:  # (drawn at std 1 and scaled in the addition: one kernel less per parameter)
                noise = [sample_noise(p, t, 1.0) for p, t in zip(bucket, summed)]
                torch._foreach_add_(summed, noise, alpha=std)
                del noise
            torch._foreach_div_(summed, batch_size)
            for p, t in zip(bucket, summed):
                set_grad(p, t)
    else:
        noisy = parallel.noisy_sum(step_params, [take_sum(p) for p in step_params], add_noise)
        for p, t in zip(step_params, noisy):
            set_grad(p, t.div_(batch_size))


#: the noise held at once by the step (``apply_private_gradient``): a bucket's, or one parameter's if larger
NOISE_BUCKET_BYTES = 32 << 20


def _buckets(params: list[nn.Parameter]):
    """The parameters in order, in runs whose sums in float32 (or wider) take at most ``NOISE_BUCKET_BYTES``."""
    bucket: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * sum_dtype(p).itemsize
        if bucket and size + nbytes > NOISE_BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += nbytes
    if bucket:
        yield bucket


class PendingMarker:
    """The gradient the engine shows on one parameter between a backward and the step.

    The private gradient exists only from ``optimizer.step()`` on, so ``optimizer.zero_grad()`` between a
    backward and the step would change nothing the engine could see. The marker makes it visible: ones on
    the smallest held parameter, which ``zero_grad()`` clears (``set_to_none``, the default) or zeroes in
    place (a version-counter change, then a look at the values: scaling it, as ``GradScaler.unscale_`` or
    gradient clipping do, keeps it non-zero). A cleared marker means the batches back-propagated before it
    are discarded, as ``zero_grad`` means in PyTorch. With a GradScaler it is also the gradient the scaler
    checks: inf makes ``scaler.step`` skip the step.
    """

    def __init__(self) -> None:
        self.param: nn.Parameter | None = None
        self.tensor: torch.Tensor | None = None
        self._version = -1
        self._skip = False

    def place(self, p: nn.Parameter, skip: bool = False) -> None:
        """Show the marker on ``p`` (inf: the scaler is to skip this step)."""
        if (self.param is p and p.grad is self.tensor is not None and skip == self._skip
                and self.tensor._version == self._version):
            return  # already shown, untouched
        self.forget()
        self.param, self.tensor, self._skip = p, torch.full_like(p, math.inf if skip else 1.0), skip
        p.grad = self.tensor
        self._version = self.tensor._version

    @property
    def skips(self) -> bool:
        """The inf marker of a skipped step is still shown (``zero_grad()`` clears it: the skipped step is over)."""
        return self._skip and self.tensor is not None and self.param is not None and self.param.grad is self.tensor

    def cleared(self) -> bool:
        """Whether ``zero_grad()`` (or anything setting ``p.grad``) removed or zeroed the marker since it was shown."""
        if self.tensor is None or self.param is None:  # (set together)
            return False
        if self.param.grad is not self.tensor:
            return True
        if self.tensor._version == self._version:
            return False
        return bool((self.tensor == 0).all())  # touched in place: zeroed, or only scaled

    def forget(self) -> None:
        """The step took its gradient (or the engine detaches): the marker goes, from ``p.grad`` too."""
        if self.tensor is not None and self.param is not None and self.param.grad is self.tensor:
            self.param.grad = None
        self.param, self.tensor, self._version, self._skip = None, None, -1, False


class PrivateStep:
    """The attached optimizer's private step, and the lifecycle of a step around it.

    Between a backward and the step, ``PendingMarker`` makes ``zero_grad()`` visible (it discards the batches
    back-propagated before it) and carries the GradScaler's skip. At ``optimizer.step()`` (its pre-hook; with a
    closure, after the closure's backward, once per step): the budget check, then the step's clipped sums plus
    the noise over the divisor into ``p.grad`` (``apply_private_gradient``), then the count in the ledger (and
    its accountant) and in the sampling check (``sampling.SamplesPerStep``: a warning when the batches are not
    the Poisson samples the accounting assumes; with ``budget="strict"`` the later steps are refused).

    Long-lived, like the step count it keeps (``steps_taken`` spans detach and attach); ``attach`` binds an
    optimizer, the GradScaler protocol and the backward runner. ``prepare`` is the engine's part before a step
    (a failed backward dropped, the trainable set read again).
    """

    def __init__(self, config, ledger, noise, budget, sums: StepSums, parallel,
                 trainable: Callable[[], TrainableSet]):
        self.config = config
        self.ledger, self.noise, self.budget, self.sums, self.parallel = ledger, noise, budget, sums, parallel
        self.trainable = trainable
        self.steps_taken = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaling: LossScaling | None = None
        self.runner: BackwardRunner | None = None
        self._prepare: Callable[[], None] | None = None
        self._handle: RemovableHandle | None = None
        self._given = GivenGradients()
        self._marker = PendingMarker()
        self._marker_key: tuple | None = None
        self._marker_on: nn.Parameter | None = None
        self.sampling_finding: str | None = None  # why the batches are not the accounted Poisson samples
        self._inner_step_due = False  # a ZeroRedundancyOptimizer's step is about to step its local optimizer

    def attach(self, optimizer: torch.optim.Optimizer, scaling, runner, prepare: Callable[[], None]) -> None:
        self.optimizer, self.scaling, self.runner, self._prepare = optimizer, scaling, runner, prepare
        self._handle = optimizer.register_step_pre_hook(self._before_step)
        self._given.clear()

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
        self._handle, self.optimizer, self.scaling, self.runner, self._prepare = None, None, None, None, None
        self._marker.forget()
        self.discard()

    def discard(self) -> None:
        """Drop the step's clipped sums and every call still waiting for a backward (the step is over)."""
        self.sums.clear()
        for state in self.trainable().layers:
            state.calls.clear()

    # ------------------------------------------------------------------ around each backward
    def _marker_param(self) -> nn.Parameter:
        """The smallest covered trainable parameter the optimizer holds: the one that shows ``PendingMarker``."""
        trainable = self.trainable()
        assert self.optimizer is not None  # (attached)
        key = (trainable, sum(len(g["params"]) for g in self.optimizer.param_groups))
        if self._marker_key != key:
            users = trainable.users
            held = [p for group in self.optimizer.param_groups for p in group["params"]
                    if p in users and p.requires_grad]
            self._marker_key, self._marker_on = key, (min(held, key=lambda q: q.numel()) if held
                                                      else next(iter(users)))
        assert self._marker_on is not None  # (chosen above)
        return self._marker_on

    def before_backward(self) -> None:
        """A backward is about to add to the step: a ``zero_grad()`` since the last one discarded the batches
        back-propagated before it."""
        if self._marker.cleared():
            self.sums.clear()
            self._marker.forget()
            assert self.runner is not None  # (attached)
            self.runner.discard_step()

    def after_backward(self, overflow: bool) -> None:
        """Show the marker: zero_grad() is seen, and with a GradScaler the scaler checks it (inf makes it skip).

        A skipped step (the plain ``loss.backward()`` path, or data parallelism, where the engine
        cannot run the backward again) counts in the accountant right away: skipping is a decision
        that looked at the data, and ``optimizer.step()`` (where steps are counted otherwise) will
        not run.
        """
        marker_param = self._marker_param()
        if self.scaling is None:
            self._marker.place(marker_param)
            return
        if self.parallel is not None:  # every rank skips, or none
            overflow = self.parallel.any(overflow, marker_param.device)
        first, skipped = self.scaling.show(overflow, self._marker.skips)
        self._marker.place(marker_param, skip=skipped)
        if skipped:
            self.sums.clear()  # nothing of a skipped step is ever applied
        if first:
            self.budget.check()
            self._refuse_on_sampling()
            self._count()
            warnings.warn(
                "fp16 overflow: this step is skipped and still counts in the privacy accountant. Through "
                "engine.backward(scaler.scale(losses)) in one process the engine finds a working scale without "
                "skipping", stacklevel=3)

    # ------------------------------------------------------------------ the step
    def _before_step(self, optimizer, args, kwargs):
        """The attached optimizer's step pre-hook. With a closure (``optimizer.step(closure)``) the private
        gradient is formed after the closure's backward, once per step."""
        # (args: the optimizer itself, then step's own arguments)
        closure = kwargs["closure"] if "closure" in kwargs else args[1] if len(args) > 1 else None
        self._inner_step_due = False
        if closure is None:
            self._step()
            self._inner_step_due = True
            return None
        self._inner_step_due = True
        evaluated = False

        def private_closure():
            nonlocal evaluated
            if evaluated:
                raise RuntimeError(
                    f"{type(optimizer).__name__} evaluated its closure a second time in one step: a private step "
                    "releases one noisy gradient per batch, and each further evaluation would be another release "
                    "on the same batch. The first evaluation's private update was applied and counted. Use an "
                    "optimizer that evaluates the closure once per step (torch.optim.LBFGS with max_iter=1, or a "
                    "first-order optimizer)"
                )
            evaluated = True
            with torch.enable_grad():
                loss = closure()
            self._step()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": private_closure}
        return (args[0], private_closure, *args[2:]), kwargs

    def _step(self) -> None:
        assert self._prepare is not None and self.runner is not None and self.optimizer is not None  # (attached)
        self._prepare()
        self.runner.new_step()
        trainable, marker = self.trainable(), self._marker.tensor
        if self.scaling is not None and self.scaling.overflowed:
            # optimizer.step() without scaler.step(): the counted, overflowed step applies nothing
            for p in held_trainable(self.optimizer, trainable):
                p.grad = None
            self.scaling.overflowed = False
            self._marker.forget()
            self.discard()
            return
        if self._marker.cleared():  # zero_grad() after the last backward: its batches are discarded
            self.sums.clear()
            self.runner.discard_step()
        step_params = held_trainable(self.optimizer, trainable)  # refuses raw gradients it does not cover
        self._given.leave_frozen_untouched(self.optimizer, marker)
        if self.parallel is not None:
            self._given.refuse_foreign(step_params, trainable, marker)
        try:
            self.budget.check()
            self._refuse_on_sampling()
        except (PrivacyBudgetExceeded, SamplingMismatch):  # nothing of this step is applied
            for p in step_params:
                p.grad = None
            self._marker.forget()
            self.discard()
            self.runner.samples_per_step.discard_step()
            raise
        self._marker.forget()
        c = self.config
        # (autocast off: an optimizer.step() inside the user's autocast region still adds float32 noise)
        outside_autocast(apply_private_gradient, step_params, self.sums, self.noise.sampler(self.steps_taken),
                         c.noise_multiplier * c.max_grad_norm, c.batch_size, self.parallel, self._given)
        self.discard()
        self._count()

    def _refuse_on_sampling(self) -> None:
        """``budget="strict"``: no step once the batches are found not to be the accounted Poisson samples."""
        if self.sampling_finding is not None and self.config.budget == "strict":
            raise SamplingMismatch(self.sampling_finding + ": nothing was applied (budget='strict' refuses every step "
                                   "once the batches are found not to be the Poisson samples the accounting assumes)")

    def _count(self) -> None:
        self.ledger.record(self.config)
        self.steps_taken += 1
        total = None
        if self.parallel is not None:
            device = next(iter(self.trainable().users)).device

            def total(values: list[float]) -> list[float]:  # the ranks' counts, summed (one collective)
                return self.parallel.total(values, device)
        assert self.runner is not None  # (attached)
        finding = self.runner.samples_per_step.end_step(total)
        if finding is None:
            return
        c = self.config
        message = sampling.describe(finding, c.batch_size, c.sample_size, c.privacy_unit)
        if not finding.understates_epsilon:  # the reported epsilon is an over-estimate: a warning in every mode
            warnings.warn(message, stacklevel=5)
        elif c.budget == "strict":
            self.sampling_finding = message
            warnings.warn(message + " (budget='strict': the next steps are refused)", stacklevel=5)
        else:
            warnings.warn(message + "; training goes on (budget='strict' refuses the next steps)", stacklevel=5)

    def refuse_foreign_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Any optimizer's step (torch's global step pre-hook, ``attached``): one other than the attached optimizer
        (or a wrapper of it) that holds covered trainable parameters would apply gradients the engine never gave."""
        mine = self.optimizer
        if (optimizer is mine or mine is None or optimizer.param_groups is mine.param_groups
                or getattr(optimizer, "optimizer", None) is mine):
            return
        if optimizer is distributed.zero_inner(mine):
            if self._inner_step_due:  # the ZeroRedundancyOptimizer's own step: the private gradient is in place
                self._inner_step_due = False
                return
            raise RuntimeError(
                f"the local optimizer ({type(optimizer).__name__}) of the ZeroRedundancyOptimizer this PrivacyEngine is "
                "attached to was stepped on its own: the engine gives the private gradient at the "
                "ZeroRedundancyOptimizer's step. Nothing was applied. Call step() on the ZeroRedundancyOptimizer"
            )
        if distributed.zero_inner(optimizer) is mine:
            raise RuntimeError(
                f"this PrivacyEngine is attached to the local optimizer ({type(mine).__name__}) of a "
                "ZeroRedundancyOptimizer, which holds only this rank's shard of the parameters: the others' private "
                "gradients would be lost. Nothing was applied. Attach the engine to the ZeroRedundancyOptimizer "
                "itself (engine.detach(); engine.attach(zero_optimizer))"
            )
        held = {p for group in optimizer.param_groups for p in group["params"]}
        trainable = self.trainable()
        private = [trainable.param_name(p) for p in trainable.users if p.requires_grad and p in held]
        if private:
            raise RuntimeError(
                f"{type(optimizer).__name__} is not the optimizer this PrivacyEngine is attached to, but it holds "
                f"trainable parameters of the private model ({private[:3]}{' ...' if len(private) > 3 else ''}): "
                "the engine gives private gradients only to the optimizer it is attached to, so this one would "
                "apply nothing, or gradients that are not private. Nothing was applied. Attach the engine to this "
                "optimizer (engine.detach(); engine.attach(optimizer)), or build the optimizer before attach"
            )
