"""The sampling check (dptrain.sampling): the samples the engine counts at each step, tested against Poisson sampling
at the accounted rate q.

The statistics first, on simulated batch sizes (cheap, many runs): the thresholds' false-alarm rate is at most their
alpha (measured at loose alphas, where it can be measured) and not vacuously below it; no honest run warns at the
chosen threshold; a 1.3x drift and fixed-size batches are found within 50 steps. Then whole engines: the issue's
rows (a 1.9x larger loader mid-run, a shuffling DataLoader only iterated), honest loaders that never warn, and what
is counted: micro-batches, empty batches, zero_grad(), fixed-shape batches (with and without their mask), users.
"""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.data import poisson_loader, split_batches
from dptrain.privacy.sampling import CHECK_EVERY, WINDOWS, PoissonTest, SamplesPerStep, SamplingMismatch

CONFIGS = [  # (sample_size, expected batch size, max_batch_size)
    (10_000, 1, None), (10_000, 4, None), (6_400, 64, None), (1_000, 500, None), (50, 49, None), (60_000, 256, 270),
]


def _first_alarms(test: PoissonTest, runs: np.ndarray, kinds=("mean-high", "variance-low", "mean-low")) -> np.ndarray:
    """For each run (a row of per-step counts): the step at whose check (every CHECK_EVERY steps, over WINDOWS) a
    test first rejects, or inf; vectorized over runs, with the thresholds PoissonTest.verdict uses."""
    count, steps = runs.shape
    first = np.full(count, np.inf)
    cumulative = np.concatenate([np.zeros((count, 1)), np.cumsum(runs, 1)], 1)
    for t in range(CHECK_EVERY, steps + 1, CHECK_EVERY):
        for window in WINDOWS:
            if window > t:
                break
            high, low, low_squares = test.thresholds(window)
            total = cumulative[:, t] - cumulative[:, t - window]
            recent = runs[:, t - window:t]
            squares = ((recent[:, 0::2] - recent[:, 1::2]) ** 2).sum(1)
            hit = np.zeros(count, bool)
            if high is not None and "mean-high" in kinds:
                hit |= total >= high
            if low is not None and "mean-low" in kinds:
                hit |= total <= low
            if low_squares is not None and "variance-low" in kinds:
                hit |= squares <= low_squares
            first = np.where(np.isinf(first) & hit, t, first)
    return first


def _poisson(rng, n, q, k, shape) -> np.ndarray:
    counts = rng.binomial(n, q, size=shape).astype(np.float64)
    return np.minimum(counts, k) if k is not None else counts


# --------------------------------------------------------------------------- the statistics
@pytest.mark.parametrize("n,b,k", CONFIGS)
def test_each_threshold_rejects_honest_windows_at_most_alpha_of_the_time(n, b, k):
    """Chernoff thresholds are upper bounds on the tail: at alpha = 1e-2 the measured rate is below alpha, yet not
    vacuously (above alpha / 50: the bound is loose by a factor of about 3-10, not by orders of magnitude)."""
    rng = np.random.default_rng(0)
    runs = 40_000
    for alpha in (1e-2, 1e-3):
        test = PoissonTest(n, b / n, k, alpha=alpha)
        for window in (10, 40):
            high, low, low_squares = test.thresholds(window)
            counts = _poisson(rng, n, b / n, k, (runs, window))
            total, squares = counts.sum(1), ((counts[:, 0::2] - counts[:, 1::2]) ** 2).sum(1)
            for name, threshold, statistic, sign in (("high", high, total, 1), ("low", low, total, -1),
                                                     ("variance", low_squares, squares, -1)):
                if threshold is None:  # no window of this length is that unlikely (e.g. b = 1: e^-10 empty ones)
                    continue
                rate = float((sign * statistic >= sign * threshold).mean())
                slack = 4 * np.sqrt(alpha / runs)  # four standard errors of the measured rate
                assert rate <= alpha + slack, (alpha, window, name, rate)
                if alpha == 1e-2:
                    assert rate >= alpha / 50, (alpha, window, name, rate)


@pytest.mark.parametrize("n,b,k", CONFIGS)
def test_no_honest_run_warns_at_the_chosen_threshold(n, b, k):
    """2,000 runs of 400 Poisson steps: not one alarm at ALPHA = 1e-9 (the bound: 3 x 8 x 1e-9 per check)."""
    rng = np.random.default_rng(1)
    test = PoissonTest(n, b / n, k)
    first = _first_alarms(test, _poisson(rng, n, b / n, k, (2_000, 400)))
    assert np.isinf(first).all(), first[np.isfinite(first)]


@pytest.mark.parametrize("b", [32, 64, 256])
def test_a_1_3x_larger_sampling_rate_is_found_within_50_steps(b):
    n, change = 100 * b, 35  # the drift starts in the middle of a check period
    rng = np.random.default_rng(2)
    runs = np.concatenate([_poisson(rng, n, b / n, None, (300, change)),
                           _poisson(rng, n, 1.3 * b / n, None, (300, 60))], 1)
    delay = _first_alarms(PoissonTest(n, b / n), runs) - change
    assert (delay > 0).all() and (delay <= 50).all(), np.unique(delay)


@pytest.mark.parametrize("b", [1, 4, 64, 256])
@pytest.mark.parametrize("remainder", [None, 0.5])
def test_fixed_size_batches_are_found_within_50_steps(b, remainder):
    """Every batch of b samples, also with a smaller last batch per epoch (DataLoader(drop_last=False))."""
    n = 100 * b + (int(remainder * b) if remainder else 0)
    epoch = [float(b)] * 100 + ([float(int(remainder * b))] if remainder and int(remainder * b) else [])
    runs = np.array([(epoch * 3)[:200]])
    first = _first_alarms(PoissonTest(n, b / n), runs, kinds=("variance-low",))
    assert first[0] <= 50


def test_the_verdict_names_the_window_and_both_numbers():
    n, b = 6_400, 64
    test = PoissonTest(n, b / n)
    rng = np.random.default_rng(3)
    honest = list(_poisson(rng, n, b / n, None, 30))
    assert test.verdict(honest) is None
    found = test.verdict(honest + [float(b)] * 20)  # fixed-size batches
    assert found.kind == "variance-low" and found.steps == 20 and found.variance == 0.0
    assert found.expected_mean == pytest.approx(64.0) and found.expected_variance == pytest.approx(64 * 0.99)
    found = test.verdict(honest + list(_poisson(rng, n, 1.9 * b / n, None, 10)))
    assert found.kind == "mean-high" and found.steps == 10 and 1.6 < found.mean / b < 2.2
    found = test.verdict(list(_poisson(rng, n, b / n / 2, None, 40)))
    assert found.kind == "mean-low" and not found.understates_epsilon
    # larger batches take precedence over smaller ones: they understate epsilon
    assert test.verdict([32.0] * 30 + [64.0] * 10).kind == "variance-low"


def _feed(counter: SamplesPerStep, step_counts, micro_batches: int = 1, total=None) -> list:
    """One step per count, its samples split into ``micro_batches`` backwards; the findings returned."""
    found = []
    for count in step_counts:
        for k in range(micro_batches):
            counter.add_backward(int(count) // micro_batches + (1 if k < int(count) % micro_batches else 0))
        found.append(counter.end_step(total))
    return [f for f in found if f is not None]


def test_the_counter_sums_micro_batches_and_ranks_and_stops_after_an_understated_epsilon():
    n, micro, accumulated = 60_000, 64, 4
    rng = np.random.default_rng(4)
    counter = SamplesPerStep(micro, micro / n)  # the micro-batch size given as batch_size
    assert _feed(counter, _poisson(rng, n, micro * accumulated / n, None, 9), accumulated) == []  # no verdict yet
    found = _feed(counter, _poisson(rng, n, micro * accumulated / n, None, 1), accumulated)
    assert [f.kind for f in found] == ["mean-high"] and 3.5 < found[0].mean / micro < 4.5
    assert _feed(counter, _poisson(rng, n, micro * accumulated / n, None, 50), accumulated) == []  # said once
    # two ranks, each counting its own half of a logical batch of 256: summed, they are honest
    mine, other = (list(_poisson(rng, n // 2, 256 / n, None, 100)) for _ in range(2))
    position = 0

    def total(values):  # what DataParallel.total does: the ranks' [rows, real, unknown] of each step, summed
        nonlocal position
        out = list(values)
        for k in range(0, len(values), 3):
            out[k] += other[position]
            out[k + 1] += other[position]
            position += 1
        return out

    assert _feed(SamplesPerStep(256, 256 / n, ranks=2), mine, total=total) == []
    counter = SamplesPerStep(256, 256 / n, ranks=2)  # one rank's counts alone: too few per step
    assert [f.kind for f in _feed(counter, mine)] == ["mean-low"]


def test_fixed_shape_batches_are_tested_on_their_real_counts_only():
    n, b, k = 1_000, 40, 60
    rng = np.random.default_rng(5)
    # with their masks: the real counts of honest truncated Poisson batches pass, fixed ones do not
    counter = SamplesPerStep(b, b / n, max_batch_size=k)
    for count in _poisson(rng, n, b / n, k, 100):
        with counter.real_count(int(count)):
            counter.add_backward(k)
        assert counter.end_step() is None
    counter = SamplesPerStep(b, b / n, max_batch_size=k)
    found = []
    for _ in range(40):
        with counter.real_count(b):
            counter.add_backward(k)
        found.append(counter.end_step())
    assert [f.kind for f in found if f] == ["variance-low"]
    # without: K rows per step (padding included) cannot be tested, but more than K rows is several batches a step
    counter = SamplesPerStep(b, b / n, max_batch_size=k)
    assert _feed(counter, [k] * 100) == []
    assert [f.kind for f in _feed(counter, [2 * k] * 10)] == ["rows-beyond-max-batch-size"]


# --------------------------------------------------------------------------- whole engines
N, B = 400, 20  # q = 0.05: Poisson batches of 20 +- 4.4


def _dataset(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _setup(mode="bk-mixopt", batch_size=B, sample_size=N, **kw):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = dptrain.PrivacyEngine(model, batch_size=batch_size, sample_size=sample_size, noise_multiplier=0.0,
                                   clipping_mode=mode, **kw)
    return model, optimizer, engine


def _train(engine, model, optimizer, batches, path="engine", until_warned=False) -> list[tuple[int, str]]:
    """One step per batch; the (step number, message) of every sampling warning."""
    seen = []
    for x, y in batches:
        if until_warned and seen:
            break
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = F.cross_entropy(model(x), y, reduction="none")
            engine.backward(losses) if path == "engine" else losses.mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        seen += [(engine.steps_taken, str(w.message)) for w in caught if "Poisson" in str(w.message)]
    return seen


def _epochs(loader, count):
    for _ in range(count):
        yield from loader


PATHS = [("bk-mixopt", "engine"), ("bk-mixopt", "plain"), ("ghost", "engine")]


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_shuffling_loader_only_iterated_warns_at_step_20_naming_both_numbers_and_the_fix(mode, path):
    """The issue's row: an ordinary shuffled DataLoader, not given to attach, every batch exactly B samples."""
    model, optimizer, engine = _setup(mode)
    engine.attach(optimizer)
    loader = DataLoader(_dataset(), batch_size=B, shuffle=True)
    seen = _train(engine, model, optimizer, _epochs(loader, 3), path)
    assert [step for step, _ in seen] == [20]  # the first check whose window can tell; said once
    message = seen[0][1]
    assert "their variance is 0 " in message and "variance B(1 - q) = 19" in message and "20.0 ± 4.4" in message
    assert "poisson_loader(dataset, batch_size=20)" in message and "data_loader=loader" in message
    assert "training goes on" in message


@pytest.mark.parametrize("mode,path", PATHS)
def test_a_strict_budget_refuses_the_steps_after_fixed_size_batches_are_found(mode, path):
    model, optimizer, engine = _setup(mode, budget="strict")
    engine.attach(optimizer)
    batches = list(DataLoader(_dataset(), batch_size=B, shuffle=True))
    seen = _train(engine, model, optimizer, batches[:20], path)
    assert [step for step, _ in seen] == [20] and "the next steps are refused" in seen[0][1]
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in batches[:2]:  # refused, and again: the verdict stands
        losses = F.cross_entropy(model(x), y, reduction="none")
        engine.backward(losses) if path == "engine" else losses.mean().backward()
        with pytest.raises(SamplingMismatch, match=r"vary far less than Poisson.*nothing was applied"):
            optimizer.step()
        optimizer.zero_grad()
    assert engine.steps_taken == 20
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("budget", ["warn", "strict"])
def test_a_new_loader_with_a_1_9x_batch_size_mid_run_is_found_within_20_steps(budget):
    """The issue's row: a second poisson_loader of 1.9x the batch size, iterated on the same engine. (Loaders only
    iterated: with the first one attached, the engine refuses a batch larger than that loader's.)"""
    model, optimizer, engine = _setup(budget=budget)
    first = poisson_loader(_dataset(), batch_size=B, generator=torch.Generator().manual_seed(1))
    engine.attach(optimizer)
    assert _train(engine, model, optimizer, _epochs(first, 2)) == []  # 40 honest steps
    larger = poisson_loader(_dataset(), batch_size=38, generator=torch.Generator().manual_seed(2))
    steps = _epochs(larger, 3)
    seen = _train(engine, model, optimizer, (next(steps) for _ in range(20)), until_warned=True)
    assert len(seen) == 1 and 40 < seen[0][0] <= 60
    ratio = float(re.search(r"about ([\d.]+)x too small", seen[0][1])[1])
    assert 1.5 < ratio < 2.3
    if budget == "strict":
        x, y = next(steps)
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
        with pytest.raises(SamplingMismatch, match="larger batch size than batch_size=20"):
            optimizer.step()


@pytest.mark.parametrize("mode,path", PATHS)
def test_honest_poisson_loaders_never_warn(mode, path):
    """100 steps each: examples (micro-batches of at most 8 through split_batches, an expected batch of 1 with
    its many empty batches), fixed-shape batches with their masks, and users."""
    dataset = _dataset()
    runs = [(B, poisson_loader(dataset, batch_size=B, steps=100, generator=torch.Generator().manual_seed(3)), 8),
            (1, poisson_loader(dataset, batch_size=1, steps=100, generator=torch.Generator().manual_seed(4)), None)]
    for batch_size, loader, physical in runs:
        model, optimizer, engine = _setup(mode, batch_size=batch_size)
        engine.attach(optimizer, data_loader=loader)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for logical in split_batches(loader, physical) if physical else ([batch] for batch in loader):
                for x, y in logical:
                    losses = F.cross_entropy(model(x), y, reduction="none")
                    engine.backward(losses) if path == "engine" else losses.sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        assert engine.steps_taken == 100 and not engine._runner.samples_per_step.warned
    if path == "plain":
        return  # (fixed-shape masks and user ids go through engine.backward)
    k = 40
    loader = poisson_loader(dataset, batch_size=B, steps=100, max_batch_size=k, generator=torch.Generator().manual_seed(5))
    model, optimizer, engine = _setup(mode, max_batch_size=k)
    engine.attach(optimizer, data_loader=loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for (x, y), mask in loader:
            engine.backward(F.cross_entropy(model(x), y, reduction="none"), mask=mask)
            optimizer.step()
            optimizer.zero_grad()
    assert not engine._runner.samples_per_step.warned
    users = torch.arange(N) // 4  # 100 users of 4 examples
    loader = poisson_loader(dataset, batch_size=10, steps=100, users=users, generator=torch.Generator().manual_seed(6))
    model, optimizer, engine = _setup(mode, batch_size=10, sample_size=100, privacy_unit="user")
    engine.attach(optimizer, data_loader=loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for (x, y), ids in loader:
            engine.backward(F.cross_entropy(model(x), y, reduction="none"), users=ids)
            optimizer.step()
            optimizer.zero_grad()
    assert not engine._runner.samples_per_step.warned


def test_a_fixed_number_of_users_per_step_is_found():
    model, optimizer, engine = _setup(batch_size=10, sample_size=100, privacy_unit="user")
    engine.attach(optimizer)
    x, y = _dataset()[:40]
    seen = []
    for _ in range(40):  # 10 users of 4 rows, every step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.backward(F.cross_entropy(model(x), y, reduction="none"), users=torch.arange(40) // 4)
            optimizer.step()
        seen += [(engine.steps_taken, str(w.message)) for w in caught if "Poisson" in str(w.message)]
    assert len(seen) == 1 and seen[0][0] <= 40 and "mean 10.0 per step" in seen[0][1]


def test_batches_discarded_by_zero_grad_are_not_counted():
    """A backward, zero_grad(), then the step's backward of the same batch: it counts once (else 2x the samples)."""
    for discard in (True, False):
        model, optimizer, engine = _setup()
        engine.attach(optimizer)
        loader = poisson_loader(_dataset(), batch_size=B, steps=40, generator=torch.Generator().manual_seed(7))
        seen = []
        for x, y in loader:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.backward(F.cross_entropy(model(x), y, reduction="none"))
                if discard:
                    optimizer.zero_grad()
                engine.backward(F.cross_entropy(model(x), y, reduction="none"))
                optimizer.step()
                optimizer.zero_grad()
            seen += [str(w.message) for w in caught if "Poisson" in str(w.message)]
        if discard:
            assert seen == []
        else:
            assert len(seen) == 1 and 1.8 < float(re.search(r"about ([\d.]+)x too small", seen[0])[1]) < 2.2


def test_fixed_shape_batches_count_their_real_rows_through_the_mask():
    k = 40
    model, optimizer, engine = _setup(max_batch_size=k)
    engine.attach(optimizer)
    x, y = _dataset()[:k]
    mask = torch.arange(k) < B  # always B real rows: fixed-size batches padded to K
    seen = []
    for _ in range(30):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.backward(F.cross_entropy(model(x), y, reduction="none"), mask=mask)
            optimizer.step()
        seen += [str(w.message) for w in caught if "Poisson" in str(w.message)]
    assert len(seen) == 1 and "their variance is 0 " in seen[0]
    # without the mask the engine sees K rows and cannot test the sampling; two batches per step are still found
    model, optimizer, engine = _setup(max_batch_size=k)
    engine.attach(optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(20):
            for _ in range(1 if step < 10 else 2):
                engine.backward(dptrain.data.masked_losses(F.cross_entropy(model(x), y, reduction="none"), mask))
            optimizer.step()
    seen = [str(w.message) for w in caught if "rows" in str(w.message)]
    assert len(seen) == 1 and "a step received 80 rows, more than max_batch_size=40" in seen[0]
