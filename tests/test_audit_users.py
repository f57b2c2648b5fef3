"""The one-run audit at the user level: canary *users* of several examples, clipped and sampled as a unit.

Canary users against the float64 user-level oracle in every clipping mode (and the per-example seam of the
broken run against it), small audits on a small model (honest in every mode; per-example clipping, a tenth of
the noise and clipping switched off caught), the digits CNN through `dptrain audit --privacy-unit user`, and
the options that make no sense at the example level refused.
"""
from __future__ import annotations

import json

import pytest
import torch

import dptrain
from dptrain.audit import (
    AUDIT_DEFAULTS,
    CANARY_NORM_OVER_R,
    CanaryModel,
    canary_losses,
    format_report,
    run_audit,
)
from dptrain.cli import main
from dptrain.models.build import build_image_model
from dptrain.testing import reference_user_clipped_gradient

MODES = tuple(dptrain.CLIPPING_MODES)


# ====================================================================== canary users through the engine


@pytest.mark.parametrize("mode", MODES)
def test_canary_users_are_clipped_as_one_unit_and_match_the_user_oracle(mode, float64):
    torch.manual_seed(0)
    audited = CanaryModel(build_image_model("cnn", 1, 10, 8).model, canaries=5)
    # Real users 0, 1, 2 (of 2, 1 and 2 rows) and canary users 3 and 0 (ids 10 + i, 3 rows each), shuffled.
    canary_id = torch.tensor([-1, 3, -1, 0, 3, -1, 0, -1, 3, 0, -1])
    users = torch.tensor([0, 13, 1, 10, 13, 2, 10, 0, 13, 10, 2])
    x = torch.randn(len(users), 1, 8, 8)
    x[canary_id >= 0] = 0
    y = torch.randint(0, 10, (len(users),))
    R = 0.5

    def losses_fn(model, x, y, canary_id):
        return canary_losses(*model(x, canary_id), y, canary_id, CANARY_NORM_OVER_R * R)

    def engine_gradient(row_users):
        optimizer = torch.optim.SGD(audited.parameters(), lr=0.0)
        engine = dptrain.PrivacyEngine(audited, batch_size=1, sample_size=100, max_grad_norm=R, noise_multiplier=0.0,
                                       clipping_mode=mode, privacy_unit="user")
        engine.attach(optimizer)
        try:
            engine.backward(losses_fn(audited, x, y, canary_id), users=row_users)
            optimizer.step()
            return {name: p.grad.detach().clone() for name, p in audited.named_parameters()}
        finally:
            optimizer.zero_grad(set_to_none=True)
            engine.detach()

    got = engine_gradient(users)
    reference = reference_user_clipped_gradient(audited, losses_fn, (x, y, canary_id), users, max_grad_norm=R)
    for name, grad in got.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-10, atol=1e-12)
    # Each canary user (3 examples of 64 R each: 192 R summed) adds exactly R on its own coordinate.
    expected = torch.zeros(6)
    expected[[3, 0]] = R
    torch.testing.assert_close(got["probe.weight"][:, 0], expected, rtol=0, atol=1e-12)
    # The real parameters get exactly the user-clipped gradient of the real users alone.
    real = canary_id < 0
    real_only = reference_user_clipped_gradient(audited, losses_fn, (x[real], y[real], canary_id[real]), users[real],
                                                max_grad_norm=R)
    for name, grad in got.items():
        if not name.startswith("probe"):
            torch.testing.assert_close(grad, real_only[name], rtol=1e-10, atol=1e-12)
    # The seam of run_audit(clip_per_example=True): a distinct id per row clips each example, and a
    # canary user of 3 examples then adds 3 R, which the audit must catch.
    broken = engine_gradient(torch.arange(len(users)))
    torch.testing.assert_close(broken["probe.weight"][:, 0], 3 * expected, rtol=0, atol=1e-12)


# ====================================================================== small audits of a small model


def _small_model_and_data():
    torch.manual_seed(0)
    inputs, labels = torch.randn(200, 6), torch.randint(0, 3, (200,))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model, (inputs, labels)


SMALL = dict(canaries=1000, steps=4, seed=0, privacy_unit="user")


@pytest.fixture(scope="module")
def small():
    model, data = _small_model_and_data()
    return dict(model=model, data=data)


@pytest.fixture(scope="module")
def default_mode_user_audit(small):
    return run_audit(**SMALL, **small)


@pytest.mark.parametrize("mode", MODES)
def test_small_user_level_audit_is_honest_in_every_mode_and_finds_the_same_picture(mode, small,
                                                                                   default_mode_user_audit):
    result = run_audit(clipping_mode=mode, **SMALL, **small)
    assert (result.privacy_unit, result.clipped_unit) == ("user", "user")
    assert result.examples_per_canary == AUDIT_DEFAULTS["examples_per_canary"] == 4
    # 200 examples dealt into users of 4: 50 real users, and q over them and the 1000 potential canary users.
    assert result.train_users == 50 and result.train_size == 200
    assert result.sample_rate == pytest.approx(round(0.5 * 1050) / 1050, rel=1e-12)
    assert result.epsilon == pytest.approx(2.0, rel=0.02) and result.epsilon <= 2.0
    assert 0 <= result.epsilon_lower_bound <= result.epsilon and result.consistent
    # Same coins, user batches and noise; every mode clips each canary user to exactly R.
    assert result.correct_guesses == default_mode_user_audit.correct_guesses
    assert result.epsilon_lower_bound == default_mode_user_audit.epsilon_lower_bound


def test_user_level_audit_catches_per_example_clipping_and_passes_the_honest_run(small):
    # Clipping each example instead of each user: a canary user of 4 examples adds 4 R where the
    # user-level promise allows R. The honest run with the same seed (coins, batches, noise) is not flagged.
    options = dict(canaries=3000, steps=10, seed=0, privacy_unit="user", **small)
    honest = run_audit(**options)
    # The engine's sampling check sees the run too: about twice the users per step that it accounts for.
    with pytest.warns(UserWarning, match="users per step on average.*epsilon is understated"):
        broken = run_audit(clip_per_example=True, **options)
    assert (broken.epsilon, broken.noise_multiplier, broken.sample_rate) == (
        honest.epsilon, honest.noise_multiplier, honest.sample_rate)
    assert honest.consistent and honest.epsilon_lower_bound <= honest.epsilon
    assert broken.clipped_unit == "example" and broken.privacy_unit == "user"
    assert broken.epsilon_lower_bound > broken.epsilon and not broken.consistent
    report = format_report(broken)
    assert report.count("clips each example instead of each user") == 2 and "PROMISE BROKEN" in report
    honest_report = format_report(honest)
    assert "DELIBERATELY" not in honest_report and "verdict: consistent" in honest_report
    assert "3000 canary users of 4 examples each" in honest_report and "200 samples of 50 users" in honest_report
    assert "per user" in honest_report and "one user (all of their examples together)" in honest_report


def test_user_level_audit_catches_a_tenth_of_the_noise_and_clipping_switched_off(small):
    quiet = run_audit(noise_scale=0.1, **SMALL, **small)
    assert quiet.epsilon_lower_bound > quiet.epsilon
    assert format_report(quiet).count("DELIBERATELY BREAKS ITS PRIVACY PROMISE") == 2
    unclipped = run_audit(clipping_off=True, **SMALL, **small)
    assert unclipped.epsilon_lower_bound > unclipped.epsilon


def test_real_users_of_your_own_and_more_examples_per_canary(small):
    # Real users: any integer ids (here 7 users with large, scattered ids); canary users of 2 examples.
    users = 1000 + 37 * (torch.arange(200) % 7)
    result = run_audit(canaries=300, steps=2, seed=0, privacy_unit="user", examples_per_canary=2, users=users,
                       **small)
    assert (result.train_users, result.examples_per_canary) == (7, 2)
    assert result.sample_rate == pytest.approx(round(0.5 * 307) / 307, rel=1e-12)
    assert 0 <= result.epsilon_lower_bound <= result.epsilon
    assert result.to_dict()["privacy_unit"] == "user"
    example = run_audit(canaries=300, steps=2, seed=0, **small)  # the example level reports its unit too
    assert (example.privacy_unit, example.examples_per_canary, example.clipped_unit, example.train_users) == (
        "example", 1, "example", None)
    assert "canary users" not in format_report(example) and "per user" not in format_report(example)


def test_user_level_options_are_refused_with_a_clear_message(small):
    tiny = dict(canaries=10, steps=1, seed=0, **small)
    with pytest.raises(ValueError, match="examples_per_canary is for canary users, with privacy_unit='user'"):
        run_audit(examples_per_canary=4, **tiny)
    with pytest.raises(ValueError, match="users is for canary users"):
        run_audit(users=torch.zeros(200, dtype=torch.long), **tiny)
    with pytest.raises(ValueError, match="clip_per_example is for canary users"):
        run_audit(clip_per_example=True, **tiny)
    with pytest.raises(ValueError, match="privacy_unit must be one of 'example', 'user'"):
        run_audit(privacy_unit="users", **tiny)
    with pytest.raises(ValueError, match="examples_per_canary must be a positive integer"):
        run_audit(privacy_unit="user", examples_per_canary=0, **tiny)
    with pytest.raises(ValueError, match="one user id per training example: the data has 200 examples"):
        run_audit(privacy_unit="user", users=torch.zeros(199, dtype=torch.long), **tiny)
    with pytest.raises(ValueError, match="integer user ids"):
        run_audit(privacy_unit="user", users=torch.zeros(200), **tiny)


# ====================================================================== dptrain audit --privacy-unit user


@pytest.mark.slow  # the digits CNN: 3-6 s on two shared cores
def test_cli_audit_with_canary_users_of_the_digits_cnn(capsys):
    status = main(["audit", "--canaries", "300", "--steps", "2", "--seed", "0", "--privacy-unit", "user",
                   "--examples-per-canary", "2", "--json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    report = json.loads(out)
    assert (report["privacy_unit"], report["clipped_unit"], report["examples_per_canary"]) == ("user", "user", 2)
    assert report["model"] == "cnn" and report["data"] == "digits" and report["train_users"] == 899  # 1797 / 2
    assert report["epsilon_lower_bound"] <= report["epsilon"] <= 2.0 and report["consistent"]


def test_cli_audit_refuses_canary_users_at_the_example_level_in_one_line(capsys):
    status = main(["audit", "--examples-per-canary", "2"])
    _, err = capsys.readouterr()
    assert status == 1 and err.count("\n") == 1 and "privacy_unit='user'" in err
    status = main(["audit", "--privacy-unit", "group"])
    _, err = capsys.readouterr()
    assert status == 2 and err.count("\n") == 1 and "--privacy-unit" in err


def test_cli_help_states_the_user_level_defaults(capsys):
    assert main(["audit", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default {AUDIT_DEFAULTS['examples_per_canary']})" in text
    assert f"unit (default {AUDIT_DEFAULTS['privacy_unit']})" in text
