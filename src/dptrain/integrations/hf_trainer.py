"""Private fine-tuning with the Hugging Face ``Trainer``: :class:`DPTrainer`.

A ``Trainer`` script becomes private by changing the class and naming the privacy budget::

    from dptrain.integrations.hf_trainer import DPTrainer

    trainer = DPTrainer(
        model=model, args=training_args, train_dataset=train_ds, data_collator=collator,
        target_epsilon=3.0,          # or noise_multiplier=...
        max_grad_norm=1.0,           # per-sample clipping threshold
    )
    trainer.train()
    print(trainer.privacy_engine.get_epsilon())

What changes inside the training loop:

* ``training_step`` computes one loss per sample (``per_sample_loss``; by default from the
  model's logits and ``labels``: per-sequence token losses for language models, the
  classification / regression loss for classifiers) and hands them to
  ``engine.backward``, which clips each sample's gradient exactly.
* The ``optimizer.step()`` that ``Trainer`` calls applies the private gradient: the engine's
  step pre-hook replaces ``p.grad`` by (sum of clipped per-sample gradients + noise) divided
  by the logical batch size ``per_device_train_batch_size * gradient_accumulation_steps``.
  Gradient accumulation therefore works as usual: micro-batches are accumulated until the step.
* ``TrainingArguments.max_grad_norm`` (clipping of the *batch* gradient) has no role any more:
  the ``max_grad_norm`` given to ``DPTrainer`` is the per-sample threshold. Trainer's logged
  ``grad_norm`` would not be the private gradient's, so it is dropped from the logs; the spent
  ``epsilon`` is logged instead.

Privacy accounting assumes Poisson sampling (each example in each batch independently with
probability ``batch_size / len(dataset)``). ``poisson_sampling=True`` makes the training
loader draw such batches (variable size, possibly empty; then ``gradient_accumulation_steps``
must be 1), from OS entropy unless ``TrainingArguments.data_seed`` is set. Trainer's default
shuffled fixed-size batches are the common practice, but the reported epsilon is then the
Poisson-sampling epsilon, not a proven bound for them.

Not supported (refused at construction, with the reason): fp16 mixed precision with a loss
scaler (use bf16 or float32), gradient checkpointing (it re-runs layers during the backward),
several processes or GPUs (the noise would be drawn once per process), ``torch_compile``.
Dropout is fine: its randomness is per sample.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:
    from transformers import Trainer
    from transformers.models.auto import modeling_auto
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "dptrain.integrations.hf_trainer needs Hugging Face transformers: pip install 'dptrain[transformers]'"
    ) from err

from .. import checks
from ..algorithms import DEFAULT_CLIPPING_MODE
from ..data import batch_len, poisson_loader
from ..engine import PrivacyEngine
from ..losses import LOSS_REDUCTIONS, sequence_losses

__all__ = ["DPTrainer", "per_sample_losses"]



def _names(mapping: Mapping) -> set[str]:
    out = set()
    for value in mapping.values():
        out.update(value if isinstance(value, (tuple, list)) else [value])
    return out


_CAUSAL_LM = _names(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
_SEQ2SEQ_LM = _names(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
_TOKEN_LEVEL = _names(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES) | _names(
    modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES
)
_CLASSIFIERS = _names(modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES) | _names(
    modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
)


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _task(model: nn.Module) -> str | None:
    base = _base_model(model)
    name = type(base).__name__
    config = getattr(base, "config", None)
    loss_type = getattr(base, "loss_type", None)
    if name in _SEQ2SEQ_LM or getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    if name in _CAUSAL_LM or loss_type == "ForCausalLM":
        return "causal-lm"
    if name in _TOKEN_LEVEL or loss_type in ("ForMaskedLM", "ForTokenClassification"):
        return "token"
    if name in _CLASSIFIERS or loss_type in ("ForSequenceClassification", "ForImageClassification"):
        return "classification"
    return None


def per_sample_losses(model: nn.Module, inputs: Mapping[str, Any], outputs: Any, *,
                      token_reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """[B] losses from a transformers model's ``outputs`` and the ``labels`` in ``inputs``.

    * causal LM: token losses of the shifted labels (``ignore_index=-100``), per sequence;
    * encoder-decoder LM, masked LM, token classification: token losses, labels as given;
    * sequence / image classification: cross entropy, MSE (``num_labels == 1`` or
      ``problem_type="regression"``) or per-sample mean binary cross entropy (multi-label),
      following the model config's ``problem_type`` like Hugging Face's own loss.

    ``token_reduction``: each sequence's loss is the ``"mean"`` over its valid tokens (the
    per-sample analogue of Hugging Face's mean over the batch's tokens) or their ``"sum"``.
    """
    labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
    if labels is None:
        raise ValueError(
            "DPTrainer's default per-sample loss needs `labels` in the batch; pass per_sample_loss=fn(model, inputs) "
            "returning a [B] tensor of per-sample losses for other objectives"
        )
    logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs.logits
    task = _task(model)
    if task in ("causal-lm", "seq2seq", "token"):
        return sequence_losses(logits, labels, shift=task == "causal-lm", reduction=token_reduction,
                               label_smoothing=label_smoothing)
    if task == "classification":
        config = _base_model(model).config
        problem = config.problem_type
        if problem is None:
            if config.num_labels == 1:
                problem = "regression"
            elif labels.dtype in (torch.long, torch.int):
                problem = "single_label_classification"
            else:
                problem = "multi_label_classification"
        if problem == "regression":
            pred = logits.squeeze(-1) if config.num_labels == 1 else logits
            losses = F.mse_loss(pred, labels.to(pred.dtype), reduction="none")
            return losses.reshape(losses.shape[0], -1).mean(1)
        if problem == "single_label_classification":
            return F.cross_entropy(logits.reshape(-1, config.num_labels), labels.reshape(-1), reduction="none",
                                   label_smoothing=label_smoothing)
        losses = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
        return losses.reshape(losses.shape[0], -1).mean(1)
    raise ValueError(
        f"DPTrainer does not know the per-sample loss of {type(_base_model(model)).__name__}: pass "
        "per_sample_loss=fn(model, inputs) returning a [B] tensor of per-sample losses"
    )


class DPTrainer(Trainer):
    """``transformers.Trainer`` with differentially private training by a :class:`dptrain.PrivacyEngine`.

    Takes every ``Trainer`` argument, plus the privacy settings: exactly one of
    ``noise_multiplier`` or ``target_epsilon`` (the noise is then calibrated to the planned
    number of steps, from ``max_steps`` or ``num_train_epochs``), ``target_delta`` (default:
    ``1 / (10 n)`` for a training set of n examples), ``max_grad_norm`` (the
    per-sample clipping threshold), ``clipping_mode`` and any other ``PrivacyEngine`` keyword
    in ``engine_kwargs``.

    ``per_sample_loss(model, inputs) -> [B]`` replaces the default loss (see
    :func:`per_sample_losses`); ``token_loss_reduction`` chooses per-sequence ``"mean"`` or
    ``"sum"`` for the default token losses. ``poisson_sampling=True`` draws Poisson-sampled
    training batches (see the module documentation). The engine is ``trainer.privacy_engine``.
    """

    def __init__(
        self,
        *args: Any,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        max_grad_norm: float = 1.0,
        clipping_mode: str = DEFAULT_CLIPPING_MODE,
        per_sample_loss: Callable[[nn.Module, Mapping[str, Any]], torch.Tensor] | None = None,
        token_loss_reduction: str = "mean",
        poisson_sampling: bool = False,
        engine_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        checks.choice("token_loss_reduction", token_loss_reduction, LOSS_REDUCTIONS)
        self._check_arguments(poisson_sampling)
        self.per_sample_loss = per_sample_loss
        self.token_loss_reduction = token_loss_reduction
        self.poisson_sampling = poisson_sampling

        args_ = self.args
        sample_size = len(self.train_dataset)
        batch_size = args_.per_device_train_batch_size * args_.gradient_accumulation_steps
        if batch_size > sample_size:
            raise ValueError(
                f"the logical batch size (per_device_train_batch_size * gradient_accumulation_steps = {batch_size}) "
                f"exceeds the training set size {sample_size}"
            )
        steps = None
        if target_epsilon is not None:
            per_epoch = sample_size / batch_size
            steps_per_epoch = round(per_epoch) if poisson_sampling else math.ceil(per_epoch)
            steps = args_.max_steps if args_.max_steps > 0 else math.ceil(args_.num_train_epochs * steps_per_epoch)
        self.privacy_engine = PrivacyEngine(
            self.model, batch_size=batch_size, sample_size=sample_size, max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, target_delta=target_delta,
            steps=steps, clipping_mode=clipping_mode, **dict(engine_kwargs or {}),
        )
        self._attached_to: torch.optim.Optimizer | None = None
        if not poisson_sampling:
            warnings.warn(
                "DPTrainer draws Trainer's shuffled fixed-size batches, not the Poisson sampling that the privacy "
                "accounting assumes: the reported epsilon does not hold for them. Pass poisson_sampling=True",
                stacklevel=2,
            )

    def _check_arguments(self, poisson_sampling: bool) -> None:
        args = self.args
        problems = []
        if args.fp16:
            problems.append("fp16=True scales the loss with a GradScaler that never sees the private gradient: "
                            "use bf16=True or float32")
        if getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing:
            problems.append("activation (gradient) checkpointing re-runs layers during the backward pass, which "
                            "records them twice: turn it off")
        if args.world_size > 1 or args.n_gpu > 1:
            problems.append(f"{max(args.world_size, args.n_gpu)} processes/GPUs: distributed private training is not "
                            "supported (each process would add its own noise); train on one device")
        if args.torch_compile:
            problems.append("torch_compile=True: compiled models bypass the per-layer hooks the engine relies on")
        if poisson_sampling and args.gradient_accumulation_steps != 1:
            problems.append("poisson_sampling=True draws one logical batch per step: set gradient_accumulation_steps=1")
        if self.train_dataset is None or not hasattr(self.train_dataset, "__len__"):
            problems.append("a train_dataset with a length is needed: the sample rate is batch_size / len(dataset)")
        if problems:
            raise ValueError("DPTrainer cannot train privately with these settings:\n- " + "\n- ".join(problems))

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(*args, **kwargs)
        if self._attached_to is not optimizer:  # Trainer may call this again on a second train()
            if self._attached_to is not None:
                self.privacy_engine.detach()
            self.privacy_engine.attach(optimizer)
            self._attached_to = optimizer
        return optimizer

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self):
        if not self.poisson_sampling:
            return super().get_train_dataloader()
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets
        except ImportError:
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        # Secret sampling randomness (OS entropy) unless data_seed asks for reproducible batches: a known
        # seed such as Trainer's default seed=42 would make the batches predictable.
        generator = None if self.args.data_seed is None else torch.Generator().manual_seed(self.args.data_seed)
        return poisson_loader(dataset, batch_size=self.privacy_engine.batch_size, collate_fn=collator,
                              generator=generator, num_workers=self.args.dataloader_num_workers)

    # ------------------------------------------------------------------ the private step
    def compute_per_sample_losses(self, model: nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
        """[B] losses of one batch; override, or pass ``per_sample_loss``, for other objectives."""
        if self.per_sample_loss is not None:
            return self.per_sample_loss(model, inputs)
        if _task(model) != "seq2seq":  # the model's own (batch) loss would be computed for nothing
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        else:  # an encoder-decoder builds its decoder inputs from the labels
            outputs = model(**inputs)
        return per_sample_losses(model, inputs, outputs, token_reduction=self.token_loss_reduction,
                                 label_smoothing=self.args.label_smoothing_factor)

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        accumulation = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        if batch_len(inputs) == 0:  # an empty Poisson batch: nothing to back-propagate, the step adds noise
            return torch.zeros((), device=self.args.device)
        with self.compute_loss_context_manager():
            losses = self.compute_per_sample_losses(model, inputs)
        if losses.dim() != 1:
            raise ValueError(f"per-sample losses must have shape [B], got {tuple(losses.shape)}")
        self.privacy_engine.backward(losses)
        return losses.detach().mean() / accumulation  # Trainer sums these over the accumulation steps

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs or "train_loss" in logs:
            logs.pop("grad_norm", None)  # the norm of p.grad before the private step: not meaningful here
            logs["epsilon"] = self.privacy_engine.get_epsilon()
        super().log(logs, *args, **kwargs)
