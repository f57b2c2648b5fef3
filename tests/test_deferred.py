"""Evaluation in eval() mode with gradients enabled: after a first such call, the next ones are deferred (run with the
layers' hooks set aside, nothing recorded), and a deferred call that engine.backward reaches is replayed, recorded and
checked, so that training in eval() mode after an evaluation is exact (``dptrain/core/deferred.py``). Every test runs a
sequence: private steps first, then the evaluation, then the hazard, then ordinary steps again."""
from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from dptrain.core.deferred import _DeferredOutput
from dptrain.rows.errors import RowsMixSamples
from dptrain.testing import attached_engine, reference_clipped_gradient, reference_user_clipped_gradient
from helpers import MODES, SINGLE_BACKWARD_MODES, assert_matches

R = 0.4
PATHS = [(m, "engine") for m in MODES] + [(m, "plain") for m in SINGLE_BACKWARD_MODES]


class Net(nn.Module):
    """A Linear, dropout (off in eval()), a LayerNorm and a head; ``mix`` mixes the input's samples (a mixup)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.drop = nn.Dropout(0.5)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        self.mix = False

    def forward(self, x):
        if self.mix:
            x = 0.5 * x + 0.5 * x.flip(0)
        return self.head(self.norm(self.drop(torch.tanh(self.inp(x)))))


def _model():
    torch.manual_seed(0)
    return Net().double()


def _losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _data(B, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 6, generator=g, dtype=torch.float64) * 3, torch.randint(0, 3, (B,), generator=g)


def _step(engine, optimizer, losses, path="engine", **kwargs):
    engine.backward(losses, **kwargs) if path == "engine" else losses.sum().backward()
    optimizer.step()
    got = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    optimizer.zero_grad()
    return got


@contextlib.contextmanager
def _attached(model, mode, **options):
    """(engine, optimizer) on ``model`` for checking (``attached_engine`` at R), detached at the end."""
    engine, optimizer = attached_engine(model, mode=mode, max_grad_norm=R, **options)
    try:
        yield engine, optimizer
    finally:
        engine.detach()


@contextlib.contextmanager
def _trained(mode, path="engine", model=None, **options):
    """A model (``_model()`` unless given) and its engine after two private steps in train() mode, then in eval()
    mode (dropout off); the engine is detached at the end."""
    model = _model() if model is None else model
    with _attached(model, mode, **options) as (engine, optimizer):
        for seed in range(2):
            _step(engine, optimizer, _losses(model, *_data(4, seed)), path)
        model.eval()
        yield model, engine, optimizer


def _evaluate(model, batches=3):
    """An evaluation loop that forgot torch.no_grad(): its outputs, gradients enabled."""
    return [model(_data(4, 10 + k)[0]) for k in range(batches)]


def _oracle(batch):
    return reference_clipped_gradient(_model().eval(), _losses, batch, max_grad_norm=R)


def _assert_the_next_step_is_exact(model, engine, optimizer, seed: int) -> None:
    """After a refusal: nothing of it was accumulated, and the engine goes on exactly."""
    batch = _data(4, seed)
    assert_matches(_step(engine, optimizer, _losses(model, *batch)), _oracle(batch), rtol=1e-10)


def _deferred(t: torch.Tensor) -> bool:
    return isinstance(t.grad_fn, _DeferredOutput._backward_cls)


def _recorded(engine) -> int:
    return sum(len(state.calls) for state in engine._trainable.layers)


# ------------------------------------------------------------------------------------------- what is deferred
def test_an_evaluation_after_training_runs_unrecorded_from_its_second_call():
    plain = _model().eval()
    with _trained("bk-mixopt") as (model, engine, _):
        outputs = _evaluate(model, 4)
        assert not _deferred(outputs[0]) and all(_deferred(o) for o in outputs[1:])
        assert engine._capture.deferred_calls == 3
        assert all(not o.grad_fn.next_functions[0][0] for o in outputs[1:])  # (nothing of the plain forward's graph)
        for k, out in enumerate(outputs):  # the outputs the model computes without the engine
            assert torch.equal(out, plain(_data(4, 10 + k)[0]))


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_nothing_is_deferred_before_the_first_engine_backward_or_after_a_plain_one(mode):
    model = _model()
    with _attached(model, mode) as (engine, optimizer):
        model.eval()
        assert not any(_deferred(o) for o in _evaluate(model))  # (no backward yet: whether it trains is unknown)
        if mode in SINGLE_BACKWARD_MODES:
            model.train()
            _step(engine, optimizer, _losses(model, *_data(4, 0)), "plain")
            model.eval()
            assert not any(_deferred(o) for o in _evaluate(model))  # (a plain backward cannot replay a call)


def test_a_call_whose_input_requires_gradients_is_not_deferred():
    """A saliency map: the input's gradient is the point, computed as without the engine."""
    plain = _model().eval()
    with _trained("bk-mixopt") as (model, engine, _):
        _evaluate(model)
        x = _data(4, 20)[0].requires_grad_()
        out = model(x)
        assert not _deferred(out)
        x_plain = x.detach().clone().requires_grad_()
        (got,) = torch.autograd.grad(out[:, 0].sum(), x)
        (want,) = torch.autograd.grad(plain(x_plain)[:, 0].sum(), x_plain)
        assert torch.allclose(got, want, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------- training on it
@pytest.mark.parametrize("mode", MODES)
def test_training_in_eval_mode_after_an_evaluation_is_exact(float64, mode):
    """Steps in train(), an evaluation, then steps in eval() mode of other batch sizes: the first is replayed, the
    others recorded; every one is the float64 oracle's."""
    with _trained(mode) as (model, engine, optimizer):
        _evaluate(model)
        for k, B in enumerate((5, 3, 5)):
            batch = _data(B, 30 + k)
            losses = _losses(model, *batch)
            assert _deferred_reached(losses, engine) == (k == 0)  # (after a backward, the next eval() call is recorded)
            got = _step(engine, optimizer, losses)
            assert_matches(got, _oracle(batch), rtol=1e-10, what=f"{mode}, eval()-mode step {k}")


@pytest.mark.parametrize("mode", MODES)
def test_a_replayed_step_moves_the_clipped_sum_by_at_most_R_for_one_sample(float64, mode):
    """The neighbour test through the replay: the clipped sums of D and of D minus one sample differ by <= R."""
    sums = []
    for drop in (None, 2):
        with _trained(mode) as (model, engine, optimizer):
            _evaluate(model)
            x, y = _data(6, 50)
            x = x * 10  # (every sample clipped)
            if drop is not None:
                keep = torch.arange(6) != drop
                x, y = x[keep], y[keep]
            losses = _losses(model, x, y)
            assert _deferred_reached(losses, engine)
            sums.append(_step(engine, optimizer, losses))
    distance = torch.sqrt(sum(((sums[0][n] - sums[1][n]) ** 2).sum() for n in sums[0]))
    assert 0.5 * R < distance <= R * (1 + 1e-9)


def test_the_replay_runs_in_the_random_state_of_the_deferred_call(float64):
    """A forward that draws noise in eval() mode is replayed with the same draws: no warning, and the step is that of
    the deferred call's outputs (a recorded run under the same seed gives the same clipped sum)."""

    class Noisy(Net):
        def forward(self, x):
            return super().forward(x + 0.3 * torch.randn_like(x))

    def run(defer: bool):
        torch.manual_seed(0)
        with _trained("bk-mixopt", model=Noisy().double()) as (model, engine, optimizer):
            if defer:
                _evaluate(model)
            torch.manual_seed(7)
            losses = _losses(model, *_data(5, 60))
            assert _deferred_reached(losses, engine) == defer
            torch.manual_seed(123)  # (the replay restores the deferred call's state, whatever the state is now)
            return _step(engine, optimizer, losses)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches(run(True), run(False), rtol=1e-12)


def _deferred_reached(losses, engine) -> bool:
    from dptrain.core.deferred import reached
    return bool(reached(losses, engine._capture.model))


@pytest.mark.parametrize("mode", MODES)
def test_a_replay_that_computes_otherwise_is_refused_and_the_next_step_is_exact(float64, mode):
    """The losses were computed on the evaluation's output: a replay that computes something else (a forward that
    reads a counter) cannot stand for it. Refused with nothing applied; a step in train() mode after it is exact."""
    class Counting(Net):
        calls = 0

        def forward(self, x):
            self.calls += 1
            return super().forward(x) + 0.01 * self.calls

    torch.manual_seed(0)
    with _trained(mode, model=Counting().double()) as (model, engine, optimizer):
        _evaluate(model)
        with pytest.raises(RuntimeError, match="came out different.*Nothing of this backward was accumulated"):
            _step(engine, optimizer, _losses(model, *_data(5, 61)))
        optimizer.zero_grad()
        model.train()  # (as the message says; dropout kept off, as in the oracle's eval() mode)
        model.drop.p = 0.0
        # (the counter adds the same to every logit: the cross-entropy's gradient is the oracle's)
        _assert_the_next_step_is_exact(model, engine, optimizer, seed=62)


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_a_fixed_shape_batch_through_a_replay_is_exact(float64, mode):
    with _trained(mode) as (model, engine, optimizer):
        _evaluate(model)
        x, y = _data(5, 70)
        padded_x = torch.cat([x, torch.full((2, 6), torch.finfo(torch.float64).min)])
        padded_y = torch.cat([y, torch.zeros(2, dtype=y.dtype)])
        mask = torch.tensor([True] * 5 + [False] * 2)
        losses = _losses(model, padded_x, padded_y)
        assert _deferred_reached(losses, engine)
        got = _step(engine, optimizer, losses, mask=mask)
        assert_matches(got, _oracle((x, y)), rtol=1e-10, what=mode)


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_user_level_units_through_a_replay_are_exact(float64, mode):
    model = _model()
    users = torch.tensor([3, 1, 3, 2, 1])
    with _attached(model, mode, privacy_unit="user") as (engine, optimizer):
        for seed in range(2):
            batch = _data(5, seed)
            _step(engine, optimizer, _losses(model, *batch), users=users)
        model.eval()
        _evaluate(model)
        batch = _data(5, 80)
        losses = _losses(model, *batch)
        assert _deferred_reached(losses, engine)
        got = _step(engine, optimizer, losses, users=users)
        want = reference_user_clipped_gradient(_model().eval(), _losses, batch, users, max_grad_norm=R)
        assert_matches(got, want, rtol=1e-10, what=mode)


# ------------------------------------------------------------------------------------------- refused
@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_a_loss_that_couples_the_samples_of_a_deferred_call_is_refused(float64, mode):
    """In-batch negatives on a deferred call's outputs: refused by the step's loss check, which reads the losses down to
    the deferred outputs; nothing is accumulated, and the next step is exact."""
    with _trained(mode) as (model, engine, optimizer):
        _evaluate(model)
        out = model(_data(5, 90)[0])
        assert _deferred(out)
        contrastive = torch.logsumexp(out @ out.T, dim=1)
        with pytest.raises(RowsMixSamples, match="couples samples"):
            engine.backward(contrastive)
        assert _recorded(engine) == 0
        _assert_the_next_step_is_exact(model, engine, optimizer, seed=91)


def test_a_mixup_inside_a_deferred_forward_is_seen_in_its_replay(float64):
    """The replay is a watched training forward: a mixup of the input that only the deferred call made is refused."""
    with _trained("bk-mixopt") as (model, engine, optimizer):
        _evaluate(model)
        model.mix = True
        losses = _losses(model, *_data(5, 92))
        with pytest.raises(RowsMixSamples, match="input"):
            engine.backward(losses)
        model.mix = False
        _assert_the_next_step_is_exact(model, engine, optimizer, seed=93)


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
def test_a_plain_backward_through_a_deferred_output_is_refused(float64, mode):
    with _trained(mode) as (model, engine, optimizer):
        _evaluate(model)
        losses = _losses(model, *_data(5, 94))
        with pytest.raises(RuntimeError, match="engine.backward\\(losses\\), which replays"):
            losses.sum().backward()
        assert all(p.grad is None for p in model.parameters())
        _assert_the_next_step_is_exact(model, engine, optimizer, seed=95)


def test_a_deferred_call_back_propagated_twice_is_refused(float64):
    """Each sample is clipped once a step: a second engine.backward through the same deferred call is refused."""
    with _trained("bk-mixopt") as (model, engine, optimizer):
        _evaluate(model)
        x, y = _data(4, 96)
        out = model(x)
        engine.backward(F.cross_entropy(out, y, reduction="none"))
        optimizer.zero_grad()
        with pytest.raises(RuntimeError, match="already back-propagated.*Nothing of this backward"):
            engine.backward(F.cross_entropy(out, y, reduction="none"))
        assert _deferred(_evaluate(model, 2)[1])  # (and with another deferred call since)
        with pytest.raises(RuntimeError, match="already back-propagated.*Nothing of this backward"):
            engine.backward(F.cross_entropy(out, y, reduction="none"))
        with pytest.raises(RuntimeError, match="already back-propagated"):
            F.cross_entropy(out, y).backward()
        _assert_the_next_step_is_exact(model, engine, optimizer, seed=95)


def test_an_input_changed_in_place_before_the_replay_is_refused(float64):
    with _trained("bk-mixopt") as (model, engine, optimizer):
        _evaluate(model)
        x, y = _data(5, 97)
        losses = _losses(model, x, y)
        x.mul_(2)
        with pytest.raises(RuntimeError, match="modified in place"):
            engine.backward(losses)
        _assert_the_next_step_is_exact(model, engine, optimizer, seed=98)


def test_a_loss_computed_inside_a_deferred_call_is_refused(float64):
    class WithLoss(Net):
        def forward(self, x):
            out = super().forward(x)
            return out, out.square().mean()

    torch.manual_seed(0)
    model = WithLoss().double()
    with _attached(model, "bk-mixopt") as (engine, optimizer):
        for seed in range(2):
            _step(engine, optimizer, model(_data(4, seed)[0])[0].square().mean(1))
        model.eval()
        [model(_data(4, 10 + k)[0]) for k in range(2)]
        out, inside = model(_data(4, 99)[0])
        with pytest.raises(RuntimeError, match="no row per sample"):
            engine.backward(out.square().mean(1) + inside)


# ------------------------------------------------------------------------------------------- memory
def test_nothing_of_a_deferred_evaluation_stays_alive():
    with _trained("bk-mixopt") as (model, engine, _):
        model(_data(4, 0)[0])
        x = _data(64, 1)[0]
        out = model(x)
        assert _deferred(out)
        storages = [StorageWeakRef(t.untyped_storage()) for t in (x, out)]
        del x, out
        gc.collect()
        assert all(s.expired() for s in storages)


def test_the_layers_hooks_are_back_after_a_deferred_call(float64):
    with _trained("bk-mixopt") as (model, engine, optimizer):
        before = [(m, dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()]
        _evaluate(model)
        assert all(dict(m._forward_pre_hooks) == pre and dict(m._forward_hooks) == post for m, pre, post in before)
        _assert_the_next_step_is_exact(model, engine, optimizer, seed=5)


# ------------------------------------------------------------------------------------------- outputs of other forms
@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_a_sequence_first_model_through_a_replay_is_exact(float64, mode):
    """Outputs [T, B, classes] (batch_first=False): the replay's losses are moved along the batch axis 1."""

    def losses_fn(model, x, y):
        return F.cross_entropy(model(x).permute(1, 2, 0), y, reduction="none").sum(1)

    def data(B, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(5, B, 6, generator=g, dtype=torch.float64) * 3, torch.randint(0, 3, (B, 5), generator=g)

    model = _model()
    with _attached(model, mode, batch_first=False) as (engine, optimizer):
        for seed in range(2):
            _step(engine, optimizer, losses_fn(model, *data(4, seed)))
        model.eval()
        assert _deferred([model(data(4, 10 + k)[0]) for k in range(2)][1])
        x, y = data(3, 20)
        losses = losses_fn(model, x, y)
        assert _deferred_reached(losses, engine)
        got = _step(engine, optimizer, losses)
        want = reference_clipped_gradient(_model().eval(), lambda m, x, y: losses_fn(m, x.transpose(0, 1), y),
                                          (x.transpose(0, 1), y), max_grad_norm=R)
        assert_matches(got, want, rtol=1e-10, what=mode)


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_a_hugging_face_model_output_through_a_replay_is_exact(float64, mode):
    """GPT-2's ModelOutput (logits, and the cache's tensors): the logits are found again in the replay's output."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30, n_positions=8)

    def make():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config).double()

    def losses_fn(model, ids):
        logits = model(input_ids=ids).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(1)

    def ids(B, seed):
        return torch.randint(0, 30, (B, 6), generator=torch.Generator().manual_seed(seed))

    model = make()
    with _attached(model, mode) as (engine, optimizer):
        for seed in range(2):
            _step(engine, optimizer, losses_fn(model, ids(3, seed)))
        model.eval()
        assert _deferred([model(input_ids=ids(3, 10 + k)).logits for k in range(2)][1])
        batch = ids(4, 20)
        losses = losses_fn(model, batch)
        assert _deferred_reached(losses, engine)
        got = _step(engine, optimizer, losses)
        want = reference_clipped_gradient(make().eval(), losses_fn, (batch,), max_grad_norm=R)
        assert_matches(got, want, rtol=1e-9, what=mode)


def test_a_compiled_model_evaluated_and_trained_in_eval_mode_stays_exact(float64):
    """torch.compile (aot_eager): steps, an evaluation with gradients enabled, then steps in eval() mode, the first
    replayed; each against the oracle."""
    model = _model()
    compiled = torch.compile(model, backend="aot_eager")
    with _attached(compiled, "bk-mixopt") as (engine, optimizer):
        for seed in range(2):
            _step(engine, optimizer, _losses(compiled, *_data(4, seed)))
        model.eval()
        assert _deferred([compiled(_data(4, 10 + k)[0]) for k in range(2)][1])
        for k in range(2):
            batch = _data(4, 20 + k)
            losses = _losses(compiled, *batch)
            assert _deferred_reached(losses, engine) == (k == 0)
            got = {n.removeprefix("_orig_mod."): g for n, g in _step(engine, optimizer, losses).items()}
            assert_matches(got, _oracle(batch), rtol=1e-10, what=f"torch.compile, eval()-mode step {k}")


def test_a_deferred_call_is_replayed_in_eval_mode_after_the_model_was_switched_to_train(float64):
    """Losses of an evaluation's outputs, back-propagated after model.train(): replayed as the call was made (dropout
    off), with every module's mode as it was afterwards."""
    with _trained("bk-mixopt") as (model, engine, optimizer):
        _evaluate(model)
        batch = _data(5, 100)
        losses = _losses(model, *batch)
        model.train()
        model.norm.eval()  # (a mixed state, given back as it was)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = _step(engine, optimizer, losses)
        assert model.training and model.drop.training and not model.norm.training
        assert_matches(got, _oracle(batch), rtol=1e-10)


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_losses_of_two_outputs_of_a_deferred_call_are_exact(float64, mode):
    """A loss of the logits and of the features returned next to them (a dict): each is found again in the replay."""

    class TwoOutputs(Net):
        def forward(self, x):
            features = self.norm(self.drop(torch.tanh(self.inp(x))))
            return {"features": features, "logits": self.head(features)}

    def losses_fn(model, x, y):
        out = model(x)
        return F.cross_entropy(out["logits"], y, reduction="none") + 0.3 * out["features"].square().sum(1)

    def make():
        torch.manual_seed(0)
        return TwoOutputs().double()

    model = make()
    with _attached(model, mode) as (engine, optimizer):
        for seed in range(2):
            _step(engine, optimizer, losses_fn(model, *_data(4, seed)))
        model.eval()
        [model(_data(4, 10 + k)[0]) for k in range(2)]
        batch = _data(5, 110)
        losses = losses_fn(model, *batch)
        assert _deferred_reached(losses, engine)
        got = _step(engine, optimizer, losses)
        want = reference_clipped_gradient(make().eval(), losses_fn, batch, max_grad_norm=R)
        assert_matches(got, want, rtol=1e-10, what=mode)


def test_another_engines_losses_through_a_deferred_output_are_refused_never_replayed_on_their_model(float64):
    """A's evaluation output (deferred) in B's loss: B's engine does not replay A's call on B's model; the backward is
    refused at A's output (A's parameters would get no clipped gradient), and both engines go on exactly."""
    with _trained("bk-mixopt") as (model_a, engine_a, optimizer_a), _trained("bk-mixopt") as (model_b, engine_b,
                                                                                          optimizer_b):
        _evaluate(model_a)
        teacher = model_a(_data(5, 120)[0])
        assert _deferred(teacher)
        x, y = _data(5, 121)
        losses = _losses(model_b, x, y) + (model_b(x) - teacher).square().sum(1)
        with pytest.raises(RuntimeError, match="did not record"):
            engine_b.backward(losses)
        assert all(p.grad is None for p in model_a.parameters())
        _assert_the_next_step_is_exact(model_b, engine_b, optimizer_b, seed=122)
        _assert_the_next_step_is_exact(model_a, engine_a, optimizer_a, seed=123)
