"""PrivacyEngine (dptrain.engine), the facade: what users do with it, in and outside the happy path.

Outside the happy path: checkpointing, (un)freezing after attach, failed forwards and backwards, reshaped batches,
user hooks, keyword calls, second optimizers and engines, the budget. Each hazard is checked two ways, in every mode
and on both backward paths where it applies: against the one-sample-at-a-time oracle (float64, clipping binding),
and at batch size 1 with noise 0, where the applied update must have norm <= R (the property the accountant relies
on).

The engine's accounting, noise calibration, loaders, virtual batches and checkpoints.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.accounting import compute_epsilon
from dptrain.data import poisson_loader, split_batches
from dptrain.testing import attached_engine, clipped_gradient, reference_clipped_gradient
from helpers import MODES, SINGLE_BACKWARD_MODES, assert_matches, one_sample_update, update_norm

R = 0.3
PATHS = [(m, "engine") for m in MODES] + [(m, "plain") for m in SINGLE_BACKWARD_MODES]
RUN = {"engine": "engine", "plain": "sum"}  # clipped_gradient's path for each: a plain backward of the summed losses


def _losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _engine(model, mode, **kw):
    kw.setdefault("noise_multiplier", 0.0)
    return dptrain.PrivacyEngine(model, batch_size=1, sample_size=100, max_grad_norm=R, clipping_mode=mode, **kw)


def _backward(engine, model, x, y, path):
    if path == "engine":
        engine.backward(_losses(model, x, y))
    else:
        _losses(model, x, y).sum().backward()


def _reference(model, batches):
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return reference_clipped_gradient(model, _losses, (x, y), max_grad_norm=R)


def _data(B, d=6, classes=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, d, generator=g, dtype=torch.float64) * 3, torch.randint(0, classes, (B,), generator=g)


# ---------------------------------------------------------------------------------------- checkpointing
class Checkpointed(nn.Module):
    """A first layer, a checkpointed block (a layer called twice inside it), and a head."""

    def __init__(self, how: str | None):
        super().__init__()
        self.how = how
        self.inp = nn.Linear(6, 8)
        self.a = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def block(self, h):
        return self.norm(torch.tanh(self.a(torch.tanh(self.a(h)))))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.how is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.how == "reentrant")
        return self.head(h)


def _checkpointed(how, seed=0):
    torch.manual_seed(seed)
    return Checkpointed(how).double()


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("mode,path", PATHS)
def test_checkpointing_is_exact(float64, mode, path, how):
    model = _checkpointed(how)
    plain = _checkpointed(None)  # same weights: the oracle runs without checkpointing
    batches = [_data(3, seed=1), _data(1, seed=2), _data(2, seed=3)]  # micro-batches of different sizes
    got = clipped_gradient(model, _losses, *batches, mode=mode, max_grad_norm=R, path=RUN[path])
    assert_matches(got, _reference(plain, batches), what=f"{how} checkpointing")


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("mode,path", PATHS)
def test_checkpointing_bounds_one_sample(float64, mode, path, how):
    x, y = _data(1, seed=4)
    update = one_sample_update(_checkpointed(how), _losses, (x * 10, y), mode=mode, max_grad_norm=R, path=RUN[path])
    assert update <= R * (1 + 1e-9)


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("mode", MODES)
def test_recomputed_calls_are_not_kept(float64, mode, how):
    model = _checkpointed(how)
    engine = _engine(model, mode).attach(torch.optim.SGD(model.parameters(), lr=0.0))
    for seed in range(3):  # micro-batches: nothing of a recomputation waits for a gradient that never comes
        engine.backward(_losses(model, *_data(2, seed=seed)))
        assert sum(len(s.calls) for s in engine._trainable.layers) == 0


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("mode,path", [("ghost", "engine"), ("bk-mixopt", "engine"), ("bk-mixopt", "plain"),
                                       ("mix-ghost", "engine")])
def test_hugging_face_gradient_checkpointing(float64, mode, path, reentrant):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=12)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    model.config.use_cache = False
    reference_model = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train(), reference_model.train()
    for m in (model, reference_model):  # dropout off: the oracle and the engine see the same function
        for mod in m.modules():
            if isinstance(mod, nn.Dropout):
                mod.p = 0.0
    ids = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(5))

    def losses_fn(m, ids):
        logits = m(input_ids=ids).logits[:, :-1]
        tokens = F.cross_entropy(logits.reshape(-1, 40), ids[:, 1:].reshape(-1), reduction="none")
        return tokens.view(ids.shape[0], -1).sum(1)

    reference = reference_clipped_gradient(reference_model, losses_fn, (ids,), max_grad_norm=R)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    losses = losses_fn(model, ids)
    engine.backward(losses) if path == "engine" else losses.sum().backward()
    opt.step()
    got = {}
    for name, p in model.named_parameters():
        got[name] = p.grad
    ref = {n: reference[n] for n in got}
    assert_matches(got, ref, rtol=1e-9, what="GPT-2 gradient checkpointing")


# ---------------------------------------------------------------------------------------- (un)freezing
def _three_layers(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_layer_unfrozen_after_attach_is_clipped_exactly(float64, mode, path):
    model = _three_layers()
    reference = _reference(model, [_data(4, seed=2)])  # every layer trainable
    model[0].requires_grad_(False)
    engine = _engine(model, mode, loss_reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # holds the frozen layer too (staged fine-tuning)
    engine.attach(opt)
    batch = _data(4, seed=2)
    _backward(engine, model, *batch, path)
    opt.step(), opt.zero_grad()
    assert model[0].weight.grad is None
    model[0].requires_grad_(True)
    _backward(engine, model, *batch, path)
    opt.step()
    got = {n: p.grad for n, p in model.named_parameters()}
    assert_matches(got, reference, what="unfrozen after attach")


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_layer_unfrozen_after_attach_bounds_one_sample(float64, mode, path):
    model = _three_layers()
    model[0].requires_grad_(False)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    model[0].requires_grad_(True)
    before = copy.deepcopy(model)
    x, y = _data(1, seed=3)
    _backward(engine, model, x * 10, y, path)
    opt.step()
    assert update_norm(before, model) <= R * (1 + 1e-9)


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_layer_frozen_after_attach_is_left_untouched_and_not_counted(float64, mode, path):
    model = _three_layers()
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    batch = _data(4, seed=2)
    _backward(engine, model, *batch, path)
    opt.step()
    model[2].requires_grad_(False)
    frozen = copy.deepcopy(model[2].state_dict())
    engine.detach()  # the oracle needs autograd's own parameter gradients
    reference = _reference(model, [batch])  # the oracle counts trainable parameters only
    engine.attach(opt)
    opt.zero_grad(set_to_none=True)
    _backward(engine, model, *batch, path)
    opt.step()
    for k, v in model[2].state_dict().items():
        assert torch.equal(v, frozen[k]), k
    assert model[2].weight.grad is None and model[2].bias.grad is None
    assert_matches({n: p.grad for n, p in model.named_parameters() if p.requires_grad}, reference,
                   what="frozen after attach")


def test_a_newly_trainable_module_without_a_rule_is_refused(float64):
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()
    model[1].requires_grad_(False)
    model[1].eval()
    engine = _engine(model, "bk-mixopt")
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.backward(_losses(model, *_data(4)))
    model[1].requires_grad_(True)
    with pytest.raises(ValueError, match="BatchNorm1d"):
        model(_data(4)[0])


# ---------------------------------------------------------------------------------------- failed backwards
class Failing(nn.Module):
    """Raises in its backward (or forward) when told to: an out-of-memory error, a NaN check, a Ctrl-C."""

    def __init__(self):
        super().__init__()
        self.fail_backward: type[BaseException] | None = None
        self.fail_forward: type[BaseException] | None = None

    def forward(self, h):
        if self.fail_forward is not None:
            raise self.fail_forward("failed in the forward")
        return _RaiseInBackward.apply(h, self)


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, owner):
        ctx.owner = owner
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        if ctx.owner.fail_backward is not None:
            raise ctx.owner.fail_backward("failed in the backward")
        return grad, None


@contextlib.contextmanager
def _failing(model, where: str, error: type[BaseException]):
    """The model's Failing layer raises ``error`` in its forward or backward inside; the error must come."""
    setattr(model[2], f"fail_{where}", error)
    try:
        with pytest.raises(error):
            yield
    finally:
        setattr(model[2], f"fail_{where}", None)


def _failing_model(seed=0):
    torch.manual_seed(seed)
    # The head is reduced before the failure point is reached; the first layers after it.
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Failing(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("mode,path", PATHS)
def test_a_failed_backward_leaves_nothing_behind(float64, mode, path, error):
    model = _failing_model()
    reference_model = copy.deepcopy(model)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    good1, bad, good2 = _data(3, seed=1), _data(4, seed=2), _data(2, seed=3)
    _backward(engine, model, *good1, path)  # a completed micro-batch of the same logical step: kept
    with _failing(model, "backward", error):
        _backward(engine, model, *bad, path)
    _backward(engine, model, *good2, path)  # another batch size: nothing of the failed one is left
    opt.step()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_matches(got, _reference(reference_model, [good1, good2]), what="after a failed backward")
    # The next step is exact too.
    opt.zero_grad()
    _backward(engine, model, *bad, path)
    opt.step()
    assert_matches({n: p.grad for n, p in model.named_parameters()}, _reference(reference_model, [bad]),
                   what="the step after")


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_failed_backward_then_one_sample_is_bounded(float64, mode, path):
    model = _failing_model()
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    with _failing(model, "backward", RuntimeError):
        _backward(engine, model, *_data(4, seed=2), path)
    opt.zero_grad()
    before = copy.deepcopy(model)
    x, y = _data(1, seed=5)
    _backward(engine, model, x * 10, y, path)
    opt.step()
    assert update_norm(before, model) <= R * (1 + 1e-9)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("mode,path", PATHS)
def test_a_failed_forward_leaves_nothing_behind(float64, mode, path, error):
    model = _failing_model()
    reference_model = copy.deepcopy(model)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    with _failing(model, "forward", error):
        model(_data(4)[0])
    assert all(p.requires_grad for p in model.parameters())  # ghost differentiation's switch was undone
    batch = _data(3, seed=3)
    _backward(engine, model, *batch, path)
    opt.step()
    assert_matches({n: p.grad for n, p in model.named_parameters()}, _reference(reference_model, [batch]),
                   what="after a failed forward")


@pytest.mark.parametrize("mode,path", [("bk-mixopt", "engine"), ("bk-mixopt", "plain"), ("ghost", "engine"),
                                       ("per-sample", "plain")])
def test_nothing_of_a_failed_backward_outlives_the_user_references(float64, mode, path):
    model = _failing_model()
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    x, y = _data(64, seed=2)
    big = weakref.ref(x)
    with _failing(model, "backward", RuntimeError):
        _backward(engine, model, x, y, path)
    engine_ref, model_ref = weakref.ref(engine), weakref.ref(model)
    del engine, model, opt, x, y
    gc.collect()
    assert engine_ref() is None and model_ref() is None and big() is None


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("mode,path", [("bk-mixopt", "engine"), ("bk-mixopt", "plain"), ("ghost", "engine"),
                                       ("per-sample", "plain")])
def test_nothing_of_a_failed_batch_stays_alive_in_the_engine(float64, mode, path, where):
    """With the engine and the model kept (a training loop that catches an out-of-memory error and halves the batch),
    no storage of the failed batch stays alive: not the input, not an activation a layer call recorded (a call of
    the failed forward once kept both until the next model call: 52 GB of an H200)."""
    model = _failing_model()
    reference_model = copy.deepcopy(model)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    storages = []
    for layer in (model[0], model[3]):  # the recorded activations: the input of model[0], model[2]'s output, ...
        layer.register_forward_hook(lambda m, i, o: storages.append(StorageWeakRef(i[0].untyped_storage())))
    x, y = _data(64, seed=2)
    storages.append(StorageWeakRef(x.untyped_storage()))
    with _failing(model, where, RuntimeError):
        _backward(engine, model, x, y, path)
    del x, y
    gc.collect()
    assert storages and all(s.expired() for s in storages)
    batch = _data(3, seed=3)  # and the next batch is exact
    _backward(engine, model, *batch, path)
    opt.step()
    assert_matches({n: p.grad for n, p in model.named_parameters()}, _reference(reference_model, [batch]),
                   what=f"after a failed {where}")


def test_a_failure_while_adding_to_the_sums_drops_the_step_as_a_whole(float64, monkeypatch):
    model = _three_layers()
    engine, opt = attached_engine(model, mode="bk", max_grad_norm=R, loss_reduction="sum")
    engine.backward(_losses(model, *_data(3, seed=1)))
    from dptrain.layers.linear import LinearRule
    calls = []
    real = LinearRule.clipped_grads

    def fail_on_second(self, module, ops, factors):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(self, module, ops, factors)

    monkeypatch.setattr(LinearRule, "clipped_grads", fail_on_second)
    with pytest.warns(UserWarning, match="dropped as a whole"), pytest.raises(RuntimeError, match="out of memory"):
        engine.backward(_losses(model, *_data(3, seed=2)))
    monkeypatch.setattr(LinearRule, "clipped_grads", real)
    opt.step()
    assert all(float(p.grad.abs().max()) == 0.0 for p in model.parameters())  # noise 0: nothing applied


# ---------------------------------------------------------------------------------------- the batch axis
class FoldsTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(6, 8)
        self.l2 = nn.Linear(8, 3)

    def forward(self, x):
        B, T, _ = x.shape
        h = torch.tanh(self.l1(x.reshape(B * T, 6)))
        return self.l2(h).view(B, T, 3).sum(1)


def _fold_data(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize("B,T", [(3, 5), (4, 4), (2, 4)], ids=["B!=T", "B=T", "T=2B"])
@pytest.mark.parametrize("mode,path", PATHS)
def test_a_model_that_folds_tokens_into_the_batch_is_exact(float64, mode, path, B, T):
    """Tokens folded into the batch ([B*T, d]): the rows are read as T rows per sample and regrouped."""
    torch.manual_seed(0)
    model = FoldsTokens().double()
    batches = [_fold_data(B, T, seed=1), _fold_data(B, T, seed=2)]
    got = clipped_gradient(copy.deepcopy(model), _losses, *batches, mode=mode, max_grad_norm=R, path=RUN[path])
    assert_matches(got, _reference(model, batches), what="tokens folded into the batch")


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_model_that_folds_tokens_into_the_batch_bounds_one_sample(float64, mode, path):
    torch.manual_seed(0)
    x, y = _fold_data(1, 4, seed=3)
    update = one_sample_update(FoldsTokens().double(), _losses, (x * 10, y), mode=mode, max_grad_norm=R, path=RUN[path])
    assert update <= R * (1 + 1e-9)


class SequenceFirst(nn.Module):
    """Takes [T, B, d] (like nn.LSTM or nn.Transformer without batch_first)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.emb(x)))).sum(0)


def _seq_first_losses(model, x, y):  # the batch is kept batch first; the model gets it sequence first
    return F.cross_entropy(model(x.transpose(0, 1)), y, reduction="none")


def _seq_first_reference(model, x, y):
    return reference_clipped_gradient(model, _seq_first_losses, (x, y), max_grad_norm=R)


def _assert_seq_first_exact(model, mode, path, x, y, what: str) -> None:
    trained = _seq_first_step(model, mode, path, x, y)
    assert_matches({n: p.grad for n, p in trained.named_parameters()}, _seq_first_reference(model, x, y), what=what)


def _seq_first_step(model, mode, path, x, y) -> nn.Module:
    """A copy of ``model`` after one step with batch_first=False (noise 0, lr 0: p.grad is the clipped sum)."""
    trained = copy.deepcopy(model)
    engine, opt = attached_engine(trained, mode=mode, max_grad_norm=R, loss_reduction="sum", batch_first=False)
    losses = _seq_first_losses(trained, x, y)
    engine.backward(losses) if path == "engine" else losses.sum().backward()
    opt.step()
    return trained


@pytest.mark.parametrize("mode,path", PATHS)
def test_sequence_first_models_with_batch_first_false(float64, mode, path):
    torch.manual_seed(0)
    model = SequenceFirst().double()
    x, y = torch.randn(4, 5, 6) * 2, torch.randint(0, 3, (4,))
    _assert_seq_first_exact(model, mode, path, x, y, what="batch_first=False")
    if path == "engine":
        # With batch_first (the default) the engine reads the batch from dim 0 (T = 5 here), and the four
        # losses give it away. A plain loss.backward() cannot tell: sequence-first models must say so.
        other = copy.deepcopy(model)
        engine = _engine(other, mode, loss_reduction="sum")
        engine.attach(torch.optim.SGD(other.parameters(), lr=0.0))
        with pytest.raises(ValueError, match="batch_first=False"):
            engine.backward(_seq_first_losses(other, x, y))


# ---------------------------------------------------------------------------------------- hooks and calls
def _hooked_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_user_hook_registered_before_attach_is_exact(float64, mode, path):
    model = _hooked_model()
    # Changes the layer's output: the gradient reaches the layer through it, exactly.
    model[0].register_forward_hook(lambda m, i, out: out * 2 + 1)
    model[0].register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
    batch = _data(4)
    reference = _reference(model, [batch])
    got = clipped_gradient(model, _losses, batch, mode=mode, max_grad_norm=R, path=RUN[path])
    assert_matches(got, reference, what="user hooks")


@pytest.mark.parametrize("kind", ["prepend", "pre-hook after attach", "global"])
def test_a_user_hook_between_the_engine_and_the_layer_is_refused(float64, kind):
    model = _hooked_model()
    engine = _engine(model, "bk-mixopt").attach(torch.optim.SGD(model.parameters(), lr=0.1))
    if kind == "prepend":
        handle = model[0].register_forward_hook(lambda m, i, out: out * 2, prepend=True)
    elif kind == "pre-hook after attach":
        handle = model[0].register_forward_pre_hook(lambda m, args: (args[0] * m.weight.sum(),))
    else:
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, out: None)
    try:
        with pytest.raises(RuntimeError, match="hook"):
            model(_data(2)[0])
    finally:
        handle.remove()
    engine.backward(_losses(model, *_data(2)))  # removing the hook makes the model usable again


class KeywordCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(6, 8)
        self.l2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.l2(input=torch.tanh(self.l1(input=x)))


@pytest.mark.parametrize("mode,path", PATHS)
def test_layers_called_with_keyword_arguments(float64, mode, path):
    torch.manual_seed(0)
    model = KeywordCall().double()
    batch = _data(4)
    got = clipped_gradient(copy.deepcopy(model), _losses, batch, mode=mode, max_grad_norm=R, path=RUN[path])
    assert_matches(got, _reference(model, [batch]),
                   what="keyword call")


def test_a_second_optimizer_is_refused_at_the_first_step(float64):
    model = _hooked_model()
    engine = _engine(model, "bk-mixopt")
    o1 = torch.optim.SGD(model[0].parameters(), lr=0.1)
    o2 = torch.optim.SGD(model[2].parameters(), lr=0.1)
    engine.attach(o1)
    with pytest.raises(RuntimeError, match="already attached"):
        engine.attach(o2)
    engine.backward(_losses(model, *_data(3)))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"\['2.weight', '2.bias'\] are not held by the optimizer"):
        o1.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_second_engine_on_the_same_model_is_refused(float64):
    model = _hooked_model()
    _engine(model, "bk").attach(torch.optim.SGD(model.parameters(), lr=0.1))
    second = _engine(model, "bk")
    with pytest.raises(RuntimeError, match="another PrivacyEngine is attached"):
        second.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    part = _engine(model[0], "bk")
    with pytest.raises(RuntimeError, match="another PrivacyEngine is attached"):
        part.attach(torch.optim.SGD(model[0].parameters(), lr=0.1))


def test_a_detached_engine_makes_room_for_another(float64):
    model = _hooked_model()
    first = _engine(model, "bk").attach(torch.optim.SGD(model.parameters(), lr=0.1))
    first.detach()
    _engine(model, "bk").attach(torch.optim.SGD(model.parameters(), lr=0.1))


# two task models sharing an encoder (multi-task): two engines would each clip their own part of a sample's gradient
def _two_task_models(frozen: bool):
    torch.manual_seed(3)
    encoder = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
    encoder.requires_grad_(not frozen)
    return encoder, nn.Sequential(encoder, nn.Linear(8, 3)), nn.Sequential(encoder, nn.Linear(8, 3))


def test_two_engines_on_models_sharing_a_trainable_module_are_refused_naming_it(float64):
    _, task_a, task_b = _two_task_models(frozen=False)
    x, y = _data(4)
    expected = reference_clipped_gradient(task_a, _losses, (x, y), max_grad_norm=R)
    first = _engine(task_a, "bk").attach(torch.optim.SGD(task_a.parameters(), lr=0.0))
    second = _engine(task_b, "bk")
    with pytest.raises(RuntimeError, match=r"module '0.0' \(Linear\) of this model is also in the model of another "
                                           r"attached PrivacyEngine.*bounded by neither engine.*one engine and one "
                                           r"optimizer"):
        second.attach(torch.optim.SGD(task_b.parameters(), lr=0.1))
    # the first engine is untouched by the refusal: still exact
    first.backward(_losses(task_a, x, y))
    first._step.optimizer.step()
    assert_matches({n: p.grad for n, p in task_a.named_parameters()}, expected)
    first.detach()
    second.attach(torch.optim.SGD(task_b.parameters(), lr=0.1))  # once the other is detached


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_frozen_module_shared_by_two_engines_models_is_exact_in_both(float64, mode, path):
    """A frozen shared encoder is hooked by neither engine: each engine's step is its own model's clipped sum, also
    with the other model's forward between its forward and its backward."""
    _, task_a, task_b = _two_task_models(frozen=True)
    (xa, ya), (xb, yb) = _data(5, seed=1), _data(4, seed=2)
    expected_a = reference_clipped_gradient(task_a, _losses, (xa, ya), max_grad_norm=R)
    expected_b = reference_clipped_gradient(task_b, _losses, (xb, yb), max_grad_norm=R)
    engine_a, optimizer_a = attached_engine(task_a, mode=mode, max_grad_norm=R,
                                            loss_reduction="sum" if path == "plain" else "mean")
    try:
        losses_a = _losses(task_a, xa, ya)
        got_b = clipped_gradient(task_b, _losses, (xb, yb), mode=mode, max_grad_norm=R, path=RUN[path])
        engine_a.backward(losses_a) if path == "engine" else losses_a.sum().backward()
        optimizer_a.step()
        got_a = {n: p.grad for n, p in task_a.named_parameters() if p.requires_grad}
    finally:
        engine_a.detach()
    assert_matches(got_a, expected_a, what="task a")
    assert_matches(got_b, expected_b, what="task b")


def test_a_shared_module_unfrozen_after_attach_is_refused_at_the_next_forward(float64):
    encoder, task_a, task_b = _two_task_models(frozen=True)
    engine_a = _engine(task_a, "bk-mixopt").attach(torch.optim.SGD(task_a.parameters(), lr=0.1))
    engine_b = _engine(task_b, "bk-mixopt").attach(torch.optim.SGD(task_b.parameters(), lr=0.1))
    encoder.requires_grad_(True)
    before = copy.deepcopy(task_a.state_dict())
    for model in (task_a, task_b):
        with pytest.raises(RuntimeError, match=r"module '0.0' \(Linear\) of this model is also in the model of "
                                               "another attached PrivacyEngine"):
            model(_data(3)[0])
    assert all(torch.equal(v, before[k]) for k, v in task_a.state_dict().items())
    engine_a.detach()
    engine_b.detach()


class EncoderWithTwoHeads(nn.Module):
    """The fix for two task models sharing an encoder: one model, both heads, one engine."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.encoder = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.head_a, self.head_b = nn.Linear(8, 3), nn.Linear(8, 2)

    def forward(self, x):
        h = self.encoder(x)
        return self.head_a(h), self.head_b(h)


def _two_task_losses(model, x, y):
    out_a, out_b = model(x)
    return F.cross_entropy(out_a, y, reduction="none") + F.cross_entropy(out_b, y % 2, reduction="none")


@pytest.mark.parametrize("mode,path", PATHS)
def test_one_model_holding_both_heads_is_exact_and_bounds_one_sample(float64, mode, path):
    x, y = _data(5)
    model = EncoderWithTwoHeads().double()
    expected = reference_clipped_gradient(model, _two_task_losses, (x, y), max_grad_norm=R)
    assert_matches(clipped_gradient(model, _two_task_losses, (x, y), mode=mode, max_grad_norm=R, path=RUN[path]),
                   expected)
    # the neighbour test: D and D minus one sample differ by at most R
    without = clipped_gradient(model, _two_task_losses, (x[1:], y[1:]), mode=mode, max_grad_norm=R, path=RUN[path])
    full = clipped_gradient(model, _two_task_losses, (x, y), mode=mode, max_grad_norm=R, path=RUN[path])
    difference = math.sqrt(sum(float((full[n] - without[n]).square().sum()) for n in full))
    assert difference <= R * (1 + 1e-9)


def test_a_forward_back_propagated_twice_is_refused(float64):
    model = _hooked_model()
    engine = _engine(model, "bk-mixopt").attach(torch.optim.SGD(model.parameters(), lr=0.1))
    loss = _losses(model, *_data(3)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already back-propagated in this step"):
        loss.backward()
    assert engine.steps_taken == 0


# ---------------------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("mode,path", [("bk-mixopt", "engine"), ("bk-mixopt", "plain"), ("ghost", "engine")])
def test_torch_compile(float64, mode, path, backend):
    model = _hooked_model()
    batch = _data(4)
    reference = _reference(model, [batch])
    compiled = torch.compile(copy.deepcopy(model), backend=backend)
    engine, opt = attached_engine(compiled, mode=mode, max_grad_norm=R, loss_reduction="sum")
    losses = _losses(compiled, *batch)
    engine.backward(losses) if path == "engine" else losses.sum().backward()
    opt.step()
    got = {n.removeprefix("_orig_mod."): p.grad for n, p in compiled.named_parameters()}
    assert_matches(got, reference, what=f"torch.compile({backend})")


# ---------------------------------------------------------------------------------------- the budget
def _budget_engine(model, **kw):
    return dptrain.PrivacyEngine(model, batch_size=10, sample_size=100, max_grad_norm=1.0, target_epsilon=1.0,
                                 steps=20, clipping_mode="bk", **kw)


def _step(engine, model, opt):
    engine.backward(_losses(model, *_data(3)))
    opt.step()
    opt.zero_grad()


def test_passing_the_budget_warns_once(float64):
    model = _hooked_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = _budget_engine(model).attach(opt)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(30):
            _step(engine, model, opt)
    budget = [w for w in seen if "target_epsilon" in str(w.message)]
    assert len(budget) == 1 and "past target_epsilon = 1" in str(budget[0].message)
    report = engine.privacy_report()
    assert report["planned_steps"] == 20 and report["steps"] == 30 and report["epsilon"] > 1.0


def test_a_strict_budget_refuses_the_step_that_would_pass_it(float64):
    model = _hooked_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = _budget_engine(model, budget="strict").attach(opt)
    taken = 0
    with pytest.raises(dptrain.engine.PrivacyBudgetExceeded, match=r"nothing was applied") as refused:
        for _ in range(40):
            _step(engine, model, opt)
            taken += 1
    assert taken >= 20 and engine.steps_taken == taken
    assert engine.get_epsilon() <= 1.0
    assert f"step {taken + 1}" in str(refused.value)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(dptrain.engine.PrivacyBudgetExceeded):
        _step(engine, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_budget_choice_is_checked():
    with pytest.raises(ValueError, match="budget"):
        _budget_engine(nn.Linear(2, 2), budget="loose")


# ---------------------------------------------------------------------------------------- the fallback
class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8) * 1.5)

    def forward(self, x):
        return x * self.scale


def test_the_engine_warns_once_naming_the_layers_on_the_fallback(float64):
    model = nn.Sequential(nn.Linear(6, 8), Scaled(), nn.Linear(8, 3)).double()
    with pytest.warns(UserWarning, match=r"1 layer\(s\) have no rule and use the per-sample fallback: 1\b"):
        engine = _engine(model, "bk-mixopt")
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: not again at the next model call or after freezing
        model[0].requires_grad_(False)
        engine.backward(_losses(model, *_data(3)))


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_fallback_layer_unfrozen_after_attach_is_exact(float64, mode, path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Scaled(), nn.Linear(8, 3)).double()
    batch = _data(4, seed=2)
    reference = _reference(model, [batch])
    model[2].requires_grad_(False)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    model[2].requires_grad_(True)
    with pytest.warns(UserWarning, match="per-sample fallback: 2"):
        _backward(engine, model, *batch, path)
    opt.step()
    assert_matches({n: p.grad for n, p in model.named_parameters()}, reference, what="fallback unfrozen")


def test_a_layer_replaced_after_attach_is_never_trained_on_a_raw_gradient(float64):
    model = _three_layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = _engine(model, "bk-mixopt").attach(opt)
    engine.backward(_losses(model, *_data(3)))
    opt.step(), opt.zero_grad()
    model[4] = nn.Linear(8, 3).double()  # a new head: its parameters are trainable, and not in the optimizer
    engine.backward(_losses(model, *_data(3)))
    assert model[4].weight.grad is None  # covered by the engine (ghost differentiation), not by autograd
    with pytest.raises(RuntimeError, match=r"\['4.weight', '4.bias'\] are not held by the optimizer"):
        opt.step()
    opt.add_param_group({"params": model[4].parameters()})
    engine.backward(_losses(model, *_data(3)))
    opt.step()
    assert model[4].weight.grad is not None


class WithChild(nn.Module):
    """A module without a rule (a parameter of its own) around a covered child: the fallback replays it
    with the child as it is, and the child's own rule clips the child."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, h):
        return torch.tanh(self.inner(h)) * self.gate


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_fallback_replay_records_nothing_of_its_covered_children(float64, mode, path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), WithChild(), nn.Linear(8, 3)).double()
    batch = _data(4, seed=2)
    reference = _reference(model, [batch])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    _backward(engine, model, *batch, path)
    assert sum(len(s.calls) for s in engine._trainable.layers) == 0  # the replay left no call behind
    opt.step()
    assert_matches({n: p.grad for n, p in model.named_parameters()}, reference, what="fallback with a child")


class WithPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(20, 8)
        self.positions = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).unsqueeze(0)  # [1, T]: broadcast over the batch
        return self.head(self.tokens(ids) + self.positions(positions)).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_an_empty_batch_through_a_broadcast_position_embedding(mode):
    torch.manual_seed(0)
    model = WithPositions()
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, lr=0.1)
    ids = torch.zeros(0, 7, dtype=torch.long)  # Poisson sampling draws empty batches
    engine.backward(F.cross_entropy(model(ids), torch.zeros(0, dtype=torch.long), reduction="none"))
    opt.step()
    assert engine.steps_taken == 1


def test_a_keyword_call_that_skips_an_argument_keeps_the_others_in_place():
    from dptrain.layers.protocol import positional_inputs

    class Three(nn.Module):
        def forward(self, x, scale=None, shift=0.0):
            return x

    x = torch.ones(2)
    assert positional_inputs(Three(), (x,), {"shift": 3.0}) == (x, None, 3.0)


# ---------------------------------------------------------------------------------------- a second reader's cases
class TiedCheckpoints(nn.Module):
    """One block applied twice, each application in its own reentrant checkpoint."""

    def __init__(self, checkpointed: bool = True):
        super().__init__()
        self.inp, self.a, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.checkpointed = checkpointed

    def block(self, h):
        return torch.tanh(self.a(h))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = checkpoint(self.block, h, use_reentrant=True) if self.checkpointed else self.block(h)
        return self.head(h)


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_layer_recomputed_in_several_checkpoints_is_exact(float64, mode, path):
    torch.manual_seed(0)
    model = TiedCheckpoints().double()
    plain = TiedCheckpoints(checkpointed=False).double()
    plain.load_state_dict(model.state_dict())
    batch = _data(4, seed=3)
    got = clipped_gradient(model, _losses, batch, mode=mode, max_grad_norm=R, path=RUN[path])
    assert_matches(got, _reference(plain, [batch]), what="tied checkpoints")
    x, y = _data(1, seed=4)
    update = one_sample_update(TiedCheckpoints().double(), _losses, (x * 10, y), mode=mode, max_grad_norm=R,
                               path=RUN[path])
    assert update <= R * (1 + 1e-9)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.h1, self.h2 = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        self.trunk.requires_grad_(False)

    def forward(self, x):
        z = torch.tanh(self.trunk(x))
        return self.h1(z), self.h2(z)


@pytest.mark.parametrize("mode,path", PATHS)
def test_one_forward_back_propagated_in_two_passes_is_refused(float64, mode, path):
    model = TwoHeads().double()
    engine = _engine(model, mode, loss_reduction="sum")
    engine.attach(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0))
    o1, o2 = model(_data(1)[0])
    l1 = F.cross_entropy(o1, torch.tensor([1]), reduction="none")
    l2 = F.cross_entropy(o2, torch.tensor([2]), reduction="none")
    engine.backward(l1) if path == "engine" else l1.sum().backward()
    with pytest.raises(RuntimeError, match="already back-propagated in this step"):
        engine.backward(l2) if path == "engine" else l2.sum().backward()


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
def test_input_gradients_inside_paused_are_not_training(float64, mode):
    model = _three_layers()
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    before = copy.deepcopy(model)
    x, y = _data(1)
    x = x.clone().requires_grad_()
    with engine.paused():  # an adversarial example: the gradient with respect to the input only
        (gx,) = torch.autograd.grad(_losses(model, x, y).sum(), x)
    engine.backward(_losses(model, (x + 0.5 * gx.sign()).detach(), y))
    opt.step()
    assert update_norm(before, model) <= R * (1 + 1e-9)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor


class DataclassOutput(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.emb, self.b1, self.b2 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.reentrant = reentrant

    def forward(self, x):
        h = checkpoint(lambda t: torch.tanh(self.b1(t)), torch.tanh(self.emb(x)), use_reentrant=self.reentrant)
        return Out(checkpoint(self.b2, h, use_reentrant=self.reentrant))


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
def test_a_dataclass_output_with_checkpoints_is_clipped_once(float64, mode):
    torch.manual_seed(0)
    model = DataclassOutput(reentrant=True).double()
    before = copy.deepcopy(model)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    x, y = _data(1)
    F.cross_entropy(model(x * 3).logits, y, reduction="sum").backward()
    opt.step()
    assert update_norm(before, model) <= R * (1 + 1e-9)


class FoldsADict(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, batch):
        x = batch["x"]
        B, T, _ = x.shape
        return self.l2(torch.tanh(self.l1(x.reshape(B * T, 6)))).view(B, T, 3).sum(1)

    def encode(self, x):
        return self.forward({"x": x})


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
def test_the_batch_is_read_through_dicts(float64, mode):
    torch.manual_seed(0)
    model = FoldsADict().double()
    batches = [_fold_data(2, 5, seed=4)]
    engine = _engine(model, mode, loss_reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    x, y = batches[0]
    F.cross_entropy(model({"x": x}), y, reduction="sum").backward()
    opt.step()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine.detach()
    expected = reference_clipped_gradient(model, lambda m, x, y: F.cross_entropy(m({"x": x}), y, reduction="none"),
                                          (x, y), max_grad_norm=R)
    assert_matches(got, expected, what="a dict input folded into the batch")


@pytest.mark.parametrize("mode", SINGLE_BACKWARD_MODES)
def test_a_model_used_through_a_method_is_refused(float64, mode):
    model = FoldsADict().double()
    engine = _engine(model, mode, loss_reduction="sum")
    engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.raises(ValueError, match="called outside a call of the model"):
        F.cross_entropy(model.encode(torch.randn(1, 20, 6)), torch.tensor([1]), reduction="sum").backward()


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_a_loss_parameter_added_to_the_optimizer_is_refused(float64, mode):
    model = _three_layers()
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    centres = nn.Parameter(torch.randn(3, 3))
    opt.add_param_group({"params": [centres]})
    before = centres.detach().clone()
    # engine.backward sees the loss reach it (rows.losses): refused before anything is accumulated
    with pytest.raises(ValueError, match="outside the model given to the engine"):
        engine.backward(F.cross_entropy(model(_data(1)[0]) @ centres * 10, torch.tensor([1]), reduction="none"))
    assert centres.grad is None
    if engine.recipe.two_pass:
        return
    # a plain backward does not show the loss to the engine: the raw gradient is found, dropped and refused at the step
    (F.cross_entropy(model(_data(1)[0]) @ centres * 10, torch.tensor([1]), reduction="none")).sum().backward()
    with pytest.raises(RuntimeError, match="not part of the model"):
        opt.step()
    assert torch.equal(centres.detach(), before) and centres.grad is None


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
def test_a_weight_swapped_in_place_of_the_registered_one_is_never_applied_raw(float64, mode):
    model = _three_layers()
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum", lr=1.0)
    engine.backward(_losses(model, *_data(2)))
    opt.step(), opt.zero_grad()
    swapped = nn.Parameter(model[2].weight.detach().clone())
    model[2]._parameters["weight"] = swapped  # no registration hook sees this (accelerate does it)
    opt.param_groups[0]["params"][2] = swapped
    before = copy.deepcopy(model)
    try:
        engine.backward(_losses(model, *_data(2)))
        opt.step()
    except RuntimeError as err:
        assert "gradient" in str(err)
    assert update_norm(before, model) <= R * (1 + 1e-9)


def test_a_frozen_batchnorm_in_training_mode_added_after_attach_is_refused(float64):
    model = nn.Sequential(nn.Linear(6, 8), nn.Identity(), nn.Linear(8, 3)).double()
    engine = _engine(model, "bk-mixopt")
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.backward(_losses(model, *_data(3)))
    model[1] = nn.BatchNorm1d(8).double().requires_grad_(False)
    with pytest.raises(RuntimeError, match="mixes samples"):
        model(_data(3)[0])


class PooledSequenceFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Linear(6, 8), nn.Linear(8, 8)

    def forward(self, x):  # [T, B, 6] -> [B, 8]: the head sees a batch-first [B, d]
        return self.head(torch.tanh(self.emb(x)).mean(0))


@pytest.mark.parametrize("mode,path", PATHS)
def test_sequence_first_layers_after_pooling_see_the_batch_first(float64, mode, path):
    torch.manual_seed(0)
    model = PooledSequenceFirst().double()
    x, y = torch.randn(4, 5, 6), torch.randint(0, 8, (4,))
    _assert_seq_first_exact(model, mode, path, x, y, what="pooled sequence first")
    # A batch as large as the head's width (its [B, d] input reads either way), and as the number of positions
    # ([T, B, d] with T == B): the rows are read from the gradient over both leading axes, never guessed.
    for T, B in [(5, 8), (4, 4)]:
        x, y = torch.randn(T, B, 6).transpose(0, 1).contiguous(), torch.randint(0, 8, (B,))
        if path != "engine" and B == 8:
            # a plain backward tags the model's output along its batch axis, which batch_first=False puts second:
            # this model's pooled output [B, 8] has B there too, and its rows do not read as samples: refused
            with pytest.raises(RuntimeError, match="could not read which sample each row"):
                _seq_first_step(model, mode, path, x, y)
            continue
        _assert_seq_first_exact(model, mode, path, x, y, what=f"pooled sequence first, T = {T}, B = {B}")


class Scale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight


class SequenceFirstScale(nn.Module):
    """A sequence-first model with a module the fallback covers (no rule reads its rows over both axes)."""

    def __init__(self):
        super().__init__()
        self.emb, self.scale, self.head = nn.Linear(6, 8), Scale(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.scale(self.emb(x)))).sum(0)


@pytest.mark.parametrize("mode,path", PATHS)
def test_sequence_first_at_T_equal_to_B_is_exact_or_refused(float64, mode, path):
    torch.manual_seed(0)
    model = SequenceFirst().double()
    x, y = torch.randn(5, 5, 6) * 2, torch.randint(0, 3, (5,))
    _assert_seq_first_exact(model, mode, path, x, y, what="batch_first=False, T == B")
    # one sample contributing (the others' losses weighted 0) moves the model by at most R
    first_only = torch.zeros(5, dtype=torch.float64)
    first_only[0] = 1.0
    one = one_sample_update(copy.deepcopy(model), lambda m, xs, ys: _seq_first_losses(m, xs, ys) * first_only,
                            (x * 10, y), mode=mode, max_grad_norm=R, path=RUN[path], batch_first=False)
    assert 0 < one <= R * (1 + 1e-9)
    with pytest.raises(ValueError, match=r"scale \(Scale\).*cannot tell which axis is the batch.*or freeze this layer"):
        _seq_first_step(SequenceFirstScale().double(), mode, path, x, torch.randint(0, 3, (5,)))


def test_a_keyboard_interrupt_in_a_forward_then_a_step(float64):
    model = _failing_model()
    engine, opt = attached_engine(model, mode="bk-mixopt", max_grad_norm=R, loss_reduction="sum")
    batch = _data(3, seed=1)
    reference = None
    engine.detach()
    reference = _reference(model, [batch])
    engine.attach(opt)
    engine.backward(_losses(model, *batch))
    with _failing(model, "forward", KeyboardInterrupt):
        model(_data(2)[0])
    opt.step()  # the interrupted forward is settled here: every parameter trainable, the earlier sum applied
    assert all(p.requires_grad for p in model.parameters())
    assert_matches({n: p.grad for n, p in model.named_parameters()}, reference, what="interrupted forward")


def test_heads_replaced_many_times_are_always_hooked(float64):
    model = _three_layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = _engine(model, "bk").attach(opt)
    for _ in range(30):  # freed modules' ids come back
        model[4] = nn.Linear(8, 3).double()
        opt.param_groups[0]["params"] = list(model.parameters())
        engine.backward(_losses(model, *_data(2)))
        opt.step(), opt.zero_grad()


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_forward_whose_loss_failed_leaves_nothing_once_its_outputs_are_dropped(float64, mode, path):
    # The batch-size finder's case where the out-of-memory error is in the loss (a large vocabulary), after the
    # model's forward returned: once the outputs are dropped, nothing of that forward is kept for the retry.
    model = _three_layers()
    reference_model = copy.deepcopy(model)
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, loss_reduction="sum")
    out = model(_data(64)[0])
    del out  # the loss raised; the user's handler dropped its references
    gc.collect()
    assert sum(len(s.calls) for s in engine._trainable.layers) == 0
    batch = _data(3, seed=2)
    _backward(engine, model, *batch, path)
    opt.step()
    assert_matches({n: p.grad for n, p in model.named_parameters()}, _reference(reference_model, [batch]),
                   what="after a failed loss")


# -------------------------------------------------------------------- accounting, calibration, loaders, checkpoints
N, FEATURES, CLASSES = 64, 5, 3


def make_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, FEATURES, generator=g), torch.randint(0, CLASSES, (N,), generator=g))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def train_steps(model, engine, optimizer, batches):
    for x, y in batches:
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.step()
        optimizer.zero_grad()


def test_calibrated_engine_spends_at_most_the_target():
    model = make_model()
    engine = dptrain.PrivacyEngine(model, batch_size=16, sample_size=N, target_epsilon=2.0, epochs=3, accountant="rdp")
    steps = engine.planned_steps
    assert steps == 12  # 3 epochs of 1/q = 4 steps
    spent = compute_epsilon(engine.noise_multiplier, 16 / N, steps, engine.target_delta, accountant="rdp")
    assert 0.99 * 2.0 <= spent <= 2.0
    assert engine.target_delta == pytest.approx(1 / (10 * N))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of noise_multiplier or target_epsilon"),
        ({"noise_multiplier": 1.0, "target_epsilon": 3.0, "epochs": 1}, "exactly one of noise_multiplier or target_epsilon"),
        ({"target_epsilon": 3.0}, "epochs or steps"),
        ({"target_epsilon": 3.0, "epochs": 1, "steps": 4}, "epochs or steps"),
        ({"target_epsilon": 0.0, "steps": 10}, "target_epsilon"),
        ({"target_epsilon": 1e-3, "target_delta": 1e-12, "steps": 10_000}, "unreachable"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ],
)
def test_noise_configuration_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dptrain.PrivacyEngine(make_model(), batch_size=16, sample_size=N, **kwargs)


def test_epsilon_counts_every_logical_step_with_the_sigma_used():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = dptrain.PrivacyEngine(model, batch_size=16, sample_size=N, noise_multiplier=1.3, accountant="rdp", seed=0)
    engine.attach(optimizer)
    x, y = make_data().tensors
    for step in range(3):  # the second step is an empty Poisson batch: it still counts
        batch = slice(0, 0) if step == 1 else slice(0, 16)
        engine.backward(F.cross_entropy(model(x[batch]), y[batch], reduction="none"))
        optimizer.step()
    assert engine.steps_taken == 3 and engine.accountant.history == [(1.3, 16 / N, 3)]
    assert engine.get_epsilon(1e-5) == pytest.approx(compute_epsilon(1.3, 16 / N, 3, 1e-5, accountant="rdp"))
    report = engine.privacy_report(1e-5)
    assert report["steps"] == 3 and report["accountant"] == "rdp" and report["epsilon"] > 0


def test_split_run_equals_unsplit_run_exactly(float64):
    """Virtual batches: a logical Poisson batch cut into physical ones gives the same update (sigma = 0)."""
    dataset = make_data()
    results = []
    for physical in (None, 3):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        engine = dptrain.PrivacyEngine(model, batch_size=16, sample_size=N, noise_multiplier=0.0)
        loader = poisson_loader(dataset, batch_size=16, generator=torch.Generator().manual_seed(1))
        engine.attach(optimizer, data_loader=loader)
        logical_batches = split_batches(loader, physical) if physical else ([batch] for batch in loader)
        sizes = []
        for logical in logical_batches:
            parts = list(logical)
            sizes.append(len(parts))
            for x, y in parts:
                engine.backward(F.cross_entropy(model(x), y, reduction="none"))
            optimizer.step()
            optimizer.zero_grad()
        results.append(([p.detach().clone() for p in model.parameters()], engine.steps_taken, sizes))
    (unsplit, steps_a, _), (split, steps_b, sizes) = results
    assert steps_a == steps_b == 4
    assert max(sizes) > 1  # some logical batch really was split
    for a, b in zip(unsplit, split):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("reproducible_noise", [False, True])
def test_resumed_run_continues_like_an_uninterrupted_one(tmp_path, reproducible_noise):
    """Same epsilon, steps and batches; the same parameters number for number only when the saved noise
    stream is continued on purpose (reproducible_noise=True); by default the noise after loading is fresh."""
    dataset = make_data()

    def fresh():
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        engine = dptrain.PrivacyEngine(model, batch_size=16, sample_size=N, noise_multiplier=0.8, seed=7)
        loader = poisson_loader(dataset, batch_size=16, steps=6, generator=torch.Generator().manual_seed(3))
        engine.attach(optimizer, data_loader=loader)
        return model, optimizer, engine, loader

    model, optimizer, engine, loader = fresh()
    train_steps(model, engine, optimizer, loader)
    uninterrupted = [p.detach().clone() for p in model.parameters()], engine.get_epsilon()

    model, optimizer, engine, loader = fresh()
    batches = iter(loader)
    train_steps(model, engine, optimizer, (next(batches) for _ in range(2)))
    checkpoint = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "engine": engine.state_dict(), "loader": loader.state_dict()}, checkpoint)

    model, optimizer, engine, loader = fresh()
    state = torch.load(checkpoint, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if reproducible_noise:
        with pytest.warns(UserWarning, match="reproducible_noise=True"):
            engine.load_state_dict(state["engine"], reproducible_noise=True)
    else:
        engine.load_state_dict(state["engine"])
    loader.load_state_dict(state["loader"])
    assert engine.steps_taken == 2
    train_steps(model, engine, optimizer, loader)
    assert engine.steps_taken == 6
    assert engine.get_epsilon() == pytest.approx(uninterrupted[1], rel=1e-12)
    if reproducible_noise:
        for a, b in zip(uninterrupted[0], model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    else:  # fresh noise on the same batches: a different run (the noise std is 0.8 R / 16 per coordinate)
        assert all(not torch.equal(a, b.detach()) for a, b in zip(uninterrupted[0], model.parameters()))


def test_secure_rng_refuses_a_seed_and_draws_fresh_noise():
    with pytest.raises(ValueError, match="operating system"):
        dptrain.PrivacyEngine(make_model(), batch_size=16, sample_size=N, noise_multiplier=1.0, secure_rng=True, seed=1)
    grads = []
    for _ in range(2):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine = dptrain.PrivacyEngine(model, batch_size=16, sample_size=N, noise_multiplier=1.0, secure_rng=True)
        engine.attach(optimizer)
        optimizer.step()  # an empty step: pure noise
        grads.append(model[0].weight.grad.clone())
        assert "generators" not in engine.state_dict()["noise"]
    assert not torch.equal(grads[0], grads[1])


def test_secure_noise_combines_independent_streams_and_is_standard_gaussian(monkeypatch):
    # torch's CPU generator keeps 32 bits of a seed: the secure noise must not hinge on one such seed.
    import os

    from dptrain.core.noise import GaussianNoise

    drawn = []
    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: drawn.append(real(n)) or drawn[-1])
    noise = GaussianNoise(secure=True)
    x = noise.sample(torch.empty(200_000), std=2.0)
    # GaussianNoise's own default seed draw, then one fresh OS seed per stream: 4 x 32 usable bits.
    assert GaussianNoise.SECURE_STREAMS >= 4
    assert len(drawn) >= GaussianNoise.SECURE_STREAMS
    assert len({(int.from_bytes(b, "little") >> 1) % 2**32 for b in drawn[-GaussianNoise.SECURE_STREAMS:]}) == 4
    # N(0, 4): sample std within 1 % (about 3.2 standard errors at n = 200k), mean and kurtosis as a Gaussian's.
    assert abs(float(x.std()) - 2.0) < 0.02
    assert abs(float(x.mean())) < 5 * 2.0 / 200_000**0.5
    kurtosis = float(((x / x.std()) ** 4).mean())
    assert abs(kurtosis - 3.0) < 0.1


def test_shuffling_loader_warns_once_and_mismatched_poisson_loader_is_refused():
    dataset = make_data()
    engine = dptrain.PrivacyEngine(make_model(), batch_size=16, sample_size=N, noise_multiplier=1.0)
    shuffling = DataLoader(dataset, batch_size=16, shuffle=True)
    with pytest.warns(UserWarning, match="does not sample batches by Poisson sampling") as caught:
        engine.attach(torch.optim.SGD(engine.model.parameters(), lr=0.1), data_loader=shuffling)
    assert caught[0].filename == __file__  # (it points at the user's attach)
    engine.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.attach(torch.optim.SGD(engine.model.parameters(), lr=0.1), data_loader=shuffling)  # said once only
    engine.detach()
    with pytest.raises(ValueError, match="q=0.5"):
        engine.attach(torch.optim.SGD(engine.model.parameters(), lr=0.1), data_loader=poisson_loader(dataset, batch_size=32))
