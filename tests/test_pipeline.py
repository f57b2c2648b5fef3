"""The clipping arithmetic and the step's sums on their own, without a model."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dptrain.core.pipeline import StepSums, clipping_factors_by_group


def test_factors_from_group_norms():
    sq = [torch.tensor([0.25, 4.0, 0.0]), torch.tensor([1.0, 0.0, 9.0])]
    factors, finite = clipping_factors_by_group(sq, 3, scale=1.0, threshold=1.0, fn="abadi", gamma=0.01)
    assert finite
    torch.testing.assert_close(factors[0], torch.tensor([1.0, 0.5, 1.0]))
    torch.testing.assert_close(factors[1], torch.tensor([1.0, 1.0, 1 / 3]))


def test_the_scale_multiplies_the_norms_before_clipping():
    # A mean loss over 4 samples gives gradients 1/4 of each sample's: scale 4 restores the norms.
    factors, _ = clipping_factors_by_group([torch.tensor([0.25**2, 1.0])], 2, scale=4.0, threshold=2.0,
                                           fn="abadi", gamma=0.01)
    torch.testing.assert_close(factors[0], torch.tensor([1.0, 0.5]))


@pytest.mark.parametrize("fn,expected", [("automatic", [1 / (2 + 0.01), 1 / (0.5 + 0.01)]), ("global", [0.0, 1.0])])
def test_other_clipping_functions(fn, expected):
    factors, _ = clipping_factors_by_group([torch.tensor([4.0, 0.25])], 2, 1.0, 1.0, fn, 0.01)
    torch.testing.assert_close(factors[0], torch.tensor(expected))


def test_a_group_no_layer_reached_has_norm_zero_and_nothing_is_clipped():
    factors, finite = clipping_factors_by_group([None, torch.tensor([16.0])], 1, 1.0, 2.0, "abadi", 0.01)
    assert finite and factors[0].tolist() == [1.0] and factors[1].tolist() == [0.5]


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_non_finite_norms_are_reported(bad):
    _, finite = clipping_factors_by_group([torch.tensor([1.0, bad])], 2, 1.0, 1.0, "abadi", 0.01)
    assert not finite


def test_an_empty_batch_has_factors_and_is_finite():
    factors, finite = clipping_factors_by_group([None], 0, 1.0, 1.0, "abadi", 0.01)
    assert finite and factors[0].shape == (0,)


def _sums_after_one_micro_batch():
    """Two parameters, and the step's sums with a completed micro-batch for the first: ``(a, b, sums)``."""
    a, b = (nn.Parameter(torch.zeros(3)) for _ in range(2))
    sums = StepSums()
    sums.begin()
    sums.add(a, torch.ones(3))
    sums.commit()
    sums.begin()
    return a, b, sums


def test_step_sums_accumulate_and_roll_back_what_a_failed_backward_created():
    a, b, sums = _sums_after_one_micro_batch()
    sums.add(b, torch.ones(3))  # the failed backward created b's sum only
    sums.rollback()
    assert set(sums.sums) == {a} and sums.sums[a].tolist() == [1.0, 1.0, 1.0]


def test_step_sums_are_dropped_whole_when_a_failed_backward_had_added_into_them():
    a, _, sums = _sums_after_one_micro_batch()
    sums.add(a, torch.ones(3))  # in place into the completed micro-batch's sum: cannot be undone exactly
    with pytest.warns(UserWarning, match="dropped as a whole"):
        sums.rollback()
    assert sums.sums == {}


# ---------------------------------------------------------------------------------------- configuration
def test_the_configuration_is_one_frozen_record_read_through_the_engine():
    import dataclasses

    import dptrain

    engine = dptrain.PrivacyEngine(nn.Linear(3, 2), batch_size=4, sample_size=40, noise_multiplier=1.0)
    assert engine.batch_size == engine.config.batch_size == 4 and engine.sample_rate == 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.config.batch_size = 8
    with pytest.raises(AttributeError, match="build a new PrivacyEngine"):
        engine.noise_multiplier = 0.0


@pytest.mark.parametrize("value", [True, 2.0, "4", 0, -1])
def test_integer_arguments_take_integers_only(value):
    import dptrain

    with pytest.raises(ValueError, match=r"batch_size must be a positive integer \(the expected logical batch size\)"):
        dptrain.PrivacyEngine(nn.Linear(3, 2), batch_size=value, sample_size=40, noise_multiplier=1.0)


def test_numpy_integers_are_integers():
    import numpy as np

    import dptrain

    engine = dptrain.PrivacyEngine(nn.Linear(3, 2), batch_size=np.int64(4), sample_size=np.int64(40),
                                   noise_multiplier=1.0)
    assert engine.batch_size == 4 and type(engine.batch_size) is int
