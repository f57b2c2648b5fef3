"""Private fine-tuning with the Hugging Face ``Trainer``: :class:`DPTrainer`.

A ``Trainer`` script becomes private by changing the class and naming the privacy budget::

    from dptrain.integrations.hf_trainer import DPTrainer

    trainer = DPTrainer(
        model=model, args=training_args, train_dataset=train_ds, data_collator=collator,
        target_epsilon=3.0,          # or noise_multiplier=...
        max_grad_norm=1.0,           # per-sample clipping threshold
    )
    trainer.train()                  # or train(resume_from_checkpoint=...): epsilon continues
    print(trainer.privacy_report())

What changes inside the training loop:

* **Sampling.** The training batches are Poisson samples, the sampling the accounting is proven for: each
  step includes every example with probability ``q = B / len(train_dataset)``, ``B =
  per_device_train_batch_size * gradient_accumulation_steps * world_size`` the expected logical batch. Shapes
  stay fixed: a step's draw is cut to a uniformly random ``max_batch_size = K`` examples when larger
  (``"auto"``: the smallest K whose truncation costs a tenth of delta over the planned steps; the accounting
  adds it, ``accounting.truncation_delta``) and padded to K rows with a mask; every micro-batch of every
  process has ``K / (gradient_accumulation_steps * world_size)`` rows. One epoch is ``round(1 / q)`` steps.
  ``TrainingArguments.data_seed`` makes the batches reproducible; without it they come from OS entropy.
  ``poisson_sampling=False`` keeps the Trainer's shuffled fixed-size batches as an explicit opt-in: it logs,
  and ``privacy_report()`` records, that the reported epsilon is then not a proven bound.
* **The step.** ``training_step`` computes one loss per sample (``per_sample_loss``; by default from the
  model's logits and ``labels``) and hands them to ``engine.backward``, which clips each sample's gradient
  exactly (padding rows count 0). The ``optimizer.step()`` that ``Trainer`` calls applies the private
  gradient: (sum of clipped per-sample gradients + noise) / B. Gradient accumulation works as usual.
  ``TrainingArguments.max_grad_norm`` (clipping of the *batch* gradient) has no role: the ``max_grad_norm``
  given to ``DPTrainer`` is the per-sample threshold; the spent ``epsilon`` is logged instead of Trainer's
  ``grad_norm``.
* **Checkpoints.** Every Trainer checkpoint holds the engine's state (step count, accountant history, noise
  state) and the sampler's, in ``dptrain_state.pt``; ``train(resume_from_checkpoint=...)`` restores both, so
  epsilon and the batches continue exactly where the stopped run was, with fresh noise (the engine's
  checkpoint semantics, ``PrivacyEngine.load_state_dict``). A checkpoint without that file is refused. A resume
  with a longer plan keeps the checkpoint's ``max_batch_size`` (``"auto"``), recalibrating the noise with it.
* **Precision, memory, processes.** bf16 (autocast), fp16 with the Trainer's loss scaler (the engine takes
  the scale out before clipping; in one process an overflow is run again at a smaller scale, under DDP the
  step is skipped and counted), gradient (activation) checkpointing, and several processes with DDP
  (``torchrun`` / ``accelerate launch``) work. The engine is then built on the wrapped model when training
  starts; every process draws the same logical batch and takes its share, and the noise is added once.
  FSDP2 (``fsdp_config={"fsdp_version": 2}``) goes through the engine's FSDP2 path but is untested through
  the Trainer (Accelerate shards with FSDP on GPUs only; on a CPU it runs DDP).

Refused at construction, with the reason: ``torch_compile`` (compiled models bypass the engine's hooks),
DeepSpeed and FSDP1, ``nn.DataParallel`` (several GPUs in one process), ``auto_find_batch_size`` (it would
change q during the run), and with Poisson sampling a ``train_sampling_strategy`` other than ``"random"``.
"""
from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping, Sized
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

try:
    import accelerate  # noqa: F401  (the Trainer trains through it, and installing transformers does not bring it)
    from transformers import Trainer
    from transformers.models.auto import modeling_auto
    from transformers.utils import logging as hf_logging
except ImportError as err:  # pragma: no cover - exercised only without the extra
    missing = (err.name or "a module").split(".")[0]
    raise ImportError(
        f"dptrain.integrations.hf_trainer needs Hugging Face transformers and accelerate (the Trainer trains through "
        f"it), and {missing!r} is not installed: pip install 'dptrain[transformers]' installs both") from err

from .. import _checks
from ..core.algorithms import DEFAULT_CLIPPING_MODE
from ..data import masked_losses
from ..engine import PrivacyEngine
from ..losses import LOSS_REDUCTIONS, sequence_losses
from .common import check_run_state, engine_on, engine_settings, inner_optimizer, resumed_settings, run_state
from .loaders import MASK_KEY, ShardedPoissonLoader, sharded_poisson_loader, steps_per_epoch

__all__ = ["DPTrainer", "STATE_FILE", "per_sample_losses"]

logger = hf_logging.get_logger(__name__)

#: The file in each Trainer checkpoint that holds the engine's and the sampler's state.
STATE_FILE = "dptrain_state.pt"
"""The file in each Trainer checkpoint folder that holds the engine's and the sampler's state."""


def _names(mapping: Mapping) -> set[str]:
    out: set[str] = set()
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
    """The transformers model inside a DDP or PEFT wrapper (or the model itself)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
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
        config: Any = _base_model(model).config  # (a transformers PretrainedConfig)
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

    Takes every ``Trainer`` argument, plus the privacy settings: exactly one of ``noise_multiplier`` or
    ``target_epsilon`` (the noise is then calibrated to the planned number of steps, from ``max_steps`` or
    ``num_train_epochs``), ``target_delta`` (default ``1 / (10 n)`` for n training examples),
    ``max_grad_norm`` (the per-sample clipping threshold), ``clipping_mode`` and any other ``PrivacyEngine``
    keyword in ``engine_kwargs``.

    ``poisson_sampling`` (default True) and ``max_batch_size`` (the fixed rows K of a logical batch: an int,
    a multiple of ``gradient_accumulation_steps * world_size``, or ``"auto"``) choose the sampling (see the
    module documentation). ``per_sample_loss(model, inputs) -> [B]`` replaces the default loss (see
    :func:`per_sample_losses`); ``token_loss_reduction`` chooses per-sequence ``"mean"`` or ``"sum"`` for
    the default token losses. The engine is ``trainer.privacy_engine``; :meth:`privacy_report` says what
    was spent and how the batches were drawn.
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
        poisson_sampling: bool = True,
        max_batch_size: int | str = "auto",
        engine_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        _checks.choice("token_loss_reduction", token_loss_reduction, LOSS_REDUCTIONS)
        if not isinstance(poisson_sampling, bool):
            raise ValueError(f"poisson_sampling must be True or False, got {poisson_sampling!r}")
        if poisson_sampling and max_batch_size is None:
            raise ValueError("max_batch_size must be an int or 'auto' (the Trainer's batches have fixed shapes: a "
                             "micro-batch may not be empty), got None")
        self.per_sample_loss = per_sample_loss
        self._check_arguments(poisson_sampling, engine_kwargs or {})
        self.token_loss_reduction = token_loss_reduction
        self.poisson_sampling = poisson_sampling

        args_ = self.args
        shares = args_.gradient_accumulation_steps * args_.world_size
        sample_size = len(cast(Sized, self.train_dataset))  # (checked: it has a length)
        batch_size = args_.per_device_train_batch_size * shares
        if args_.max_steps > 0:
            steps = args_.max_steps
        else:  # the Trainer's epochs: round(1/q) Poisson steps, or its own count of shuffled batches
            per_epoch = (steps_per_epoch(batch_size / sample_size) if poisson_sampling
                         else math.ceil(sample_size / batch_size))
            steps = math.ceil(args_.num_train_epochs * per_epoch)
        self._engine_settings = engine_settings(
            sample_size=sample_size, batch_size=batch_size, shares=shares, max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, target_delta=target_delta,
            steps=steps, epochs=None, max_batch_size=max_batch_size if poisson_sampling else None,
            engine_kwargs={"clipping_mode": clipping_mode, **dict(engine_kwargs or {})})
        self._max_batch_size = max_batch_size  # (as given: "auto" keeps a resumed checkpoint's K)
        self.privacy_engine = self._new_engine()
        self._attached_to: torch.optim.Optimizer | None = None
        self._train_loader: ShardedPoissonLoader | None = None
        self._resumed_state: dict | None = None
        if not poisson_sampling:
            message = ("DPTrainer draws the Trainer's shuffled fixed-size batches (poisson_sampling=False): the "
                       "reported epsilon is the Poisson-sampling epsilon, which is not a proven bound for them")
            logger.warning(message)
            warnings.warn(message, stacklevel=2)

    def _new_engine(self) -> PrivacyEngine:
        with warnings.catch_warnings():
            if self.args.world_size > 1:  # (the engine that trains is built on the DDP-wrapped model at the first step)
                warnings.filterwarnings("ignore", message="torch.distributed runs .* neither DistributedDataParallel")
            assert self.model is not None  # (Trainer.__init__ sets it, from model_init too)
            return PrivacyEngine(self.model, **self._engine_settings)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; resuming, the engine keeps the checkpoint's ``max_batch_size`` (a longer plan would take
        another, and the interrupted epoch's batches are drawn again only with theirs)."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            checkpoint = get_last_checkpoint(self.args.output_dir)
        path = os.path.join(checkpoint, STATE_FILE) if isinstance(checkpoint, str) else None
        state = check_run_state(torch.load(path, weights_only=False), path) if path and os.path.isfile(path) else {}
        if self.poisson_sampling and state.get("sampler") is not None:  # (another sampling: refused at its load)
            settings = resumed_settings(self._engine_settings, self._max_batch_size, state,
                                        self.args.gradient_accumulation_steps * self.args.world_size, "DPTrainer")
            if settings != self._engine_settings:
                if self._attached_to is not None:
                    self.privacy_engine.detach()
                    self._attached_to = None
                self._engine_settings = settings
                self.privacy_engine = self._new_engine()
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _check_arguments(self, poisson_sampling: bool, engine_kwargs: Mapping[str, Any]) -> None:
        args = self.args
        problems = []
        own_loss = type(self).compute_per_sample_losses is not DPTrainer.compute_per_sample_losses
        if self.per_sample_loss is None and not own_loss:
            # (the Trainer's batch loss is what per-sample clipping cannot use: training would silently take the
            # default per-sample loss instead)
            if type(self).compute_loss is not DPTrainer.compute_loss:
                problems.append("compute_loss is overridden, but DPTrainer trains on per-sample losses and never calls "
                                "it in training: override compute_per_sample_losses(model, inputs) -> [B] instead, or "
                                "pass per_sample_loss=fn(model, inputs)")
            if getattr(self, "compute_loss_func", None) is not None:
                problems.append("compute_loss_func= gives a batch loss, which DPTrainer never calls in training: pass "
                                "per_sample_loss=fn(model, inputs) -> [B] instead")
        if engine_kwargs.get("privacy_unit", "example") != "example":
            problems.append(f"privacy_unit={engine_kwargs['privacy_unit']!r}: DPTrainer samples examples; for "
                            "user-level privacy use PrivacyEngine(privacy_unit='user') with "
                            "dptrain.data.poisson_loader(..., users=...) in your own loop (docs/user-level.md)")
        if args.torch_compile:
            problems.append("torch_compile=True: compiled models bypass the per-layer hooks the engine relies on")
        if getattr(self, "is_deepspeed_enabled", False):
            problems.append("DeepSpeed: its ZeRO stages own the gradient buffers the engine writes; use DDP or FSDP2")
        if getattr(self, "is_fsdp_enabled", False) and getattr(self.accelerator.state.fsdp_plugin, "fsdp_version",
                                                               1) != 2:
            problems.append("FSDP1 hides the layers' weights in flat parameters: use fsdp_config={'fsdp_version': 2}")
        if args.n_gpu > 1:
            problems.append(f"{args.n_gpu} GPUs in one process (nn.DataParallel): launch one process per GPU with "
                            "torchrun or accelerate launch")
        if args.auto_find_batch_size:
            problems.append("auto_find_batch_size=True changes the batch size, hence q, during the run: set "
                            "per_device_train_batch_size")
        strategy = getattr(args, "train_sampling_strategy", "random")
        if poisson_sampling and strategy != "random":
            problems.append(f"train_sampling_strategy={strategy!r} orders or groups the batches, which Poisson "
                            "sampling does not: leave it at 'random' (or opt out with poisson_sampling=False)")
        if self.train_dataset is None or not hasattr(self.train_dataset, "__len__"):
            problems.append("a train_dataset with a length is needed: the sample rate is batch_size / len(dataset)")
        if problems:
            raise ValueError("DPTrainer cannot train privately with these settings:\n- " + "\n- ".join(problems))

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self):
        """The Poisson loader with fixed shapes (``poisson_sampling=True``, the default), or the Trainer's own."""
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
        # Secret sampling randomness (OS entropy, agreed by all processes) unless data_seed asks for reproducible
        # batches: a known seed such as Trainer's default seed=42 would make the batches predictable.
        generator = None if self.args.data_seed is None else torch.Generator().manual_seed(self.args.data_seed)
        engine = self.privacy_engine
        loader = sharded_poisson_loader(
            dataset, engine.batch_size, max_batch_size=engine.max_batch_size,
            micro_batches=self.args.gradient_accumulation_steps, num_replicas=self.args.world_size,
            rank=self.args.process_index, generator=generator, collate_fn=collator,
            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory,
            mask_key=MASK_KEY)
        loader.mask_call = (f"DPTrainer.training_step passes the batch's {MASK_KEY!r} entry to engine.backward(losses, "
                            "mask=...): keep it in the batch (a training_step of your own: pop it and pass it so)")
        loader.poisson_sampler.resolve()  # the process group is up: agree on the seed now, with every process
        self._train_loader = loader
        return loader

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        # (written first: a checkpoint the Trainer sees as complete always holds the privacy state)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        output_dir = os.path.join(self._get_output_dir(trial=trial), folder)
        state = run_state(self.privacy_engine, self._sampler_state())
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            torch.save(state, os.path.join(output_dir, STATE_FILE))
        super()._save_checkpoint(model, trial)

    def _sampler_state(self) -> dict | None:
        if self._train_loader is None:
            return None
        sampler = self._train_loader.poisson_sampler
        return sampler.state_in_epoch(self.state.global_step % sampler.steps)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.isfile(path):
            if self.state.global_step > 0:
                raise FileNotFoundError(
                    f"{checkpoint} holds no privacy state ({STATE_FILE}): it was not written by a DPTrainer, so "
                    f"resuming its {self.state.global_step} steps would restart the privacy accounting at 0 and "
                    "report too small an epsilon. Resume from a DPTrainer checkpoint, or start a new run")
            return
        state = check_run_state(torch.load(path, weights_only=False), path)
        self._resumed_state = state
        sampler_state = state.get("sampler")
        if self._train_loader is not None:
            if sampler_state is None:
                raise ValueError(f"{path} holds no sampler state (it was saved with poisson_sampling=False): resume "
                                 "with the same sampling")
            sampler_state = dict(sampler_state)
            if not self.args.ignore_data_skip:
                sampler_state["position"] = 0  # the Trainer itself skips the batches of this epoch already trained
            try:
                self._train_loader.load_state_dict(sampler_state)
            except ValueError as err:
                saved = sampler_state.get("num_samples"), sampler_state.get("sample_rate")
                raise ValueError(
                    f"{checkpoint} was trained on batches of another sampling: {saved[0]} training examples at a "
                    f"sample rate of {saved[1]} (expected batch size per_device_train_batch_size x "
                    "gradient_accumulation_steps x world_size over len(train_dataset)), its epochs and max_batch_size; "
                    "this run's differ, so the saved batches and the privacy accounting cannot continue. Resume with "
                    f"the checkpoint's train_dataset and batch settings, or start a new run ({err})") from None
        elif sampler_state is not None:
            raise ValueError(f"{path} was saved with Poisson sampling: resume with poisson_sampling=True")

    # ------------------------------------------------------------------ the private step
    def _attach(self, model: nn.Module) -> None:
        """At the first step of each ``train()``: the engine on the model as prepared (wrapped by DDP, sharded by
        FSDP2), attached to the prepared optimizer, with the loader it checks and the Trainer's loss scaler."""
        optimizer = inner_optimizer(self.optimizer)
        if self._attached_to is optimizer:
            return
        if self._attached_to is not None:
            self.privacy_engine.detach()
            self._attached_to = None
        engine = engine_on(model, self.privacy_engine, self._engine_settings)
        if self._resumed_state is not None:
            engine.load_state_dict(self._resumed_state["engine"])
            self._resumed_state = None
        engine.attach(optimizer, data_loader=self._train_loader, grad_scaler=self.accelerator.scaler)
        self.privacy_engine, self._attached_to = engine, optimizer

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
        """Per-sample losses of the micro-batch, clipped by ``engine.backward`` (through the scaler with fp16); the
        Trainer's ``optimizer.step()`` then applies the private gradient. Returns the mean loss, for the logs."""
        model.train()
        self._attach(model)
        inputs = dict(self._prepare_inputs(inputs))
        mask = inputs.pop(MASK_KEY, None)
        accumulation = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        with self.compute_loss_context_manager():
            losses = self.compute_per_sample_losses(model, inputs)
        if losses.dim() != 1:
            raise ValueError(f"per-sample losses must have shape [B], got {tuple(losses.shape)}")
        scaler = self.accelerator.scaler
        self.privacy_engine.backward(scaler.scale(losses) if scaler is not None else losses, mask=mask)
        detached = losses.detach()
        if mask is not None:
            detached = masked_losses(detached, mask).sum() / mask.sum().clamp(min=1)
        return detached.mean() / accumulation  # Trainer sums these over the accumulation steps

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's logs, with the epsilon spent instead of the norm of the batch gradient."""
        if "loss" in logs or "train_loss" in logs:
            logs.pop("grad_norm", None)  # the norm of p.grad before the private step: not meaningful here
            logs["epsilon"] = self.privacy_engine.get_epsilon()
        super().log(logs, *args, **kwargs)

    def privacy_report(self, delta: float | None = None) -> dict:
        """The engine's report, and how the batches were drawn: ``epsilon_is_proven_bound`` is False for the
        shuffled batches of ``poisson_sampling=False``."""
        report = self.privacy_engine.privacy_report(delta)
        if self.poisson_sampling:
            report["sampling"] = f"Poisson, fixed shapes of {self.privacy_engine.max_batch_size} rows per step"
            report["epsilon_is_proven_bound"] = True
        else:
            report["sampling"] = "shuffled fixed-size batches (poisson_sampling=False)"
            report["epsilon_is_proven_bound"] = False
            report["note"] = ("epsilon is the Poisson-sampling epsilon; it is not a proven bound for shuffled "
                              "batches. Train with poisson_sampling=True for a guarantee")
        return report
