"""PrivacyEngine: validated configuration, attach/detach, the backward passes, and the private step.

The per-backward work (operands, norms, clipping factors, clipped sums) is ``pipeline.BackwardPipeline``;
the GradScaler protocol is ``precision.LossScaling``; the hooks are ``capture.Capture``.
"""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

from . import accounting, checks, data, distributed
from .algorithms import DEFAULT_CLIPPING_MODE, RECIPES
from .capture import Call, Capture, LayerState, graph_task, in_backward, outside_model_call
from .clipping import CLIPPING_FNS, build_groups, group_threshold
from .layers import resolve_rule
from .layers.registry import layer_params
from .layers.fallback import FallbackRule, fallback_warning
from .losses import LOSS_REDUCTIONS
from .noise import GaussianNoise
from .pipeline import BackwardPipeline, Overflow, StepSums
from .planning import DECISION_RULES, DEFAULT_DECISION_RULE, LayerDecision
from .precision import LossScaling
from .rows import RowReader, tag_passes, tag_rows
from .validation import validate

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


class _Phase(Enum):
    """Which backward is running, as the output-gradient hooks need to know."""

    IDLE = "idle"                # none through engine.backward: a gradient here starts a plain loss.backward()
    SINGLE = "single"            # engine.backward, single-backward modes
    FIRST_PASS = "first-pass"    # two-pass modes: the norms
    SECOND_PASS = "second-pass"  # two-pass modes: the re-weighted losses
    DISCARD = "discard"          # an empty batch's backward (FSDP2 ranks keep in step): nothing to record


class PrivacyBudgetExceeded(RuntimeError):
    """``budget="strict"``: the next step would spend more than ``target_epsilon``."""


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

        # The step's clipped sums, and the work of one backward on them.
        self._sums = StepSums()
        self._rows = RowReader(seed)
        self._pipeline = BackwardPipeline(self.recipe, self.decision_rule, self.clipping_fn, self.clipping_gamma,
                                          self._sums, self._rows)

        # The trainable set, read again at every model call (staged fine-tuning freezes and unfreezes).
        self._layers: list[LayerState] = []
        self._users: dict[nn.Parameter, list[tuple[LayerState, str]]] = {}
        self._group_of: dict[nn.Parameter, int] = {}
        self._group_params: list[list[nn.Parameter]] = []
        self._num_groups = 0
        self._trainable: tuple = ()
        self._params: list[nn.Parameter] | None = None
        self._params_seen = -1
        self._warned_fallback: set[str] = set()
        self._build_layers()
        if not self._layers:
            raise ValueError("the model has no trainable parameters: nothing to train privately")
        if self.recipe.two_pass and self._num_groups > 1:
            warnings.warn(
                f"clipping_mode={clipping_mode!r} with {self._num_groups} clipping groups re-weights the loss once per "
                "group (Lee & Kifer's second backward applies one factor per sample), so each step runs "
                f"{self._num_groups} extra backward passes; the book-keeping modes clip groups at no extra cost",
                stacklevel=2,
            )

        # Hooks and the optimizer (set by attach).
        self._capture: Capture | None = None
        self._scaling: LossScaling | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._step_handle = None
        self._grad_handles: dict[nn.Parameter, Any] = {}
        self._given_grads: dict[nn.Parameter, weakref.ref] = {}

        # Which backward is running, and the end-of-backward callback of a plain loss.backward().
        self._phase = _Phase.IDLE
        self._done_forwards: set[int] = set()  # model calls already back-propagated in this step
        self._callback_queued = False
        self._callback_task = -1

        # Counters.
        self.steps_taken = 0
        self._warned_loader = False
        self._warned_budget = False
        self._budget_limit: int | None = None

    # ------------------------------------------------------------------ configuration
    def _trainable_key(self) -> tuple:
        """Identifies the trainable set: the model's parameters (walked again only after a module or parameter
        was registered anywhere, which a global registration hook counts) and their requires_grad flags."""
        if self._params_seen != _Structure.version or self._params is None:
            self._params = list(self.model.parameters())
            self._params_seen = _Structure.version
        return (id(self._params), *(p.requires_grad for p in self._params))

    def _build_layers(self) -> None:
        """Covered layers, tied-parameter users and clipping groups for the parameters trainable now.

        A parameter that became trainable is covered exactly by its rule, or refused (``validate``);
        a frozen one drops out of the norms and is left untouched by the step.
        """
        validate(self.model, allow_fallback=self.allow_fallback)
        covered = layer_params(self.model)  # own parameters, and descendants' ones a rule claims
        previous = {id(s.module): s for s in self._layers}
        layers = []
        for name, module in self.model.named_modules():
            if module not in covered:
                continue
            state = previous.get(id(module))
            if state is None:
                rule = resolve_rule(module, self.allow_fallback, batch_first=self.batch_first, name=name)
                state = LayerState(name, module, rule, covered[module])
            else:
                state.params = covered[module]
            layers.append(state)
        # A parameter shared by several layers (tied weights) is clipped once, its per-sample
        # gradient being the sum of every layer's; its first user names it in clipping groups.
        users: dict[nn.Parameter, list[tuple[LayerState, str]]] = {}
        for state in layers:
            for name, p in state.params.items():
                users.setdefault(p, []).append((state, name))
        param_of = {(u[0][0].name, u[0][1]): p for p, u in users.items()}
        groups = build_groups(self.clipping_style, [s.name for s in layers], list(param_of)) if users else []
        fallback = [s.name or "<root>" for s in layers if isinstance(s.rule, FallbackRule)
                    and (s.name or "<root>") not in self._warned_fallback]
        message = fallback_warning(fallback)
        if message is not None:
            self._warned_fallback.update(fallback)
            warnings.warn(message, stacklevel=4)
        self._layers = layers
        self._users = users
        self._group_of = {param_of[key]: k for k, group in enumerate(groups) for key in group}
        self._group_params = [[param_of[key] for key in group] for group in groups]
        self._num_groups = len(groups)
        self._pipeline.set_layers(layers, users, self._group_of, len(groups),
                                  group_threshold(self.max_grad_norm, max(1, len(groups))))
        self._trainable = self._trainable_key()

    def _follow_trainable(self) -> None:
        """Re-read the trainable set (called at each model call with gradients enabled)."""
        if self._trainable_key() == self._trainable:
            return
        self._build_layers()
        if self._capture is not None:
            self._capture.add_checks(_frozen_batchnorm_checks(self.model))  # modules added since attach
            self._capture.set_layers(self._layers)
            self._sync_grad_hooks()

    def _sync_grad_hooks(self) -> None:
        for p in list(self._grad_handles):
            if p not in self._users:
                self._grad_handles.pop(p).remove()
        # The hook lives in the parameter's C++ autograd data, where Python's gc cannot see it: a strong
        # reference to the engine would keep the engine, the model and all its state alive forever.
        engine = weakref.ref(self)

        def on_accumulated_grad(p: nn.Parameter) -> None:
            alive = engine()
            if alive is not None:
                alive._on_accumulated_grad(p)

        for p in self._users:
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
        if not any(p in self._users for p in held):
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
        self._capture.install(self._layers, extra_checks=_frozen_batchnorm_checks(self.model))
        self._sync_grad_hooks()
        self._step_handle = optimizer.register_step_pre_hook(self._before_step)
        self._optimizer = optimizer
        enabled = grad_scaler is not None and grad_scaler.is_enabled()
        self._scaling = LossScaling(grad_scaler) if enabled else None
        self._pipeline.overflow_skippable = self._scaling is not None
        self._given_grads = {}
        _ATTACHED[self.model] = weakref.ref(self)
        _Structure.watch()
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
            _Structure.unwatch()
        self._capture, self._step_handle, self._optimizer = None, None, None
        self._pipeline.forget_calls()
        self._sums.clear()

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

    # ------------------------------------------------------------------ every exit of a backward
    def _abort_backward(self) -> None:
        """Drop everything a failed (or abandoned) forward/backward captured; the step's earlier sums stay
        (or go as a whole, never in part: see ``StepSums``)."""
        self._pipeline.abort()
        self._rows.end_backward()
        self._rows.tagging = False
        self._callback_queued = False
        self._phase = _Phase.IDLE
        if self._capture is not None:
            self._capture.restore_switched()

    def _settle_failed_backward(self) -> None:
        """A plain ``loss.backward()`` whose end-of-backward callback never ran has failed: drop its state."""
        if self._callback_queued and not in_backward():
            self._abort_backward()

    def _on_model_call(self) -> None:
        self._settle_failed_backward()
        if torch.is_grad_enabled():
            self._follow_trainable()

    # ------------------------------------------------------------------ backward
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
        # Whether a tag pass runs (rows.py) is agreed by every rank, the empty and overflowed ones included:
        # it is one more backward, in which FSDP2 gathers the parameters.
        passes = None  # tag passes (rows.py) agreed by every rank: one more backward each, in which FSDP2 gathers
        if self._parallel is not None:
            needs = losses.shape[0] > 0 and losses.requires_grad and self._needs_tags()
            flag, most = self._parallel.maximum([float(needs), float(losses.shape[0])], losses.device)
            passes = tag_passes(int(most)) if flag else 0
        # Without a scaler, non-finite losses show as non-finite norms (checked once, with them): no extra
        # host-device synchronisation on the hot path.
        if self._scaling is not None and not torch.isfinite(losses).all():
            self._pipeline.forget_calls()  # fp16 overflow already in the forward: the step is skipped
            self._after_backward(overflow=True)
            return
        B = losses.shape[0]
        forward_batch = self._capture.forward_batch
        if B and forward_batch is not None and B != forward_batch and losses.requires_grad:
            self._pipeline.forget_calls()
            raise ValueError(
                f"engine.backward got {B} per-sample losses but the model was last called with a batch of "
                f"{forward_batch}: give one loss per sample of that call (reduction='none'). A model that takes "
                "the batch in the second dimension of its input (sequence first) needs batch_first=False"
            )
        if B == 0 or not losses.requires_grad:
            if B == 0 and losses.requires_grad and isinstance(self._parallel, distributed.FSDP2Gradients):
                # FSDP2 gathers parameters inside each backward: a rank with an empty batch runs as many.
                self._phase = _Phase.DISCARD
                passes += 1 + self._num_groups if self.recipe.two_pass else 1
                try:
                    for k in range(passes):
                        torch.autograd.backward(losses.sum(), retain_graph=k < passes - 1)
                finally:
                    self._phase = _Phase.IDLE
            self._pipeline.forget_calls()
            if B > 0:
                raise ValueError("the losses do not depend on any trainable parameter (did the forward run under no_grad?)")
            self._after_backward(overflow=False)
            return  # an empty batch contributes nothing; the step still adds noise and counts
        overflow = False
        try:
            self._pipeline.samples = B
            overflow = self._scaled_backward(losses, passes)
            self._backward_done()
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
            self._phase = _Phase.IDLE
            self._pipeline.samples = None
            self._rows.end_backward()
        self._after_backward(overflow)

    def _scaled_backward(self, losses: torch.Tensor, passes: int | None) -> bool:
        """One backward (both passes in the two-pass modes); True if it overflowed and the step is skipped.

        Without a GradScaler the objective is ``sum_i L_i``. With one, ``losses`` carry its scale S and
        the objective is their mean, as in ordinary fp16 training (a sum would be B times larger and
        overflow). Where a scale above the last one that worked overflows, the same batch is
        back-propagated again at the scaler's back-off (single process): finding the scale costs a
        backward, never a skipped step or privacy budget. The graph is kept for that only then.
        """
        B = losses.shape[0]
        if self._scaling is None:
            self._one_backward(losses, 1.0, 1.0, retain=False, passes=passes)
            return False
        scale = self._scaling.scale()
        retry = self._scaling.can_retry(scale, self.recipe.two_pass, self._parallel is not None)
        attempt = 1.0
        while True:
            try:
                self._pipeline.consumed = [] if retry else None
                self._one_backward(losses, attempt / B, scale * attempt / B, retain=retry, passes=passes)
                break
            except Overflow:
                if not retry or scale * attempt <= 1.0:  # below scale 1 a smaller scale no longer helps: a real NaN
                    return True
                self._pipeline.reset_for_retry()
                attempt *= self._scaling.backoff()
            finally:
                self._pipeline.consumed = None
        self._scaling.worked(scale, attempt)
        return False

    def _one_backward(self, losses: torch.Tensor, factor: float, kappa: float, retain: bool,
                      passes: int | None) -> None:
        """Back-propagate ``factor * sum_i losses_i``; ``kappa`` is that objective's factor on the true losses.

        First the tag passes that read new patterns' rows: ``passes`` (agreed by every rank), or, in one
        process (None), as many as the batch needs if a call waits with an unread pattern."""
        objective = losses.sum() if factor == 1.0 else (losses * factor).sum()
        if passes is None:
            passes = tag_passes(losses.shape[0]) if self._needs_tags() else 0
        if passes:
            self._tag_pass(losses, factor, passes)
        self._capture.new_pass()
        if self.recipe.two_pass:
            self._two_pass_backward(losses, objective, factor, kappa)
        else:
            self._phase = _Phase.SINGLE
            torch.autograd.backward(objective, retain_graph=retain)
            self._pipeline.finish(losses.shape[0], 1.0 / kappa)

    def _two_pass_backward(self, losses: torch.Tensor, objective: torch.Tensor, factor: float, kappa: float) -> None:
        """Lee & Kifer: norms from a first backward of sum_i L_i, then back-propagate sum_i C_i L_i.

        Both passes only produce output gradients (ghost differentiation); the second pass's
        parameter gradients (module 2b) are a^T g of its re-weighted output gradients, one
        pass per clipping group. The output gradients of the second pass are those that reach
        a layer call during it: the forward's calls, or their recomputations under activation
        checkpointing.
        """
        self._phase = _Phase.FIRST_PASS
        torch.autograd.backward(objective, retain_graph=True)
        factors = self._pipeline.finish(losses.shape[0], 1.0 / kappa)
        ones = torch.full_like(factors[0], 1.0 / kappa)
        self._phase = _Phase.SECOND_PASS
        self._sums.begin()
        for k, params in enumerate(self._group_params):
            self._capture.new_pass()
            weights = factors[k] if factor == 1.0 else factors[k] * factor
            reweighted = (losses * weights.to(losses.dtype)).sum()
            self._pipeline.reweighted = []
            torch.autograd.backward(reweighted, retain_graph=k < len(self._group_params) - 1)
            self._pipeline.second_pass_gradients(params, ones)
        self._sums.commit()

    def _needs_tags(self) -> bool:
        """Whether a call waiting for its gradient has a pattern whose rows were not read yet."""
        recomputed = self._rows.recomputed_batches
        if recomputed is not None and self._capture.forward_batch not in recomputed:
            return True
        return any(call.unread and call.rowmap is None for state in self._layers for call in state.calls)

    def _tag_pass(self, losses: torch.Tensor, factor: float, passes: int) -> None:
        """Back-propagate ``factor * sum_i v_i L_i`` once per set of per-sample tags ``v`` (``rows.make_tags``):
        each call's tagged output gradients show which sample each of its rows belongs to
        (``rows.read_rows``). Nothing is reduced."""
        dtype = torch.promote_types(losses.dtype, torch.float32)
        for k, tags in enumerate(self._rows.new_tags(losses.shape[0], passes)):
            self._rows.tagging, self._rows.tag_pass = True, k
            self._capture.new_pass()
            try:
                torch.autograd.backward((losses * (tags * factor).to(losses.device, dtype)).sum(), retain_graph=True)
            finally:
                self._rows.tagging = False

    def _tag_outputs(self, output, needs_tags: bool):
        """A model call with patterns not read yet: its per-sample outputs tag a plain backward (``tag_rows``).

        Under data parallelism every rank agrees (an empty rank too): the tagged pass is one more backward,
        in which FSDP2 gathers the parameters.
        """
        batch = self._capture.forward_batch
        passes = tag_passes(batch or 0)
        if self._parallel is not None:
            flag, most = self._parallel.maximum([float(needs_tags), float(batch or 0)],
                                                next(iter(self._users)).device)
            needs_tags, passes = bool(flag), tag_passes(int(most))
        if not needs_tags or self.recipe.two_pass or batch is None:
            return None  # (two-pass modes refuse a plain backward at its first output gradient)
        all_tags = self._rows.new_tags(batch, passes)
        engine = weakref.ref(self)

        def tagged_pass(raw: torch.Tensor, grad: torch.Tensor, axis: int) -> None:
            alive = engine()
            if alive is None or alive._rows.tagging or alive._phase is not _Phase.IDLE:
                return  # engine.backward tags its losses instead
            rows = alive._rows
            shape = [1] * grad.dim()
            shape[axis] = -1
            rows.tags = all_tags
            for k, tags in enumerate(all_tags):
                rows.tagging, rows.tag_pass = True, k
                alive._capture.new_pass()
                try:
                    torch.autograd.backward(raw, grad * tags.to(grad.device, grad.dtype).reshape(shape),
                                            retain_graph=True)
                finally:
                    rows.tagging = False
                    alive._capture.new_pass()

        return tag_rows(output, self._capture.forward_batch, 0 if self.batch_first else 1, tagged_pass)

    def _backward_done(self) -> None:
        """A backward completed: its model calls may not be back-propagated again in this step."""
        self._done_forwards |= self._pipeline.forwards
        self._pipeline.forwards = set()

    def _on_output_grad(self, state: LayerState, call: Call, grad: torch.Tensor) -> None:
        if self._phase is _Phase.DISCARD or self._capture.paused:
            return
        if self._rows.tagging:
            self._rows.record_tagged(state, call, grad)
            return
        if self._phase is _Phase.SECOND_PASS:
            call.grad = grad.detach()
            self._pipeline.reweighted.append((state, call))
            return
        if self._phase is _Phase.IDLE:
            if self.recipe.two_pass:
                raise RuntimeError(
                    f"clipping_mode={self.clipping_mode!r} needs two backward passes: call "
                    "engine.backward(per_sample_losses) instead of loss.backward()"
                )
            self._begin_plain_backward(from_layer=call)
            if call.batch_size is None and not call.recomputed:
                raise outside_model_call(state)
        if call.forward_id is not None and call.forward_id in self._done_forwards:
            raise RuntimeError(
                f"{state.name or '<root>'}: this model call was already back-propagated in this step (one forward, "
                "two backward passes, e.g. two heads' losses back-propagated one after the other): each would be "
                "clipped on its own, so a sample could contribute more than max_grad_norm. Add the losses and "
                "back-propagate them once"
            )
        if not any(c is call for c in state.calls):
            raise RuntimeError(
                f"{state.name or '<root>'}: a layer call received a second output gradient (the same forward was "
                "back-propagated twice, e.g. with retain_graph=True): each sample may enter a step once. Run a new "
                "forward for each backward"
            )
        call.grad = grad.detach()
        state.calls.hold(call)
        if self._pipeline.can_reduce_now(state):
            self._pipeline.reduce_layer(state)

    def _refuse_loss_inside_model(self) -> None:
        """A plain backward from a loss the model computed itself (Hugging Face's ``labels=``)."""
        if self._phase is _Phase.IDLE and not self._rows.tagging and not self._capture.paused:
            raise ValueError(
                "loss.backward() from a loss computed inside the model (e.g. Hugging Face's labels=...): the engine "
                "cannot see which sample each part of it comes from, and Hugging Face's loss is a mean over every "
                "token of the batch, so each sample's weight depends on the other samples' lengths. Compute "
                "per-sample losses from the logits (dptrain.losses.sequence_losses or token_losses) and call "
                "engine.backward(losses)"
            )

    def _on_model_output_grad(self) -> None:
        """The gradient reached the model's output: a backward starts (on the outermost graph task)."""
        if self._phase is _Phase.IDLE and not self.recipe.two_pass and not self._rows.tagging:
            self._begin_plain_backward(from_layer=None)

    def _begin_plain_backward(self, from_layer: Call | None) -> None:
        """Queue the end-of-backward callback of a plain ``loss.backward()`` once, on the outermost task."""
        task = graph_task()
        if self._callback_queued:
            if from_layer is not None or task == self._callback_task:
                return
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
        self._callback_queued = True
        self._callback_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_plain_backward)

    def _on_accumulated_grad(self, p: nn.Parameter) -> None:
        """Autograd reached a covered parameter: it was used outside its own layer's forward call."""
        name = next(f"{s.name}.{n}" if s.name else n for s, n in self._users[p])
        p.grad = None  # never leave a non-private gradient where the optimizer could use it
        raise RuntimeError(
            f"parameter {name!r} was used outside the forward call of its own layer (e.g. a weight read by "
            "F.linear or a matmul elsewhere), so its per-sample gradient would not be clipped: use the layer "
            "module itself, tie it to another covered layer (shared parameters are exact), or freeze it"
        )

    def _finish_plain_backward(self) -> None:
        self._callback_queued = False
        try:
            batch = self._pipeline.reduce_all(expected=None)
            scale = float(batch) if self.loss_reduction == "mean" else 1.0
            self._pipeline.finish(batch, scale / self._loss_scale())
        except Overflow:
            self._rows.end_backward()
            self._after_backward(overflow=True)
        except BaseException:
            self._abort_backward()
            raise
        else:
            self._rows.end_backward()
            self._backward_done()
            self._after_backward(overflow=False)

    # ------------------------------------------------------------------ the private step
    def _loss_scale(self) -> float:
        """The GradScaler's current scale (the factor on this step's loss), or 1."""
        return self._scaling.scale() if self._scaling is not None else 1.0

    def _held_trainable(self) -> list[nn.Parameter]:
        """The covered trainable parameters the optimizer holds; refuses trainable ones it does not hold."""
        held = [p for group in self._optimizer.param_groups for p in group["params"]]
        # (a parameter no longer in the model, without a gradient, is harmless: the optimizer skips it)
        foreign = [p for p in held if p.requires_grad and p not in self._users and p.grad is not None]
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
        missing = [p for p in self._users if p.requires_grad and p not in held_set]
        if missing:
            names = [f"{s.name}.{n}" if s.name else n for p in missing for s, n in self._users[p][:1]]
            raise RuntimeError(
                f"trainable parameters {names[:5]}{' ...' if len(names) > 5 else ''} are not held by the optimizer "
                "the engine is attached to: their private gradients would be lost (a second optimizer never "
                "receives any). Put every trainable parameter into this optimizer (parameter groups can set their "
                "own learning rates), or freeze them"
            )
        return [p for p in held if p in self._users and p.requires_grad]

    def _after_backward(self, overflow: bool) -> None:
        """With a GradScaler: show it the marker gradient it checks (inf makes it skip the step).

        A skipped step (the plain ``loss.backward()`` path, or data parallelism, where the engine
        cannot run the backward again) counts in the accountant right away: skipping is a decision
        that looked at the data, and ``optimizer.step()`` (where steps are counted otherwise) will
        not run.
        """
        if self._scaling is None:
            return
        if self._parallel is not None:  # every rank skips, or none
            overflow = self._parallel.any(overflow, next(iter(self._users)).device)
        held = [p for group in self._optimizer.param_groups for p in group["params"]
                if p in self._users and p.requires_grad]
        marker_param = min(held, key=lambda q: q.numel()) if held else next(iter(self._users))
        first, skipped = self._scaling.show(overflow, marker_param)
        if skipped:
            self._sums.clear()  # nothing of a skipped step is ever applied
        if first:
            self._check_budget()
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
            for p in self._held_trainable():
                p.grad = None
            self._scaling.overflowed = False
            self._sums.clear()
            self._pipeline.forget_calls()
            return
        step_params = self._held_trainable()  # refuses raw gradients on held parameters the engine does not cover
        self._leave_frozen_untouched()
        if self._parallel is not None:
            self._refuse_foreign_grads(step_params)
        try:
            self._check_budget()
        except PrivacyBudgetExceeded:
            for p in step_params:
                p.grad = None
            self._sums.clear()
            self._pipeline.forget_calls()
            raise
        std = self.noise_multiplier * self.max_grad_norm

        # In place on the engine's own sums, one parameter at a time: the step needs no more
        # memory than the gradients themselves (plus one parameter's noise).
        def add_noise(t: torch.Tensor) -> torch.Tensor:
            return t.add_(self._noise.sample(t, std)) if std > 0 else t

        def take_sum(p: nn.Parameter) -> torch.Tensor:
            summed = self._sums.pop(p)
            return summed if summed is not None else torch.zeros(p.shape, dtype=p.dtype, device=p.device)

        self._given_grads = {}

        def set_grad(p: nn.Parameter, t: torch.Tensor) -> None:
            grad = t.div_(self.batch_size).to(p.dtype)
            p.grad = self._parallel.as_grad(p, grad) if self._parallel is not None else grad
            self._given_grads[p] = weakref.ref(p.grad)

        if self._parallel is None:
            for p in step_params:
                set_grad(p, add_noise(take_sum(p)))
        else:  # the ranks' sums, with the noise added once
            noisy = self._parallel.noisy_sum(step_params, [take_sum(p) for p in step_params], add_noise)
            for p, t in zip(step_params, noisy):
                set_grad(p, t)
        self._sums.clear()
        self._pipeline.forget_calls()
        self._count_step()

    def _marker(self) -> torch.Tensor | None:
        return self._scaling.marker if self._scaling is not None else None

    def _leave_frozen_untouched(self) -> None:
        """A parameter frozen after the engine gave it gradients keeps none (the optimizer then skips it)."""
        marker = self._marker()
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad and p.grad is not None:
                    given = self._given_grads.get(p)
                    if given is not None and given() is p.grad or p.grad is marker:
                        p.grad = None

    def _count_step(self) -> None:
        self.accountant.step(self.noise_multiplier, self.sample_rate)
        self.steps_taken += 1

    def _check_budget(self) -> None:
        """Warn once when the next step passes ``target_epsilon``; ``budget="strict"`` refuses it."""
        if self.target_epsilon is None or self.steps_taken + 1 <= self.planned_steps:
            return
        if self._budget_limit is None:
            self._budget_limit = self._steps_within_budget()
        if self.steps_taken + 1 <= self._budget_limit:
            return
        spent = self._epsilon_after(self.steps_taken + 1)
        message = (f"step {self.steps_taken + 1} would spend epsilon = {spent:.4g} at delta = {self.target_delta:.3g}, "
                   f"past target_epsilon = {self.target_epsilon:g} (the noise was calibrated for "
                   f"{self.planned_steps} steps; at most {self._budget_limit} fit the target)")
        if self.budget == "strict":
            raise PrivacyBudgetExceeded(message + ": nothing was applied (budget='strict')")
        if not self._warned_budget:
            self._warned_budget = True
            warnings.warn(message + "; training goes on (budget='strict' refuses such steps)", stacklevel=4)

    def _epsilon_after(self, steps: int) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return accounting.compute_epsilon(self.noise_multiplier, self.sample_rate, steps, self.target_delta,
                                                  accountant=self.accountant.name, sample_size=self.sample_size,
                                                  max_batch_size=self.max_batch_size)
            except ValueError:  # truncation alone uses up target_delta by then
                return math.inf

    def _steps_within_budget(self) -> int:
        """The largest number of steps whose epsilon stays within ``target_epsilon`` (at least the plan)."""
        low, high = self.planned_steps, self.planned_steps + 1
        while self._epsilon_after(high) <= self.target_epsilon:
            low, high = high, 2 * high
        while high - low > 1:
            mid = (low + high) // 2
            if self._epsilon_after(mid) <= self.target_epsilon:
                low = mid
            else:
                high = mid
        return low

    def _refuse_foreign_grads(self, step_params: list[nn.Parameter]) -> None:
        """Backstop under data parallelism: a gradient the engine did not give came from a use of the
        parameter outside its layer's call. (FSDP2 writes autograd's gradients to the sharded ``p.grad``
        by its reduce-scatter; recent torch then runs the post-accumulate-grad hook, which refuses them
        during the backward, but nothing guarantees every version does.) Without data parallelism the
        step replaces every covered parameter's gradient, and ``_held_trainable`` refuses the others'."""
        marker = self._marker()
        for p in step_params:
            given = self._given_grads.get(p)
            if p.grad is not None and (given is None or given() is not p.grad) and p.grad is not marker:
                name = next(f"{s.name}.{n}" if s.name else n for s, n in self._users[p])
                p.grad = None
                raise RuntimeError(
                    f"parameter {name!r} holds a gradient the engine did not give: autograd's own, unclipped (the "
                    "parameter was used outside the forward call of its own layer, or the layer was replaced "
                    "outside a model call). It was dropped; nothing was applied. Use the layer module itself, "
                    "call the model itself, or freeze the parameter"
                )

    # ------------------------------------------------------------------ reports
    def last_decisions(self) -> list[LayerDecision]:
        """What each layer did in the last backward: T, p, d, costs, and the chosen primitives."""
        return list(self._pipeline.last_decisions)

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


class _Structure:
    """Counts module and parameter registrations in the process while an engine is attached, so that
    each model call can re-read the trainable set from a cached parameter list (walking a large model's
    modules at every call costs milliseconds)."""

    version = 0
    _handles: list = []
    _watchers = 0

    @classmethod
    def _changed(cls, *args):
        cls.version += 1

    @classmethod
    def watch(cls) -> None:
        cls._watchers += 1
        if cls._watchers == 1:
            cls.version += 1
            hooks = nn.modules.module
            cls._handles = [hooks.register_module_parameter_registration_hook(cls._changed),
                            hooks.register_module_module_registration_hook(cls._changed)]

    @classmethod
    def unwatch(cls) -> None:
        cls._watchers = max(0, cls._watchers - 1)
        if cls._watchers == 0:
            for handle in cls._handles:
                handle.remove()
            cls._handles = []
            cls.version += 1


def _frozen_batchnorm_checks(model: nn.Module):
    """A frozen BatchNorm is fine in eval mode, but in train mode it mixes samples in the forward."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            where = f"the submodule {name!r}" if name else "the model itself"

            def check(mod, inputs, _where=where):
                if mod.training and torch.is_grad_enabled():
                    raise RuntimeError(
                        f"{_where} ({type(mod).__name__}) is frozen but in training mode: it normalises with "
                        "statistics of the whole batch, which mixes samples. Call .eval() on it (its running "
                        "statistics are then used), or train dptrain.fix(model), a copy in which every BatchNorm "
                        "is a GroupNorm"
                    )
            found.append((module, check))
    return found
