"""PrivacyEngine: validated configuration, attach/detach, backward, and the private step."""
from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import accounting, data, distributed
from .algorithms import RECIPES
from .capture import Call, Capture, LayerState
from .clipping import CLIPPING_FNS, build_groups, clipping_factors, group_threshold
from .layers import resolve_rule
from .layers.base import LayerDims, layer_params, shared_sq_norm
from .noise import GaussianNoise
from .planning import DECISION_RULES, LayerDecision, decide
from .validation import validate

LOSS_REDUCTIONS = ("mean", "sum")


@dataclass
class _ReadyLayer:
    """A layer's operands for this backward, all its calls concatenated along the token axis."""

    state: LayerState
    ops: tuple
    dims: LayerDims
    batch_size: int


@dataclass
class _ParamWork:
    """The norm stage of one parameter in one backward, and what its gradient stage needs."""

    group: int
    batch_size: int
    sq_norm: torch.Tensor
    per_sample: torch.Tensor | None                     # kept for module 5
    book: list[tuple[LayerState, str, tuple]]            # kept (layer, name, operands) for module 2b(C)


class PrivacyEngine:
    """Makes an ordinary PyTorch training loop differentially private.

    After ``attach(optimizer)``, each ``optimizer.step()`` applies the private gradient
    ``(sum_i C_i g_i + sigma * R * N(0, I)) / batch_size`` where ``g_i`` are the per-sample
    gradients of the (micro-)batches back-propagated since the last step.
    """

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
        clipping_mode: str = "bk-mixopt",
        clipping_fn: str = "abadi",
        clipping_style: str | Sequence[Sequence[str]] = "all-layer",
        loss_reduction: str = "mean",
        decision_rule: str = "space",
        clipping_gamma: float = 0.01,
        accountant: str = "pld",
        secure_rng: bool = False,
        seed: int | None = None,
        allow_fallback: bool = True,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        model, self._parallel = distributed.data_parallel(model)
        _check_choice("clipping_mode", clipping_mode, tuple(RECIPES))
        _check_choice("clipping_fn", clipping_fn, CLIPPING_FNS)
        _check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
        _check_choice("decision_rule", decision_rule, DECISION_RULES)
        _check_choice("accountant", accountant, accounting.ACCOUNTANTS)
        if not (isinstance(batch_size, int) and batch_size > 0):
            raise ValueError(f"batch_size must be a positive int (the expected logical batch size), got {batch_size!r}")
        if not (isinstance(sample_size, int) and sample_size > 0):
            raise ValueError(f"sample_size must be a positive int (the dataset size), got {sample_size!r}")
        if batch_size > sample_size:
            raise ValueError(f"batch_size={batch_size} is larger than sample_size={sample_size}")
        if not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
        if not clipping_gamma > 0:
            raise ValueError(f"clipping_gamma must be positive, got {clipping_gamma!r}")

        self.model = model
        self.batch_size = batch_size
        self.sample_size = sample_size
        self.sample_rate = batch_size / sample_size
        self.max_grad_norm = float(max_grad_norm)
        self.clipping_mode = clipping_mode
        self.recipe = RECIPES[clipping_mode]
        self.clipping_fn = clipping_fn
        self.clipping_gamma = float(clipping_gamma)
        self.loss_reduction = loss_reduction
        self.decision_rule = decision_rule
        self.target_delta = target_delta if target_delta is not None else accounting.default_delta(sample_size)
        self.noise_multiplier = self._resolve_noise_multiplier(
            noise_multiplier, target_epsilon, target_delta, epochs, steps, accountant
        )
        self.target_epsilon = target_epsilon
        self.accountant = accounting.create_accountant(accountant)
        rank = self._parallel.rank if self._parallel is not None else 0
        # Under FSDP2 every rank draws the noise of its own shard: independent streams per rank.
        self._noise = GaussianNoise(seed=None if seed is None else seed + 7919 * rank, secure=secure_rng)

        self.allow_fallback = bool(allow_fallback)
        validate(model, allow_fallback=self.allow_fallback)
        covered = layer_params(model)  # own parameters, and descendants' ones a rule claims
        self._layers = [
            LayerState(name, module, resolve_rule(module, self.allow_fallback), covered[module])
            for name, module in model.named_modules()
            if module in covered
        ]
        if not self._layers:
            raise ValueError("the model has no trainable parameters: nothing to train privately")
        # A parameter shared by several layers (tied weights) is clipped once, its per-sample
        # gradient being the sum of every layer's; its first user names it in clipping groups.
        self._users: dict[nn.Parameter, list[tuple[LayerState, str]]] = {}
        for state in self._layers:
            for name, p in state.params.items():
                self._users.setdefault(p, []).append((state, name))
        param_of = {(users[0][0].name, users[0][1]): p for p, users in self._users.items()}
        params = list(param_of)
        groups = build_groups(clipping_style, [s.name for s in self._layers], params)
        if self.recipe.two_pass and len(groups) > 1:
            warnings.warn(
                f"clipping_mode={clipping_mode!r} with {len(groups)} clipping groups re-weights the loss once per "
                "group (Lee & Kifer's second backward applies one factor per sample), so each step runs "
                f"{len(groups)} extra backward passes; the book-keeping modes clip groups at no extra cost",
                stacklevel=2,
            )
        self.clipping_style = clipping_style
        self._group_of = {param_of[key]: k for k, group in enumerate(groups) for key in group}
        self._group_params = [[param_of[key] for key in group] for group in groups]
        self._num_groups = len(groups)
        self._threshold = group_threshold(self.max_grad_norm, len(groups))

        self._capture: Capture | None = None
        self._scaler = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._step_handle = None
        self._phase = "idle"  # idle | single | first-pass | second-pass | discard (an empty batch)
        self._callback_queued = False
        self._ready: dict[int, _ReadyLayer] = {}
        self._second_pass_calls: dict[int, list[Call]] = {}
        self._forward_batches: set[int] = set()
        self._param_works: dict[nn.Parameter, _ParamWork] = {}
        self._decisions: dict[int, LayerDecision] = {}
        self._summed: dict[nn.Parameter, torch.Tensor] = {}
        self._last_decisions: list[LayerDecision] = []
        self.steps_taken = 0
        self._warned_loader = False
        # Multiplies the noise actually drawn, never the accounted one: only dptrain.audit sets it,
        # to show that the audit catches a run whose noise is smaller than its accounting claims.
        self._audit_noise_scale = 1.0

    # ------------------------------------------------------------------ configuration
    def _resolve_noise_multiplier(self, sigma, target_epsilon, target_delta, epochs, steps, accountant_name):
        if (sigma is None) == (target_epsilon is None):
            raise ValueError("give exactly one of noise_multiplier or target_epsilon (with epochs or steps)")
        if sigma is not None:
            if epochs is not None or steps is not None or target_delta is not None:
                warnings.warn("epochs/steps/target_delta only matter with target_epsilon; they are ignored for calibration")
            if not (sigma >= 0 and math.isfinite(sigma)):
                raise ValueError(f"noise_multiplier must be a finite number >= 0, got {sigma!r}")
            return float(sigma)
        if (epochs is None) == (steps is None):
            raise ValueError("target_epsilon needs the planned length of training: give exactly one of epochs or steps")
        # An epoch is round(1/q) Poisson steps, as dptrain.data.poisson_loader runs it.
        planned = steps if steps is not None else int(math.ceil(epochs * max(1, round(1 / self.sample_rate))))
        self.planned_steps = planned
        return accounting.calibrate_noise_multiplier(
            target_epsilon, self.target_delta, self.sample_rate, planned, accountant=accountant_name
        )

    # ------------------------------------------------------------------ attach / detach
    def attach(self, optimizer: torch.optim.Optimizer, data_loader=None, grad_scaler=None) -> PrivacyEngine:
        """Install the hooks; ``optimizer.step()`` then applies the private gradient.

        ``data_loader`` (optional) is checked against the accounting: a Poisson loader must
        sample with ``q = batch_size / sample_size``; any other loader gets a warning, once,
        that the reported epsilon assumes Poisson sampling.

        ``grad_scaler``: the ``torch.amp.GradScaler`` whose ``scale()`` multiplies the loss
        (fp16 training). The engine removes its scale before clipping, and a backward whose
        scaled gradients overflow makes ``scaler.step(optimizer)`` skip the step, which still
        counts in the accountant.
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
        ours = {p for s in self._layers for p in s.params.values()}
        model_params = {p for p in self.model.parameters()}
        self._step_params = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p not in model_params:
                    raise ValueError("the optimizer holds a parameter that is not in the model given to the engine")
                if p in ours:
                    self._step_params.append(p)
        if not self._step_params:
            raise ValueError("the optimizer holds none of the model's trainable parameters")
        # FSDP2 swaps the unsharded parameters in during each forward: hooks look them up by name.
        self._capture = Capture(self.model, self._layers, self._on_output_grad,
                                params_by_name=isinstance(self._parallel, distributed.FSDP2Gradients))
        self._capture.install(extra_checks=_frozen_batchnorm_checks(self.model))
        self._grad_handles = [
            p.register_post_accumulate_grad_hook(self._on_accumulated_grad) for p in self._users
        ]
        self._step_handle = optimizer.register_step_pre_hook(self._before_step)
        self._optimizer = optimizer
        self._scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        # The scaler skips a step when it finds inf/NaN in the gradients it unscales; the engine's
        # gradients exist only from the step on, so it shows the scaler one small marker gradient.
        self._marker_param = min(self._step_params, key=lambda p: p.numel())
        self._marker: torch.Tensor | None = None
        self._overflowed = False
        # Weak references: holding the given gradients would keep a whole model's worth of memory
        # alive after the user's zero_grad().
        self._given_grads: dict[nn.Parameter, weakref.ref] = {}
        if self._parallel is not None:
            self._parallel.attach()
        return self

    def _check_loader(self, loader) -> None:
        if data.is_poisson_loader(loader):
            if not math.isclose(loader.sample_rate, self.sample_rate, rel_tol=1e-9):
                raise ValueError(
                    f"the loader samples with q={loader.sample_rate:.6g} but the engine accounts for "
                    f"q = batch_size / sample_size = {self.sample_rate:.6g}: build both from the same batch size "
                    "and dataset size"
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
        if self._capture is not None:
            self._capture.remove()
        if self._step_handle is not None:
            self._step_handle.remove()
        for handle in getattr(self, "_grad_handles", []):
            handle.remove()
        self._grad_handles = []
        if self._parallel is not None and self._optimizer is not None:
            self._parallel.detach()
        self._capture, self._step_handle, self._optimizer = None, None, None
        self._forget_calls()
        self._summed.clear()
        self._phase = "idle"

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
        if losses.dim() > 1:
            losses = losses.flatten(1).sum(1)
        if not torch.isfinite(losses).all():
            if self._scaler is not None:  # fp16 overflow already in the forward: the step is skipped
                self._forget_calls()
                self._after_backward(overflow=True)
                return
            bad = (~torch.isfinite(losses)).nonzero().flatten().tolist()
            raise ValueError(f"non-finite per-sample losses at batch positions {bad[:10]}: nothing was accumulated")
        B = losses.shape[0]
        if B == 0 or not losses.requires_grad:
            if B == 0 and losses.requires_grad and isinstance(self._parallel, distributed.FSDP2Gradients):
                # FSDP2 gathers parameters inside each backward: a rank with an empty batch runs as many.
                self._phase = "discard"
                passes = 1 + self._num_groups if self.recipe.two_pass else 1
                try:
                    for k in range(passes):
                        torch.autograd.backward(losses.sum(), retain_graph=k < passes - 1)
                finally:
                    self._phase = "idle"
            self._forget_calls()
            if B > 0:
                raise ValueError("the losses do not depend on any trainable parameter (did the forward run under no_grad?)")
            self._after_backward(overflow=False)
            return  # an empty batch contributes nothing; the step still adds noise and counts
        overflow = False
        try:
            if self.recipe.two_pass:
                self._two_pass_backward(losses)
            else:
                self._phase = "single"
                torch.autograd.backward(losses.sum())
                self._finish_backward(expected_batch=B, scale=1.0 / self._loss_scale())
        except _Overflow:
            overflow = True
        finally:
            self._phase = "idle"
        self._after_backward(overflow)

    def _two_pass_backward(self, losses: torch.Tensor) -> None:
        """Lee & Kifer: norms from a first backward of sum_i L_i, then back-propagate sum_i C_i L_i.

        Both passes only produce output gradients (ghost differentiation); the second pass's
        parameter gradients (module 2b) are a^T g of its re-weighted output gradients, one
        pass per clipping group.
        """
        self._phase = "first-pass"
        try:
            torch.autograd.backward(losses.sum(), retain_graph=True)
            loss_scale = self._loss_scale()
            factors = self._finish_backward(expected_batch=losses.shape[0], scale=1.0 / loss_scale)
            # The re-weighted losses carry the GradScaler's scale too: removed from a^T g'.
            ones = torch.full_like(factors[0], 1.0 / loss_scale)
            self._phase = "second-pass"
            for k, params in enumerate(self._group_params):
                reweighted = (losses * factors[k].to(losses.dtype)).sum()
                torch.autograd.backward(reweighted, retain_graph=k < len(self._group_params) - 1)
                for p in params:
                    for state, name in self._users[p]:
                        calls = [c for c in self._second_pass_calls.get(id(state), []) if c.grad is not None]
                        if calls:
                            ops = self._operands(state, calls)
                            self._accumulate(p, state.rule.clipped_grads(state.module, ops, {name: ones})[name])
                for calls in self._second_pass_calls.values():
                    for c in calls:
                        c.grad = None
        finally:
            self._phase = "idle"
            self._second_pass_calls.clear()

    def _on_output_grad(self, state: LayerState, call: Call, grad: torch.Tensor) -> None:
        if self._phase == "discard":
            return
        if self._phase == "second-pass":
            call.grad = grad.detach()
            return
        if self._phase == "idle":
            if self.recipe.two_pass:
                raise RuntimeError(
                    f"clipping_mode={self.clipping_mode!r} needs two backward passes: call "
                    "engine.backward(per_sample_losses) instead of loss.backward()"
                )
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_plain_backward)
        call.grad = grad.detach()
        # A layer called once, whose parameters no other layer shares, is reduced right away,
        # freeing its activation and output gradient during the backward pass.
        if len(state.calls) == 1 and not any(len(self._users[p]) > 1 for p in state.params.values()):
            self._prepare_layer(state)
            for name, p in state.params.items():
                self._norm_stage(p)
            self._release_layer(state)

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
        batch = self._batch_size_of_backward(expected=None)
        model_batch = max(self._forward_batches, default=1)
        if batch == 1 and model_batch > 1:
            self._forward_batches.clear()
            self._param_works.clear()
            raise ValueError(
                f"every trainable layer saw a batch of 1 while the model was called with a batch of "
                f"{model_batch}: an input broadcast over the batch loses the per-sample "
                "gradients. Expand it to the batch (x.expand(B, ...)), or use engine.backward(losses)"
            )
        scale = float(batch) if self.loss_reduction == "mean" else 1.0
        try:
            self._finish_backward(expected_batch=batch, scale=scale / self._loss_scale())
        except _Overflow:
            self._after_backward(overflow=True)
        else:
            self._after_backward(overflow=False)

    # ------------------------------------------------------------------ the recipe
    def _prepare_layer(self, state: LayerState) -> None:
        """Operands of all of a layer's calls that received an output gradient, as one call.

        Calls still waiting for their gradient (a later forward whose backward has not run
        yet) stay recorded.
        """
        calls = [c for c in state.calls if c.grad is not None]
        state.calls = [c for c in state.calls if c.grad is None]
        if not calls:
            return
        if self._phase == "first-pass":  # kept, with their activations, for the re-weighted pass
            self._second_pass_calls.setdefault(id(state), []).extend(calls)
        self._forward_batches.update(c.forward_batch for c in calls if c.forward_batch is not None)
        dims = calls[0].dims
        if len(calls) > 1:
            dims = LayerDims(T=sum(c.dims.T for c in calls), p=dims.p, d=dims.d, blocks=dims.blocks,
                             ghost_supported=dims.ghost_supported)
        self._ready[id(state)] = _ReadyLayer(state, self._operands(state, calls), dims, calls[0].batch_size)

    def _operands(self, state: LayerState, calls: list[Call]) -> tuple:
        sizes = {c.batch_size for c in calls}
        if len(sizes) > 1:
            raise ValueError(f"module {state.name!r} was called with different batch sizes {sorted(sizes)} in one forward")
        # With ghost differentiation autograd does not save a layer's input, so its own check
        # for inputs modified in place cannot fire: this one does.
        if any(c.version is not None and c.activation._version != c.version for c in calls):
            raise RuntimeError(
                f"the input of {state.name!r} ({type(state.module).__name__}) was modified in place after the "
                "layer used it (e.g. `h += layer(h)`), so its per-sample gradients cannot be computed: "
                "use an out-of-place operation (`h = h + layer(h)`)"
            )
        rule, module = state.rule, state.module
        parts = [rule.operands(module, c.activation, c.grad) for c in calls]
        return parts[0] if len(parts) == 1 else rule.concat_calls(parts)

    def _norm_stage(self, p: nn.Parameter) -> None:
        """Per-sample squared norms of one parameter (modules 3/4), keeping what its gradient stage needs.

        A parameter used by several layers (tied weights) sums their per-sample gradients, so
        its norm includes the cross terms: instantiated, or as a ghost norm from the Grams of
        the layers' weight factors.
        """
        parts = [(self._ready[id(s)], name) for s, name in self._users[p] if id(s) in self._ready]
        if not parts or p in self._param_works:
            return
        sizes = {ready.batch_size for ready, _ in parts}
        if len(sizes) > 1:
            raise ValueError(f"layers sharing a parameter saw different batch sizes {sorted(sizes)}")
        first, name = parts[0]
        if len(parts) == 1:
            dims = first.dims
            ghost_ok = name == "weight" and dims.ghost_supported
        else:
            factors = [r.state.rule.weight_factors(r.state.module, r.ops) for r, _ in parts]
            dims = LayerDims(T=sum(r.dims.T for r, _ in parts), p=p.shape[0], d=p[0].numel())
            ghost_ok = all(n == "weight" for _, n in parts) and all(f is not None for f in factors)
        norm_via, grad_via = decide(self.recipe, dims, self.decision_rule, ghost_ok)

        per_sample = None
        if norm_via == "ghost":
            if len(parts) == 1:
                sq_norm = first.state.rule.ghost_sq_norm(first.state.module, first.ops)
            else:
                sq_norm = shared_sq_norm(factors)
        else:
            for ready, n in parts:
                g = ready.state.rule.per_sample_grads(ready.state.module, ready.ops, {n})[n]
                per_sample = g if per_sample is None else per_sample + g
            sq_norm = _float32(per_sample).flatten(1).square().sum(1)
        self._param_works[p] = _ParamWork(
            group=self._group_of[p],
            batch_size=first.batch_size,
            sq_norm=sq_norm,
            per_sample=per_sample if grad_via == "weighted-sum" else None,
            book=[(r.state, n, r.ops) for r, n in parts] if grad_via == "book-keeping" else [],
        )
        for ready, n in parts:
            if n == "weight" or "weight" not in ready.state.params:
                d = ready.dims
                self._decisions[id(ready.state)] = LayerDecision(
                    ready.state.name, type(ready.state.module).__name__, d.T, d.p, d.d * d.blocks,
                    d.ghost_cost, d.instantiate_cost, norm_via, grad_via,
                )

    def _release_layer(self, state: LayerState) -> None:
        """Drop a layer's operands once every parameter it holds is reduced (book-keeping keeps its own)."""
        if all(p in self._param_works for p in state.params.values()):
            self._ready.pop(id(state), None)

    def _batch_size_of_backward(self, expected: int | None) -> int:
        for state in self._layers:
            if state.calls:
                self._prepare_layer(state)
        for p in self._users:
            self._norm_stage(p)
        self._ready.clear()
        sizes = {}
        for p, work in self._param_works.items():
            sizes.setdefault(self._users[p][0][0].name, work.batch_size)
        distinct = set(sizes.values())
        if expected is not None:
            distinct.add(expected)
        if len(distinct) > 1:
            detail = ", ".join(f"{n}: {b}" for n, b in sizes.items())
            raise ValueError(
                f"layers saw different batch sizes ({detail}"
                + (f"; losses: {expected}" if expected is not None else "")
                + "). Every trainable layer must get the batch as its first dimension: an input broadcast over "
                "the batch must be expanded to the batch first (x.expand(B, ...))"
            )
        return distinct.pop() if distinct else 0

    def _finish_backward(self, expected_batch: int | None, scale: float) -> list[torch.Tensor]:
        """Clipping factors per group from all parameters' norms; single-pass modes then form the clipped sum."""
        try:
            batch = self._batch_size_of_backward(expected_batch)
            group_sq: list[torch.Tensor | None] = [None] * self._num_groups
            for work in self._param_works.values():
                k = work.group
                group_sq[k] = work.sq_norm if group_sq[k] is None else group_sq[k] + work.sq_norm
            like = next((sq for sq in group_sq if sq is not None), None)
            group_sq = [
                sq if sq is not None else (like.new_zeros(batch) if like is not None else torch.zeros(batch))
                for sq in group_sq
            ]
            norms = [torch.sqrt(sq) * scale for sq in group_sq]
            if batch and not all(bool(torch.isfinite(n).all()) for n in norms):
                if self._scaler is not None:
                    raise _Overflow
                raise FloatingPointError(
                    "a per-sample gradient norm is inf or NaN (overflow or a NaN in the model): nothing was "
                    "accumulated for this batch; check the inputs, the learning rate, or use float32"
                )
            factors = [clipping_factors(n, self._threshold, self.clipping_fn, self.clipping_gamma) for n in norms]
            self._last_decisions = [self._decisions[id(s)] for s in self._layers if id(s) in self._decisions]
            if not self.recipe.two_pass:
                for p, work in self._param_works.items():
                    self._gradient_stage(p, work, factors[work.group] * scale)
            return factors
        finally:
            self._param_works.clear()
            self._decisions.clear()
            self._ready.clear()
            self._forward_batches.clear()

    def _gradient_stage(self, p: nn.Parameter, work: _ParamWork, factor: torch.Tensor) -> None:
        """Module 5 (weighted sum of kept per-sample gradients) or 2b(C) (book-keeping) for one parameter."""
        if work.per_sample is not None:  # factors stay float32: rounding them to bf16 would exceed R by 2^-8
            per_sample = _float32(work.per_sample)
            self._accumulate(p, torch.tensordot(factor.to(per_sample.dtype), per_sample, dims=1))
        for state, name, ops in work.book:
            self._accumulate(p, state.rule.clipped_grads(state.module, ops, {name: factor})[name])

    def _accumulate(self, p: nn.Parameter, g: torch.Tensor) -> None:
        g = g.to(p.dtype)
        if p in self._summed:
            self._summed[p].add_(g)
        else:
            self._summed[p] = g  # always a fresh tensor from the rules or autograd.grad

    def _forget_calls(self) -> None:
        for s in self._layers:
            s.calls.clear()
        self._ready.clear()
        self._param_works.clear()
        self._decisions.clear()

    # ------------------------------------------------------------------ the private step
    def _loss_scale(self) -> float:
        """The GradScaler's current scale (the factor on this step's loss), or 1."""
        return float(self._scaler.get_scale()) if self._scaler is not None else 1.0

    def _after_backward(self, overflow: bool) -> None:
        """With a GradScaler: show it the marker gradient it checks (inf makes it skip the step).

        The first overflow of a logical step counts the step in the accountant right away:
        skipping is a decision that looked at the data, and ``optimizer.step()`` (where
        steps are counted otherwise) will not run.
        """
        if self._scaler is None:
            return
        if self._parallel is not None:  # every rank skips, or none
            overflow = self._parallel.any(overflow, self._marker_param.device)
        p = self._marker_param
        if self._overflowed and not (p.grad is self._marker and bool(torch.isinf(p.grad).any())):
            self._overflowed = False  # zero_grad() cleared the marker: the skipped step is over
        if overflow or self._overflowed:
            self._summed.clear()  # nothing of a skipped step is ever applied
            if not self._overflowed:
                self._overflowed = True
                self._count_step()
            self._marker = torch.full_like(p, math.inf)
            p.grad = self._marker
        elif p.grad is None:
            self._marker = torch.zeros_like(p)
            p.grad = self._marker

    def _before_step(self, optimizer, args, kwargs) -> None:
        if self._overflowed:  # optimizer.step() without scaler.step(): the counted, overflowed step applies nothing
            for p in self._step_params:
                p.grad = None
            self._overflowed = False
            self._summed.clear()
            self._forget_calls()
            return
        if self._parallel is not None:
            self._refuse_foreign_grads()
        std = self.noise_multiplier * self.max_grad_norm * self._audit_noise_scale

        # In place on the engine's own sums, one parameter at a time: the step needs no more
        # memory than the gradients themselves (plus one parameter's noise).
        def add_noise(t: torch.Tensor) -> torch.Tensor:
            return t.add_(self._noise.sample(t, std)) if std > 0 else t

        def take_sum(p: nn.Parameter) -> torch.Tensor:
            summed = self._summed.pop(p, None)
            return summed if summed is not None else torch.zeros(p.shape, dtype=p.dtype, device=p.device)

        self._given_grads = {}

        def set_grad(p: nn.Parameter, t: torch.Tensor) -> None:
            grad = t.div_(self.batch_size).to(p.dtype)
            p.grad = self._parallel.as_grad(p, grad) if self._parallel is not None else grad
            self._given_grads[p] = weakref.ref(p.grad)

        if self._parallel is None:
            for p in self._step_params:
                set_grad(p, add_noise(take_sum(p)))
        else:  # the ranks' sums, with the noise added once
            noisy = self._parallel.noisy_sum(self._step_params, [take_sum(p) for p in self._step_params], add_noise)
            for p, t in zip(self._step_params, noisy):
                set_grad(p, t)
        self._summed.clear()
        self._forget_calls()
        self._count_step()

    def _count_step(self) -> None:
        self.accountant.step(self.noise_multiplier, self.sample_rate)
        self.steps_taken += 1

    def _refuse_foreign_grads(self) -> None:
        """Backstop under data parallelism: a gradient the engine did not give came from a use of the
        parameter outside its layer's call. (FSDP2 writes autograd's gradients to the sharded ``p.grad``
        by its reduce-scatter; recent torch then runs the post-accumulate-grad hook, which refuses them
        during the backward, but nothing guarantees every version does.)"""
        for p in self._step_params:
            given = self._given_grads.get(p)
            if p.grad is not None and (given is None or given() is not p.grad) and p.grad is not self._marker:
                name = next(f"{s.name}.{n}" if s.name else n for s, n in self._users[p])
                p.grad = None
                raise RuntimeError(
                    f"parameter {name!r} received a gradient from autograd: it was used outside the forward call "
                    "of its own layer, so its per-sample gradient would not be clipped. Use the layer module "
                    "itself, or freeze the parameter"
                )

    # ------------------------------------------------------------------ reports
    def last_decisions(self) -> list[LayerDecision]:
        """What each layer did in the last backward: T, p, d, costs, and the chosen primitives."""
        return list(self._last_decisions)

    def get_epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent by the steps taken so far, at ``delta`` (default: ``target_delta``)."""
        return self.accountant.get_epsilon(self.target_delta if delta is None else delta)

    def privacy_report(self, delta: float | None = None) -> dict:
        delta = self.target_delta if delta is None else delta
        return {
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "steps": self.steps_taken,
            "epsilon": self.get_epsilon(delta),
            "delta": delta,
            "accountant": self.accountant.name,
            "max_grad_norm": self.max_grad_norm,
            "clipping_mode": self.clipping_mode,
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


class _Overflow(Exception):
    """Per-sample norms of a GradScaler-scaled backward are inf/NaN: the step is to be skipped."""


def _check_choice(name: str, value: Any, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _frozen_batchnorm_checks(model: nn.Module):
    """A frozen BatchNorm is fine in eval mode, but in train mode it mixes samples in the forward."""
    checks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            def check(mod, inputs, _name=name or "<root>"):
                if mod.training and torch.is_grad_enabled():
                    raise RuntimeError(
                        f"{_name} ({type(mod).__name__}) is in training mode: it normalises with statistics of the "
                        "whole batch, which mixes samples. Call .eval() on it (frozen statistics) or replace it "
                        "with nn.GroupNorm"
                    )
            checks.append((module, check))
    return checks
