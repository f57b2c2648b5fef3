"""DPTrainer: the Hugging Face Trainer loop made private by the engine.

The central check: one Trainer step (two accumulated micro-batches, the Trainer's own
optimizer.step) leaves in p.grad exactly the oracle's clipped per-sample sum divided by the
logical batch size, in float64.
"""
from __future__ import annotations

import importlib
import sys
import warnings

import pytest
import torch

from dptrain.losses import sequence_losses
from helpers import Case, assert_matches, reference, split_max_grad_norm

T = pytest.importorskip("transformers")
from dptrain.integrations.hf_trainer import DPTrainer, per_sample_losses  # noqa: E402

N, L, V = 8, 6, 30


class DictDataset(torch.utils.data.Dataset):
    def __init__(self, **columns):
        self.columns = columns

    def __len__(self):
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.columns.items()}


def _gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = T.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=L, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return T.GPT2LMHeadModel(cfg)


def _lm_data(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, L), generator=g)
    mask = torch.ones(n, L, dtype=torch.long)
    mask[1, -2:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _args(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  max_steps=1, learning_rate=0.0, optim="sgd", save_strategy="no", report_to=[], use_cpu=True,
                  logging_steps=1, disable_tqdm=True, seed=0)
    kwargs.update(overrides)
    return T.TrainingArguments(**kwargs)


class GradSnapshot(T.TrainerCallback):
    """p.grad right after the Trainer's optimizer.step (before it zeroes the gradients)."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}


def _lm_losses(model, ids, mask, labels):
    return sequence_losses(model(input_ids=ids, attention_mask=mask).logits, labels, shift=True, reduction="mean")


@pytest.mark.parametrize("mode", ["bk-mixopt", "ghost"])
def test_one_trainer_step_is_the_clipped_per_sample_mean(tmp_path, mode):
    model = _gpt2().double()
    ids, mask, labels = _lm_data()
    case = Case(model, _lm_losses, (ids, mask, labels))
    R = split_max_grad_norm(case, "all-layer")
    expected = {n: g / N for n, g in reference(case, max_grad_norm=R).items()}

    snapshot = GradSnapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPTrainer(model=model, args=_args(tmp_path), train_dataset=DictDataset(
            input_ids=ids, attention_mask=mask, labels=labels), callbacks=[snapshot],
            noise_multiplier=0.0, max_grad_norm=R, clipping_mode=mode)
        trainer.train()
    assert trainer.privacy_engine.batch_size == N
    assert trainer.privacy_engine.steps_taken == 1
    assert_matches(snapshot.grads, expected, what=f"DPTrainer one step, {mode}")


def test_training_logs_epsilon_and_calibrates_to_max_steps(tmp_path):
    ids, mask, labels = _lm_data(n=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPTrainer(model=_gpt2(), args=_args(tmp_path, max_steps=3, learning_rate=1e-3, optim="adamw_torch"),
                            train_dataset=DictDataset(input_ids=ids, attention_mask=mask, labels=labels),
                            target_epsilon=4.0, max_grad_norm=1.0)
        trainer.train()
    engine = trainer.privacy_engine
    assert engine.steps_taken == 3
    assert engine.get_epsilon() == pytest.approx(4.0, rel=0.05)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all("epsilon" in entry and "grad_norm" not in entry for entry in logged)


def test_poisson_sampling_draws_variable_batches(tmp_path):
    ids, mask, labels = _lm_data(n=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPTrainer(model=_gpt2(), args=_args(tmp_path, max_steps=4, gradient_accumulation_steps=1),
                            train_dataset=DictDataset(input_ids=ids, attention_mask=mask, labels=labels),
                            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=True)
        loader = trainer.get_train_dataloader()
        sizes = [batch["input_ids"].shape[0] for batch in loader]
        trainer.train()
    from dptrain.data import is_poisson_loader

    assert is_poisson_loader(loader)
    assert len(sizes) == 4  # one expected pass: 1 / q batches with q = 4 / 16
    assert trainer.privacy_engine.steps_taken == 4


_CHECKPOINTING = ("activation_checkpointing" if "activation_checkpointing" in T.TrainingArguments.__dataclass_fields__
                  else "gradient_checkpointing")


@pytest.mark.parametrize("setting, message", [
    ({_CHECKPOINTING: True}, "checkpointing"),
    (dict(torch_compile=True), "torch_compile"),
])
def test_unsupported_settings_are_refused(tmp_path, setting, message):
    ids, mask, labels = _lm_data()
    with pytest.raises(ValueError, match=message):
        DPTrainer(model=_gpt2(), args=_args(tmp_path, **setting), noise_multiplier=1.0,
                  train_dataset=DictDataset(input_ids=ids, attention_mask=mask, labels=labels))


def test_fixed_size_batches_warn_that_the_accounting_assumes_poisson_sampling(tmp_path):
    ids, mask, labels = _lm_data()
    with pytest.warns(UserWarning, match="Poisson"):
        DPTrainer(model=_gpt2(), args=_args(tmp_path), noise_multiplier=1.0,
                  train_dataset=DictDataset(input_ids=ids, attention_mask=mask, labels=labels))


def test_poisson_sampling_needs_one_batch_per_step(tmp_path):
    ids, mask, labels = _lm_data()
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1"):
        DPTrainer(model=_gpt2(), args=_args(tmp_path), noise_multiplier=1.0, poisson_sampling=True,
                  train_dataset=DictDataset(input_ids=ids, attention_mask=mask, labels=labels))


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


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an absent package looks like to import
    monkeypatch.delitem(sys.modules, "dptrain.integrations.hf_trainer")
    with pytest.raises(ImportError, match=r"pip install 'dptrain\[transformers\]'"):
        importlib.import_module("dptrain.integrations.hf_trainer")
