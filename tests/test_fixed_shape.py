"""Fixed-shape Poisson batches: the loader, the padding, the truncation term of the accounting, and the engine's
side of it (``PrivacyEngine(..., max_batch_size=K)``: the epsilon and report with the truncation term, calibration,
the loader and the engine agreeing on K).

Padded rows are checked against the engine as it is, through ``masked_losses``.
"""
from __future__ import annotations

import itertools
import math
import warnings
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from dptrain import PrivacyEngine, accounting
from dptrain.data import FixedShapeBatch, PoissonSampler, masked_losses, poisson_loader, split_batches
from dptrain.testing import attached_engine, clipped_gradient
from helpers import (
    MODES,
    SINGLE_BACKWARD_MODES,
    assert_matches,
    classify,
    conv_case,
    linear_case,
    tag_passes_counted,
    transformer_case,
)


class Records(Dataset):
    """(features [3], label, name): a tensor, a number and a string per example."""

    def __init__(self, n: int):
        self.x = torch.arange(1, 3 * n + 1, dtype=torch.float32).view(n, 3)  # no row is zero

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i + 1, f"ex{i}"


def _seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- the loader


def test_every_batch_has_k_rows_real_rows_first_then_zero_padding():
    data = Records(40)
    # q = 0.25 of 40 examples: draws of 0 to ~20 around 10, so K = 8 sees both truncation and padding
    loader = poisson_loader(data, sample_rate=0.25, max_batch_size=8, steps=60, generator=_seeded(1))
    assert loader.max_batch_size == 8 and loader.expected_batch_size == 10.0
    real_counts = []
    for batch in loader:
        assert isinstance(batch, FixedShapeBatch)
        (x, label, name), mask = batch
        assert x.shape == (8, 3) and label.shape == (8,) and len(name) == 8
        assert mask.dtype == torch.bool and mask.shape == (8,)
        n = int(mask.sum())
        real_counts.append(n)
        assert mask[:n].all() and not mask[n:].any()  # real rows first
        indices = (label[:n] - 1).tolist()
        assert indices == sorted(set(indices))
        assert torch.equal(x[:n], data.x[indices]) and list(name[:n]) == [f"ex{i}" for i in indices]
        assert not x[n:].any() and not label[n:].any() and list(name[n:]) == [""] * (8 - n)
    assert max(real_counts) == 8 and min(real_counts) < 8  # some draws were cut, some padded


def test_a_collator_that_pads_to_the_batchs_longest_example_gets_padding_rows_of_its_shape():
    """Dynamic padding (Hugging Face's DataCollatorWithPadding pads to the batch's longest example): each batch has its
    own sequence length, and the padding rows take it. Refused mid-run before, when a batch's length differed from
    dataset[0]'s, after steps (and privacy) were spent (an outside probe). K rows whatever the draw; a padded step
    is exact against the same step on the real rows alone."""
    lengths = [3, 7, 5, 2, 6, 4, 7, 3, 5, 6]
    examples = [torch.arange(1, n + 1) for n in lengths]

    def pad_to_longest(items):
        longest = max(len(x) for x in items)
        return torch.stack([torch.cat([x, x.new_zeros(longest - len(x))]) for x in items])

    loader = poisson_loader(examples, sample_rate=0.4, max_batch_size=6, steps=30, collate_fn=pad_to_longest,
                            generator=_seeded(3))
    widths = set()
    for ids, mask in loader:
        n = int(mask.sum())
        assert ids.shape[0] == 6 and not ids[n:].any()
        widths.add(ids.shape[1])
    assert len(widths) > 1  # (the batches' lengths differ)
    embedding = nn.EmbeddingBag(8, 2, mode="sum")
    x = torch.tensor([[1, 2, 0], [3, 0, 0]])
    losses = lambda m, ids: m(ids).square().sum(1)  # noqa: E731
    kwargs = dict(mode="bk-mixopt", max_grad_norm=0.5, batch_size=4)
    alone = clipped_gradient(embedding, losses, (x,), **kwargs)
    padded = clipped_gradient(embedding, lambda m, ids, mask: masked_losses(losses(m, ids), mask),
                              (torch.cat([x, x.new_zeros(2, 3)]), torch.arange(4) < 2), **kwargs)
    assert torch.allclose(padded["weight"], alone["weight"], rtol=1e-12, atol=0)


def test_an_empty_draw_is_all_padding():
    loader = poisson_loader(Records(5), sample_rate=1e-9, max_batch_size=3, steps=2, generator=_seeded())
    for (x, _label, name), mask in loader:
        assert x.shape == (3, 3) and not mask.any() and not x.any() and list(name) == ["", "", ""]


def test_without_max_batch_size_batches_are_as_before():
    loader = poisson_loader(Records(20), sample_rate=0.5, steps=3, generator=_seeded())
    assert loader.max_batch_size is None
    for batch in loader:
        assert not isinstance(batch, FixedShapeBatch) and len(batch) == 3


def test_inclusion_probability_is_q_when_k_is_not_binding():
    N, q, steps = 200, 0.1, 2000
    # P[Binomial(200, 0.1) > 45] < 1e-9: no draw is cut, so each example is in a batch w.p. q
    sampler = PoissonSampler(N, q, steps=steps, generator=_seeded(2), max_batch_size=45)
    counts = torch.zeros(N)
    for batch in sampler:
        assert len(batch) <= 45
        counts[batch] += 1
    sd = math.sqrt(steps * q * (1 - q))  # each example's count is Binomial(steps, q)
    assert (counts - steps * q).abs().max() < 5.5 * sd
    assert abs(counts.sum() - N * steps * q) < 5.5 * math.sqrt(N * steps * q * (1 - q))


def test_truncation_keeps_a_uniformly_random_subset():
    # q = 1: every draw is all 6 examples, cut to K = 3: each of the C(6, 3) = 20 subsets w.p. 1/20
    steps, subsets = 8000, list(itertools.combinations(range(6), 3))
    sampler = PoissonSampler(6, 1.0, steps=steps, generator=_seeded(3), max_batch_size=3)
    counts = dict.fromkeys(subsets, 0)
    for batch in sampler:
        counts[tuple(batch)] += 1  # sorted, as every batch is
    expected, sd = steps / 20, math.sqrt(steps * (1 / 20) * (19 / 20))
    assert max(abs(c - expected) for c in counts.values()) < 5.5 * sd


def test_truncation_has_no_bias_towards_any_example():
    # K = 20 binds often for Binomial(50, 0.5); every example is still in w.p. E[min(X, K)] / N
    N, q, K, steps = 50, 0.5, 20, 3000
    half = Fraction(1, 2)
    expected_rate = float(sum(math.comb(N, j) * half**N * min(j, K) for j in range(N + 1)) / N)
    sampler = PoissonSampler(N, q, steps=steps, generator=_seeded(4), max_batch_size=K)
    counts = torch.zeros(N)
    for batch in sampler:
        counts[batch] += 1
    sd = math.sqrt(steps * expected_rate * (1 - expected_rate))  # about: draws are not quite independent
    assert (counts - steps * expected_rate).abs().max() < 5.5 * sd
    assert counts[:25].sum() / counts[25:].sum() == pytest.approx(1.0, abs=0.03)


def test_checkpoint_resumes_the_same_truncated_batches_and_refuses_another_k():
    def loader(k=4):
        return poisson_loader(Records(30), sample_rate=0.3, max_batch_size=k, steps=12, generator=_seeded(5))

    full = [(b.data[1].tolist(), b.mask.tolist()) for b in loader()]
    first = loader()
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    assert state["max_batch_size"] == 4
    resumed = loader()
    resumed.load_state_dict(state)
    assert [(b.data[1].tolist(), b.mask.tolist()) for b in resumed] == full[5:]
    with pytest.raises(ValueError, match="max_batch_size=4.*max_batch_size=5"):
        loader(5).load_state_dict(state)
    untruncated = poisson_loader(Records(30), sample_rate=0.3, steps=12, generator=_seeded(5))
    with pytest.raises(ValueError, match="max_batch_size"):
        untruncated.load_state_dict(state)


def test_split_batches_cuts_the_mask_with_the_data():
    def loader():
        return poisson_loader(Records(40), sample_rate=0.25, max_batch_size=8, steps=5, generator=_seeded(6))

    for logical, whole in zip(split_batches(loader(), 4), loader()):
        assert [type(b) for b in logical] == [FixedShapeBatch, FixedShapeBatch]
        assert torch.equal(torch.cat([b.mask for b in logical]), whole.mask)
        assert torch.equal(torch.cat([b.data[0] for b in logical]), whole.data[0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        poisson_loader(Records(5), sample_rate=0.5, max_batch_size=0)
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        PoissonSampler(5, 0.5, max_batch_size=2.5)
    with pytest.raises(ValueError, match="not supported with distributed=True"):
        poisson_loader(Records(5), sample_rate=0.5, max_batch_size=2, distributed=True, num_replicas=1, rank=0)
    ragged = [torch.zeros(2), torch.zeros(3)]
    loader = poisson_loader(ragged, sample_rate=1.0, max_batch_size=3, steps=1,
                            collate_fn=lambda items: torch.stack(items[:1]))
    with pytest.raises(ValueError, match="collate_fn made 1 rows of 2 examples"):
        next(iter(loader))


def test_masked_losses():
    losses = torch.tensor([[1.0, 2.0], [float("nan"), float("inf")], [3.0, 4.0]], requires_grad=True)
    mask = torch.tensor([True, False, True])
    out = masked_losses(losses, mask)
    assert torch.equal(out, torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]]))
    out.sum().backward()
    assert torch.equal(losses.grad, torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]))
    with pytest.raises(ValueError, match="boolean"):
        masked_losses(losses, mask.float())
    with pytest.raises(ValueError, match="one row per row of the batch"):
        masked_losses(torch.zeros(2), mask)


# ------------------------------------------------------- padded rows through the engine (as it is)


def _padded(batch: tuple, extra: int) -> tuple:
    """The batch with ``extra`` zero rows appended, and its mask as the last element."""
    B = batch[0].shape[0]
    padded = tuple(torch.cat([t, torch.zeros((extra, *t.shape[1:]), dtype=t.dtype)]) for t in batch)
    return (*padded, torch.arange(B + extra) < B)


CASES = {
    "linear": lambda: linear_case(0, token_dims=1),
    "conv": lambda: conv_case(1, ndim=2),
    "transformer": lambda: transformer_case(2),
}


@pytest.mark.parametrize("case_name", sorted(CASES))
@pytest.mark.parametrize("mode, path", [(m, "engine") for m in MODES] + [(m, "mean") for m in SINGLE_BACKWARD_MODES])
def test_padded_rows_contribute_nothing_to_the_clipped_sum(float64, mode, case_name, path):
    """engine.backward(masked_losses(...)) of a padded batch, or a plain backward of their mean over
    all rows, gives the clipped sum of the real rows alone (noise 0)."""
    case = CASES[case_name]()
    kwargs = dict(mode=mode, max_grad_norm=0.5, batch_size=4, path=path)  # noise 0: p.grad = clipped sum / 4
    plain = clipped_gradient(case.model, case.losses_fn, case.batch, **kwargs)
    padded = _padded(case.batch, 3)

    def masked(model, *batch):
        return masked_losses(case.losses_fn(model, *batch[:-1]), batch[-1])

    got = clipped_gradient(case.model, masked, padded, **kwargs)
    assert_matches(got, plain, rtol=1e-12, what=mode)  # the same up to summation order: float64 rounding only


@pytest.mark.parametrize("case_name", sorted(CASES))
@pytest.mark.parametrize("mode", MODES)
def test_a_mask_given_to_the_engine_is_exact_and_proven_from_the_graph(float64, mode, case_name):
    """engine.backward(losses, mask=mask): the padded rows count as 0, as with masked_losses; the masked losses'
    graph is proven (no tag pass) at every step, the second one's from the memo (but for the convolutions' circular
    padding, whose in-place copies into slices no rule opens: read by tag passes at every step)."""
    case = CASES[case_name]()
    plain = clipped_gradient(case.model, case.losses_fn, case.batch, mode=mode, max_grad_norm=0.5)
    *padded, mask = _padded(case.batch, 3)
    engine, optimizer = attached_engine(case.model, mode=mode, max_grad_norm=0.5)
    try:
        with tag_passes_counted() as passes:
            for _ in range(2):
                engine.backward(case.losses_fn(case.model, *padded), mask=mask)
                optimizer.step()
                got = {n: p.grad.clone() for n, p in case.model.named_parameters()}
                optimizer.zero_grad()
        assert bool(passes) == (case_name == "conv")
        assert engine._rows.proofs.reused >= 1
    finally:
        engine.detach()
    assert_matches(got, plain, rtol=1e-12, what=mode)


@pytest.mark.parametrize("fill", ["sentinel", "nan", "inf"])
@pytest.mark.parametrize("case_name", sorted(CASES))
@pytest.mark.parametrize("mode", MODES)
def test_padded_rows_count_for_nothing_whatever_they_hold(float64, mode, case_name, fill):
    """Padded rows holding a mask sentinel (float32's lowest value), NaN or inf, given to the engine with their
    mask, over two steps: exact, as if they held zeros (they are zeroed before any norm is formed; a Gram of the
    sentinel overflowed, and 0 times NaN is NaN)."""
    value = {"sentinel": torch.finfo(torch.float32).min, "nan": float("nan"), "inf": float("inf")}[fill]
    case = CASES[case_name]()
    plain = clipped_gradient(case.model, case.losses_fn, case.batch, mode=mode, max_grad_norm=0.5)
    *padded, mask = _padded(case.batch, 3)
    padded = [t.masked_fill((~mask).reshape(-1, *([1] * (t.dim() - 1))), value) if t.is_floating_point() else t
              for t in padded]
    engine, optimizer = attached_engine(case.model, mode=mode, max_grad_norm=0.5)
    try:
        for _ in range(2):
            optimizer.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine.backward(case.losses_fn(case.model, *padded), mask=mask)
            optimizer.step()
            got = {n: p.grad.clone() for n, p in case.model.named_parameters()}
            assert_matches(got, plain, rtol=1e-12, what=f"{mode}, {fill}")
    finally:
        engine.detach()


def test_padded_rows_are_not_counted_as_samples(float64):
    # Division by the expected batch size, never by rows: a batch of 1 real row and 5 padded rows
    # gives the same gradient as the real row alone.
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(1, 3), torch.tensor([1])
    kwargs = dict(mode="bk-mixopt", max_grad_norm=10.0, batch_size=7)
    alone = clipped_gradient(model, classify, (x, y), **kwargs)
    padded = clipped_gradient(model, lambda m, x, y, mask: masked_losses(classify(m, x, y), mask),
                        _padded((x, y), 5), **kwargs)
    expected = torch.autograd.grad(F.cross_entropy(model(x), y), model.weight)[0] / 7
    assert torch.allclose(alone["weight"], expected, rtol=1e-12, atol=0)
    for name in alone:  # zero rows add exact zeros; only the summation order may differ
        assert torch.allclose(padded[name], alone[name], rtol=1e-12, atol=0)


def test_batches_drawn_through_another_loader_need_their_mask():
    """A DataLoader built on the attached loader's sampler (as ``accelerator.prepare`` builds one) draws batches the
    attached loader never handed out: the engine cannot tell their padding rows without the mask, and clipped them as
    samples (1.7 R, silent; an outside probe). A backward without the mask is refused, as is the same through the
    attached loader; with the mask the step is taken; after the attached loader draws again, its own record counts."""
    torch.manual_seed(0)
    n, K = 12, 10
    data = TensorDataset(torch.randn(n, 3), torch.randint(0, 2, (n,)))
    loader = poisson_loader(data, sample_rate=0.5, max_batch_size=K, generator=torch.Generator().manual_seed(1))
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine(model, batch_size=6, sample_size=n, noise_multiplier=1.0, max_grad_norm=1.0,
                           max_batch_size=K).attach(optimizer, data_loader=loader)
    try:
        (x, y), mask = next(iter(torch.utils.data.DataLoader(data, batch_sampler=loader.batch_sampler,
                                                             collate_fn=loader.collate_fn)))
        assert not mask.all()  # (padding rows: K exceeds every draw of 12 examples at q = 0.5 in this seed)
        with pytest.raises(ValueError, match="drawn through another DataLoader .* Give the mask: engine.backward"):
            engine.backward(classify(model, x, y))
        with pytest.raises(ValueError, match="drawn through another DataLoader"):
            F.cross_entropy(model(x), y).backward()
        assert model.weight.grad is None
        engine.backward(masked_losses(classify(model, x, y), mask), mask=mask)
        optimizer.step()
        optimizer.zero_grad()
        assert engine.steps_taken == 1
        (x, y), mask = next(iter(loader))
        with pytest.raises(ValueError, match=f"batch has {int(mask.sum())} real samples"):
            engine.backward(classify(model, x, y))
    finally:
        engine.detach()


# ---------------------------------------------------------------------------- torch.compile


def test_fixed_shapes_compile_once_and_poisson_batches_recompile():
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))

    def run(**loader_kwargs) -> int:
        torch._dynamo.reset()
        compiles.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))

        @torch.compile(backend=counting_backend, dynamic=False)
        def step_losses(x, y, mask):
            return masked_losses(F.cross_entropy(model(x), y, reduction="none"), mask)

        loader = poisson_loader(data, batch_size=16, steps=6, generator=_seeded(7), **loader_kwargs)
        sizes = set()
        for batch in loader:
            if isinstance(batch, FixedShapeBatch):
                (x, y), mask = batch
            else:
                (x, y), mask = batch, torch.ones(len(batch[0]), dtype=torch.bool)
            sizes.add(len(x))
            step_losses(x, y, mask).sum().backward()
        return len(compiles), len(sizes)

    fixed, fixed_sizes = run(max_batch_size=24)
    assert (fixed, fixed_sizes) == (1, 1)
    variable, variable_sizes = run()
    assert variable_sizes > 1 and variable == variable_sizes  # one compilation per batch size
    torch._dynamo.reset()


# ------------------------------------------------------------------------------- accounting


def _exact_tail(n: int, q: Fraction, k: int) -> float:
    """P[Binomial(n, q) >= k], exactly (then rounded)."""
    return float(sum(math.comb(n, j) * q**j * (1 - q) ** (n - j) for j in range(k, n + 1)))


@pytest.mark.parametrize("n", [1, 7, 60, 250])
@pytest.mark.parametrize("q", [Fraction(1, 1000), Fraction(1, 20), Fraction(3, 10), Fraction(9, 10)])
def test_truncation_delta_is_the_binomial_tail_times_steps(n, q):
    for k in sorted({1, 2, n // 4, n // 2, int(n * q) + 1, int(n * q) + 5, n - 1, n, n + 1} - {0}):
        exact = _exact_tail(n, q, k)
        got = accounting.truncation_delta(n, float(q), k, 1)
        assert exact <= got * (1 + 1e-14) and got <= exact * (1 + 1e-9) + 1e-300, (n, q, k, got, exact)
        assert accounting.truncation_delta(n, float(q), k, 100) == pytest.approx(min(1.0, 100 * got), rel=1e-12)


def test_truncation_delta_edges_and_large_datasets():
    assert accounting.truncation_delta(100, 0.1, 101, 10**6) == 0.0  # K > N: never truncates
    # K = N truncates a neighbour with N + 1 examples when all N are drawn
    assert accounting.truncation_delta(100, 0.5, 100, 1) == pytest.approx(0.5**100, rel=1e-9)
    assert accounting.truncation_delta(100, 0.1, 5, 0) == 0.0
    assert accounting.truncation_delta(100, 1.0, 100, 1) == 1.0
    assert accounting.truncation_delta(100, 0.5, 1, 10) == 1.0  # capped
    # tails far below the smallest float round up, not to 0
    assert 0.0 < accounting.truncation_delta(10**6, 1e-6, 501, 1) < 1e-300
    # A billion examples, expected batch 10^6: fast, and decreasing in K
    tails = [accounting.truncation_delta(10**9, 1e-3, 10**6 + 1 + s * 1000, 1) for s in (0, 2, 4, 6)]
    assert 0.4 < tails[0] < 0.6 and tails == sorted(tails, reverse=True) and tails[-1] < 1e-8
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        accounting.truncation_delta(100, 0.1, 0, 1)
    with pytest.raises(ValueError, match="steps must be an integer >= 0"):
        accounting.truncation_delta(100, 0.1, 5, -1)


@pytest.mark.parametrize("n, q, delta, steps", [
    (60_000, 256 / 60_000, 1e-5, 2_345),  # MNIST-like
    (1_437, 256 / 1_437, 1e-5, 90),       # dptrain train's default run
    (50, 0.5, 0.01, 1),
    (10**9, 1e-4, 1e-10, 10**5),
])
def test_default_max_batch_size_is_the_smallest_k_within_a_tenth_of_delta(n, q, delta, steps):
    k = accounting.default_max_batch_size(n, q, delta, steps)
    assert accounting.truncation_delta(n, q, k, steps) <= delta / 10
    assert k == 1 or accounting.truncation_delta(n, q, k - 1, steps) > delta / 10
    assert k > n * q  # never below the expected batch size
    assert accounting.poisson_delta(delta, n, q, k, steps) >= 0.9 * delta


def test_poisson_delta_and_epsilon_with_truncation():
    n, q, steps, delta = 10_000, 0.01, 500, 1e-5
    k = 140  # P[Binomial(10^4, 0.01) > 140] ~ 1e-4: far too often for this delta
    assert accounting.poisson_delta(delta, n, q, None, steps) == delta
    with pytest.raises(ValueError, match=r"max_batch_size=140 truncates too often.*max_batch_size >= \d+"):
        accounting.poisson_delta(delta, n, q, k, steps)
    with pytest.raises(ValueError, match="truncates too often"):
        accounting.compute_epsilon(1.0, q, steps, delta, sample_size=n, max_batch_size=k)
    with pytest.raises(ValueError, match="max_batch_size needs sample_size"):
        accounting.compute_epsilon(1.0, q, steps, delta, max_batch_size=k)

    k = accounting.default_max_batch_size(n, q, delta, steps)
    left = accounting.poisson_delta(delta, n, q, k, steps)
    assert left == delta - accounting.truncation_delta(n, q, k, steps)
    truncated = accounting.compute_epsilon(1.0, q, steps, delta, sample_size=n, max_batch_size=k)
    assert truncated == accounting.compute_epsilon(1.0, q, steps, left)
    assert truncated >= accounting.compute_epsilon(1.0, q, steps, delta)  # the price of fixed shapes
    sigma = accounting.calibrate_noise_multiplier(2.0, delta, q, steps, sample_size=n, max_batch_size=k)
    assert 0.99 * 2.0 <= accounting.compute_epsilon(sigma, q, steps, left) <= 2.0
    assert sigma >= accounting.calibrate_noise_multiplier(2.0, delta, q, steps)


# ---------------------------------------------------------------------------- the engine (max_batch_size=K)
SAMPLES, BATCH = 1_000, 50
RATE = BATCH / SAMPLES


def _linear():
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def _examples():
    return TensorDataset(torch.randn(SAMPLES, 4), torch.randint(0, 3, (SAMPLES,)))


def test_epsilon_and_report_include_the_truncation_term():
    k = accounting.default_max_batch_size(SAMPLES, RATE, 1e-5, 20)
    model = _linear()
    engine = PrivacyEngine(model, batch_size=BATCH, sample_size=SAMPLES, noise_multiplier=1.0, max_batch_size=k)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = poisson_loader(_examples(), batch_size=BATCH, max_batch_size=k, steps=20,
                            generator=torch.Generator().manual_seed(0))
    engine.attach(optimizer, data_loader=loader)
    for (x, y), mask in loader:
        engine.backward(masked_losses(F.cross_entropy(model(x), y, reduction="none"), mask))
        optimizer.step()
        optimizer.zero_grad()
    assert engine.steps_taken == 20 and engine.max_batch_size == k
    expected = accounting.compute_epsilon(1.0, RATE, 20, 1e-5, sample_size=SAMPLES, max_batch_size=k)
    assert engine.get_epsilon(1e-5) == pytest.approx(expected, rel=1e-9)
    assert engine.get_epsilon(1e-5) > accounting.compute_epsilon(1.0, RATE, 20, 1e-5)
    report = engine.privacy_report(1e-5)
    assert report["max_batch_size"] == k
    assert report["truncation_delta"] == accounting.truncation_delta(SAMPLES, RATE, k, 20)
    assert report["epsilon"] == pytest.approx(expected, rel=1e-9)


def test_calibration_leaves_the_truncation_term_out_of_the_accountants_delta():
    k = accounting.default_max_batch_size(SAMPLES, RATE, 1e-5, 100)
    engine = PrivacyEngine(_linear(), batch_size=BATCH, sample_size=SAMPLES, target_epsilon=2.0, steps=100,
                           max_batch_size=k, target_delta=1e-5)
    assert engine.noise_multiplier == accounting.calibrate_noise_multiplier(
        2.0, 1e-5, RATE, 100, sample_size=SAMPLES, max_batch_size=k)
    plain = PrivacyEngine(_linear(), batch_size=BATCH, sample_size=SAMPLES, target_epsilon=2.0, steps=100,
                          target_delta=1e-5)
    assert engine.noise_multiplier >= plain.noise_multiplier


def test_without_max_batch_size_nothing_changes():
    engine = PrivacyEngine(_linear(), batch_size=BATCH, sample_size=SAMPLES, noise_multiplier=1.0)
    assert engine.max_batch_size is None
    report = engine.privacy_report()
    assert report["max_batch_size"] is None and report["truncation_delta"] == 0.0


def test_loader_and_engine_must_agree_on_k():
    data = _examples()
    for engine_k, loader_k in [(60, 70), (None, 70), (60, None)]:
        model = _linear()
        engine = PrivacyEngine(model, batch_size=BATCH, sample_size=SAMPLES, noise_multiplier=1.0,
                               max_batch_size=engine_k)
        loader = poisson_loader(data, batch_size=BATCH, max_batch_size=loader_k)
        with pytest.raises(ValueError, match="max_batch_size"):
            engine.attach(torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader)


def test_bad_max_batch_size_values():
    for bad in (0, -3, 2.5, True, "64"):
        with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
            PrivacyEngine(_linear(), batch_size=BATCH, sample_size=SAMPLES, noise_multiplier=1.0, max_batch_size=bad)
    with pytest.raises(ValueError, match="truncates too often"):  # calibration: no delta left for the accountant
        PrivacyEngine(_linear(), batch_size=BATCH, sample_size=SAMPLES, target_epsilon=2.0, steps=100,
                      max_batch_size=BATCH)
