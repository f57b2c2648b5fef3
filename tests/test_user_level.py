"""User-level privacy (``privacy_unit="user"``): the clipped unit is the sum of a user's per-example gradients.

Checked against the oracle (per-example gradients from one autograd call each, summed per user, then clipped;
float64, clipping binding) in every mode, and at one user with noise 0, where the update must have norm <= R
however many examples the user has.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dptrain
from dptrain.testing import neighbour_test, reference_user_clipped_gradient
from helpers import MODES, assert_matches

R = 0.3


class Tokens(nn.Module):
    """Embedding, a per-token Linear and a LayerNorm, a mean over tokens and a head: rows of one example stay
    one example's, so the user's rows are regrouped for every rule (tokens folded, norms, embeddings)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.mix = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        h = self.norm(torch.tanh(self.mix(self.emb(ids))))
        h = torch.tanh(self.conv(h.transpose(1, 2))).mean(2)
        return self.head(h)


def _losses(model, ids, y):
    return F.cross_entropy(model(ids), y, reduction="none")


def _batch(N, seed, T=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 20, (N, T), generator=g), torch.randint(0, 3, (N,), generator=g)


def _model():
    torch.manual_seed(0)
    return Tokens().double()


def _engine(model, mode, **kw):
    return dptrain.PrivacyEngine(model, batch_size=1, sample_size=50, max_grad_norm=R, noise_multiplier=0.0,
                                 clipping_mode=mode, loss_reduction="sum", privacy_unit="user", **kw)


def _step(model, mode, batches, **kw):
    engine = _engine(model, mode, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    try:
        for ids, y, users in batches:
            engine.backward(_losses(model, ids, y), users=users)
        opt.step()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, engine
    finally:
        engine.detach()


# users of 1 to 4 examples, in a shuffled order; user ids arbitrary integers
USERS = torch.tensor([7, 3, 7, 11, 3, 7, 42, 7, 11])


@pytest.mark.parametrize("mode", MODES)
def test_each_users_summed_gradient_is_clipped_exactly(float64, mode):
    model = _model()
    ids, y = _batch(len(USERS), seed=1)
    reference = reference_user_clipped_gradient(model, _losses, (ids, y), USERS, max_grad_norm=R)
    got, engine = _step(model, mode, [(ids, y, USERS)])
    assert_matches(got, reference, what=f"user-level {mode}")
    assert engine.privacy_report()["privacy_unit"] == "user"


@pytest.mark.parametrize("style", ["layer-wise", "param-wise"])
@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_user_level_clipping_styles(float64, mode, style):
    model = _model()
    ids, y = _batch(len(USERS), seed=2)
    reference = reference_user_clipped_gradient(model, _losses, (ids, y), USERS, max_grad_norm=R,
                                                clipping_style=style)
    got, _ = _step(model, mode, [(ids, y, USERS)], clipping_style=style)
    assert_matches(got, reference, what=f"user-level {mode} {style}")


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_of_whole_users_accumulate(float64, mode):
    model = _model()
    ids, y = _batch(len(USERS), seed=3)
    first = torch.isin(USERS, torch.tensor([7, 42]))
    reference = reference_user_clipped_gradient(model, _losses, (ids, y), USERS, max_grad_norm=R)
    got, _ = _step(model, mode, [(ids[first], y[first], USERS[first]), (ids[~first], y[~first], USERS[~first])])
    assert_matches(got, reference, what=f"two micro-batches of whole users, {mode}")


@pytest.mark.parametrize("mode", MODES)
def test_one_user_with_many_examples_moves_the_model_at_most_r(float64, mode):
    model = _model()
    before = copy.deepcopy(model)
    engine = _engine(model, mode)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    ids, y = _batch(6, seed=4)
    engine.backward(_losses(model, ids, y), users=torch.full((6,), 5))
    opt.step()
    engine.detach()
    norm = math.sqrt(sum(float((p - q).square().sum()) for p, q in zip(model.parameters(), before.parameters())))
    assert 0 < norm <= R * (1 + 1e-9)  # six examples: with example-level clipping up to 6 R


def test_a_user_split_over_two_backwards_of_a_step_is_refused(float64):
    model = _model()
    engine = _engine(model, "bk-mixopt")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    ids, y = _batch(4, seed=5)
    engine.backward(_losses(model, ids[:2], y[:2]), users=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"users \[2\] already had rows in an earlier engine.backward"):
        engine.backward(_losses(model, ids[2:], y[2:]), users=torch.tensor([2, 3]))
    opt.step()  # the next step starts afresh
    engine.backward(_losses(model, ids[2:], y[2:]), users=torch.tensor([2, 3]))
    opt.step()
    engine.detach()


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_zero_grad_discards_a_backwards_users_with_it(float64, mode):
    """``zero_grad()`` between a backward and the step discards that backward (docs/engine.md): its users too, so the
    same users back-propagated again (a batch-size finder's retry) are this step's, once. The step is the twin's
    that saw only the second backward; a user split over two backwards after it is still refused."""
    ids, y = _batch(9, seed=5)
    first = (ids[:5], y[:5], USERS[:5])
    second = (ids[4:], y[4:], USERS[4:])  # (users 3, 7, 42, 11: 3, 7 and 11 were in the first)
    model, twin = _model(), _model()
    want, _ = _step(twin, mode, [second])
    engine = _engine(model, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    try:
        engine.backward(_losses(model, first[0], first[1]), users=first[2])
        opt.zero_grad()
        engine.backward(_losses(model, second[0], second[1]), users=second[2])
        with pytest.raises(ValueError, match=r"already had rows in an earlier engine.backward"):
            engine.backward(_losses(model, first[0], first[1]), users=first[2])
        opt.step()
        assert_matches({n: p.grad for n, p in model.named_parameters()}, want, what=f"{mode}: after zero_grad()")
    finally:
        engine.detach()


def test_a_forward_that_mixes_one_users_examples_is_refused_saying_where_to_couple_them(float64):
    """Rows are read per example at user level: a forward mixing the two examples of each user is refused, and the
    message says to couple them in the loss (which the loss check reads per user)."""

    class PairMix(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 3)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            return self.b(h + 0.7 * h.view(-1, 2, 6).flip(1).reshape(-1, 6))

    torch.manual_seed(0)
    model = PairMix().double()
    engine = _engine(model, "bk-mixopt")
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    try:
        x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
        with pytest.raises(ValueError, match=r"privacy_unit='user'.*Couple them in the loss"):
            engine.backward(F.cross_entropy(model(x), y, reduction="none"), users=torch.arange(8) // 2)
    finally:
        engine.detach()


def test_users_are_required_with_user_level_privacy_and_refused_without(float64):
    model = _model()
    ids, y = _batch(3, seed=6)
    engine = _engine(model, "bk-mixopt").attach(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="privacy_unit='user'"):
        engine.backward(_losses(model, ids, y))
    with pytest.raises(ValueError, match=r"users must be an integer tensor of shape \[3\]"):
        engine.backward(_losses(model, ids, y), users=torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="plain loss.backward\\(\\) cannot"):
        _losses(model, ids, y).sum().backward()
    engine.detach()
    example_level = dptrain.PrivacyEngine(model, batch_size=1, sample_size=50, noise_multiplier=0.0)
    example_level.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="with privacy_unit='user' \\(and only then\\)"):
        example_level.backward(_losses(model, ids, y), users=torch.tensor([1, 2, 3]))
    example_level.detach()
    with pytest.raises(ValueError, match="unknown privacy_unit 'person'; valid: example, user"):
        dptrain.PrivacyEngine(model, batch_size=1, sample_size=50, noise_multiplier=0.0, privacy_unit="person")


def test_a_loader_of_another_privacy_unit_is_refused_at_attach(float64):
    from torch.utils.data import TensorDataset

    model = _model()
    ids, y = _batch(12, seed=7)
    users = torch.arange(12) // 3
    user_loader = dptrain.data.poisson_loader(TensorDataset(ids, y), batch_size=2, users=users)
    example_level = dptrain.PrivacyEngine(model, batch_size=2, sample_size=4, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="the loader samples users but the engine's privacy_unit is 'example'"):
        example_level.attach(torch.optim.SGD(model.parameters(), lr=0.1), data_loader=user_loader)
    user_level = dptrain.PrivacyEngine(model, batch_size=2, sample_size=4, noise_multiplier=1.0, privacy_unit="user")
    user_level.attach(torch.optim.SGD(model.parameters(), lr=0.1), data_loader=user_loader)  # q = 2 / 4 users
    user_level.detach()


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
def test_user_level_with_a_mask_counts_padding_as_nothing(float64, mode):
    model = _model()
    ids, y = _batch(len(USERS), seed=8)
    reference = reference_user_clipped_gradient(model, _losses, (ids, y), USERS, max_grad_norm=R)
    padded_ids = torch.cat([ids, torch.zeros(3, ids.shape[1], dtype=ids.dtype)])
    padded_y = torch.cat([y, torch.zeros(3, dtype=y.dtype)])
    users = torch.cat([USERS, torch.tensor([7, 100, 101])])  # a padding row in user 7's slot, two empty slots
    mask = torch.arange(len(users)) < len(USERS)
    engine = _engine(model, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    engine.backward(_losses(model, padded_ids, padded_y), users=users, mask=mask)
    opt.step()
    engine.detach()
    assert_matches({n: p.grad for n, p in model.named_parameters()}, reference, what=f"user-level, padded, {mode}")


class _RMSNorm(nn.Module):
    """An RMS norm of the user's own (Llama's): recognised by its structure (``RecognisedRMSNormRule``)."""

    def __init__(self, d: int, one_plus: bool = False):
        super().__init__()
        self.one_plus, self.eps = one_plus, 1e-6
        self.weight = nn.Parameter(torch.randn(d) * 0.3 + (0.0 if one_plus else 1.0))

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((1 + self.weight) if self.one_plus else self.weight) * h


class _RMSTokens(Tokens):
    def __init__(self, one_plus: bool):
        super().__init__()
        self.norm = _RMSNorm(8, one_plus)


@pytest.mark.parametrize("one_plus", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_a_recognised_rms_norm_regroups_each_users_rows_exactly(float64, mode, one_plus):
    """A recognised RMS norm (Llama's, Gemma's 1 + w) at user level: its rows summed per user, as the oracle sums the
    user's per-example gradients (it was refused, so no Llama trained at user level)."""
    torch.manual_seed(0)
    model = _RMSTokens(one_plus).double()
    ids, y = _batch(len(USERS), seed=1)
    reference = reference_user_clipped_gradient(model, _losses, (ids, y), USERS, max_grad_norm=R)
    got, _ = _step(model, mode, [(ids, y, USERS)])
    assert_matches(got, reference, what=f"user-level RMS norm {mode}")


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost", "per-sample"])
def test_a_recognised_rms_norm_at_user_level_moves_the_step_by_at_most_r(float64, mode):
    """DP's own definition at user level, with the RMS norm's rows regrouped: removing a user moves the step by at
    most R, at B == T (5 examples of 5 tokens) and B != T, warm after a step of another size."""
    torch.manual_seed(0)
    users = torch.tensor([0, 0, 1, 2, 2])
    for T in (5, 3):
        ids, y = _batch(5, seed=2, T=T)
        warm_ids, warm_y = _batch(3, seed=3, T=4)
        report = neighbour_test(_RMSTokens(one_plus=False).double(), _losses, (ids, y), mode=mode, users=users,
                                warm_up=[((warm_ids, warm_y), torch.tensor([4, 4, 5]))])
        assert report.refused is None and report.worst <= 1 + 1e-9, (T, report)
