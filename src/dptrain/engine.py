"""PrivacyEngine: the facade. Validated configuration, attach/detach, which backward runs, reports, checkpoints.

The parts it wires together, one step's machinery from ``core``: the hooks (``capture.Capture``), the trainable set
(``trainable``), one ``backward.Backward`` per backward (the stages are ``pipeline``'s), the private step (``step``),
the GradScaler protocol (``precision``) and data parallelism (``distributed``); from ``privacy``, the ledger, the
budget and the loader's checks; from ``models``, the validation of the model.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from . import _checks, accounting, data
from .core import attached, distributed
from .core.algorithms import DEFAULT_CLIPPING_MODE
from .core.backward import BackwardSetup
from .core.capture import Capture
from .core.config import EngineConfig, FromConfig, make_config
from .core.noise import GaussianNoise
from .core.pipeline import StepSums
from .core.planning import DEFAULT_DECISION_RULE, LayerDecision
from .core.precision import LossScaling
from .core.runner import BackwardRunner
from .core.step import PrivateStep
from .core.trainable import TrainableKey, TrainableSet, build_trainable_set
from .correlated.privacy import CorrelatedAccountant
from .correlated.streaming import CorrelatedNoise
from .layers.fallback import FallbackRule, fallback_warning
from .models.validation import frozen_batchnorm_checks, validate
from .privacy.budget import Budget, PrivacyBudgetExceeded
from .privacy.ledger import Ledger
from .privacy.loader_checks import (
    check_cyclic_step,
    check_loader,
    loader_watch,
    no_cyclic_loader_warning,
    not_poisson_warning,
)
from .privacy.report import PrivacyReport
from .privacy.sampling import SamplingMismatch
from .rows import RowReader

__all__ = ["EngineConfig", "PrivacyBudgetExceeded", "PrivacyEngine", "SamplingMismatch"]


def _real_units(mask: torch.Tensor, users: torch.Tensor | None) -> int:
    """The units of a fixed-shape batch that are not padding: its real rows, or the users of its real rows."""
    if users is None:
        return int(mask.sum())  # (a loader's mask is on the CPU: no host-device synchronisation)
    return int(torch.unique(users.detach().cpu()[mask.cpu()]).numel())


class PrivacyEngine:
    """Makes an ordinary PyTorch training loop differentially private.

    After ``attach(optimizer)``, each ``optimizer.step()`` applies the private gradient
    ``(sum_i C_i g_i + sigma * R * N(0, I)) / batch_size`` where ``g_i`` are the per-sample
    gradients of the (micro-)batches back-propagated since the last step.
    ``engine.config`` holds the configuration; its fields read as ``engine.<name>`` too.
    """

    batch_size = FromConfig()
    sample_size = FromConfig()
    sample_rate = FromConfig()
    max_grad_norm = FromConfig()
    noise_multiplier = FromConfig()
    target_epsilon = FromConfig()
    target_delta = FromConfig()
    planned_steps = FromConfig()
    max_batch_size = FromConfig()
    clipping_mode = FromConfig()
    clipping_fn = FromConfig()
    clipping_style = FromConfig()
    clipping_gamma = FromConfig()
    loss_reduction = FromConfig()
    decision_rule = FromConfig()
    allow_fallback = FromConfig()
    batch_first = FromConfig()
    budget = FromConfig()
    privacy_unit = FromConfig()
    noise = FromConfig()
    cyclic_groups = FromConfig()
    recipe = FromConfig()

    def __init__(
        self,
        model: nn.Module,
        *,
        batch_size: int,
        sample_size: int,
        max_grad_norm: float = 1.0,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        epochs: float | None = None,
        steps: int | None = None,
        clipping_mode: str = DEFAULT_CLIPPING_MODE,
        clipping_fn: str = "abadi",
        clipping_style: str | Sequence[Sequence[str]] = "all-layer",
        loss_reduction: str = "mean",
        decision_rule: str = DEFAULT_DECISION_RULE,
        clipping_gamma: float = 0.01,
        accountant: str = "pld",
        secure_rng: bool = False,
        seed: int | None = None,
        allow_fallback: bool = True,
        batch_first: bool = True,
        budget: str = "warn",
        max_batch_size: int | None = None,
        privacy_unit: str = "example",
        noise: str = "gaussian",
        bands: int | None = None,
        buffers: int | None = None,
        cyclic_groups: int | None = None,
        workload_momentum: float = 0.0,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        model, self._parallel = distributed.data_parallel(model)
        self.config = make_config(
            batch_size=batch_size, sample_size=sample_size, max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, target_delta=target_delta,
            epochs=epochs, steps=steps, clipping_mode=clipping_mode, clipping_fn=clipping_fn,
            clipping_style=clipping_style, loss_reduction=loss_reduction, decision_rule=decision_rule,
            clipping_gamma=clipping_gamma, accountant=accountant, secure_rng=secure_rng, seed=seed,
            allow_fallback=allow_fallback, batch_first=batch_first, budget=budget, max_batch_size=max_batch_size,
            privacy_unit=privacy_unit, noise=noise, bands=bands, buffers=buffers, cyclic_groups=cyclic_groups,
            workload_momentum=workload_momentum)
        self.model = model
        mechanism = self.config.mechanism
        self.accountant = (accounting.create_accountant(accountant) if mechanism is None
                           else CorrelatedAccountant(accountant, mechanism))
        self._ledger = Ledger(self.config, self.accountant)  # the steps applied, with their values (in the accountant)
        rank = self._parallel.rank if self._parallel is not None else 0
        # Under FSDP2 every rank draws the noise of its own shard: independent streams per rank.
        self._noise: GaussianNoise | CorrelatedNoise = GaussianNoise(seed=None if seed is None else seed + 7919 * rank,
                                                                     secure=secure_rng)
        if mechanism is not None:  # correlated noise: the i.i.d. draws through the strategy's C^{-1}, per parameter
            self._noise = CorrelatedNoise(mechanism, self._noise, lambda p: self._trainable.param_name(p))
        self._cyclic_loader: weakref.ref | None = None  # the attached loader, when it samples cyclic groups (its steps are checked)

        # Set by attach: the hooks, the optimizer, the GradScaler protocol, what every backward works with.
        self._capture: Capture | None = None
        self._scaling: LossScaling | None = None
        self._runner: BackwardRunner | None = None  # which backward runs (made at attach, with the hooks)
        self._grad_handles: dict[nn.Parameter, Any] = {}

        # Long-lived parts: the step's clipped sums, the row layouts read so far, the budget, the trainable set.
        self._sums = StepSums()
        self._rows = RowReader(seed)
        self._budget = Budget(self.config, self._ledger)
        self._key = TrainableKey(model)
        self._trainable: TrainableSet = None  # type: ignore[assignment]  # (read just below: _follow_trainable)
        self._warned_fallback: set[str] = set()
        self._follow_trainable()
        # the private step and its lifecycle (zero_grad, closures, the GradScaler's skip, the step count)
        self._step = PrivateStep(self.config, self._ledger, self._noise, self._budget, self._sums, self._parallel,
                                 lambda: self._trainable)
        if not self._trainable.layers:
            raise ValueError("the model has no trainable parameters: nothing to train privately")
        if self.recipe.two_pass and self._trainable.num_groups > 1:
            groups = self._trainable.num_groups
            warnings.warn(
                f"clipping_mode={clipping_mode!r} with {groups} clipping groups re-weights the loss once per "
                "group (Lee & Kifer's second backward applies one factor per sample), so each step runs "
                f"{groups} extra backward passes; the book-keeping modes clip groups at no extra cost",
                stacklevel=2,
            )

        self._warned_loader = False

    @property
    def steps_taken(self) -> int:
        """Private steps applied (and counted in the accountant) so far, a resumed checkpoint's included."""
        return self._step.steps_taken

    @steps_taken.setter
    def steps_taken(self, value: int) -> None:
        self._step.steps_taken = int(value)

    # ------------------------------------------------------------------ the trainable set
    def _follow_trainable(self) -> None:
        """Read the trainable set again if it changed (at every model call with gradients enabled).

        A parameter that became trainable is covered exactly by its rule, or refused (``validate``);
        a frozen one drops out of the norms and is left untouched by the step.
        """
        key = self._key()
        if self._trainable is not None and key == self._trainable.key:
            return
        if self._capture is not None:
            attached.refuse_shared(self.model, self._step)  # a module shared with another engine's model, unfrozen
        validate(self.model, allow_fallback=self.allow_fallback)
        self._trainable = build_trainable_set(
            self.model, allow_fallback=self.allow_fallback, batch_first=self.batch_first,
            clipping_style=self.clipping_style, max_grad_norm=self.max_grad_norm, key=key, previous=self._trainable)
        fallback = [s.path for s in self._trainable.layers
                    if isinstance(s.rule, FallbackRule) and s.path not in self._warned_fallback]
        message = fallback_warning(fallback)
        if message is not None:
            self._warned_fallback.update(fallback)
            warnings.warn(message, stacklevel=4)
        if self._capture is not None:
            self._capture.add_checks(frozen_batchnorm_checks(self.model))  # modules added since attach
            self._capture.set_layers(list(self._trainable.layers))
            self._sync_grad_hooks()

    def _sync_grad_hooks(self) -> None:
        users = self._trainable.users
        for p in list(self._grad_handles):
            if p not in users:
                self._grad_handles.pop(p).remove()
        # The hook lives in the parameter's C++ autograd data, where Python's gc cannot see it: a strong
        # reference to the engine would keep the engine, the model and all its state alive forever.
        engine = weakref.ref(self)

        def on_accumulated_grad(p: nn.Parameter) -> None:
            alive = engine()
            if alive is not None:
                alive._on_accumulated_grad(p)

        for p in users:
            if p not in self._grad_handles:
                self._grad_handles[p] = p.register_post_accumulate_grad_hook(on_accumulated_grad)

    # ------------------------------------------------------------------ attach / detach
    def attach(self, optimizer: torch.optim.Optimizer, data_loader=None, grad_scaler=None) -> PrivacyEngine:
        """Install the hooks; ``optimizer.step()`` then applies the private gradient.

        ``data_loader`` (optional) is checked against the accounting: a Poisson loader must
        sample with ``q = batch_size / sample_size``; any other loader gets a warning, once,
        that the reported epsilon assumes Poisson sampling.

        ``grad_scaler``: the ``torch.amp.GradScaler`` whose ``scale()`` multiplies the losses
        (fp16 training): pass ``engine.backward(scaler.scale(losses))``. The engine removes the
        scale before clipping; where a backward overflows it finds a smaller scale by running
        the backward again on the same batch, so no step is skipped (single process, through
        ``engine.backward``). See docs/precision.md.
        """
        if data_loader is not None and not check_loader(data_loader, self.config) and not self._warned_loader:
            self._warned_loader = True
            warnings.warn(not_poisson_warning(data_loader), stacklevel=2)
        elif data_loader is None and self.cyclic_groups > 1:
            warnings.warn(no_cyclic_loader_warning(self.noise, self.cyclic_groups), stacklevel=2)
        if self._step.optimizer is not None:
            raise RuntimeError("this engine is already attached; call detach() first")
        distributed.refuse_unsupported_optimizer(optimizer)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"attach() needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if grad_scaler is not None and not (hasattr(grad_scaler, "get_scale") and hasattr(grad_scaler, "is_enabled")):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        attached.refuse_second(self.model, self._step)
        attached.refuse_shared(self.model, self._step)
        self._follow_trainable()
        model_params = set(self.model.parameters())
        held = [p for group in optimizer.param_groups for p in group["params"]]
        outside = sum(p not in model_params for p in held)
        if outside:
            raise ValueError(
                f"the optimizer holds {outside} of its {len(held)} parameters that are not in the model given to the "
                "engine. dptrain.fix(model) returns a copy with parameters of its own: build the optimizer after it, "
                "from the model it returned (model = dptrain.fix(model), then the optimizer on model.parameters()). A "
                "module outside the model (a loss module, a second model): put it into the model given to the engine")
        if not any(p in self._trainable.users for p in held):
            raise ValueError("the optimizer holds none of the model's trainable parameters")
        # FSDP2 swaps the unsharded parameters in during each forward: hooks look them up by name.
        enabled = grad_scaler is not None and grad_scaler.is_enabled()
        self._scaling = LossScaling(grad_scaler) if enabled else None
        self._capture = capture = Capture(
            self.model, None, on_model_call=self._on_model_call, on_output_grad=None,
            params_by_name=isinstance(self._parallel, distributed.FSDP2Gradients), batch_first=self.batch_first,
            rows=self._rows,
        )
        setup = BackwardSetup(self.recipe, self.decision_rule, self.clipping_fn, self.clipping_gamma,
                              self._sums, self._rows, capture, overflow_skippable=enabled,
                              loss_divisor=max(1, self.config.batch_size))
        self._runner = runner = BackwardRunner(self.config, setup, lambda: self._trainable, self._scaling,
                                               self._parallel, self._step.before_backward, self._step.after_backward)
        capture.on_grad, capture.on_output_grad = runner.on_output_grad, runner.on_model_output_grad
        capture.on_tag_outputs, capture.on_scalar_output_grad = runner.tag_outputs, runner.refuse_loss_inside_model
        capture.on_input_grad = runner.on_input_grad
        capture.install(list(self._trainable.layers), extra_checks=frozen_batchnorm_checks(self.model))
        self._sync_grad_hooks()
        if data.is_poisson_loader(data_loader):
            loader = weakref.ref(data_loader)
            runner.loader_rows, runner.loader_padding, runner.loader_drawn_elsewhere = loader_watch(loader)
            self._cyclic_loader = loader if self.cyclic_groups > 1 else None
        self._step.attach(optimizer, self._scaling, runner, self._prepare_step)
        attached.add(self.model, self._step)
        TrainableKey.watch(self.model)
        if self._parallel is not None:
            self._parallel.attach()
        return self

    def detach(self) -> None:
        """Remove every hook; the model and optimizer behave exactly as before ``attach``."""
        if self._runner is not None:
            self._runner.abort()
        if self._capture is not None:
            self._capture.remove()
        for handle in self._grad_handles.values():
            handle.remove()
        self._grad_handles = {}
        if self._parallel is not None and self._step.optimizer is not None:
            self._parallel.detach()
        if attached.remove(self.model, self._step):
            TrainableKey.unwatch()
        self._capture = None
        self._step.detach()

    @contextlib.contextmanager
    def paused(self):
        """Forwards and backwards inside are not training: nothing is recorded or clipped.

        For gradients with respect to the *inputs* (adversarial examples, saliency maps) taken with
        ``torch.autograd.grad(loss, x)``, and for a GAN's generator step through the private discriminator
        (``with engine.paused(): g_loss.backward()``: the generator gets its exact gradient): outside this context
        the engine cannot tell such a backward from a training one, and would add the sample's clipped gradient to
        the step. A ``.backward()`` inside leaves no gradient in the model's trainable parameters (they would not be
        private): theirs are dropped, and only the private step gives them one.
        """
        if self._capture is None:
            raise RuntimeError("call engine.attach(optimizer) first")
        previous = self._capture.paused
        self._capture.paused = True
        try:
            yield self
        finally:
            self._capture.paused = previous

    # ------------------------------------------------------------------ backwards
    def backward(self, losses: torch.Tensor, users: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> None:
        """Back-propagate per-sample losses ``[B]`` (or ``[B, ...]``, summed per sample).

        Valid in every clipping mode; micro-batches accumulate until ``optimizer.step()``.
        ``users`` (``privacy_unit="user"``): each row's user id ``[B]``; the clipped unit is then the
        sum of a user's per-example gradients, and all of a user's rows of a step must come in one call.
        ``mask`` (a ``FixedShapeBatch``'s ``[B]`` bool mask): the padded rows' losses count as 0, exactly as
        ``masked_losses(losses, mask)``; given this way, the engine still reads the padded rows' layout
        (their unmasked losses tag them), so a structural layout is cached once instead of read every step.
        Attached to a fixed-shape loader (``attach(optimizer, data_loader=...)``), a backward without the mask
        (losses not from ``masked_losses``, or a plain ``loss.backward()``) over more rows than the batch's real
        ones is refused before anything is applied: it would clip the padding rows as samples.
        """
        if self._runner is None:
            raise RuntimeError("call engine.attach(optimizer) before engine.backward(losses)")
        if not isinstance(losses, torch.Tensor) or losses.dim() == 0:
            got = "a scalar" if isinstance(losses, torch.Tensor) else type(losses).__name__
            raise ValueError(
                f"engine.backward needs per-sample losses of shape [B], one per sample; got {got}. A loss reduced "
                "over the batch (a mean or sum, or a model's own loss from labels=, the mean over the batch's tokens) "
                "cannot be clipped per sample. Compute one loss per sample from the model's outputs and pass those: "
                "F.cross_entropy(logits, y, reduction='none'), or for a language model "
                "dptrain.losses.sequence_losses(logits, labels, shift=True) (call the model without labels=)"
            )
        masked_already = data.fixed_shape.mask_of_masked_losses(losses) if mask is None else None
        losses = losses.flatten(1).sum(1) if losses.dim() > 1 else losses
        if (users is None) != (self.privacy_unit == "example"):
            raise ValueError(
                "engine.backward(losses, users=...) takes each row's user id with privacy_unit='user' (and only "
                f"then); this engine's privacy_unit is {self.privacy_unit!r}"
            )
        if users is not None and (not isinstance(users, torch.Tensor) or users.shape != losses.shape[:1]
                                  or users.is_floating_point()):
            raise ValueError(f"users must be an integer tensor of shape [{losses.shape[0]}] (one user id per loss), "
                             f"got {type(users).__name__}{tuple(users.shape) if isinstance(users, torch.Tensor) else ''}")
        real_rows: int | torch.Tensor | None
        tag_losses = real = padded = real_rows = None
        if masked_already is not None:  # (losses from masked_losses: the rows its mask kept are the real ones)
            real_rows = masked_already
        elif mask is not None:
            masked = data.masked_losses(losses, mask)  # (checks the mask)
            # a padded row's loss tags its rows, unless it is not finite (zero inputs can give that)
            tag_losses = torch.where(losses.detach().isfinite(), losses, masked)
            losses = masked
            real = _real_units(mask, users)
            real_rows = real if users is None else mask
            padded = ~mask.detach().cpu()
            if not bool(padded.any()):
                padded = None
        with self._runner.samples_per_step.real_count(real):  # the sampling check counts real samples, not rows
            self._runner.run(losses, users, tag_losses, padded, real_rows)

    def _on_model_call(self) -> None:
        assert self._runner is not None  # (attached: the capture calls it)
        self._runner.settle()
        if torch.is_grad_enabled():
            self._follow_trainable()

    def _on_accumulated_grad(self, p: nn.Parameter) -> None:
        """Autograd reached a covered parameter: it was used outside its own layer's forward call (or the backward
        runs inside ``paused()``, which is not training: the gradient is dropped)."""
        name = self._trainable.param_name(p)
        p.grad = None  # never leave a non-private gradient where the optimizer could use it
        if self._capture is not None and self._capture.paused:
            return
        raise RuntimeError(
            f"parameter {name!r} was used outside the forward call of its own layer (e.g. a weight read by "
            "F.linear or a matmul elsewhere, or a layer called with gradients enabled inside a model call made "
            "under torch.no_grad(), which records nothing), so its per-sample gradient would not be clipped: use the "
            "layer module itself, call the model with gradients enabled, tie the parameter to another covered layer "
            "(shared parameters are exact), or freeze it"
        )

    def _prepare_step(self) -> None:
        """Before the private step: a failed plain backward is dropped, the trainable set read again, and with
        cyclic sampling the step's batch checked to be the loader's batch of this step."""
        if self._cyclic_loader is not None:
            check_cyclic_step(self._cyclic_loader(), self.steps_taken, self.cyclic_groups)
        assert self._runner is not None and self._capture is not None  # (attached: the step calls it)
        self._runner.settle()
        self._capture.settle_open_forward()
        self._follow_trainable()

    # ------------------------------------------------------------------ reports
    def last_decisions(self) -> list[LayerDecision]:
        """What each layer did in the last backward: T, p, d, costs, and the chosen primitives."""
        return list(self._runner.decisions) if self._runner is not None else []

    def get_epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent by the steps taken so far, at ``delta`` (default: ``target_delta``): the composition of the
        steps as they ran (a resumed checkpoint's with its own values), fixed-shape truncation included."""
        return self._epsilon(self.target_delta if delta is None else self._check_delta(delta))

    def _epsilon(self, delta: float) -> float:
        if self.config.mechanism is not None:  # correlated noise: the mechanism's event over the run
            return self.accountant.get_epsilon(accounting.poisson_delta(
                delta, self.sample_size, self.config.inclusion_rate, self.max_batch_size, self.steps_taken))
        return self._ledger.epsilon(delta)

    def _check_delta(self, delta: float) -> float:
        delta = _checks.open_unit("delta", delta)
        problem = accounting.small_delta_problem(delta, self.sample_size, self.privacy_unit)
        if problem is not None:
            warnings.warn(problem, stacklevel=3)
        return delta

    def privacy_report(self, delta: float | None = None) -> PrivacyReport:
        """This engine's configuration and what the steps taken spent, at ``delta`` (default ``target_delta``): a
        dict (its keys: :class:`~dptrain.privacy.report.PrivacyReport`) whose ``str()`` reads "epsilon = ... at
        delta = ... after t of T planned steps", with the noise multiplier and the sample rate."""
        delta = self.target_delta if delta is None else self._check_delta(delta)
        return PrivacyReport.of_run(self.config, self._ledger, self.accountant.name, self.steps_taken,
                                    self._epsilon(delta), delta)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything needed to resume: step counter, accountant history, the ledger (the values every step ran
        with: noise multiplier, sample rate, sample size, max_batch_size, and the privacy unit) and, unless
        ``secure_rng``, the noise generator's state (used only by ``load_state_dict(..., reproducible_noise=True)``)."""
        return {
            "steps_taken": self.steps_taken,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "accountant": self.accountant.state_dict(),
            "ledger": self._ledger.state_dict(),
            "noise": self._noise.state_dict(),
        }

    def load_state_dict(self, state: dict, *, reproducible_noise: bool = False) -> None:
        """Restore a checkpoint written by ``state_dict()``; epsilon continues from its history.

        The noise after loading is fresh (reseeded from the operating system), never the saved stream: a
        checkpoint resumed twice, or on other batches, would otherwise add the noise of its steps k..n again
        to different data. ``reproducible_noise=True`` continues the saved stream instead, to reproduce an
        uninterrupted run number for number; it is private only if this checkpoint is resumed once, on the
        batches the stopped run would have drawn (it warns). ``secure_rng=True`` never saves the stream.

        The noise multiplier, sample rate, sample size and ``max_batch_size`` are configuration, not state: the
        steps after loading run with this engine's. Where they differ from the checkpoint's (a noise multiplier
        calibrated for a longer plan, another dataset size), the accountant composes the checkpoint's steps with
        their own values and this engine's with its own; epsilon and the budget are those of the steps as they
        ran, and a warning says what changed, how many steps still fit ``target_epsilon`` and the noise multiplier
        that would fit the plan. A checkpoint of another ``privacy_unit`` or accountant is refused. A checkpoint
        written before the ledger existed loads with a warning: its steps are taken with this
        engine's sample size, ``max_batch_size`` and privacy unit.
        """
        missing = {"steps_taken", "accountant", "noise"} - set(state)
        if missing:
            raise ValueError(f"not a dptrain engine state: missing {sorted(missing)}")
        self._noise.load_state_dict(state["noise"], keep_stream=reproducible_noise)  # (may refuse: nothing else changed)
        old_format = self._ledger.load_state_dict(state, self.config)  # checks it all before changing anything
        self.steps_taken = int(state["steps_taken"])
        for note in (old_format, self._budget.resume_note()):
            if note is not None:
                warnings.warn(note, stacklevel=2)
        if reproducible_noise:
            warnings.warn(
                "reproducible_noise=True: the noise continues the checkpoint's stream. Resuming this checkpoint "
                "again, or on other batches than the stopped run's, adds the same noise to different data and "
                "breaks the privacy guarantee", stacklevel=2)
