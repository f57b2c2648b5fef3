"""The engine knows when a step's batch carries padding: attached to a fixed-shape loader, it refuses every backward of
a padded batch that comes without the batch's mask (before anything is applied, naming the call that passes it), and
the paths that carry the mask are exact. A batch without padding works on every path.

The oracle is DP's own definition: with noise 0, the clipped sums of one step on D and on D minus one sample differ
by at most R. R = 1e-3 clips every sample, so a private step moves by exactly R; counting padding rows as samples
moved it by up to 2R (the number of padding rows is K minus the real ones). The steps run through the loader, which is
what tells the engine about the padding (``dptrain.testing.neighbour_test`` attaches none); ordinary steps come first.
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from dptrain import PrivacyEngine
from dptrain.data import FixedShapeUserBatch, masked_losses, poisson_loader, split_batches
from dptrain.testing import reference_clipped_gradient
from framework_helpers import grad_norm_difference
from helpers import assert_matches

N, K, R = 8, 12, 1e-3
DOCUMENTED_CALL = "Give the mask: engine.backward(losses, mask=mask)"

PATHS = {
    "mask=": lambda engine, losses, mask: engine.backward(losses, mask=mask),
    "masked_losses": lambda engine, losses, mask: engine.backward(masked_losses(losses, mask)),
    "no mask": lambda engine, losses, mask: engine.backward(losses),
    "masked_losses scaled": lambda engine, losses, mask: engine.backward(masked_losses(losses, mask) * 1.0),
    "plain mean": lambda engine, losses, mask: losses.mean().backward(),
    "plain masked mean": lambda engine, losses, mask: masked_losses(losses, mask).mean().backward(),
}
WITH_THE_MASK = {"mask=", "masked_losses"}  # what engine.backward can see the mask of
CASES = [("bk-mixopt", path) for path in PATHS] + [("ghost", path) for path in PATHS if "plain" not in path]


def _data(n: int = N, removed: int | None = None) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
    keep = [i for i in range(n) if i != removed]
    return TensorDataset(x[keep], y[keep])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _engine(model, n, k, mode, batch_size=None, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = PrivacyEngine(model, batch_size=batch_size or n, sample_size=n, noise_multiplier=0.0, max_grad_norm=R,
                           clipping_mode=mode, max_batch_size=k, **kwargs)
    return engine, optimizer


def _run(data, path: str, *, k: int = K, mode: str = "bk-mixopt", warm: int = 2):
    """``warm`` ordinary steps through ``engine.backward(losses, mask=mask)``, then one through ``path``, on a loader
    of q = 1 (every example in every step). (The last step's clipped sum, the refusal or None.) A refused step is
    then taken the documented way: its sum shows whether anything of the refused backward stayed."""
    model, n = _model(), len(data)
    engine, optimizer = _engine(model, n, k, mode)
    loader = poisson_loader(data, batch_size=n, max_batch_size=k, steps=warm + 1, generator=torch.Generator().manual_seed(1))
    engine.attach(optimizer, data_loader=loader)
    refusal = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the sampling check: too few steps to matter here)
            for step, ((x, y), mask) in enumerate(loader):
                optimizer.zero_grad(set_to_none=True)
                if step < warm:
                    engine.backward(_losses(model, x, y), mask=mask)
                else:
                    try:
                        PATHS[path](engine, _losses(model, x, y), mask)
                    except ValueError as err:
                        refusal = str(err)
                        engine.backward(_losses(model, x, y), mask=mask)
                optimizer.step()
        return {name: p.grad * n for name, p in model.named_parameters()}, refusal
    finally:
        engine.detach()


@pytest.mark.parametrize("mode, path", CASES)
def test_a_padded_batch_is_exact_with_its_mask_and_refused_without(mode, path):
    full, full_refusal = _run(_data(), path, mode=mode)
    smaller, smaller_refusal = _run(_data(removed=3), path, mode=mode)
    if path in WITH_THE_MASK:
        assert full_refusal is None and smaller_refusal is None
    else:
        for refusal, real in ((full_refusal, N), (smaller_refusal, N - 1)):
            assert refusal is not None and DOCUMENTED_CALL in refusal, refusal
            assert f"{K} " in refusal and f"has {real} real samples" in refusal
            assert "Nothing of this backward was accumulated" in refusal
        documented, _ = _run(_data(), "mask=", mode=mode)
        assert_matches(full, documented, rtol=1e-12, what=f"{path}: the step after the refusal")
    assert grad_norm_difference(full, smaller) / R == pytest.approx(1.0, rel=1e-9)  # every sample clipped to R


@pytest.mark.parametrize("mode, path", CASES)
def test_a_batch_without_padding_works_on_every_path(mode, path):
    """K = the number of examples and q = 1: no row is padding, and every path is the oracle's clipped sum."""
    sums = []
    for data in (_data(), _data(removed=3)):
        got, refusal = _run(data, path, k=len(data), mode=mode)
        assert refusal is None, refusal
        expected = reference_clipped_gradient(_model(), _losses, data.tensors, max_grad_norm=R)
        assert_matches(got, expected, rtol=1e-9, what=path)
        sums.append(got)
    assert grad_norm_difference(*sums) / R == pytest.approx(1.0, rel=1e-9)


def _physical_run(data, paths: tuple[str, ...]):
    """One step of q = 1 over K = 12 rows, in physical batches of 4, each through one of ``PATHS``."""
    model, n = _model(), len(data)
    engine, optimizer = _engine(model, n, K, "bk-mixopt")
    loader = poisson_loader(data, batch_size=n, max_batch_size=K, steps=1, generator=torch.Generator().manual_seed(1))
    engine.attach(optimizer, data_loader=loader)
    try:
        for logical in split_batches(loader, 4):
            for ((x, y), mask), path in zip(logical, paths):
                PATHS[path](engine, _losses(model, x, y), mask)
            optimizer.step()
        return {name: p.grad * n for name, p in model.named_parameters()}
    finally:
        engine.detach()


def test_physical_batches_of_one_batch_add_up():
    """6 real rows of 12 in physical batches of 4: the first is all real and needs no mask; the second holds 2 real
    rows and 2 of padding, which no backward without the mask may take, whatever came before it."""
    paths = ("no mask", "mask=", "masked_losses")
    assert grad_norm_difference(_physical_run(_data(6), paths), _physical_run(_data(6, removed=2), paths)) / R == \
        pytest.approx(1.0, rel=1e-9)
    for first in ("no mask", "mask=", "masked_losses"):  # 4 real rows, whichever way they came
        with pytest.raises(ValueError, match="got 4 per-sample losses after 4 rows of the same batch in earlier "
                                             "backwards, but the attached loader's batch has 6 real samples"):
            _physical_run(_data(6), (first, "no mask", "mask="))


@pytest.mark.parametrize("path", ["engine", "plain"])
def test_a_model_called_on_the_real_rows_alone_needs_no_mask(path):
    """``model(x[mask])``: no padding row reaches the model, so nothing is refused, and the step is private."""
    sums = []
    for data in (_data(), _data(removed=3)):
        model = _model()
        engine, optimizer = _engine(model, len(data), K, "bk-mixopt")
        loader = poisson_loader(data, batch_size=len(data), max_batch_size=K, steps=3)
        engine.attach(optimizer, data_loader=loader)
        for (x, y), mask in loader:  # three steps
            optimizer.zero_grad(set_to_none=True)
            losses = _losses(model, x[mask], y[mask])
            engine.backward(losses) if path == "engine" else losses.mean().backward()
            optimizer.step()
        engine.detach()
        sums.append({name: p.grad * len(data) for name, p in model.named_parameters()})
    assert grad_norm_difference(*sums) / R == pytest.approx(1.0, rel=1e-9)


def test_a_loop_that_fetched_the_next_batch_first_is_refused_too():
    """The batch trained on has padding, the next one (fetched before the backward, as a prefetching loop does) none:
    the engine cannot tell which one the backward is of, and refuses."""
    def loader():  # q = 1/2 of 16 and K = 8: some draws are cut to 8 (no padding), others padded
        return poisson_loader(_data(16), batch_size=8, max_batch_size=8, steps=40,
                              generator=torch.Generator().manual_seed(3))

    masks = [mask for _, mask in loader()]
    t = next(t for t in range(1, len(masks) - 1) if not masks[t].all() and masks[t + 1].all())
    model = _model()
    engine, optimizer = _engine(model, 16, 8, "bk-mixopt", batch_size=8)
    engine.attach(optimizer, data_loader=(loader := loader()))
    fetched = iter(loader)
    for _ in range(t):  # ordinary steps, the mask given
        (x, y), mask = next(fetched)
        engine.backward(_losses(model, x, y), mask=mask)
        optimizer.step()
    (x, y), mask = next(fetched)
    next(fetched)  # the next batch: no padding
    with pytest.raises(ValueError, match=f"has {int(mask.sum())} real samples.*{re.escape(DOCUMENTED_CALL)}"):
        engine.backward(_losses(model, x, y))
    engine.backward(_losses(model, x, y), mask=mask)  # the documented call on the same batch
    engine.detach()


def _user_run(removed_user: int | None, path: str):
    """Users 0..3 with 2 examples each, q = 1, K = 6 slots of m = 2 rows: the empty slots are padding."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    users = torch.arange(8) // 2
    keep = users != (-1 if removed_user is None else removed_user)
    x, y, users = x[keep], y[keep], users[keep]
    units = len(torch.unique(users))
    model = _model()
    engine, optimizer = _engine(model, units, 6, "bk-mixopt", privacy_unit="user")
    loader = poisson_loader(TensorDataset(x, y), batch_size=units, users=users, max_examples_per_user=2,
                            max_batch_size=6, steps=2)
    engine.attach(optimizer, data_loader=loader)
    try:
        for batch in loader:
            assert isinstance(batch, FixedShapeUserBatch) and not batch.mask.all()
            (bx, by), ids, mask = batch
            optimizer.zero_grad(set_to_none=True)
            losses = _losses(model, bx, by)
            if path == "masked_losses":
                engine.backward(masked_losses(losses, mask), users=ids)
            else:
                engine.backward(losses, users=ids)
            optimizer.step()
        return {name: p.grad * units for name, p in model.named_parameters()}
    finally:
        engine.detach()


def test_user_level_fixed_shape_batches_are_exact_with_their_mask_and_refused_without():
    assert grad_norm_difference(_user_run(None, "masked_losses"), _user_run(1, "masked_losses")) / R == \
        pytest.approx(1.0, rel=1e-9)
    with pytest.raises(ValueError, match="got 12 per-sample losses, but the attached loader's batch has 8 real"):
        _user_run(None, "no mask")
