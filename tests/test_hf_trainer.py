"""DPTrainer: the Hugging Face Trainer loop made private by the engine.

The central check: one Trainer step (accumulated micro-batches, the Trainer's own optimizer.step) leaves in
p.grad exactly the oracle's clipped per-sample sum over the step's Poisson batch (the specification's draw,
tests/framework_helpers.py) divided by the expected logical batch size, in float64; under gradient
checkpointing the same, and under bf16 / fp16 within what the precision explains. A run resumed from a
checkpoint continues the uninterrupted run's epsilon, step count and batches, with fresh noise. Several
processes: tests/test_frameworks_distributed.py.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import warnings

import pytest
import torch

from dptrain.data import PoissonSampler
from dptrain.losses import sequence_losses
from framework_helpers import assert_within, grad_norm_difference, logical_batches, oracle_step, precision_bounds, take
from helpers import Case, assert_matches, reference, split_max_grad_norm

T = pytest.importorskip("transformers")
from dptrain.integrations.hf_trainer import STATE_FILE, DPTrainer, per_sample_losses  # noqa: E402
from dptrain.integrations.loaders import MASK_KEY  # noqa: E402

N, L, V = 8, 6, 30


class DictDataset(torch.utils.data.Dataset):
    def __init__(self, **columns):
        self.columns = columns

    def __len__(self):
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.columns.items()}


def _gpt2(seed=0, layers=1):
    torch.manual_seed(seed)
    cfg = T.GPT2Config(vocab_size=V, n_embd=16, n_layer=layers, n_head=2, n_positions=L, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return T.GPT2LMHeadModel(cfg)


def _lm_data(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, L), generator=g)
    mask = torch.ones(n, L, dtype=torch.long)
    mask[1, -2:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _dataset(columns):
    ids, mask, labels = columns
    return DictDataset(input_ids=ids, attention_mask=mask, labels=labels)


def _args(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  max_steps=1, learning_rate=0.0, optim="sgd", save_strategy="no", report_to=[], use_cpu=True,
                  logging_steps=1, disable_tqdm=True, seed=0, data_seed=7)
    kwargs.update(overrides)
    return T.TrainingArguments(**kwargs)


def _trainer(cls=None, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return (cls or DPTrainer)(**kwargs)


class GradSnapshot(T.TrainerCallback):
    """p.grad right after the Trainer's optimizer.step (before it zeroes the gradients)."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}


def _lm_losses(model, ids, mask, labels):
    return sequence_losses(model(input_ids=ids, attention_mask=mask).logits, labels, shift=True, reduction="mean")


def _first_batch(columns, batch_size, trainer):
    """The indices of the first logical batch, by the specification (the single-process seeded draw)."""
    return logical_batches(len(columns[0]), batch_size, trainer.privacy_engine.max_batch_size, 7, 1)[0]


# --------------------------------------------------------------------------- one step against the oracle
@pytest.mark.parametrize("mode, checkpointing", [("bk-mixopt", False), ("ghost", False), ("bk-mixopt", True),
                                                 ("ghost", True)])
def test_one_trainer_step_is_the_clipped_per_sample_mean(tmp_path, mode, checkpointing):
    # q = 1 (all 8 every step) in two micro-batches of K / 2 rows, padding included
    model = _gpt2(layers=2).double()
    columns = _lm_data()
    R = split_max_grad_norm(Case(model, _lm_losses, columns), "all-layer")
    expected = {n: g / N for n, g in reference(Case(model, _lm_losses, columns), max_grad_norm=R).items()}
    snapshot = GradSnapshot(model)
    trainer = _trainer(model=model, args=_args(tmp_path, activation_checkpointing=checkpointing),
                       train_dataset=_dataset(columns), callbacks=[snapshot], noise_multiplier=0.0, max_grad_norm=R,
                       clipping_mode=mode)
    trainer.train()
    assert model.is_activation_checkpointing == checkpointing
    engine = trainer.privacy_engine
    assert engine.batch_size == N and engine.steps_taken == 1 and engine.max_batch_size > N
    assert_matches(snapshot.grads, expected, what=f"DPTrainer one step, {mode}, checkpointing={checkpointing}")


def test_a_poisson_step_is_the_oracle_on_the_specified_batch(tmp_path):
    # q = 1/2: the step's batch is the seeded single-process draw, cut into two padded micro-batches
    model = _gpt2().double()
    columns = _lm_data(n=16)
    snapshot = GradSnapshot(model)
    trainer = _trainer(model=model, args=_args(tmp_path), train_dataset=_dataset(columns), callbacks=[snapshot],
                       noise_multiplier=0.0, max_grad_norm=0.05)
    loader = trainer.get_train_dataloader()
    K = trainer.privacy_engine.max_batch_size
    assert all(batch["input_ids"].shape[0] == K // 2 for batch in loader) and len(loader) == 2 * 2  # round(1/q) steps
    indices = _first_batch(columns, 8, trainer)
    assert 0 < len(indices) < 16
    expected = oracle_step(model, _lm_losses, columns, indices, 0.05, 8)
    trainer.train()
    assert_matches(snapshot.grads, expected, what="Poisson step")


class _CPUFp16Trainer(DPTrainer):
    """Accelerate turns fp16 off on a CPU (it needs a GPU for its scaler); these two attributes are what it sets on
    a GPU, so the Trainer's fp16 path (autocast to float16 around the forward, the GradScaler in the prepared
    optimizer's step) runs here as it runs there."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.native_amp = True
        self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # overflows: the engine retries


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_steps_are_within_what_the_precision_explains(tmp_path, precision):
    model64 = _gpt2(layers=2).double()
    columns = _lm_data()
    R = split_max_grad_norm(Case(model64, _lm_losses, columns), "all-layer")
    bounds = precision_bounds(model64, _lm_losses, columns, R, torch.bfloat16 if precision == "bf16" else torch.float16)
    ref = reference(Case(model64, _lm_losses, columns), max_grad_norm=R)
    model = _gpt2(layers=2)
    snapshot = GradSnapshot(model)
    trainer = _trainer(_CPUFp16Trainer if precision == "fp16" else DPTrainer, model=model,
                       args=_args(tmp_path, **{precision: True}), train_dataset=_dataset(columns),
                       callbacks=[snapshot], noise_multiplier=0.0, max_grad_norm=R)
    trainer.train()
    scaler = trainer.accelerator.scaler
    assert (scaler is not None) == (precision == "fp16")
    if scaler is not None:
        assert scaler.get_scale() < 2.0**40  # the first scale overflowed; the engine found one that works ...
    assert trainer.privacy_engine.steps_taken == 1  # ... without skipping the step
    assert not trainer.accelerator.optimizer_step_was_skipped
    assert_within({n: g * N for n, g in snapshot.grads.items()}, ref, bounds, what=precision)


def test_one_sample_moves_the_step_by_at_most_the_clipping_norm(tmp_path):
    """The neighbour test through the Trainer: D and D minus one sample (q = 1 for both), noise 0."""
    R = 1e-3  # clips every sample: each one's contribution is exactly R long
    sums = []
    for n in (N, N - 1):
        model = _gpt2().double()
        ids, mask, labels = _lm_data()
        keep = [i for i in range(N) if n == N or i != 3]
        snapshot = GradSnapshot(model)
        trainer = _trainer(model=model, args=_args(tmp_path, per_device_train_batch_size=n,
                                                   gradient_accumulation_steps=1),
                           train_dataset=_dataset(take((ids, mask, labels), keep)), callbacks=[snapshot],
                           noise_multiplier=0.0, max_grad_norm=R)
        trainer.train()
        sums.append({k: g * n for k, g in snapshot.grads.items()})
    assert grad_norm_difference(*sums) == pytest.approx(R, rel=1e-9)


class _MaskDroppingTrainer(DPTrainer):
    """A training_step of one's own from step 2 on, which forgets the batch's fixed-shape mask."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.state.global_step < 2:
            return super().training_step(model, inputs, num_items_in_batch)
        inputs = dict(self._prepare_inputs(inputs))
        inputs.pop(MASK_KEY)
        losses = self.compute_per_sample_losses(model, inputs)
        self.privacy_engine.backward(losses)
        return losses.detach().mean()


def test_a_training_step_that_drops_the_mask_is_refused_naming_it(tmp_path):
    """q = 1 of 8 examples in micro-batches of K / 2 rows (K > 8: padding): two ordinary steps, then refused."""
    trainer = _trainer(_MaskDroppingTrainer, model=_gpt2(), args=_args(tmp_path, max_steps=3),
                       train_dataset=_dataset(_lm_data()), noise_multiplier=0.0)
    with pytest.raises(ValueError, match=r"has \d real samples.*DPTrainer.training_step passes the batch's "
                                         r"'dptrain_mask' entry to engine.backward"):
        trainer.train()
    assert trainer.privacy_engine.steps_taken == 2 and trainer.privacy_engine.max_batch_size > N


# --------------------------------------------------------------------------- checkpoints
def _resumable_run(tmp_path, seen, resume=None, **overrides):
    """16 examples, expected batch 4 (round(1/q) = 4 steps per epoch), 6 steps; a checkpoint every 2 steps."""
    def losses(model, inputs):
        seen.append(inputs["input_ids"].clone())
        return _lm_losses(model, inputs["input_ids"], inputs["attention_mask"], inputs["labels"])

    settings = dict(per_device_train_batch_size=2, max_steps=6, learning_rate=1e-2, save_strategy="steps", save_steps=2)
    args = _args(tmp_path / "run", **{**settings, **overrides})
    trainer = _trainer(model=_gpt2(), args=args, train_dataset=_dataset(_lm_data(n=16)), noise_multiplier=1.0,
                       per_sample_loss=losses, engine_kwargs={"seed": 0})
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(trainer, the batches of its micro-steps, its output folder): 6 steps, a checkpoint every 2."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    batches = []
    trainer = _resumable_run(folder, batches)
    assert all(os.path.isfile(folder / "run" / f"checkpoint-{s}" / STATE_FILE) for s in (2, 4, 6))
    return trainer, batches, folder


# from the middle of the first epoch (the Trainer skips its trained batches, or with ignore_data_skip the sampler
# continues itself) and from the end of it (the next epoch's draw)
@pytest.mark.parametrize("checkpoint, ignore_data_skip", [(2, False), (2, True), (4, False)])
def test_resuming_continues_epsilon_steps_and_batches_with_fresh_noise(tmp_path, uninterrupted, checkpoint,
                                                                       ignore_data_skip):
    full, full_batches, folder = uninterrupted
    resumed_batches = []
    resumed = _resumable_run(tmp_path, resumed_batches, resume=str(folder / "run" / f"checkpoint-{checkpoint}"),
                             ignore_data_skip=ignore_data_skip)
    engine = resumed.privacy_engine
    assert engine.steps_taken == full.privacy_engine.steps_taken == 6
    assert engine.get_epsilon() == full.privacy_engine.get_epsilon()
    micro = 2 * checkpoint  # two micro-batches per step
    assert len(resumed_batches) == len(full_batches) - micro
    assert all(torch.equal(a, b) for a, b in zip(full_batches[micro:], resumed_batches))  # the same batches
    # the same batches, model and optimizer state from the checkpoint: only the noise differs (fresh, not seed 0's)
    final = dict(resumed.model.named_parameters())
    assert any(not torch.equal(p, final[n]) for n, p in full.model.named_parameters())
    logged = [e for e in resumed.state.log_history if "epsilon" in e and "loss" in e]
    assert logged[-1]["epsilon"] == pytest.approx(full.privacy_engine.get_epsilon())


def test_resuming_with_another_batch_size_is_refused_naming_the_trainers_settings(tmp_path, uninterrupted):
    """A checkpoint's batches come from its sampling (q = B / n): a resume with another per_device_train_batch_size is
    refused before training, naming the Trainer's arguments rather than the sampler's internals (an outside probe)."""
    _, _, folder = uninterrupted
    with pytest.raises(ValueError, match=r"trained on batches of another sampling: 16 training examples at a sample "
                                         r"rate of 0.25 .*per_device_train_batch_size"):
        _resumable_run(tmp_path, [], resume=str(folder / "run" / "checkpoint-2"), per_device_train_batch_size=4)


class _StopAt(T.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def _planned_run(folder, seen, *, max_steps, stop, resume=None, **kwargs):
    """16 examples, expected batch 4, ``max_steps`` planned (K "auto": 12 for 3, 14 for 30), a checkpoint every 2
    steps, stopped after step ``stop``."""
    def losses(model, inputs):
        seen.append(inputs["input_ids"].clone())
        return _lm_losses(model, inputs["input_ids"], inputs["attention_mask"], inputs["labels"])

    args = _args(folder, per_device_train_batch_size=2, max_steps=max_steps, learning_rate=1e-2,
                 save_strategy="steps", save_steps=2)
    trainer = _trainer(model=_gpt2(), args=args, train_dataset=_dataset(_lm_data(n=16)), noise_multiplier=1.0,
                       per_sample_loss=losses, engine_kwargs={"seed": 0}, callbacks=[_StopAt(stop)], **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_resuming_with_a_longer_plan_keeps_the_checkpoints_max_batch_size(tmp_path):
    """A checkpoint at step 2 of max_steps=3, resumed with max_steps=30 (alone, K would be 14): the run keeps 12, and
    draws what an uninterrupted run with K = 12 draws. (The noise recalibrated to the new plan with the checkpoint's
    K: tests/test_accelerate_integration.py.)"""
    first = _planned_run(tmp_path / "first", [], max_steps=3, stop=2)
    assert first.privacy_engine.max_batch_size == 12
    seen, reference_seen = [], []
    resumed = _planned_run(tmp_path / "resumed", seen, max_steps=30, stop=6,
                           resume=str(tmp_path / "first" / "checkpoint-2"))
    _planned_run(tmp_path / "reference", reference_seen, max_steps=30, stop=6, max_batch_size=12)
    engine = resumed.privacy_engine
    assert engine.steps_taken == 6 and engine.max_batch_size == 12
    assert len(seen) == 8 and all(torch.equal(a, b) for a, b in zip(seen, reference_seen[4:]))
    assert [(h["max_batch_size"], h["steps"]) for h in engine.privacy_report()["history"]] == [(12, 6)]
    with pytest.raises(ValueError, match="Pass max_batch_size=12 to DPTrainer"):
        _planned_run(tmp_path / "explicit", [], max_steps=30, stop=6, max_batch_size=14,
                     resume=str(tmp_path / "first" / "checkpoint-2"))


def test_a_checkpoint_without_privacy_state_is_refused(tmp_path):
    ids, mask, labels = _lm_data(n=16)
    args = _args(tmp_path, per_device_train_batch_size=2, max_steps=2, save_strategy="steps", save_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        T.Trainer(model=_gpt2(), args=args, train_dataset=_dataset((ids, mask, labels))).train()
    assert json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    trainer = _trainer(model=_gpt2(), args=_args(tmp_path, per_device_train_batch_size=2, max_steps=4),
                       train_dataset=_dataset((ids, mask, labels)), noise_multiplier=1.0)
    with pytest.raises(FileNotFoundError, match="holds no privacy state .dptrain_state.pt.*restart the privacy"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


# --------------------------------------------------------------------------- sampling, logs, refusals
def test_training_logs_epsilon_and_calibrates_to_max_steps(tmp_path):
    ids, mask, labels = _lm_data(n=16)
    trainer = _trainer(model=_gpt2(), args=_args(tmp_path, max_steps=3, learning_rate=1e-3, optim="adamw_torch"),
                       train_dataset=_dataset((ids, mask, labels)), target_epsilon=4.0, max_grad_norm=1.0)
    trainer.train()
    engine = trainer.privacy_engine
    assert engine.steps_taken == 3
    assert engine.get_epsilon() == pytest.approx(4.0, rel=0.05)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all("epsilon" in entry and "grad_norm" not in entry for entry in logged)
    report = trainer.privacy_report()
    assert report["epsilon_is_proven_bound"] and report["truncation_delta"] > 0  # fixed shapes, truncation counted


def test_shuffled_batches_are_an_opt_in_recorded_as_unproven(tmp_path):
    ids, mask, labels = _lm_data()
    with pytest.warns(UserWarning, match="not a proven bound"):
        trainer = DPTrainer(model=_gpt2(), args=_args(tmp_path), noise_multiplier=1.0, poisson_sampling=False,
                            train_dataset=_dataset((ids, mask, labels)))
    assert not isinstance(trainer.get_train_dataloader().batch_sampler, PoissonSampler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    report = trainer.privacy_report()
    assert report["epsilon_is_proven_bound"] is False and "not a proven bound" in report["note"]
    assert report["max_batch_size"] is None and report["steps"] == 1


@pytest.mark.parametrize("setting, engine_kwargs, message", [
    (dict(torch_compile=True), {}, "torch_compile"),
    (dict(auto_find_batch_size=True), {}, "auto_find_batch_size"),
    (dict(train_sampling_strategy="group_by_length"), {}, "train_sampling_strategy"),
    ({}, {"batch_size": 4}, r"engine_kwargs must not repeat .*batch_size"),
    ({}, {"max_batch_size": 12}, r"engine_kwargs must not repeat .*max_batch_size"),
    ({}, {"privacy_unit": "user"}, r"privacy_unit='user': DPTrainer samples examples; .*poisson_loader"),
])
def test_settings_that_cannot_be_private_are_refused(tmp_path, setting, engine_kwargs, message):
    ids, mask, labels = _lm_data()
    with pytest.raises(ValueError, match=message):
        DPTrainer(model=_gpt2(), args=_args(tmp_path, **setting), noise_multiplier=1.0, engine_kwargs=engine_kwargs,
                  train_dataset=_dataset((ids, mask, labels)))


class _BatchLossTrainer(DPTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss * 0  # (an objective of the user's)


def test_a_batch_loss_of_the_users_is_refused_where_training_would_not_use_it(tmp_path):
    """DPTrainer trains on per-sample losses: a compute_loss override, or compute_loss_func=, was never called in
    training, and the default loss silently replaced the user's objective (an outside probe). Refused at construction,
    naming compute_per_sample_losses and per_sample_loss; with per_sample_loss given, compute_loss (the evaluation's)
    may stay."""
    data = _dataset(_lm_data())
    with pytest.raises(ValueError, match="compute_loss is overridden.* compute_per_sample_losses"):
        _trainer(_BatchLossTrainer, model=_gpt2(), args=_args(tmp_path), train_dataset=data, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="compute_loss_func= .* per_sample_loss="):
        _trainer(model=_gpt2(), args=_args(tmp_path), train_dataset=data, noise_multiplier=1.0,
                 compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss)

    def losses(model, inputs):
        return _lm_losses(model, inputs["input_ids"], inputs["attention_mask"], inputs["labels"])

    calls = []
    trainer = _trainer(_BatchLossTrainer, model=_gpt2(), args=_args(tmp_path), train_dataset=data,
                       noise_multiplier=1.0, per_sample_loss=lambda m, i: calls.append(1) or losses(m, i))
    trainer.train()
    assert calls and trainer.privacy_engine.steps_taken == 1


def test_a_max_batch_size_that_does_not_split_is_refused(tmp_path):
    with pytest.raises(ValueError, match="use a multiple of 2, e.g. 10"):
        DPTrainer(model=_gpt2(), args=_args(tmp_path), noise_multiplier=1.0, max_batch_size=9,
                  train_dataset=_dataset(_lm_data()))


# --------------------------------------------------------------------------- default per-sample losses
def _bert(num_labels, problem_type=None):
    torch.manual_seed(0)
    cfg = T.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                       vocab_size=V, max_position_embeddings=L, num_labels=num_labels, problem_type=problem_type,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return T.BertForSequenceClassification(cfg).double().eval()


@pytest.mark.parametrize("num_labels, labels", [
    (3, torch.tensor([0, 2, 1])),
    (1, torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)),
    (2, torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)),
])
def test_classifier_losses_are_hugging_face_losses_per_sample(num_labels, labels):
    model = _bert(num_labels)
    ids = torch.randint(0, V, (3, L), generator=torch.Generator().manual_seed(1))
    losses = per_sample_losses(model, {"labels": labels}, model(input_ids=ids))
    assert losses.shape == (3,)
    for i in range(3):
        hf = model(input_ids=ids[i:i + 1], labels=labels[i:i + 1]).loss
        torch.testing.assert_close(losses[i], hf.to(losses.dtype))


def test_causal_lm_loss_is_per_sequence_mean_of_shifted_tokens():
    model = _gpt2().double().eval()
    ids, mask, labels = _lm_data()
    out = model(input_ids=ids, attention_mask=mask)
    losses = per_sample_losses(model, {"labels": labels}, out)
    torch.testing.assert_close(losses, sequence_losses(out.logits, labels, shift=True, reduction="mean"))
    for i in range(2):
        hf = model(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1], labels=labels[i:i + 1]).loss
        torch.testing.assert_close(losses[i].float(), hf)


def test_missing_labels_and_unknown_models_ask_for_a_per_sample_loss():
    model = _gpt2()
    with pytest.raises(ValueError, match="labels"):
        per_sample_losses(model, {}, None)
    with pytest.raises(ValueError, match="per_sample_loss"):
        per_sample_losses(torch.nn.Linear(2, 2), {"labels": torch.zeros(1)}, {"logits": torch.zeros(1, 2)})


@pytest.mark.parametrize("absent", ["transformers", "accelerate"])
def test_a_missing_package_is_named_with_the_extra_that_installs_it(monkeypatch, absent):
    monkeypatch.setitem(sys.modules, absent, None)  # what an absent package looks like to import
    monkeypatch.delitem(sys.modules, "dptrain.integrations.hf_trainer")
    with pytest.raises(ImportError, match=rf"and '{absent}' is not installed: pip install 'dptrain\[transformers\]' "
                                          "installs both"):
        importlib.import_module("dptrain.integrations.hf_trainer")


def test_the_transformers_extra_installs_accelerate_too():
    """The Trainer needs accelerate; an extra without it would leave DPTrainer's error unfixable by its own advice."""
    from pathlib import Path

    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extra = {Requirement(r).name for r in project["optional-dependencies"]["transformers"]}
    assert {"transformers", "accelerate"} <= extra



