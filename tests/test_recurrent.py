"""DPRNN / DPLSTM / DPGRU: same function and state dict as the torch modules, exact private gradients."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import dptrain
from dptrain.core.algorithms import DEFAULT_CLIPPING_MODE
from dptrain.nn import DPGRU, DPLSTM, DPRNN
from dptrain.testing import assert_rule_exact, clipped_gradient, per_sample_gradients, threshold_between

F64 = torch.float64

# (torch class, DP class, extra constructor arguments)
KINDS = {
    "rnn-tanh": (nn.RNN, DPRNN, {}),
    "rnn-relu": (nn.RNN, DPRNN, {"nonlinearity": "relu"}),
    "lstm": (nn.LSTM, DPLSTM, {}),
    "lstm-proj": (nn.LSTM, DPLSTM, {"proj_size": 2}),
    "gru": (nn.GRU, DPGRU, {}),
}


def make_pair(kind, input_size=3, hidden_size=4, **options):
    """A float64 torch module and its DP version holding the torch module's weights."""
    torch_cls, dp_cls, extra = KINDS[kind]
    reference = torch_cls(input_size, hidden_size, **extra, **options, dtype=F64)
    dp = dp_cls(input_size, hidden_size, **extra, **options, dtype=F64)
    dp.load_state_dict(reference.state_dict())
    return reference, dp


def initial_state(kind, module, batch, generator, batched=True):
    depth = module.num_layers * (2 if module.bidirectional else 1)
    out_size = module.proj_size or module.hidden_size
    shape = (depth, batch, out_size) if batched else (depth, out_size)
    h0 = torch.randn(*shape, dtype=F64, generator=generator)
    if not kind.startswith("lstm"):
        return h0
    cell_shape = shape[:-1] + (module.hidden_size,)
    return h0, torch.randn(*cell_shape, dtype=F64, generator=generator)


def assert_same_outputs(expected, actual):
    out_e, state_e = expected
    out_a, state_a = actual
    torch.testing.assert_close(out_a, out_e, atol=1e-10, rtol=0)
    if isinstance(state_e, tuple):
        for e, a in zip(state_e, state_a, strict=True):
            torch.testing.assert_close(a, e, atol=1e-10, rtol=0)
    else:
        torch.testing.assert_close(state_a, state_e, atol=1e-10, rtol=0)


# ---------------------------------------------------------------------------- same function
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(
    "num_layers,bidirectional,batch_first,bias",
    list(itertools.product([1, 2], [False, True], [False, True], [True, False])),
)
def test_forward_matches_torch(kind, num_layers, bidirectional, batch_first, bias):
    reference, dp = make_pair(kind, num_layers=num_layers, bidirectional=bidirectional, batch_first=batch_first,
                              bias=bias)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 3, dtype=F64, generator=g)  # [B, T, d] or [T, B, d]: both are valid inputs
    batch = x.shape[0] if batch_first else x.shape[1]
    assert_same_outputs(reference(x), dp(x))
    hx = initial_state(kind, reference, batch, g)
    assert_same_outputs(reference(x, hx), dp(x, hx))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("enforce_sorted", [False, True])
def test_packed_sequences_match_torch(kind, enforce_sorted):
    reference, dp = make_pair(kind, num_layers=2, bidirectional=True, batch_first=True)
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([6, 4, 3, 1]) if enforce_sorted else torch.tensor([3, 6, 1, 4])
    x = torch.randn(4, 6, 3, dtype=F64, generator=g)
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)
    hx = initial_state(kind, reference, 4, g)
    for args in [(packed,), (packed, hx)]:
        (out_e, state_e), (out_a, state_a) = reference(*args), dp(*args)
        assert torch.equal(out_a.batch_sizes, out_e.batch_sizes)
        for e, a in [(out_e.sorted_indices, out_a.sorted_indices), (out_e.unsorted_indices, out_a.unsorted_indices)]:
            assert (e is None and a is None) or torch.equal(e, a)
        assert_same_outputs((out_e.data, state_e), (out_a.data, state_a))


@pytest.mark.parametrize("kind", list(KINDS))
def test_unbatched_input_matches_torch(kind):
    reference, dp = make_pair(kind, num_layers=2, bidirectional=True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, dtype=F64, generator=g)
    assert_same_outputs(reference(x), dp(x))
    hx = initial_state(kind, reference, None, g, batched=False)
    assert_same_outputs(reference(x, hx), dp(x, hx))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("batch_first", [False, True])
def test_dropout_between_layers_drops_what_torch_drops(kind, batch_first):
    reference, dp = make_pair(kind, num_layers=3, dropout=0.5, bidirectional=True, batch_first=batch_first)
    x = torch.randn(5, 2, 3, dtype=F64, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(7)
    expected = reference(x)
    torch.manual_seed(7)
    actual = dp(x)
    assert_same_outputs(expected, actual)
    assert not torch.allclose(dp(x)[0], actual[0]), "dropout is active in training mode"
    dp.eval()
    reference.eval()
    assert_same_outputs(reference(x), dp(x))


# ---------------------------------------------------------------------------- state dicts
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_uses_torch_keys_both_ways(kind, bias):
    reference, dp = make_pair(kind, num_layers=2, bidirectional=True, bias=bias)
    assert list(dp.state_dict()) == list(reference.state_dict())
    fresh_dp = type(dp)(**_constructor_args(reference, kind), dtype=F64)
    fresh_dp.load_state_dict(reference.state_dict())  # strict: every key maps
    fresh_torch = type(reference)(**_constructor_args(reference, kind), dtype=F64)
    fresh_torch.load_state_dict(fresh_dp.state_dict())
    for name, tensor in reference.state_dict().items():
        assert torch.equal(fresh_torch.state_dict()[name], tensor)
        assert torch.equal(fresh_dp.state_dict()[name], tensor)


def _constructor_args(module, kind):
    args = dict(input_size=module.input_size, hidden_size=module.hidden_size, num_layers=module.num_layers,
                bias=module.bias, bidirectional=module.bidirectional)
    return {**args, **KINDS[kind][2]}


def test_state_dict_inside_a_model_keeps_prefixes_and_order():
    class Tagger(nn.Module):
        def __init__(self, recurrent):
            super().__init__()
            self.embed = nn.Embedding(10, 3)
            self.rnn = recurrent
            self.head = nn.Linear(8, 2)

    reference = Tagger(nn.LSTM(3, 4, bidirectional=True))
    dp = Tagger(DPLSTM(3, 4, bidirectional=True))
    assert list(dp.state_dict()) == list(reference.state_dict())
    dp.load_state_dict(reference.state_dict())
    assert torch.equal(dp.rnn.hh_l0_reverse.bias, reference.rnn.bias_hh_l0_reverse)


def test_torch_parameter_names_are_attributes():
    dp = DPLSTM(3, 4, num_layers=2, bidirectional=True, proj_size=2)
    assert dp.weight_hh_l1_reverse is dp.hh_l1_reverse.weight
    assert dp.weight_hr_l0 is dp.hr_l0.weight
    assert dp.bias_ih_l0 is dp.ih_l0.bias
    nn.init.zeros_(dp.weight_ih_l1)  # in place on the real parameter
    assert not dp.ih_l1.weight.any()
    with pytest.raises(AttributeError):
        dp.weight_ih_l2  # noqa: B018  (no third layer)
    with pytest.raises(AttributeError):
        DPGRU(3, 4, bias=False).bias_ih_l0  # noqa: B018


def test_parameters_are_initialised_like_torch():
    dp = DPGRU(3, 16, num_layers=2)
    bound = 1 / 16**0.5
    for p in dp.parameters():
        assert p.abs().max() <= bound
        assert p.std() > bound / 3  # not all zeros, not Linear's default fan-in scale


# ---------------------------------------------------------------------------- clear errors
def test_argument_errors_match_torch():
    with pytest.raises(ValueError, match="Unknown nonlinearity"):
        DPRNN(3, 4, nonlinearity="sigmoid")
    with pytest.raises(ValueError, match="proj_size has to be smaller than hidden_size"):
        DPLSTM(3, 4, proj_size=4)
    with pytest.raises(ValueError, match="dropout should be a number in range"):
        DPGRU(3, 4, dropout=1.5)
    with pytest.warns(UserWarning, match="dropout option adds dropout after all but last"):
        DPGRU(3, 4, dropout=0.5)
    with pytest.raises(TypeError, match="proj_size"):
        DPLSTM(3, 4, proj_size=1.5)


def test_input_errors_name_the_expected_shape():
    lstm = DPLSTM(3, 4, num_layers=2)
    with pytest.raises(ValueError, match="input_size"):
        lstm(torch.randn(5, 2, 4))
    with pytest.raises(ValueError, match=r"\(L, N, H_in\)"):
        lstm(torch.randn(5, 2, 3, 1))
    with pytest.raises(ValueError, match="tuple"):
        lstm(torch.randn(5, 2, 3), torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match=r"expected h_0 of size \(2, 2, 4\)"):
        lstm(torch.randn(5, 2, 3), (torch.zeros(1, 2, 4), torch.zeros(2, 2, 4)))
    with pytest.raises(ValueError, match="should be 2-D"):
        lstm(torch.randn(5, 3), (torch.zeros(2, 1, 4), torch.zeros(2, 1, 4)))


# ---------------------------------------------------------------------------- exact private gradients
class SequenceRegressor(nn.Module):
    """recurrent layer -> Linear head on every step (padded input with lengths, packed inside)."""

    def __init__(self, recurrent, out_size):
        super().__init__()
        self.recurrent = recurrent
        self.head = nn.Linear(out_size, 2)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        output, _ = self.recurrent(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(output, batch_first=True, total_length=x.shape[1])
        return self.head(padded)


class LastStateClassifier(nn.Module):
    """recurrent layer -> Linear head on the final hidden state of the last layer."""

    def __init__(self, recurrent, out_size):
        super().__init__()
        self.recurrent = recurrent
        self.head = nn.Linear(out_size, 3)

    def forward(self, x):  # x: [B, T, d], as the oracle slices samples along dim 0
        _, state = self.recurrent(x if self.recurrent.batch_first else x.transpose(0, 1))
        h_n = state[0] if isinstance(state, tuple) else state
        return self.head(h_n[-1])


def sequence_losses(model, x, lengths, y):
    return (model(x, lengths) - y).square().sum((1, 2))


def class_losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _regression_case(kind):
    torch.manual_seed(11)
    _, dp_cls, extra = KINDS[kind]
    recurrent = dp_cls(3, 4, num_layers=2, bidirectional=True, batch_first=True, **extra, dtype=F64)
    model = SequenceRegressor(recurrent, 2 * (recurrent.proj_size or 4)).double()
    g = torch.Generator().manual_seed(12)
    x = torch.randn(4, 5, 3, dtype=F64, generator=g)
    lengths = torch.tensor([5, 2, 4, 1])
    # the loss also reads the zero-padded outputs: steps beyond a sequence's length must add nothing
    y = torch.randn(4, 5, 2, dtype=F64, generator=g)
    return model, sequence_losses, (x, lengths, y)


def _classification_case(kind):
    torch.manual_seed(13)
    _, dp_cls, extra = KINDS[kind]
    recurrent = dp_cls(3, 5, num_layers=1, batch_first=False, **extra, dtype=F64)
    model = LastStateClassifier(recurrent, recurrent.proj_size or 5).double()
    g = torch.Generator().manual_seed(14)
    x = torch.randn(3, 6, 3, dtype=F64, generator=g)
    return model, class_losses, (x, torch.tensor([0, 2, 1]))


CASES = [("regression-packed", _regression_case), ("classification-last-state", _classification_case)]
EXACT_KINDS = ["rnn-tanh", "lstm-proj", "gru"]


@pytest.mark.parametrize("case", [c for c, _ in CASES])
@pytest.mark.parametrize("kind", EXACT_KINDS)
def test_every_clipping_mode_is_exact_through_both_backward_paths(case, kind):
    model, losses_fn, batch = dict(CASES)[case](kind)
    assert_rule_exact(model, batch, losses_fn=losses_fn)


def test_padding_steps_do_not_change_the_private_gradient():
    """Padding every sequence further (a longer T of garbage) leaves the clipped gradient unchanged."""
    model, _, (x, lengths, y) = _regression_case("lstm")

    def valid_step_losses(model, x, lengths, y):
        valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
        return ((model(x, lengths) - y).square().sum(2) * valid).sum(1)

    R = threshold_between(model, valid_step_losses, (x, lengths, y))
    grads = per_sample_gradients(model, valid_step_losses, (x, lengths, y))
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))
    assert (norms > R * 1.01).any() and (norms < R * 0.99).any()  # some samples clipped, some kept
    g = torch.Generator().manual_seed(15)
    longer = (torch.cat([x, torch.randn(4, 3, 3, dtype=F64, generator=g)], dim=1), lengths,
              torch.cat([y, torch.randn(4, 3, 2, dtype=F64, generator=g)], dim=1))
    short, long = (clipped_gradient(model, valid_step_losses, batch, mode=DEFAULT_CLIPPING_MODE, max_grad_norm=R)
                   for batch in [(x, lengths, y), longer])
    for name, _ in model.named_parameters():
        torch.testing.assert_close(long[name], short[name], atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------- random shapes
@st.composite
def packed_batches(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(1, T), min_size=B, max_size=B))
    return B, T, torch.tensor(lengths)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(list(KINDS)), shapes=packed_batches(), num_layers=st.integers(1, 2),
       bidirectional=st.booleans(), seed=st.integers(0, 2**16))
def test_random_packed_batches_match_torch(kind, shapes, num_layers, bidirectional, seed):
    B, T, lengths = shapes
    reference, dp = make_pair(kind, num_layers=num_layers, bidirectional=bidirectional)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, 3, dtype=F64, generator=g)
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    (out_e, state_e), (out_a, state_a) = reference(packed), dp(packed)
    assert_same_outputs((out_e.data, state_e), (out_a.data, state_a))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(list(KINDS)), shapes=packed_batches(), mode=st.sampled_from(dptrain.CLIPPING_MODES),
       seed=st.integers(0, 2**16))
def test_random_packed_batches_are_clipped_exactly(kind, shapes, mode, seed):
    B, T, lengths = shapes
    torch.manual_seed(seed)
    _, dp_cls, extra = KINDS[kind]
    recurrent = dp_cls(3, 4, bidirectional=True, batch_first=True, **extra, dtype=F64)
    model = SequenceRegressor(recurrent, 2 * (recurrent.proj_size or 4)).double()
    g = torch.Generator().manual_seed(seed)
    batch = (torch.randn(B, T, 3, dtype=F64, generator=g), lengths, torch.randn(B, T, 2, dtype=F64, generator=g))
    grads = per_sample_gradients(model, sequence_losses, batch)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))
    R = float(norms.mean())  # with B = 1 or equal norms nothing is clipped: still a valid case
    assert_rule_exact(model, batch, losses_fn=sequence_losses, modes=[mode], plain_backward=False, max_grad_norm=R)
