"""PrivacyEngine: the facade. Validated configuration, attach/detach, which backward runs, reports, checkpoints.

The parts it wires together: the hooks (``capture.Capture``), the trainable set (``trainable``), one
``backward.Backward`` per backward (the stages are ``pipeline``'s), the private step (``step``), the
budget (``budget``), the GradScaler protocol (``precision``) and data parallelism (``distributed``).
"""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import accounting, checks, data, distributed
from .algorithms import DEFAULT_CLIPPING_MODE, RECIPES
from .backward import Backward, BackwardSetup, Phase, needs_tags
from .budget import Budget, PrivacyBudgetExceeded
from .capture import Call, Capture, graph_task, in_backward
from .clipping import CLIPPING_FNS
from .layers.fallback import FallbackRule, fallback_warning
from .losses import LOSS_REDUCTIONS
from .noise import GaussianNoise
from .pipeline import Overflow, StepSums
from .planning import DECISION_RULES, DEFAULT_DECISION_RULE, LayerDecision
from .precision import LossScaling
from .rows import RowReader, tag_passes, tag_rows
from .step import GivenGradients, apply_private_gradient, held_trainable
from .trainable import TrainableKey, TrainableSet, build_trainable_set
from .validation import frozen_batchnorm_checks, validate

__all__ = ["EngineConfig", "PrivacyBudgetExceeded", "PrivacyEngine"]

BUDGETS = ("warn", "strict")

# Engines attached right now, by the model they hook: a second engine on the same model (or on a part
# of it) would see the first one's ghost-differentiated backward as ordinary gradients.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class EngineConfig:
    """The engine's configuration, validated once; the defaults are those of ``PrivacyEngine``'s signature."""

    batch_size: int
    sample_size: int
    max_grad_norm: float
    noise_multiplier: float
    target_epsilon: float | None
    target_delta: float
    planned_steps: int | None  # the length the noise was calibrated for (None: noise_multiplier was given)
    max_batch_size: int | None  # K of fixed-shape batches (None: Poisson batches are never truncated)
    clipping_mode: str
    clipping_fn: str
    clipping_style: Any
    clipping_gamma: float
    loss_reduction: str
    decision_rule: str
    accountant: str
    secure_rng: bool
    seed: int | None
    allow_fallback: bool
    batch_first: bool
    budget: str

    @property
    def sample_rate(self) -> float:
        return self.batch_size / self.sample_size

    @property
    def recipe(self):
        return RECIPES[self.clipping_mode]


class _FromConfig:
    """``engine.<name>``: a read-only view of ``engine.config.<name>`` (configuration is not changed in place)."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, engine, owner=None):
        return self if engine is None else getattr(engine.config, self.name)

    def __set__(self, engine, value):
        raise AttributeError(f"{self.name} is configuration: build a new PrivacyEngine to change it")


def _noise_multiplier(sigma, target_epsilon, target_delta, epochs, steps, sample_rate, accountant,
                      delta_given: bool, sample_size: int, max_batch_size: int | None) -> tuple[float, int | None]:
    """(noise multiplier, planned steps): the one given, or the one calibrated for the planned run."""
    if (sigma is None) == (target_epsilon is None):
        raise ValueError("give exactly one of noise_multiplier or target_epsilon (with epochs or steps)")
    if sigma is not None:
        if epochs is not None or steps is not None or delta_given:
            warnings.warn("epochs/steps/target_delta only matter with target_epsilon; they are ignored for calibration",
                          stacklevel=3)
        return checks.non_negative("noise_multiplier", sigma), None
    if (epochs is None) == (steps is None):
        raise ValueError("target_epsilon needs the planned length of training: give exactly one of epochs or steps")
    # An epoch is round(1/q) Poisson steps, as dptrain.data.poisson_loader runs it.
    planned = steps if steps is not None else int(math.ceil(epochs * max(1, round(1 / sample_rate))))
    return accounting.calibrate_noise_multiplier(target_epsilon, target_delta, sample_rate, planned,
                                                 accountant=accountant, sample_size=sample_size,
                                                 max_batch_size=max_batch_size), planned


class PrivacyEngine:
    """Makes an ordinary PyTorch training loop differentially private.

    After ``attach(optimizer)``, each ``optimizer.step()`` applies the private gradient
    ``(sum_i C_i g_i + sigma * R * N(0, I)) / batch_size`` where ``g_i`` are the per-sample
    gradients of the (micro-)batches back-propagated since the last step.
    ``engine.config`` holds the configuration; its fields read as ``engine.<name>`` too.
    """

    batch_size = _FromConfig()
    sample_size = _FromConfig()
    sample_rate = _FromConfig()
    max_grad_norm = _FromConfig()
    noise_multiplier = _FromConfig()
    target_epsilon = _FromConfig()
    target_delta = _FromConfig()
    planned_steps = _FromConfig()
    max_batch_size = _FromConfig()
    clipping_mode = _FromConfig()
    clipping_fn = _FromConfig()
    clipping_style = _FromConfig()
    clipping_gamma = _FromConfig()
    loss_reduction = _FromConfig()
    decision_rule = _FromConfig()
    allow_fallback = _FromConfig()
    batch_first = _FromConfig()
    budget = _FromConfig()
    recipe = _FromConfig()

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
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        model, self._parallel = distributed.data_parallel(model)
        batch_size = checks.positive_int("batch_size", batch_size, "the expected logical batch size")
        sample_size = checks.positive_int("sample_size", sample_size, "the dataset size")
        if batch_size > sample_size:
            raise ValueError(f"batch_size={batch_size} is larger than sample_size={sample_size}")
        delta_given = target_delta is not None
        checked = dict(  # everything cheap first: a wrong choice is reported before any calibration
            batch_size=batch_size,
            sample_size=sample_size,
            max_grad_norm=checks.positive("max_grad_norm", max_grad_norm, "the clipping threshold R"),
            target_epsilon=target_epsilon,
            target_delta=checks.open_unit("target_delta", target_delta if delta_given
                                          else accounting.default_delta(sample_size)),
            clipping_mode=checks.choice("clipping_mode", clipping_mode, tuple(RECIPES)),
            clipping_fn=checks.choice("clipping_fn", clipping_fn, CLIPPING_FNS),
            clipping_style=clipping_style,
            clipping_gamma=checks.positive("clipping_gamma", clipping_gamma),
            loss_reduction=checks.choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS),
            decision_rule=checks.choice("decision_rule", decision_rule, DECISION_RULES),
            accountant=checks.choice("accountant", accountant, accounting.ACCOUNTANTS),
            secure_rng=bool(secure_rng),
            seed=seed,
            allow_fallback=bool(allow_fallback),
            batch_first=bool(batch_first),
            budget=checks.choice("budget", budget, BUDGETS),
            max_batch_size=None if max_batch_size is None else checks.positive_int(
                "max_batch_size", max_batch_size, "the fixed number of rows of every batch, K"),
        )
        sigma, planned = _noise_multiplier(noise_multiplier, target_epsilon, checked["target_delta"], epochs, steps,
                                           batch_size / sample_size, accountant, delta_given, sample_size,
                                           checked["max_batch_size"])
        self.config = EngineConfig(noise_multiplier=sigma, planned_steps=planned, **checked)
        self.model = model
        self.accountant = accounting.create_accountant(accountant)
        rank = self._parallel.rank if self._parallel is not None else 0
        # Under FSDP2 every rank draws the noise of its own shard: independent streams per rank.
        self._noise = GaussianNoise(seed=None if seed is None else seed + 7919 * rank, secure=secure_rng)

        # Set by attach: the hooks, the optimizer, the GradScaler protocol, what every backward works with.
        self._capture: Capture | None = None
        self._scaling: LossScaling | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._setup: BackwardSetup | None = None
        self._step_handle = None
        self._grad_handles: dict[nn.Parameter, Any] = {}
        self._given = GivenGradients()

        # Long-lived parts: the step's clipped sums, the row layouts read so far, the budget, the trainable set.
        self._sums = StepSums()
        self._rows = RowReader(seed)
        self._budget = Budget(self.config)
        self._key = TrainableKey(model)
        self._trainable: TrainableSet | None = None
        self._warned_fallback: set[str] = set()
        self._follow_trainable()
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

        # The running backward (engine.backward's, or a plain loss.backward() until its queued callback).
        self._backward: Backward | None = None
        self._done_forwards: set[int] = set()  # model calls already back-propagated in this step
        self._decisions: list[LayerDecision] = []

        self.steps_taken = 0
        self._warned_loader = False

    # ------------------------------------------------------------------ the trainable set
    def _follow_trainable(self) -> None:
        """Read the trainable set again if it changed (at every model call with gradients enabled).

        A parameter that became trainable is covered exactly by its rule, or refused (``validate``);
        a frozen one drops out of the norms and is left untouched by the step.
        """
        key = self._key()
        if self._trainable is not None and key == self._trainable.key:
            return
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
        ``engine.backward``). See the README's mixed-precision section.
        """
        if data_loader is not None:
            self._check_loader(data_loader)
        if self._optimizer is not None:
            raise RuntimeError("this engine is already attached; call detach() first")
        distributed.refuse_deepspeed(optimizer)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"attach() needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if grad_scaler is not None and not (hasattr(grad_scaler, "get_scale") and hasattr(grad_scaler, "is_enabled")):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        self._refuse_second_engine()
        self._follow_trainable()
        model_params = set(self.model.parameters())
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if any(p not in model_params for p in held):
            raise ValueError("the optimizer holds a parameter that is not in the model given to the engine")
        if not any(p in self._trainable.users for p in held):
            raise ValueError("the optimizer holds none of the model's trainable parameters")
        # FSDP2 swaps the unsharded parameters in during each forward: hooks look them up by name.
        self._capture = Capture(
            self.model, self._on_output_grad, on_model_call=self._on_model_call,
            on_output_grad=self._on_model_output_grad,
            params_by_name=isinstance(self._parallel, distributed.FSDP2Gradients), batch_first=self.batch_first,
            rows=self._rows,
        )
        self._capture.on_tag_outputs = self._tag_outputs
        self._capture.on_scalar_output_grad = self._refuse_loss_inside_model
        self._capture.install(list(self._trainable.layers), extra_checks=frozen_batchnorm_checks(self.model))
        self._sync_grad_hooks()
        self._step_handle = optimizer.register_step_pre_hook(self._before_step)
        self._optimizer = optimizer
        enabled = grad_scaler is not None and grad_scaler.is_enabled()
        self._scaling = LossScaling(grad_scaler) if enabled else None
        self._setup = BackwardSetup(self.recipe, self.decision_rule, self.clipping_fn, self.clipping_gamma,
                                    self._sums, self._rows, self._capture, overflow_skippable=enabled)
        self._given.clear()
        _ATTACHED[self.model] = weakref.ref(self)
        TrainableKey.watch()
        if self._parallel is not None:
            self._parallel.attach()
        return self

    def _refuse_second_engine(self) -> None:
        mine = set(self.model.modules())
        for root, ref in list(_ATTACHED.items()):
            other = ref()
            if other is None or other is self or other._optimizer is None:
                continue
            if root in mine or self.model in set(root.modules()):
                raise RuntimeError(
                    f"another PrivacyEngine is attached to this model ({type(root).__name__}): two engines on one model "
                    "would each see the other's backward as ordinary gradients. Use one engine (one optimizer with "
                    "several parameter groups), or call detach() on the other first"
                )

    def _check_loader(self, loader) -> None:
        if data.is_poisson_loader(loader):
            if not math.isclose(loader.sample_rate, self.sample_rate, rel_tol=1e-9):
                raise ValueError(
                    f"the loader samples with q={loader.sample_rate:.6g} but the engine accounts for "
                    f"q = batch_size / sample_size = {self.sample_rate:.6g}: build both from the same batch size "
                    "and dataset size"
                )
            loader_k = getattr(getattr(loader, "batch_sampler", None), "max_batch_size", None)
            if loader_k != self.max_batch_size:
                raise ValueError(
                    f"the loader makes batches with max_batch_size={loader_k!r} but the engine accounts for "
                    f"max_batch_size={self.max_batch_size!r}: give PrivacyEngine the loader's max_batch_size "
                    "(truncating batches changes the privacy accounting)"
                )
        elif not self._warned_loader:
            self._warned_loader = True
            warnings.warn(
                f"{type(loader).__name__} does not sample batches by Poisson sampling, which the privacy accounting "
                "assumes: the reported epsilon does not hold for fixed-size shuffled batches. "
                "Use dptrain.data.poisson_loader(dataset, batch_size=...)",
                stacklevel=3,
            )

    def detach(self) -> None:
        """Remove every hook; the model and optimizer behave exactly as before ``attach``."""
        self._abort_backward()
        if self._capture is not None:
            self._capture.remove()
        if self._step_handle is not None:
            self._step_handle.remove()
        for handle in self._grad_handles.values():
            handle.remove()
        self._grad_handles = {}
        if self._parallel is not None and self._optimizer is not None:
            self._parallel.detach()
        if _ATTACHED.get(self.model) is not None and _ATTACHED[self.model]() is self:
            del _ATTACHED[self.model]
            TrainableKey.unwatch()
        self._capture, self._step_handle, self._optimizer, self._setup = None, None, None, None
        self._discard_step()

    @contextlib.contextmanager
    def paused(self):
        """Forwards and backwards inside are not training: nothing is recorded or clipped.

        For gradients with respect to the *inputs* (adversarial examples, saliency maps) taken with
        ``torch.autograd.grad(loss, x)``: outside this context the engine cannot tell such a backward
        from a training one, and would add the sample's clipped gradient to the step. A ``.backward()``
        inside still refuses to leave parameter gradients (they would not be private).
        """
        if self._capture is None:
            raise RuntimeError("call engine.attach(optimizer) first")
        previous = self._capture.paused
        self._capture.paused = True
        try:
            yield self
        finally:
            self._capture.paused = previous

    # ------------------------------------------------------------------ every exit
    def _abort_backward(self) -> None:
        """Drop the running backward whole (a failed or abandoned one); the step's earlier sums stay
        (or go as a whole, never in part: see ``StepSums``)."""
        backward, self._backward = self._backward, None
        if backward is not None:
            backward.abort()
        if self._capture is not None:
            self._capture.restore_switched()

    def _discard_step(self) -> None:
        """Drop the step's clipped sums and every call still waiting for a backward (the step is over)."""
        self._sums.clear()
        for state in self._trainable.layers:
            state.calls.clear()

    def _settle_failed_backward(self) -> None:
        """A plain ``loss.backward()`` whose end-of-backward callback never ran has failed: drop it."""
        if self._backward is not None and self._backward.phase is Phase.PLAIN and not in_backward():
            self._abort_backward()

    def _on_model_call(self) -> None:
        self._settle_failed_backward()
        if torch.is_grad_enabled():
            self._follow_trainable()

    # ------------------------------------------------------------------ engine.backward
    def backward(self, losses: torch.Tensor) -> None:
        """Back-propagate per-sample losses ``[B]`` (or ``[B, ...]``, summed per sample).

        Valid in every clipping mode; micro-batches accumulate until ``optimizer.step()``.
        """
        if self._capture is None:
            raise RuntimeError("call engine.attach(optimizer) before engine.backward(losses)")
        if not isinstance(losses, torch.Tensor) or losses.dim() == 0:
            raise ValueError(
                "engine.backward needs per-sample losses of shape [B], e.g. "
                "F.cross_entropy(logits, y, reduction='none'); got a scalar. For a scalar loss use loss.backward() "
                "in a single-backward mode"
            )
        self._settle_failed_backward()
        self._capture.settle_open_forward()
        if losses.dim() > 1:
            losses = losses.flatten(1).sum(1)
        passes = None  # tag passes (rows.py) agreed by every rank: one more backward each, in which FSDP2 gathers
        if self._parallel is not None:
            needs = losses.shape[0] > 0 and losses.requires_grad and self._needs_tags()
            flag, most = self._parallel.maximum([float(needs), float(losses.shape[0])], losses.device)
            passes = tag_passes(int(most)) if flag else 0
        # Without a scaler, non-finite losses show as non-finite norms (checked once, with them): no extra
        # host-device synchronisation on the hot path.
        if self._scaling is not None and not torch.isfinite(losses).all():
            self._forget_calls()  # fp16 overflow already in the forward: the step is skipped
            self._after_backward(overflow=True)
            return
        B = losses.shape[0]
        forward_batch = self._capture.forward_batch
        if B and forward_batch is not None and B != forward_batch and losses.requires_grad:
            self._forget_calls()
            raise ValueError(
                f"engine.backward got {B} per-sample losses but the model was last called with a batch of "
                f"{forward_batch}: give one loss per sample of that call (reduction='none'). A model that takes "
                "the batch in the second dimension of its input (sequence first) needs batch_first=False"
            )
        if B == 0 or not losses.requires_grad:
            if B == 0 and losses.requires_grad and isinstance(self._parallel, distributed.FSDP2Gradients):
                self._discarded_backwards(losses, passes)
            self._forget_calls()
            if B > 0:
                raise ValueError("the losses do not depend on any trainable parameter (did the forward run under no_grad?)")
            self._after_backward(overflow=False)
            return  # an empty batch contributes nothing; the step still adds noise and counts
        backward = self._backward = Backward(self._setup, self._trainable, Phase.SINGLE, samples=B)
        scaling = self._scaling
        can_retry = scaling is not None and scaling.can_retry(scaling.scale(), self.recipe.two_pass,
                                                              self._parallel is not None)
        try:
            overflow = backward.run(losses, scaling, can_retry, passes)
            backward.commit()
            self._backward_done(backward)
        except FloatingPointError as err:
            self._abort_backward()
            bad = (~torch.isfinite(losses.detach())).nonzero().flatten().tolist()
            if bad:
                raise ValueError(
                    f"non-finite per-sample losses at batch positions {bad[:10]}: nothing was accumulated"
                ) from err
            raise
        except BaseException:
            self._abort_backward()
            raise
        finally:
            self._backward = None
        self._after_backward(overflow)

    def _discarded_backwards(self, losses: torch.Tensor, passes: int) -> None:
        """FSDP2 gathers parameters inside each backward: a rank with an empty batch runs as many as the others."""
        self._backward = Backward(self._setup, self._trainable, Phase.DISCARD)
        passes += 1 + self._trainable.num_groups if self.recipe.two_pass else 1
        try:
            for k in range(passes):
                torch.autograd.backward(losses.sum(), retain_graph=k < passes - 1)
        finally:
            self._backward.commit()  # (nothing was added)
            self._backward = None

    def _forget_calls(self) -> None:
        for state in self._trainable.layers:
            state.calls.clear()

    def _needs_tags(self) -> bool:
        return needs_tags(self._trainable, self._rows, self._capture.forward_batch)

    def _backward_done(self, backward: Backward) -> None:
        """A backward completed: its model calls may not be back-propagated again in this step."""
        self._done_forwards |= backward.forwards
        self._decisions = backward.decisions

    # ------------------------------------------------------------------ what the hooks report
    def _on_output_grad(self, state, call: Call, grad: torch.Tensor) -> None:
        """A covered layer call received its output gradient: the running backward takes it (a plain
        ``loss.backward()`` starts here if its gradient reaches a layer before the model's output)."""
        if self._capture.paused:
            return
        backward = self._backward
        if backward is None:
            if self.recipe.two_pass:
                raise RuntimeError(
                    f"clipping_mode={self.clipping_mode!r} needs two backward passes: call "
                    "engine.backward(per_sample_losses) instead of loss.backward()"
                )
            backward = self._begin_plain_backward(from_layer=call)
        backward.on_output_grad(state, call, grad, self._done_forwards)

    def _plain_or_none(self) -> bool:
        """No backward runs, or a plain one outside its tag passes."""
        backward = self._backward
        return backward is None or backward.phase is Phase.PLAIN and not backward.rows.tagging

    def _on_model_output_grad(self) -> None:
        """The gradient reached the model's output: a plain backward starts (on the outermost graph task)."""
        if self._plain_or_none() and not self.recipe.two_pass:
            self._begin_plain_backward(from_layer=None)

    def _refuse_loss_inside_model(self) -> None:
        """A plain backward from a loss the model computed itself (Hugging Face's ``labels=``)."""
        if self._plain_or_none() and not self._capture.paused:
            raise ValueError(
                "loss.backward() from a loss computed inside the model (e.g. Hugging Face's labels=...): the engine "
                "cannot see which sample each part of it comes from, and Hugging Face's loss is a mean over every "
                "token of the batch, so each sample's weight depends on the other samples' lengths. Compute "
                "per-sample losses from the logits (dptrain.losses.sequence_losses or token_losses) and call "
                "engine.backward(losses)"
            )

    def _tag_outputs(self, output, needs: bool):
        """A model call with patterns not read yet: its per-sample outputs tag a plain backward (``tag_rows``).

        Under data parallelism every rank agrees (an empty rank too): the tagged pass is one more backward,
        in which FSDP2 gathers the parameters.
        """
        batch = self._capture.forward_batch
        passes = tag_passes(batch or 0)
        if self._parallel is not None:
            flag, most = self._parallel.maximum([float(needs), float(batch or 0)],
                                                next(iter(self._trainable.users)).device)
            needs, passes = bool(flag), tag_passes(int(most))
        if not needs or self.recipe.two_pass or batch is None:
            return None  # (two-pass modes refuse a plain backward at its first output gradient)
        all_tags = self._rows.new_tags(batch, passes)
        engine = weakref.ref(self)

        def tagged_pass(raw: torch.Tensor, grad: torch.Tensor, axis: int) -> None:
            alive = engine()
            backward = alive._backward if alive is not None else None
            if backward is None or backward.phase is not Phase.PLAIN or backward.rows.tagging:
                return  # engine.backward tags its losses instead
            backward.tag_plain(raw, grad, axis, all_tags)

        return tag_rows(output, batch, 0 if self.batch_first else 1, tagged_pass)

    def _begin_plain_backward(self, from_layer: Call | None) -> Backward:
        """The running plain ``loss.backward()``, made with its end-of-backward callback on the outermost task."""
        task = graph_task()
        backward = self._backward
        if backward is not None and backward.phase is Phase.PLAIN:
            if from_layer is not None or task == backward.task:
                return backward
            self._abort_backward()  # a new backward reached the model's output: the queued one died
        elif from_layer is not None and from_layer.recomputed:
            # Reentrant checkpointing runs a recomputation's backward as a nested backward, which ends before
            # the outer one: the end of this backward is unknown. (It is known when the gradient reaches the
            # model's output first, or with engine.backward.)
            raise RuntimeError(
                "a plain loss.backward() reached a layer recomputed by reentrant activation checkpointing before "
                "the model's output: the engine cannot tell where this backward ends. Return the model's outputs as "
                "tensors (or tuples, dicts, dataclasses of tensors) from model(...), use "
                "engine.backward(per_sample_losses), or checkpoint with use_reentrant=False"
            )
        backward = self._backward = Backward(self._setup, self._trainable, Phase.PLAIN)
        backward.task = task
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._finish_plain_backward(backward))
        return backward

    def _finish_plain_backward(self, backward: Backward) -> None:
        if self._backward is not backward:
            return  # dropped meanwhile
        try:
            backward.finish_plain(self.loss_reduction, self._loss_scale())
        except Overflow:
            backward.commit()  # (nothing was added: the factors were not finite)
            self._backward = None
            self._after_backward(overflow=True)
        except BaseException:
            self._abort_backward()
            raise
        else:
            backward.commit()
            self._backward = None
            self._backward_done(backward)
            self._after_backward(overflow=False)

    def _on_accumulated_grad(self, p: nn.Parameter) -> None:
        """Autograd reached a covered parameter: it was used outside its own layer's forward call."""
        name = self._trainable.param_name(p)
        p.grad = None  # never leave a non-private gradient where the optimizer could use it
        raise RuntimeError(
            f"parameter {name!r} was used outside the forward call of its own layer (e.g. a weight read by "
            "F.linear or a matmul elsewhere), so its per-sample gradient would not be clipped: use the layer "
            "module itself, tie it to another covered layer (shared parameters are exact), or freeze it"
        )

    # ------------------------------------------------------------------ the private step
    def _loss_scale(self) -> float:
        """The GradScaler's current scale (the factor on this step's loss), or 1."""
        return self._scaling.scale() if self._scaling is not None else 1.0

    def _after_backward(self, overflow: bool) -> None:
        """With a GradScaler: show it the marker gradient it checks (inf makes it skip the step).

        A skipped step (the plain ``loss.backward()`` path, or data parallelism, where the engine
        cannot run the backward again) counts in the accountant right away: skipping is a decision
        that looked at the data, and ``optimizer.step()`` (where steps are counted otherwise) will
        not run.
        """
        if self._scaling is None:
            return
        users = self._trainable.users
        if self._parallel is not None:  # every rank skips, or none
            overflow = self._parallel.any(overflow, next(iter(users)).device)
        held = [p for group in self._optimizer.param_groups for p in group["params"]
                if p in users and p.requires_grad]
        marker_param = min(held, key=lambda q: q.numel()) if held else next(iter(users))
        first, skipped = self._scaling.show(overflow, marker_param)
        if skipped:
            self._sums.clear()  # nothing of a skipped step is ever applied
        if first:
            self._budget.check(self.steps_taken + 1)
            self._count_step()
            warnings.warn(
                "fp16 overflow: this step is skipped and still counts in the privacy accountant. Through "
                "engine.backward(scaler.scale(losses)) in one process the engine finds a working scale without "
                "skipping", stacklevel=3)

    def _before_step(self, optimizer, args, kwargs) -> None:
        self._settle_failed_backward()
        self._capture.settle_open_forward()
        self._follow_trainable()
        self._done_forwards.clear()
        if self._scaling is not None and self._scaling.overflowed:
            # optimizer.step() without scaler.step(): the counted, overflowed step applies nothing
            for p in held_trainable(self._optimizer, self._trainable):
                p.grad = None
            self._scaling.overflowed = False
            self._discard_step()
            return
        step_params = held_trainable(self._optimizer, self._trainable)  # refuses raw gradients it does not cover
        marker = self._scaling.marker if self._scaling is not None else None
        self._given.leave_frozen_untouched(self._optimizer, marker)
        if self._parallel is not None:
            self._given.refuse_foreign(step_params, self._trainable, marker)
        try:
            self._budget.check(self.steps_taken + 1)
        except PrivacyBudgetExceeded:
            for p in step_params:
                p.grad = None
            self._discard_step()
            raise
        apply_private_gradient(step_params, self._sums, self._noise.sample, self.noise_multiplier * self.max_grad_norm,
                               self.batch_size, self._parallel, self._given)
        self._discard_step()
        self._count_step()

    def _count_step(self) -> None:
        self.accountant.step(self.noise_multiplier, self.sample_rate)
        self.steps_taken += 1

    # ------------------------------------------------------------------ reports
    def last_decisions(self) -> list[LayerDecision]:
        """What each layer did in the last backward: T, p, d, costs, and the chosen primitives."""
        return list(self._decisions)

    def get_epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent by the steps taken so far, at ``delta`` (default: ``target_delta``)."""
        delta = self.target_delta if delta is None else delta
        return self.accountant.get_epsilon(accounting.poisson_delta(
            delta, self.sample_size, self.sample_rate, self.max_batch_size, self.steps_taken))

    def privacy_report(self, delta: float | None = None) -> dict:
        delta = self.target_delta if delta is None else delta
        return {
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "steps": self.steps_taken,
            "planned_steps": self.planned_steps,
            "epsilon": self.get_epsilon(delta),
            "target_epsilon": self.target_epsilon,
            "delta": delta,
            "accountant": self.accountant.name,
            "max_grad_norm": self.max_grad_norm,
            "clipping_mode": self.clipping_mode,
            "max_batch_size": self.max_batch_size,
            "truncation_delta": 0.0 if self.max_batch_size is None else accounting.truncation_delta(
                self.sample_size, self.sample_rate, self.max_batch_size, self.steps_taken),
        }

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything needed to resume: step counter, accountant history and noise generator state."""
        return {
            "steps_taken": self.steps_taken,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "accountant": self.accountant.state_dict(),
            "noise": self._noise.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint written by ``state_dict()``; epsilon continues from its history.

        The noise multiplier is configuration, not state: build the engine with the same
        ``noise_multiplier`` (the checkpoint holds it) before loading.
        """
        missing = {"steps_taken", "accountant", "noise"} - set(state)
        if missing:
            raise ValueError(f"not a dptrain engine state: missing {sorted(missing)}")
        self.accountant.load_state_dict(state["accountant"])
        self._noise.load_state_dict(state["noise"])
        self.steps_taken = int(state["steps_taken"])
