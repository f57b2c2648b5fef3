"""Which backward runs, and how each one starts and ends.

Two kinds of backward reach the engine. ``engine.backward(losses)`` makes its ``Backward`` itself and
runs it to the end. A plain ``loss.backward()`` is only seen through hooks: its ``Backward`` is made
when its gradient first reaches the model's output (or a covered layer), and it ends in a callback
queued on the autograd engine's outermost task; a backward that raised never runs that callback,
and is found (and dropped) at the next model call, backward or step. One backward runs at a time;
``BackwardRunner.current`` is it.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..layers.numerics import outside_autocast
from ..privacy.sampling import SamplesPerStep
from ..rows import NonFiniteRows, tag_passes, tag_rows
from ..rows.losses import OutputMark, check_losses
from ..rows.proof import Rows
from . import deferred, distributed
from .backward import Backward, BackwardSetup, Phase, needs_tags
from .calls import Call, graph_task, in_backward
from .config import EngineConfig
from .pipeline import Overflow
from .planning import LayerDecision
from .precision import LossScaling
from .refusals import compiled_backward_refusal, non_finite_losses, rounded_mean_refusal, rows_beyond_loader
from .trainable import TrainableSet


class BackwardRunner:
    """Runs the engine's backwards (see the module docstring). The engine's step bookkeeping:
    ``before_backward()`` before a backward adds to the step, ``after_backward(overflow)`` once one has ended
    without an error."""

    def __init__(self, config: EngineConfig, setup: BackwardSetup, trainable: Callable[[], TrainableSet],
                 scaling: LossScaling | None, parallel, before_backward: Callable[[], None],
                 after_backward: Callable[[bool], None]):
        self.config = config
        self.recipe = config.recipe
        self.setup = setup
        self.capture = setup.capture
        self.trainable = trainable
        self.scaling = scaling
        self.parallel = parallel
        self.before_backward = before_backward
        self.after_backward = after_backward
        #: the running backward (engine.backward's, or a plain loss.backward() until its queued callback)
        self.current: Backward | None = None
        #: model calls already back-propagated in this step
        self.done_forwards: set[int] = set()
        #: user ids (privacy_unit="user") whose rows were back-propagated in this step
        self.users_in_step: set[int] = set()
        #: what each layer did in the last backward
        self.decisions: list[LayerDecision] = []
        #: the most rows an attached Poisson loader handed out in its last batches (None: no loader attached)
        self.loader_rows: Callable[[], int | None] = lambda: None
        #: the attached loader's padding: (batches handed out, the fewest real rows of its last batches with padding
        #: or None, the call that gives the engine their masks), or None (no loader that records it)
        self.loader_padding: Callable[[], tuple[int, int | None, str] | None] = lambda: None
        self.loader_drawn_elsewhere: Callable[[], str | None] = lambda: None  # (loader_checks.drawn_elsewhere_refusal)
        # rows back-propagated from the loader's last batch (physical batches of one batch add up), and the rows
        # the running backward adds once it is done
        self._batch_mark: int | None = None
        self._rows_of_batch = 0
        self._pending_rows: int | torch.Tensor = 0  # (a mask: its real rows, counted only where a loader needs them)
        #: samples reaching each step, against the batch size the accounting assumes (a warning when far off)
        self.samples_per_step = SamplesPerStep(
            config.batch_size, config.sample_rate, max_batch_size=config.max_batch_size,
            ranks=1 if parallel is None else torch.distributed.get_world_size())

    # ------------------------------------------------------------------ every exit
    def abort(self) -> None:
        """Drop the running backward whole (a failed or abandoned one); the step's earlier sums stay
        (or go as a whole, never in part: see ``StepSums``)."""
        backward, self.current = self.current, None
        self._pending_rows = 0
        if backward is not None:
            backward.abort()
        self.capture.restore_switched()

    def settle(self) -> None:
        """A plain ``loss.backward()`` whose end-of-backward callback never ran has failed: drop it."""
        if self.current is not None and self.current.phase is Phase.PLAIN and not in_backward():
            self.abort()

    def forget_calls(self) -> None:
        for state in self.trainable().layers:
            state.calls.clear()

    def _done(self, backward: Backward) -> None:
        """A backward completed: its model calls may not be back-propagated again in this step."""
        self.done_forwards |= backward.forwards
        self.capture.backward_ended()
        # evaluations in eval() mode may be deferred once the backwards go through engine.backward (which replays a
        # deferred call it reaches), in one process
        self.capture.defer_evaluations = backward.phase is not Phase.PLAIN and self.parallel is None
        self.decisions = backward.decisions
        self.samples_per_step.add_backward(backward.batch)
        if self._loader_batch() is not None:
            rows = self._pending_rows
            self._rows_of_batch += int(rows.sum()) if isinstance(rows, torch.Tensor) else rows
        self._pending_rows = 0

    # ------------------------------------------------------------------ engine.backward
    def run(self, losses: torch.Tensor, users: torch.Tensor | None = None,
            tag_losses: torch.Tensor | None = None, padded: torch.Tensor | None = None,
            real_rows: int | torch.Tensor | None = None) -> None:
        """``engine.backward(losses[, users])``, the losses checked and ``[B]`` (``users``: each row's user id;
        ``tag_losses``: what the tag passes weight, the unmasked losses of a fixed-shape batch; ``real_rows``: the
        rows a fixed-shape mask keeps, or the mask (counted only where a loader needs the count), None without a
        mask: every row counts as a sample)."""
        self.settle()
        self.capture.settle_open_forward()
        replayed = []
        if self.capture.deferred_calls and losses.grad_fn is not None:
            (losses, tag_losses), replayed = self._replay_deferred(losses, tag_losses)
        try:
            self._run(losses, users, tag_losses, padded, real_rows)
        except RuntimeError as err:
            refusal = compiled_backward_refusal(err)
            if refusal is None:
                raise
            raise refusal from err
        finally:
            for call in replayed:  # (a backward of its own, done or failed: never again)
                call.state = deferred.DeferredCall.CONSUMED

    def _run(self, losses: torch.Tensor, users: torch.Tensor | None, tag_losses: torch.Tensor | None,
             padded: torch.Tensor | None, real_rows: int | torch.Tensor | None) -> None:
        parallel = self.parallel
        B = losses.shape[0]
        forward_batch = self.capture.forward_batch
        trained = B > 0 and losses.requires_grad and (forward_batch is None or B == forward_batch)
        units, step_users, proven = None, set(), True
        if trained:
            self.before_backward()  # (a zero_grad() since the last backward discarded it, and its users: seen first)
            # (every backward that adds to the step gets here: one that is not trained returns before adding)
            self._refuse_rows_beyond_loader(B, "engine.backward got", "per-sample losses")
            if real_rows is None:
                self._refuse_unmasked_padding(B, "engine.backward(losses) without mask= got", "per-sample losses")
            self._pending_rows = B if real_rows is None else real_rows
            units, step_users = self._units(users) if users is not None else (None, set())
            try:
                proven = outside_autocast(self._check_rows, losses, units)
            except NonFiniteRows as err:  # (the loss check's tag passes met inf or NaN before the backward's norms)
                if self.scaling is None:
                    raise non_finite_losses(losses) or err  # noqa: B904  (the refusal that replaces err, or err)
                self.after_backward(True)  # with a GradScaler, an overflow: the step is skipped, the scale backs off
                return
        passes = None  # tag passes (rows.py) agreed by every rank: one more backward each, in which FSDP2 gathers
        needs = trained and (not proven or self._needs_tags())
        if parallel is not None:
            flag, most = parallel.maximum([float(needs), float(B)], losses.device)
            passes = tag_passes(int(most)) if flag else 0
        elif trained:
            passes = tag_passes(B) if needs else 0
        # Without a scaler, non-finite losses show as non-finite norms (checked once, with them): no extra
        # host-device synchronisation on the hot path.
        scaling = self.scaling
        if scaling is not None and not torch.isfinite(losses).all():
            self.forget_calls()  # fp16 overflow already in the forward: the step is skipped
            self.after_backward(True)
            return
        if B and forward_batch is not None and B != forward_batch and losses.requires_grad:
            self.forget_calls()
            raise ValueError(
                f"engine.backward got {B} per-sample losses but the model was last called with a batch of "
                f"{forward_batch}: give one loss per sample of that call (reduction='none'). The batch size is read "
                "from the first tensor of the model's input (in argument order, containers looked into), along its "
                "first dimension: a tensor without the batch given before the batched ones (a table, a prior) is read "
                "instead, so pass it after them. A model that takes the batch in the second dimension of its input "
                "(sequence first) needs batch_first=False"
            )
        if B == 0 or not losses.requires_grad:
            if B == 0 and losses.requires_grad and isinstance(parallel, distributed.FSDP2Gradients):
                assert passes is not None  # (agreed by every rank above)
                self._discarded_backwards(losses, passes)
            self.forget_calls()
            if B > 0:
                raise ValueError("the losses do not depend on any trainable parameter (did the forward run under no_grad?)")
            self.after_backward(False)
            return  # an empty batch contributes nothing; the step still adds noise and counts
        backward = self.current = Backward(self.setup, self.trainable(), Phase.SINGLE, samples=B, units=units,
                                           tag_losses=tag_losses, padded=padded)
        can_retry = scaling is not None and scaling.can_retry(scaling.scale(), self.recipe.two_pass,
                                                              parallel is not None)
        try:
            overflow = backward.run(losses, scaling, can_retry, passes)
            backward.commit()
            self._done(backward)
            self.users_in_step |= step_users
        except FloatingPointError as err:
            self.abort()
            refusal = non_finite_losses(losses)
            if refusal is not None:
                raise refusal from err
            raise
        except BaseException:
            self.abort()
            raise
        finally:
            self.current = None
        self.after_backward(overflow)

    def _replay_deferred(self, losses: torch.Tensor, tag_losses: torch.Tensor | None):
        """The losses reach model calls deferred as evaluations (``deferred.py``): the calls are made again, recorded,
        and the losses given the same gradient through the replays (checked as any step's, ``_check_rows``)."""
        found = deferred.reached(losses, self.capture.model)
        if not found:
            return (losses, tag_losses), []
        self.capture.replaying = True
        try:
            return deferred.replay(losses, tag_losses, found, self.capture.pausing)
        except BaseException:
            self.capture.settle_open_forward()
            self.forget_calls()
            raise
        finally:
            self.capture.replaying = False

    def _check_rows(self, losses: torch.Tensor, units: torch.Tensor | None) -> bool:
        """The checks of which sample each row belongs to that run before the backward: the loss check (every step:
        rows.losses), then the layouts the graph proves for the calls not read yet (rows.proof). Whether nothing is
        left for a tag pass; a refusal drops the calls (nothing was accumulated)."""
        try:
            calls = [(s, c) for s in self.trainable().layers for c in s.calls]
            with self.capture.pausing():  # (its passes are not training: no hook records them)
                reading = check_losses(losses, units, self.setup.rows.generator, calls, model=self.capture.model)
            if losses.grad_fn is None:
                return True
            roots = [(losses.grad_fn, losses.output_nr, Rows(0))]
            marks = [(edge, what) for edge, what in reading.sources.items() if isinstance(what, OutputMark)]
            if not reading.proven and marks and len(marks) == len(reading.sources):
                # The loss check read each output row's gradient to be its own sample's (or, per user, its own
                # user's): the model's rows are proven from its outputs, whatever the loss did above them.
                roots = [(node, nr, Rows(what.axis)) for (node, nr), what in marks]
            return self.setup.rows.prove(roots, losses.shape[0], calls)
        except BaseException:
            self.forget_calls()
            raise

    def _units(self, users: torch.Tensor) -> tuple[torch.Tensor, set[int]]:
        """(each row's unit, 0..U-1 in the order of the users' ids; the users' ids). Refuses a user whose rows of
        this step came in an earlier backward: each backward clips its own rows, so a user split over two would
        move the model by up to 2R."""
        ids, units = torch.unique(users.detach().cpu(), return_inverse=True)
        ids = set(ids.tolist())
        again = ids & self.users_in_step
        if again:
            raise ValueError(
                f"users {sorted(again)[:5]} already had rows in an earlier engine.backward of this step: with "
                "privacy_unit='user' the clipped unit is the sum of a user's gradients, so all of a user's rows of a "
                "step must come in one engine.backward call (split micro-batches by user, e.g. "
                "dptrain.data.poisson_loader(..., users=...) batches). Nothing of this call was accumulated"
            )
        return units, ids

    def _refuse_rows_beyond_loader(self, rows: int | None, what: str, unit: str) -> None:
        """More rows in one backward than the attached loader's batch had samples: some rows are not samples (a
        model called on ``torch.cat([x, x_augmented])``), and clipping each row alone would let one sample move
        the model by more than R."""
        limit = self.loader_rows()
        if rows is None or limit is None or rows <= limit:
            return
        self.forget_calls()
        raise rows_beyond_loader(what, rows, unit, limit)

    def _refuse_unmasked_padding(self, rows: int | None, what: str, unit: str) -> None:
        """A backward without a fixed-shape mask over more rows than the attached loader's batch has real ones: the
        padding rows would be clipped as samples, and since their number is K minus the real ones, removing one
        sample would move the step by up to 2R. (A loop may fetch the next batch before this backward: the fewest
        real rows of the last two batches count. Physical batches of one batch add up.)"""
        refusal = self.loader_drawn_elsewhere()  # (another loader drew the attached one's batches)
        if refusal is not None:
            self.forget_calls()
            raise ValueError(refusal)
        padding = self._loader_batch()
        if rows is None or padding is None or padding[1] is None or self._rows_of_batch + rows <= padding[1]:
            return
        _, real, call = padding
        self.forget_calls()
        earlier = (f" after {self._rows_of_batch} rows of the same batch in earlier backwards"
                   if self._rows_of_batch else "")
        raise ValueError(
            f"{what} {rows} {unit}{earlier}, but the attached loader's batch has {real} real samples: it is a "
            "fixed-shape batch whose other rows are padding. Without the batch's mask the engine would clip the "
            "padding rows as samples, and as their number depends on the real ones, removing one sample could move "
            f"the step by up to 2 x max_grad_norm. Give the mask: {call}. Nothing of this backward was accumulated"
        )

    def _loader_batch(self) -> tuple[int, int | None, str] | None:
        """``loader_padding()``, the rows counted for the loader's batch restarting at each batch it hands out."""
        padding = self.loader_padding()
        if padding is not None and padding[0] != self._batch_mark:
            self._batch_mark, self._rows_of_batch = padding[0], 0
        return padding

    def new_step(self) -> None:
        """The optimizer stepped: model calls and users start afresh."""
        self.done_forwards.clear()
        self.users_in_step = set()

    def discard_step(self) -> None:
        """The backwards of this step so far were discarded (``zero_grad()``): their users and rows with them."""
        self.users_in_step = set()
        self.samples_per_step.discard_step()

    def _discarded_backwards(self, losses: torch.Tensor, passes: int) -> None:
        """FSDP2 gathers parameters inside each backward: a rank with an empty batch runs as many as the others."""
        self.current = Backward(self.setup, self.trainable(), Phase.DISCARD)
        passes += 1 + self.trainable().num_groups if self.recipe.two_pass else 1
        try:
            for k in range(passes):
                torch.autograd.backward(losses.sum(), retain_graph=k < passes - 1)
        finally:
            self.current.commit()  # (nothing was added)
            self.current = None

    def _needs_tags(self) -> bool:
        return needs_tags(self.trainable(), self.setup.rows)

    # ------------------------------------------------------------------ what the hooks report
    def on_output_grad(self, state, call: Call, grad: torch.Tensor) -> None:
        """A covered layer call received its output gradient: the running backward takes it (a plain
        ``loss.backward()`` starts here if its gradient reaches a layer before the model's output)."""
        if self.capture.paused:
            return
        backward = self.current
        if backward is None:
            self._refuse_plain_user_level()
            if self.recipe.two_pass:
                raise RuntimeError(
                    f"clipping_mode={self.config.clipping_mode!r} needs two backward passes: call "
                    "engine.backward(per_sample_losses) instead of loss.backward()"
                )
            backward = self._begin_plain(from_layer=call)
        # (the engine's arithmetic in float32 also where the backward runs inside the user's autocast region)
        outside_autocast(backward.on_output_grad, state, call, grad, self.done_forwards)

    def on_input_grad(self, reading, grad: torch.Tensor) -> None:
        """The gradient of a tensor carrying the model input's rows (a verifying forward, ``rows.InputRows``)."""
        backward = self.current
        if backward is not None and backward.phase not in (Phase.SECOND_PASS, Phase.DISCARD) and not self.capture.paused:
            outside_autocast(backward.rows.record_input, reading, grad)

    def _refuse_plain_user_level(self) -> None:
        if self.config.privacy_unit == "user":
            raise ValueError(
                "privacy_unit='user' clips the sum of each user's gradients, which a plain loss.backward() cannot "
                "tell apart: call engine.backward(per_example_losses, users=batch_user_ids)"
            )

    def _plain_or_none(self) -> bool:
        """No backward runs, or a plain one outside its tag passes."""
        backward = self.current
        return backward is None or backward.phase is Phase.PLAIN and not backward.rows.tagging

    def on_model_output_grad(self) -> None:
        """The gradient reached the model's output: a plain backward starts (on the outermost graph task), unless
        nothing in the model is trainable now (a frozen discriminator in a GAN's generator step)."""
        if (self._plain_or_none() and not self.recipe.two_pass and not self.capture.paused
                and self.trainable().users):
            self._refuse_plain_user_level()
            self._begin_plain(from_layer=None)

    def refuse_loss_inside_model(self) -> None:
        """A plain backward from a loss the model computed itself (Hugging Face's ``labels=``)."""
        if self._plain_or_none() and not self.capture.paused:
            raise ValueError(
                "loss.backward() from a loss computed inside the model (e.g. Hugging Face's labels=...): the engine "
                "cannot see which sample each part of it comes from, and Hugging Face's loss is a mean over every "
                "token of the batch, so each sample's weight depends on the other samples' lengths. Compute "
                "per-sample losses from the logits (dptrain.losses.sequence_losses or token_losses) and call "
                "engine.backward(losses)"
            )

    def tag_outputs(self, output, from_input: bool = False):
        """A model call's per-sample outputs, made the roots of a plain backward's row check (``tag_rows``): when the
        backward reaches them, the graph below them is proven (``rows.proof``, through its memo), and what it leaves
        unproven is read by tag passes from there. ``from_input``: only the outputs computed from the model's input
        are per-sample.

        Under data parallelism every rank agrees, at the backward, whether tag passes run and how many (an empty rank
        too): each is one more backward, in which FSDP2 gathers the parameters.
        """
        batch = self.capture.forward_batch
        if self.recipe.two_pass or batch is None:
            return None  # (two-pass modes refuse a plain backward at its first output gradient)
        runner = weakref.ref(self)
        tagged: list = []  # the _TagRows node of each output tagged (held weakly): the roots of the proof
        decided: dict[str, Any] = {}  # the backward that decided (held weakly: the graph holds this), how many tag passes it runs

        def tagged_pass(raw, grad: torch.Tensor, axis: int) -> None:
            alive = runner()
            backward = alive.current if alive is not None else None
            if backward is None or backward.phase is not Phase.PLAIN or backward.rows.tagging:
                return  # engine.backward tags its losses instead
            assert alive is not None  # (its backward runs)
            if decided.get("backward", lambda: None)() is not backward:
                decided.clear()
                decided["backward"] = weakref.ref(backward)
                decided["passes"] = alive._plain_tag_passes(tagged, batch, grad.device)
            passes = decided["passes"]
            if passes:
                if "tags" not in decided:  # (drawn at the first tag pass of this backward)
                    decided["tags"] = alive.setup.rows.new_tags(batch, passes)
                try:
                    backward.tag_plain(raw, grad, axis, decided["tags"])
                except RuntimeError as err:
                    refusal = compiled_backward_refusal(err)
                    if refusal is None:
                        raise
                    raise refusal from err

        return tag_rows(output, batch, 0 if self.config.batch_first else 1, tagged_pass, from_input, tagged)

    def _plain_tag_passes(self, tagged: list, batch: int, device) -> int:
        """How many tag passes a plain backward runs from a model call's outputs (``tagged``): none where the graph
        below them proves every row, else one per base-4 digit of the batch (of the largest rank's, under data
        parallelism, where every rank runs as many)."""
        roots = []
        for ref in tagged:
            node = ref()
            if node is None:
                continue
            edge = node.edge
            roots.append((edge.node, edge.output_nr, Rows(node.axis)) if not isinstance(edge, torch.Tensor)
                         else (edge.grad_fn, edge.output_nr, Rows(node.axis)))
        calls = [(s, c) for s in self.trainable().layers for c in s.calls]
        needs = not all(node is not None for node, _, _ in roots) or not self.setup.rows.prove(roots, batch, calls)
        if self.parallel is None:
            return tag_passes(batch) if needs else 0
        flag, most = self.parallel.maximum([float(needs), float(batch)], device)
        return tag_passes(int(most)) if flag else 0

    # ------------------------------------------------------------------ a plain loss.backward()
    def _begin_plain(self, from_layer: Call | None) -> Backward:
        """The running plain ``loss.backward()``, made with its end-of-backward callback on the outermost task."""
        task = graph_task()
        backward = self.current
        if backward is not None and backward.phase is Phase.PLAIN:
            if from_layer is not None or task == backward.task:
                return backward
            self.abort()  # a new backward reached the model's output: the queued one died
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
        self._refuse_rows_beyond_loader(self.capture.forward_batch, "loss.backward() over a model call of", "rows")
        self._refuse_unmasked_padding(self.capture.forward_batch, "loss.backward() over a model call of", "rows")
        if (refusal := rounded_mean_refusal(self.config.loss_reduction, self.config.max_batch_size is not None,
                                            self.capture.forward_precision)) is not None:
            raise refusal
        self._pending_rows = self.capture.forward_batch or 0
        self.before_backward()
        backward = self.current = Backward(self.setup, self.trainable(), Phase.PLAIN)
        backward.task = task
        self.capture.new_pass()  # its recomputations are numbered afresh (the last backward's may have run on)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._finish_plain(backward))
        return backward

    def _finish_plain(self, backward: Backward) -> None:
        if self.current is not backward:
            return  # dropped meanwhile
        loss_scale = self.scaling.scale() if self.scaling is not None else 1.0
        try:
            if self.capture.passthrough_task == backward.task:
                raise ValueError(
                    "loss.backward() went both through the model's own calls, which it trains privately, and through "
                    "a model call whose input depends on trainable parameters outside the model (a GAN's generated "
                    "samples, not detached): a discriminator step would clip the first and leave the second "
                    "untrained, silently. Detach the generated samples for the discriminator step (D(fake.detach())); "
                    "back-propagate the generator's loss in a backward of its own (the model is then a function of "
                    "the generator's output, not trained: plainly, or inside engine.paused()). Nothing of this "
                    "backward was accumulated")
            backward.finish_plain(self.config.loss_reduction, loss_scale)
        except Overflow:
            backward.commit()  # (nothing was added: the factors were not finite)
            self.current = None
            self.after_backward(True)
        except BaseException:
            self.abort()
            raise
        else:
            backward.commit()
            self.current = None
            self._done(backward)
            self.after_backward(False)

