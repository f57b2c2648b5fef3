"""Process bodies for tests/test_frameworks_distributed.py: each framework's own data-parallel path, 2 gloo
processes on the CPU, launched the way torchrun does (the environment variables), so the frameworks set up the
process group themselves.

Each trains 2 logical steps of 2 micro-batches per process (noise 0, SGD at lr 0.5, the batches from a seeded
generator) and saves its final parameters, steps and epsilon for the parent to compare with the single-process
float64 oracle on the specified batches.
"""
from __future__ import annotations

import os
import warnings

import torch

from framework_helpers import build_classifier, classifier_columns, classifier_losses

STEPS, ACCUMULATION, WORLD, BATCH, LR, SEED = 2, 2, 2, 8, 0.5, 7


def _environment(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      NODE_RANK="0", GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")


def _save(out: str, rank: int, params: dict, engine) -> None:
    torch.save({"params": {n.removeprefix("module."): p.detach().clone() for n, p in params.items()},
                "steps": engine.steps_taken, "epsilon": engine.get_epsilon(), "K": engine.max_batch_size,
                "parallel": type(engine._parallel).__name__}, f"{out}.rank{rank}")


def run_trainer(rank: int, world: int, port: int, out: str, R: float) -> None:
    """DPTrainer under DDP (the Trainer's Accelerate wraps the model; the engine is rebuilt on the wrapper)."""
    _environment(rank, world, port)
    import transformers as T

    from dptrain.integrations.hf_trainer import DPTrainer
    from test_hf_trainer import _dataset, _gpt2, _lm_data

    model = _gpt2().double()
    args = T.TrainingArguments(
        output_dir=f"{out}.dir", per_device_train_batch_size=BATCH // (ACCUMULATION * world),
        gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        data_seed=SEED, ddp_backend="gloo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = DPTrainer(model=model, args=args, train_dataset=_dataset(_lm_data(n=16)), noise_multiplier=0.0,
                            max_grad_norm=R)
        trainer.train()
    _save(out, rank, dict(model.named_parameters()), trainer.privacy_engine)
    torch.save([str(w.message) for w in caught if "trains alone" in str(w.message)], f"{out}.alone{rank}")


def run_accelerate(rank: int, world: int, port: int, out: str, R: float) -> None:
    """make_private under Accelerate's DDP (MULTI_CPU)."""
    _environment(rank, world, port)
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import send_to_device

    from dptrain.integrations.accelerate import make_private

    AcceleratorState._reset_state(reset_partial_state=True)  # (a forked process inherits the parent's state)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    model = build_classifier()
    prepared, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    private = make_private(accelerator, prepared, optimizer, torch.utils.data.TensorDataset(*classifier_columns()),
                           batch_size=BATCH, noise_multiplier=0.0, max_grad_norm=R, steps=4,
                           generator=torch.Generator().manual_seed(SEED))
    for batch in private.loader:
        (x, y), mask = send_to_device(batch, accelerator.device)
        with accelerator.accumulate(prepared):
            private.backward(classifier_losses(prepared, x, y), mask)
            optimizer.step()
            optimizer.zero_grad()
        if private.engine.steps_taken == STEPS:
            break
    _save(out, rank, dict(model.named_parameters()), private.engine)
    # without a generator: a secret seed from process 0, the same in every process
    from dptrain.integrations.loaders import sharded_poisson_loader

    secret = sharded_poisson_loader(torch.utils.data.TensorDataset(*classifier_columns()), BATCH, micro_batches=2)
    secret.poisson_sampler.resolve()
    torch.save(secret.poisson_sampler.generator.initial_seed(), f"{out}.seed{rank}")


def run_lightning(rank: int, world: int, port: int, out: str, R: float) -> None:
    """DPCallback under Lightning's DDP strategy."""
    _environment(rank, world, port)
    import lightning.pytorch as L

    from dptrain.integrations.lightning import DPCallback
    from test_lightning_integration import Lit

    dp = DPCallback(noise_multiplier=0.0, max_grad_norm=R, steps=4)
    module = Lit(classifier_columns(), batch_size=BATCH, lr=LR)
    trainer = L.Trainer(max_steps=STEPS, accumulate_grad_batches=ACCUMULATION, accelerator="cpu", devices=world,
                        strategy="ddp", use_distributed_sampler=False, callbacks=[dp], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module)
    _save(out, rank, dict(module.net.named_parameters()), dp.engine)
