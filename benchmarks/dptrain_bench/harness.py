"""Benchmark harness: step time, peak memory and (on GPU) the largest batch, per model and clipping mode.

``main(argv)`` is the ``dptrain bench`` command (and ``benchmarks/run.py``). For every
configuration (a model at a size and batch) it compares *arms*: non-private training, the
seven dptrain clipping modes and, when Opacus is installed, Opacus' ``hooks`` and ``ghost``
modes. Each measurement runs in a fresh subprocess:

- **memory**: one process per arm: build the model, take the baseline, run a warm-up step
  and one more step; the peak above the baseline. On CPU the peak is the kernel's resident
  high-water mark (``VmHWM``), reset to the current RSS (``/proc/self/clear_refs``) once the
  model, batches, optimizer and engine exist; on GPU ``torch.cuda.max_memory_allocated``.
  A crash (out of memory, an Opacus exception) then costs one arm, not the run.
- **time**: one process per configuration holds every arm that passed the memory stage, on
  the same batches; after warm-up the arms take their timed steps round-robin, in a shuffled
  order per round, so that load from other processes on a shared machine hits every arm
  alike. A step is forward + loss + backward + optimizer step + zero_grad; we report the
  median.
- **largest batch** (GPU only): one process per arm, doubling then bisecting the physical
  batch until CUDA runs out of memory; then the throughput at that batch.

Results are written as JSON (every figure, with hardware, versions and date), CSV, a
Markdown table and a PNG plot (memory and throughput per arm, as in the papers' figures).
"""
from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import datetime as _dt
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.algorithms import CLIPPING_MODES

from .options import ALL_ARMS, NON_PRIVATE, OPACUS_ARMS, PRESET_NAMES, SCALES, parser

SAMPLE_SIZE = 50_000  # dataset size given to the engines: only the sample rate (accounting) depends on it
SEED = 0


# ====================================================================== models and batches


def cifar_cnn(num_classes: int = 10, image_size: int = 32) -> nn.Sequential:
    """The CIFAR-10 CNN of Papernot et al. (2021) / Tramer & Boneh (2021), 550,570 parameters at 32x32.

    The mixed-ghost paper's Table 4 benchmarks it as "CNN [45, 35] 0.551M": six 3x3 convs
    (32, 32, M, 64, 64, M, 128, 128, M) with tanh and 2x2 max-pooling, then 128 -> 10.
    """
    layers: list[nn.Module] = []
    channels = 3
    for v in (32, 32, "M", 64, 64, "M", 128, 128, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(channels, v, 3, padding=1), nn.Tanh()]
            channels = v
    side = image_size // 8
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(128 * side * side, 128), nn.Tanh(), nn.Linear(128, num_classes))


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(channels, 32), channels)


def vgg11_gn(num_classes: int = 10, head: str = "cifar", hidden: int = 4096) -> nn.Module:
    """torchvision's ``vgg11_bn`` with every BatchNorm replaced by GroupNorm (dptrain refuses BatchNorm).

    ``head="cifar"``: the 32x32 model of the papers' CIFAR runs (kuangliu/pytorch-cifar, 9.2M
    parameters): the 1x1 feature map goes straight into ``Linear(512, num_classes)``.
    ``head="imagenet"``: torchvision's classifier (7x7 average pool, two hidden layers of width
    ``hidden`` with dropout), as the papers use at 224x224.
    """
    import torchvision

    model = torchvision.models.vgg11_bn(weights=None, num_classes=num_classes)
    for i, layer in enumerate(model.features):
        if isinstance(layer, nn.BatchNorm2d):
            model.features[i] = _group_norm(layer.num_features)
    if head == "cifar":
        model.avgpool = nn.Identity()
        model.classifier = nn.Linear(512, num_classes)
    elif hidden != 4096:
        model.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, hidden), nn.ReLU(True), nn.Dropout(),
            nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(),
            nn.Linear(hidden, num_classes),
        )
    return model


def resnet18_gn(num_classes: int = 10) -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(weights=None, num_classes=num_classes, norm_layer=_group_norm)


def timm_vit(name: str, num_classes: int = 10, image_size: int = 224) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=num_classes, img_size=image_size)


def gpt2(layers: int, width: int, heads: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=1024, use_cache=False)
    return GPT2LMHeadModel(config)


def roberta(layers: int, width: int, heads: int, num_labels: int = 2) -> nn.Module:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    config = RobertaConfig(
        num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
        intermediate_size=4 * width, num_labels=num_labels,
    )
    return RobertaForSequenceClassification(config)


@dataclass(frozen=True)
class Task:
    """How to build a model, draw its batches and compute its per-sample losses."""

    kind: str                   # "image", "lm" or "seq-cls"
    build: Callable[[], nn.Module]
    image_size: int = 32
    seq_len: int = 0
    vocab: int = 0
    num_classes: int = 10

    def make_batch(self, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        if self.kind == "image":
            return {
                "x": torch.randn(batch_size, 3, self.image_size, self.image_size, generator=generator,
                                 device=generator.device),
                "y": torch.randint(0, self.num_classes, (batch_size,), generator=generator, device=generator.device),
            }
        # token ids from 3 up: skip RoBERTa's special ids (padding 1 would shift its positions)
        ids = torch.randint(3, self.vocab, (batch_size, self.seq_len), generator=generator, device=generator.device)
        if self.kind == "lm":
            return {"ids": ids}
        return {"ids": ids, "y": torch.randint(0, self.num_classes, (batch_size,), generator=generator,
                                               device=generator.device)}

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor], batched_positions: bool = False) -> torch.Tensor:
        """``batched_positions``: give GPT-2 its position ids as [B, T] instead of letting it broadcast [1, T]."""
        if self.kind == "image":
            return model(batch["x"])
        if batched_positions and self.kind == "lm":
            ids = batch["ids"]
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            return model(input_ids=ids, position_ids=positions).logits
        return model(input_ids=batch["ids"]).logits

    def per_sample_loss(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B] losses; a sequence is one sample (its token losses averaged)."""
        if self.kind == "lm":
            B, T, V = output.shape
            tokens = F.cross_entropy(output[:, :-1].reshape(-1, V), batch["ids"][:, 1:].reshape(-1), reduction="none")
            return tokens.view(B, T - 1).mean(1)
        return F.cross_entropy(output, batch["y"], reduction="none")


def _image_task(build, image_size):
    return Task("image", build, image_size=image_size)


@dataclass(frozen=True)
class BenchConfig:
    """One model at one size and physical batch, with its number of warm-up and timed steps."""

    name: str
    description: str
    batch_size: int
    warmup: int
    steps: int
    task: Callable[[], Task] = field(repr=False, compare=False)


def _configs(scale: str) -> list[BenchConfig]:
    """The benchmark models at the papers' sizes; ``cpu`` scales them down so the whole suite runs on two cores."""
    cpu = scale == "cpu"
    out: list[BenchConfig] = []
    if cpu:  # the CPU targets come first, at exactly the sizes their targets are set for
        out.append(BenchConfig(
            "gpt2-t64", "GPT-2 (HF config) 4 layers, width 256, 4 heads, vocab 50257 (tied), T=64", 16, 3, 10,
            lambda: Task("lm", lambda: gpt2(4, 256, 4), seq_len=64, vocab=50257)))
    out.append(BenchConfig(
        "vgg11-gn-32", "VGG-11 (vgg11_bn with GroupNorm), CIFAR head Linear(512, 10), 32x32", 32 if cpu else 256,
        3, 10, lambda: _image_task(vgg11_gn, 32)))
    out.append(BenchConfig(
        "cifar-cnn", "CIFAR-10 CNN of Papernot et al. / Tramer & Boneh (6 conv, tanh; 0.551M params), 32x32",
        64 if cpu else 256, 2 if cpu else 3, 5 if cpu else 10, lambda: _image_task(cifar_cnn, 32)))
    out.append(BenchConfig(
        "resnet18-gn-32", "ResNet-18 (torchvision, GroupNorm), 32x32", 32 if cpu else 256,
        2 if cpu else 3, 5 if cpu else 10, lambda: _image_task(resnet18_gn, 32)))
    vgg224 = (lambda: vgg11_gn(head="imagenet", hidden=512)) if cpu else (lambda: vgg11_gn(head="imagenet"))
    out.append(BenchConfig(
        "vgg11-gn-224",
        "VGG-11 (vgg11_bn with GroupNorm), torchvision head" + (" with hidden width 512 (scaled from 4096)" if cpu else "")
        + ", 224x224", 4 if cpu else 32, 1 if cpu else 3, 3 if cpu else 10, lambda: _image_task(vgg224, 224)))
    out.append(BenchConfig(
        "resnet18-gn-224", "ResNet-18 (torchvision, GroupNorm), 224x224", 4 if cpu else 32,
        1 if cpu else 3, 3 if cpu else 10, lambda: _image_task(resnet18_gn, 224)))
    if not cpu:  # the GPU table's second ResNet-18 row: where the fixed cost per layer matters less
        out.append(BenchConfig(
            "resnet18-gn-224-b128", "ResNet-18 (torchvision, GroupNorm), 224x224, batch 128", 128, 3, 10,
            lambda: _image_task(resnet18_gn, 224)))
    vit = "vit_tiny_patch16_224" if cpu else "vit_base_patch16_224"
    out.append(BenchConfig(
        "vit-224", f"ViT timm {vit}, random weights, 224x224", 4 if cpu else 32, 1 if cpu else 3, 3 if cpu else 10,
        lambda: _image_task(lambda: timm_vit(vit), 224)))
    gpt_size = (4, 256, 4) if cpu else (12, 768, 12)
    gpt_name = "GPT-2 (HF config) " + ("4 layers, width 256 (scaled from GPT-2 small)" if cpu else "small (12 layers, 768)")
    for T, b_cpu, b_full in ((100, 8, 32), (1000, 2, 4)):
        out.append(BenchConfig(
            f"gpt2-t{T}", f"{gpt_name}, vocab 50257 (tied), T={T}", b_cpu if cpu else b_full,
            1 if cpu else 3, 3 if cpu else 10,
            lambda T=T: Task("lm", lambda: gpt2(*gpt_size), seq_len=T, vocab=50257)))
    rob_size = (4, 256, 4) if cpu else (12, 768, 12)
    out.append(BenchConfig(
        "roberta-256",
        "RoBERTa " + ("4 layers, width 256 (scaled from base)" if cpu else "base") + " sequence classification, T=256",
        4 if cpu else 32, 1 if cpu else 3, 3 if cpu else 10,
        lambda: Task("seq-cls", lambda: roberta(*rob_size), seq_len=256, vocab=50265, num_classes=2)))
    return out


def smoke_config(batch_size: int = 4, steps: int = 2) -> BenchConfig:
    """A tiny configuration (the CIFAR CNN on 8x8 images) for tests of the harness itself."""
    return BenchConfig("smoke-cnn", "CIFAR CNN on 8x8 images (harness smoke test)", batch_size, 1, steps,
                       lambda: _image_task(lambda: cifar_cnn(image_size=8), 8))


def configs_for(scale: str) -> dict[str, BenchConfig]:
    out = {c.name: c for c in _configs(scale)}
    smoke = smoke_config()
    out[smoke.name] = smoke
    return out


# ====================================================================== arms


@dataclass
class Arm:
    """One way of training a model: ``step(batch)`` runs forward, backward and the optimizer step."""

    name: str
    step: Callable[[dict], None]
    close: Callable[[], None]
    note: str = ""  # how the model had to be changed for this arm, if at all


class _PerSampleCriterion(nn.Module):
    """The task's loss as a criterion with a ``reduction`` attribute, as Opacus' ghost mode needs."""

    def __init__(self, task: Task):
        super().__init__()
        self.task = task
        self.reduction = "mean"

    def forward(self, output, batch):
        losses = self.task.per_sample_loss(output, batch)
        return losses if self.reduction == "none" else (losses.mean() if self.reduction == "mean" else losses.sum())


def make_arm(name: str, model: nn.Module, task: Task, batch_size: int) -> Arm:
    # Plain SGD keeps no optimizer state, so memory differences come from clipping alone.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if name == NON_PRIVATE:
        def step(batch):
            task.per_sample_loss(task.forward(model, batch), batch).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return Arm(name, step, lambda: None)
    if name in CLIPPING_MODES:
        from dptrain.engine import PrivacyEngine

        engine = PrivacyEngine(model, batch_size=batch_size, sample_size=SAMPLE_SIZE, max_grad_norm=1.0,
                               noise_multiplier=1.0, clipping_mode=name, seed=SEED)
        engine.attach(optimizer)

        def step(batch):
            engine.backward(task.per_sample_loss(task.forward(model, batch), batch))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return Arm(name, step, engine.detach)
    if name in OPACUS_ARMS:
        return _opacus_arm(name, model, task, batch_size, optimizer)
    raise ValueError(f"unknown arm {name!r}; valid: {', '.join(ALL_ARMS)}")


def _opacus_arm(name, model, task, batch_size, optimizer) -> Arm:
    import opacus
    from torch.utils.data import DataLoader, TensorDataset

    # Opacus' full backward hooks refuse in-place activations (torchvision's ReLU(inplace=True)):
    # the usual user fix, applied to this arm's copy only.
    inplace = [m for m in model.modules() if getattr(m, "inplace", False) is True]
    for m in inplace:
        m.inplace = False
    notes = []
    if inplace:
        notes.append(f"in-place turned off on {len(inplace)} activation modules (Opacus refuses them)")
    # Opacus needs every layer's input batched: GPT-2's position ids [1, T] broadcast over the
    # batch would give its position embedding per-sample gradients of batch 1.
    batched_positions = task.kind == "lm"
    if batched_positions:
        notes.append("position ids passed as [B, T] (Opacus cannot take them broadcast over the batch)")
    note = "; ".join(notes)
    # Only the loader's length matters to Opacus here (it sets the sample rate); batches are ours.
    loader = DataLoader(TensorDataset(torch.zeros(SAMPLE_SIZE, 1)), batch_size=batch_size)
    engine = opacus.PrivacyEngine(accountant="rdp")
    common = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                  poisson_sampling=False)
    if name == "opacus-hooks":
        wrapped, dp_optimizer, _ = engine.make_private(**common, grad_sample_mode="hooks")

        def step(batch):
            task.per_sample_loss(task.forward(wrapped, batch, batched_positions), batch).mean().backward()
            dp_optimizer.step()
            dp_optimizer.zero_grad(set_to_none=True)
    else:
        wrapped, dp_optimizer, criterion, _ = engine.make_private(
            **common, criterion=_PerSampleCriterion(task), grad_sample_mode="ghost")

        def step(batch):
            criterion(task.forward(wrapped, batch, batched_positions), batch).backward()  # Opacus runs both backward passes here
            dp_optimizer.step()
            dp_optimizer.zero_grad(set_to_none=True)

    return Arm(name, step, getattr(wrapped, "cleanup", None) or wrapped.remove_hooks, note)


# ====================================================================== measurement primitives


def _proc_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


#: glibc settings for the CPU memory workers: blocks of 128 KiB and more are mapped and returned to
#: the kernel when freed (by default malloc keeps up to 32 MiB per freed block and trims lazily), so
#: the resident set follows the live bytes, as ``torch.cuda.max_memory_allocated`` does on a GPU:
#: without them an arm's peak depended on what the allocator happened to keep from earlier steps.
LIVE_BYTES_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _malloc_follows_live_bytes() -> bool:
    return all(os.environ.get(k) == v for k, v in LIVE_BYTES_MALLOC.items())


def _reset_rss_peak() -> bool:
    """Reset the kernel's resident high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory above a baseline taken at ``start()``, in bytes.

    CPU: resident set size. ``VmHWM`` after ``clear_refs`` is exact (the kernel tracks it at
    every page fault); without it, ``ru_maxrss`` is the process's lifetime peak, an upper
    bound (it may include model construction). GPU: ``torch.cuda.max_memory_allocated``.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.method = ""
        self.baseline = 0

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated"
        elif _reset_rss_peak() and _proc_status_kb("VmHWM") is not None:
            self.baseline = _proc_status_kb("VmRSS") * 1024
            self.method = "VmHWM after clear_refs (exact RSS peak)"
            if _malloc_follows_live_bytes():
                self.method += "; malloc returns freed blocks >= 128 KiB at once"
        else:
            self.baseline = _proc_status_kb("VmRSS") * 1024 if _proc_status_kb("VmRSS") else 0
            self.method = "ru_maxrss (lifetime RSS peak: an upper bound)"

    def peak(self) -> int:
        """The peak since ``start()``, in bytes (total, not above the baseline)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        hwm = _proc_status_kb("VmHWM")
        if hwm is not None and self.method.startswith("VmHWM"):
            return hwm * 1024
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def largest_batch(fits: Callable[[int], bool], start: int, cap: int) -> int:
    """Largest batch size b <= cap with ``fits(b)``, for a monotone ``fits``; 0 if even 1 does not fit.

    Doubling from ``start`` until a failure (or the cap), then bisection, as in the
    mixed-ghost paper's maximum-batch experiments.
    """
    return search_largest_batch(fits, start, cap).found


@dataclass(frozen=True)
class BatchSearch:
    """What a largest-batch search established: ``found`` fits; ``too_large`` (if known) does not."""

    found: int
    too_large: int | None
    stopped: str = ""  # why the bracket was left open: "time budget" or "tolerance"; "" if exact

    def describe(self) -> str:
        if not self.stopped:
            return str(self.found)
        upper = f", {self.too_large} does not" if self.too_large else ""
        return f"{self.found} fits{upper} (stopped by the {self.stopped})"


def search_largest_batch(fits: Callable[[int], bool], start: int, cap: int, *, deadline: float | None = None,
                         clock: Callable[[], float] = time.monotonic, rel_tolerance: float = 0.0) -> BatchSearch:
    """Doubling then bisection (see ``largest_batch``) that starts no new trial once ``clock()`` passes
    ``deadline``, and stops bisecting once the bracket is within ``rel_tolerance`` of the batch found."""
    lo, hi = 0, None  # fits(lo) (0 trivially); hi is the smallest size known not to fit
    b = max(1, min(start, cap))

    def out_of_time() -> bool:
        return deadline is not None and clock() >= deadline

    while hi is None:
        if lo and out_of_time():
            return BatchSearch(lo, None, "time budget")
        if fits(b):
            lo = b
            if b >= cap:
                return BatchSearch(b, None)
            b = min(2 * b, cap)
        else:
            hi = b
    while hi - lo > max(1, int(rel_tolerance * lo)):
        if out_of_time():
            return BatchSearch(lo, hi, "time budget")
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return BatchSearch(lo, hi, "" if hi - lo <= 1 else "tolerance")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return "out of memory" in text or "can't allocate memory" in text or "cannot allocate memory" in text


def _describe(exc: BaseException) -> str:
    if _is_oom(exc):
        return "out of memory: " + _first_line(exc)
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else "")[:400]


# ====================================================================== workers (run in subprocesses)


def _start_memory_watchdog(limit_bytes: int, marker: Path, period_s: float = 0.02) -> None:
    """Kill this worker once its resident memory passes ``limit_bytes`` above the current RSS.

    So that an arm needing too much fails alone (the parent reads the marker and records it
    as out of memory) instead of waking the kernel's OOM killer on a shared machine. RSS,
    not the address space: RLIMIT_AS also counts reserved, untouched memory.
    """
    start = (_proc_status_kb("VmRSS") or 0) * 1024

    def watch():
        while True:
            rss = (_proc_status_kb("VmRSS") or 0) * 1024
            if rss - start > limit_bytes:
                marker.write_text(f"resident memory passed the cap of {limit_bytes / 2**20:.0f} MiB above "
                                  f"the worker's start ({rss / 2**30:.1f} GiB resident); see --mem-limit-gb")
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(period_s)

    threading.Thread(target=watch, name="memory-watchdog", daemon=True).start()


def _setup_worker(task: dict) -> torch.device:
    device = torch.device(task["device"])
    if not task.get("isolated", True):
        return device  # in-process (tests): leave the caller's threads and limits alone
    torch.set_num_threads(task["threads"])
    if device.type == "cpu" and task.get("mem_limit_bytes") and task.get("oom_marker"):
        _start_memory_watchdog(task["mem_limit_bytes"], Path(task["oom_marker"]))
    import warnings

    warnings.filterwarnings("ignore")
    return device


def _build(config: BenchConfig, device: torch.device, batch_size: int, n_batches: int):
    task = config.task()
    torch.manual_seed(SEED)
    model = task.build().to(device).train()
    generator = torch.Generator().manual_seed(SEED + 1)
    batches = [{k: v.to(device) for k, v in task.make_batch(batch_size, generator).items()} for _ in range(n_batches)]
    return task, model, batches


def _worker_memory(task: dict) -> dict:
    device = _setup_worker(task)
    config = configs_for(task["scale"])[task["config"]]
    task_, model, batches = _build(config, device, config.batch_size, 2)
    arm = make_arm(task["arm"], model, task_, config.batch_size)
    meter = PeakMemory(device)
    meter.start()
    for batch in batches:  # a warm-up step (one-time allocations count: they are real) and one more
        arm.step(batch)
    peak = meter.peak()
    arm.close()
    return {"peak_bytes": peak, "baseline_bytes": meter.baseline, "peak_above_baseline_bytes": peak - meter.baseline,
            "memory_method": meter.method, "note": arm.note}


def _discard(arm: Arm | None) -> None:
    """Release a failed arm's model and hooks; its own failure is already recorded."""
    if arm is not None:
        try:
            arm.close()
        except Exception:  # noqa: BLE001 - a half-done step may leave the engine mid-state
            pass
    gc.collect()


def _worker_time(task: dict) -> dict:
    device = _setup_worker(task)
    config = configs_for(task["scale"])[task["config"]]
    warmup, steps = task["warmup"], task["steps"]
    task_, reference, batches = _build(config, device, config.batch_size, warmup + steps)
    arms: dict[str, Arm] = {}
    failures: dict[str, str] = {}
    for name in task["arms"]:
        arm = None
        try:
            arm = make_arm(name, copy.deepcopy(reference), task_, config.batch_size)
            for batch in batches[:warmup]:
                arm.step(batch)
            _sync(device)
            arms[name] = arm
        except Exception as exc:  # noqa: BLE001 - an arm's failure is a result, the others go on
            failures[name] = _describe(exc)
        if name in failures:
            _discard(arm)
            arm = None
    del reference
    wall: dict[str, list[float]] = {name: [] for name in arms}
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    order = list(arms)
    rng = random.Random(SEED)
    for batch in batches[warmup:]:
        rng.shuffle(order)  # no arm always runs right after the same neighbour
        for name in list(order):
            if name in failures:
                continue
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                arms[name].step(batch)
                _sync(device)
            except Exception as exc:  # noqa: BLE001
                failures[name] = _describe(exc)
            if name in failures:
                # drop the arm now: its model, engine and half-done step must not crowd out the others
                _discard(arms.pop(name))
                continue
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    out = {}
    for name in task["arms"]:
        if name in failures:
            out[name] = {"error": failures[name]}
        else:
            out[name] = {"step_times_s": wall[name], "cpu_times_s": cpu[name]}
    return out


def _worker_max_batch(task: dict) -> dict:
    """Largest batch of one arm; ``budget_s`` (optional) bounds the search: no trial starts after it."""
    device = _setup_worker(task)
    config = configs_for(task["scale"])[task["config"]]
    deadline = time.monotonic() + task["budget_s"] if task.get("budget_s") else None
    task_ = config.task()
    torch.manual_seed(SEED)
    reference = task_.build()  # built once, on the CPU: each trial trains a copy
    tried: dict[int, bool] = {}

    def trial(batch_size: int, n_steps: int) -> list[float] | None:
        """Step times at this batch size, or None when it runs out of memory."""
        times, oom = [], None
        model = batches = arm = None
        try:
            model = copy.deepcopy(reference).to(device).train()
            # drawn on the device: a batch of thousands of 224x224 images takes seconds on the CPU
            generator = torch.Generator(device).manual_seed(SEED + 1)
            batches = [task_.make_batch(batch_size, generator)]
            arm = make_arm(task["arm"], model, task_, batch_size)
            for _ in range(n_steps):
                _sync(device)
                t0 = time.perf_counter()
                arm.step(batches[0])
                _sync(device)
                times.append(time.perf_counter() - t0)
            arm.close()
        except Exception as exc:  # noqa: BLE001
            if not _is_oom(exc):
                raise
            oom = _first_line(exc)
        # outside the except block, so the traceback no longer pins the failed step's tensors
        model = batches = arm = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        tried[batch_size] = oom is None
        return None if oom else times

    search = search_largest_batch(lambda b: trial(b, 2) is not None, config.batch_size, task["cap"],
                                  deadline=deadline, rel_tolerance=task.get("tolerance", 0.0))
    result: dict[str, Any] = {"max_batch": search.found, "cap": task["cap"], "max_batch_search": search.describe(),
                              "max_batch_trials": len(tried)}
    if search.found:
        warmup = task.get("final_warmup", config.warmup)
        times = trial(search.found, warmup + task.get("final_steps", config.steps))
        if times:
            median = statistics.median(times[warmup:] or times)
            result.update(max_batch_step_s=median, max_batch_throughput=search.found / median)
    return result


def _worker_arm(task: dict) -> dict:
    """One arm of one configuration, alone in its process: peak memory over the warm-up and timed steps,
    and the step times (the GPU preset: one process per arm, no round-robin needed on a GPU)."""
    device = _setup_worker(task)
    config = configs_for(task["scale"])[task["config"]]
    warmup, steps = task["warmup"], task["steps"]
    # Two batches, taken in turn: every arm's peak includes the batches it holds, so thirteen of them
    # (a GiB for ResNet-18 at batch 128) would dilute the ratios between arms.
    task_, model, batches = _build(config, device, config.batch_size, min(2, warmup + steps))
    arm = make_arm(task["arm"], model, task_, config.batch_size)
    meter = PeakMemory(device)
    meter.start()
    wall, cpu = [], []
    for i in range(warmup + steps):
        batch = batches[i % len(batches)]
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        arm.step(batch)
        _sync(device)
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    peak = meter.peak()
    arm.close()
    return {"peak_bytes": peak, "baseline_bytes": meter.baseline, "peak_above_baseline_bytes": peak - meter.baseline,
            "memory_method": meter.method, "note": arm.note, "step_times_s": wall, "cpu_times_s": cpu}


WORKERS = {"memory": _worker_memory, "time": _worker_time, "max-batch": _worker_max_batch, "arm": _worker_arm}


def _run_task(task: dict) -> dict:
    try:
        return {"ok": True, "result": WORKERS[task["kind"]](task)}
    except Exception as exc:  # noqa: BLE001 - reported as the arm's failure
        return {"ok": False, "error": _describe(exc), "traceback": traceback.format_exc()}


def _worker_main(task_file: str, result_file: str) -> int:
    result = _run_task(json.loads(Path(task_file).read_text()))
    Path(result_file).write_text(json.dumps(result))
    return 0


def run_worker(task: dict, timeout: float, isolate: bool = True) -> dict:
    """Run one measurement in a fresh Python process; a crash or timeout becomes an error entry.

    ``isolate=False`` runs it in this process instead (fast, for tests): no address-space cap,
    no thread setting, and the memory peak then includes whatever this process did before.
    """
    if not isolate:
        return _run_task({**task, "isolated": False})
    with tempfile.TemporaryDirectory(prefix="dptrain-bench-") as tmp:
        task_file, result_file, marker = Path(tmp, "task.json"), Path(tmp, "result.json"), Path(tmp, "oom.txt")
        task_file.write_text(json.dumps({**task, "oom_marker": str(marker)}))
        env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(task["threads"])
        if task.get("omp_wait_policy"):
            env["OMP_WAIT_POLICY"] = task["omp_wait_policy"]
        if task["kind"] in ("memory", "arm") and task["device"] == "cpu":
            env.update(LIVE_BYTES_MALLOC)
        # the workers must import this very harness and this very dptrain (a checkout, a snapshot), not another install
        import dptrain

        roots = (str(Path(__file__).resolve().parents[1]), str(Path(dptrain.__file__).resolve().parents[1]))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (*roots, env.get("PYTHONPATH"))))
        cmd = [sys.executable, "-m", "dptrain_bench", "--worker", str(task_file), str(result_file)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
        if result_file.exists():
            return json.loads(result_file.read_text())
        if marker.exists():
            return {"ok": False, "error": "out of memory: " + marker.read_text()}
        if proc.returncode < 0:
            sig = signal.Signals(-proc.returncode).name
            why = " (likely out of memory)" if sig == "SIGKILL" else ""
            return {"ok": False, "error": f"worker killed by {sig}{why}"}
        tail = (proc.stderr or "").strip().splitlines()[-5:]
        return {"ok": False, "error": f"worker exited with status {proc.returncode}: " + " | ".join(tail)[-600:]}


# ====================================================================== orchestration


def _opacus_missing() -> str | None:
    return None if importlib.util.find_spec("opacus") else "opacus not installed (pip install opacus)"


def _version(distribution: str) -> str | None:
    try:  # from the installed metadata: importing transformers or timm just for this takes seconds
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    import dptrain

    root = Path(dptrain.__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "src"], capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("DPTRAIN_BENCH_COMMIT")
    if head.returncode != 0:  # not a checkout (a copy of the tree on a GPU machine): the caller may name it
        return os.environ.get("DPTRAIN_BENCH_COMMIT")
    return head.stdout.strip() + (" (src/ has uncommitted changes)" if dirty.stdout.strip() else "")


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def _wait_for_load(max_load: float, max_wait: float, log) -> None:
    """On a shared machine: wait (up to ``max_wait`` s) until the 1-minute load average is at most ``max_load``."""
    if not hasattr(os, "getloadavg"):
        return
    deadline = time.monotonic() + max_wait
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        log(f"  load average {os.getloadavg()[0]:.1f} > {max_load}: waiting")
        time.sleep(60)


def environment(device: torch.device, threads: int, omp_wait_policy: str | None = None) -> dict:
    from dptrain import __version__

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "cpu": _cpu_model(),
        "cpu_cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": threads,
        "omp_wait_policy": omp_wait_policy or os.environ.get("OMP_WAIT_POLICY") or "default",
        "memory_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        if hasattr(os, "sysconf") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in ("torch", "torchvision", "transformers", "timm", "opacus", "numpy")},
        "dptrain": __version__,
        "dptrain_commit": _git_commit(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        env["cuda"] = torch.version.cuda
    return env


def _summarise_times(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) >= 2 else [times[0]] * 3
    return {"median_s": statistics.median(times), "p25_s": q[0], "p75_s": q[2], "min_s": min(times)}


def benchmark_config(config: BenchConfig, arms: Sequence[str], *, scale: str, device: torch.device, threads: int,
                     timeout: float, mem_limit_bytes: int | None, max_batch_cap: int | None,
                     warmup: int | None = None, steps: int | None = None, isolate: bool = True,
                     omp_wait_policy: str | None = None, log=print) -> dict:
    """Every arm of one configuration: memory (one process each), time (one process), largest batch (GPU)."""
    warmup = config.warmup if warmup is None else warmup
    steps = config.steps if steps is None else steps
    base = {"scale": scale, "config": config.name, "device": str(device), "threads": threads,
            "mem_limit_bytes": mem_limit_bytes, "omp_wait_policy": omp_wait_policy}
    entry: dict[str, Any] = {
        "config": config.name, "description": config.description, "batch_size": config.batch_size,
        "warmup": warmup, "steps": steps, "arms": {},
        "load_average_before": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    started = time.perf_counter()
    opacus_missing = _opacus_missing() if any(a in OPACUS_ARMS for a in arms) else None
    runnable = []
    for arm in arms:
        if arm in OPACUS_ARMS and opacus_missing:
            entry["arms"][arm] = {"status": "skipped", "error": opacus_missing}
            continue
        res = run_worker({**base, "kind": "memory", "arm": arm}, timeout, isolate)
        if res["ok"]:
            entry["arms"][arm] = {"status": "ok", **res["result"]}
            runnable.append(arm)
            log(f"  {config.name} {arm}: peak {res['result']['peak_above_baseline_bytes'] / 2**20:.0f} MiB above baseline")
        else:
            entry["arms"][arm] = {"status": "failed", "stage": "memory", "error": res["error"],
                                  "traceback": res.get("traceback")}
            log(f"  {config.name} {arm}: FAILED ({res['error'][:160]})")
    if runnable:
        res = run_worker({**base, "kind": "time", "arms": runnable, "warmup": warmup, "steps": steps,
                          "mem_limit_bytes": 2 * mem_limit_bytes if mem_limit_bytes else None}, timeout, isolate)
        for arm in runnable:
            rec = entry["arms"][arm]
            got = res["result"].get(arm, {}) if res["ok"] else {"error": res["error"]}
            if "error" in got:
                rec.update(status="failed", stage="time", error=got["error"])
                log(f"  {config.name} {arm}: timing FAILED ({got['error'][:160]})")
            else:
                rec.update(step_times_s=got["step_times_s"], cpu_times_s=got["cpu_times_s"],
                           **_summarise_times(got["step_times_s"]),
                           cpu_median_s=statistics.median(got["cpu_times_s"]))
                rec["throughput"] = config.batch_size / rec["median_s"]
                log(f"  {config.name} {arm}: {rec['median_s'] * 1e3:.0f} ms/step")
    if device.type == "cuda" and max_batch_cap:
        for arm in runnable:
            rec = entry["arms"][arm]
            if rec["status"] != "ok":
                continue
            res = run_worker({**base, "kind": "max-batch", "arm": arm, "cap": max_batch_cap}, timeout, isolate)
            if res["ok"]:
                rec.update(res["result"])
                log(f"  {config.name} {arm}: largest batch {res['result']['max_batch']}")
            else:
                rec["max_batch_error"] = res["error"]
    _add_ratios(entry, device)
    entry["wall_s"] = time.perf_counter() - started
    entry["load_average_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return entry


def _memory_of(rec: dict, device: torch.device) -> float | None:
    """The figure compared across arms: total allocated on GPU (as the papers), RSS above baseline on CPU."""
    if "peak_bytes" not in rec:
        return None
    return rec["peak_bytes"] if device.type == "cuda" else rec["peak_above_baseline_bytes"]


def _add_ratios(entry: dict, device: torch.device) -> None:
    ref = entry["arms"].get(NON_PRIVATE, {})
    for rec in entry["arms"].values():
        if "median_s" in rec and "median_s" in ref:
            rec["time_ratio"] = rec["median_s"] / ref["median_s"]
            rec["cpu_time_ratio"] = rec["cpu_median_s"] / ref["cpu_median_s"]
        mem, ref_mem = _memory_of(rec, device), _memory_of(ref, device)
        if mem is not None and ref_mem:
            rec["memory_ratio"] = mem / ref_mem


# ====================================================================== targets and reports


@dataclass(frozen=True)
class Target:
    device: str        # "cpu" or "cuda"
    config: str
    arm: str
    metric: str        # "time_ratio", "memory_ratio", "max_batch_vs_non_private" or "max_batch_vs_opacus_hooks"
    bound: float
    note: str = ""

    def evaluate(self, results: dict) -> tuple[float | None, bool | None, str]:
        entry = results["configs"].get(self.config)
        if entry is None:
            return None, None, "not run"
        rec = entry["arms"].get(self.arm, {})
        if rec.get("status") != "ok":
            return None, None, f"{self.arm}: {rec.get('error', 'not run')}"
        if self.metric.startswith("max_batch_vs_"):
            other = entry["arms"].get({"max_batch_vs_opacus_hooks": "opacus-hooks"}.get(self.metric, NON_PRIVATE), {})
            if not rec.get("max_batch") or not other.get("max_batch"):
                return None, None, "largest batch not measured for both"
            value = rec["max_batch"] / other["max_batch"]
            return value, value >= self.bound, ""
        value = rec.get(self.metric)
        if value is None:
            return None, None, "no figure"
        return value, value <= self.bound, ""


TARGETS = (
    # CPU (2 cores): keep the time ratios; peak memory of the 224x224 CNNs at most 1.3x non-private
    Target("cpu", "gpt2-t64", "bk-mixopt", "time_ratio", 1.15, "for comparison: Opacus ghost about 2.6x, the book-keeping paper's code 1.5x"),
    Target("cpu", "vgg11-gn-32", "bk-mixopt", "time_ratio", 1.1, "for comparison: Opacus hooks about 12x, the book-keeping paper's code 2.1x"),
    Target("cpu", "vgg11-gn-224", "bk-mixopt", "memory_ratio", 1.3),
    Target("cpu", "resnet18-gn-224", "bk-mixopt", "memory_ratio", 1.3),
    # one GPU, each arm in its own process (the gpu-quick preset's rows)
    Target("cuda", "gpt2-t100", "bk-mixopt", "time_ratio", 1.12),
    Target("cuda", "gpt2-t100", "bk-mixopt", "memory_ratio", 1.02),
    Target("cuda", "resnet18-gn-224-b128", "bk-mixopt", "time_ratio", 1.8),
    Target("cuda", "resnet18-gn-224-b128", "bk-mixopt", "memory_ratio", 1.3),
    Target("cuda", "vgg11-gn-224", "bk-mixopt", "time_ratio", 1.8),
    Target("cuda", "vgg11-gn-224", "bk-mixopt", "memory_ratio", 1.3),
    Target("cuda", "resnet18-gn-224", "bk-mixopt", "time_ratio", 2.5),
    Target("cuda", "vit-224", "bk-mixopt", "time_ratio", 1.2),
    Target("cuda", "vit-224", "bk-mixopt", "memory_ratio", 1.1),
    Target("cuda", "resnet18-gn-224-b128", "bk-mixopt", "max_batch_vs_non_private", 0.7),
    Target("cuda", "vgg11-gn-224", "bk-mixopt", "max_batch_vs_non_private", 0.7),
    Target("cuda", "resnet18-gn-224-b128", "bk-mixopt", "max_batch_vs_opacus_hooks", 2.0),
    Target("cuda", "vgg11-gn-224", "bk-mixopt", "max_batch_vs_opacus_hooks", 2.0),
)


def _targets_for(results: dict) -> list[Target]:
    device = "cuda" if results["environment"]["device"].startswith("cuda") else "cpu"
    scale_ok = results["scale"] == ("full" if device == "cuda" else "cpu")
    return [t for t in TARGETS if t.device == device and scale_ok]


CSV_FIELDS = ("config", "arm", "status", "batch_size", "median_s", "p25_s", "p75_s", "min_s", "cpu_median_s",
              "time_ratio", "cpu_time_ratio", "throughput", "peak_bytes", "baseline_bytes",
              "peak_above_baseline_bytes", "memory_ratio", "max_batch", "max_batch_throughput", "error", "note")


def write_csv(results: dict, path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for entry in results["configs"].values():
            for arm, rec in entry["arms"].items():
                row = {k: rec.get(k) for k in CSV_FIELDS}
                row.update(config=entry["config"], arm=arm, batch_size=entry["batch_size"])
                writer.writerow(row)


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "—" if value is None else format(value, spec) + suffix


def markdown(results: dict) -> str:
    env = results["environment"]
    cuda = env["device"].startswith("cuda")
    v = env["versions"]
    lines = [
        f"# dptrain benchmark — {results['scale']} scale on {env['device']}",
        "",
        f"- Date: {env['date']}",
        f"- Hardware: {env.get('gpu', 'no GPU') + ', ' if cuda else ''}CPU {env['cpu']}, "
        f"{env['cpu_cores_available']} cores available, {env['memory_total_gib']} GiB RAM; "
        f"torch threads: {env['torch_threads']}" + ("" if cuda else f", OMP_WAIT_POLICY={env.get('omp_wait_policy')}"),
        f"- Versions: python {env['python']}, torch {v['torch']}, torchvision {v['torchvision']}, transformers "
        f"{v['transformers']}, timm {v['timm']}, opacus {v['opacus']}; dptrain {env['dptrain']} "
        f"(commit {env['dptrain_commit']})",
        f"- Load average (1, 5, 15 min) at start: {env['load_average_at_start']}",
        f"- Memory: {'total `torch.cuda.max_memory_allocated`' if cuda else 'peak RSS above the baseline taken after the model, batches, optimizer and engine exist'}"
        f" ({_memory_method(results)}), over a warm-up step and one more, each arm in its own process.",
        "- Time: median wall-clock step (forward + loss + backward + optimizer step), after warm-up; all arms of "
        "a configuration in one process on the same batches, timed steps round-robin in shuffled order.",
    ]
    if not cuda:
        lines.append("- No GPU in this run: largest batch and GPU memory are not measured.")
    targets = _targets_for(results)
    if targets:
        lines += ["", "## Targets", "", "| configuration | arm | metric | measured | target | met | note |",
                  "|---|---|---|---|---|---|---|"]
        for t in targets:
            value, ok, why = t.evaluate(results)
            sign = "≥" if t.metric.startswith("max_batch") else "≤"
            met = "—" if ok is None else ("yes" if ok else "**no**")
            lines.append(f"| {t.config} | {t.arm} | {t.metric} | {_fmt(value, '.2f', '×')} | {sign} {t.bound}× | "
                         f"{met} | {why or t.note} |")
    run_method = _memory_method(results)
    for entry in results["configs"].values():
        lines += ["", f"## {entry['config']}", "",
                  f"{entry['description']}; batch {entry['batch_size']}; {entry['warmup']} warm-up + "
                  f"{entry['steps']} timed steps; load average before/after: {entry.get('load_average_before')} / "
                  f"{entry.get('load_average_after')}" + _separate_run(entry, env, run_method), ""]
        header = "| arm | step time (ms) median [IQR] | × non-private | CPU time × | peak memory (MiB) | × non-private |"
        rule = "|---|---|---|---|---|---|"
        if cuda:
            header += " largest batch | samples/s at largest |"
            rule += "---|---|"
        lines += [header + " note |", rule + "---|"]
        for arm, rec in entry["arms"].items():
            mem = _memory_of(rec, torch.device(env["device"]))
            time_cell = "—" if "median_s" not in rec else (
                f"{rec['median_s'] * 1e3:.0f} [{rec['p25_s'] * 1e3:.0f}–{rec['p75_s'] * 1e3:.0f}]")
            row = (f"| {arm} | {time_cell} | {_fmt(rec.get('time_ratio'), '.2f', '×')} | "
                   f"{_fmt(rec.get('cpu_time_ratio'), '.2f', '×')} | {_fmt(mem and mem / 2**20, '.0f')} | "
                   f"{_fmt(rec.get('memory_ratio'), '.2f', '×')} |")
            if cuda:
                row += f" {_fmt(rec.get('max_batch'), 'd')} | {_fmt(rec.get('max_batch_throughput'), '.1f')} |"
            search = rec.get("max_batch_search")
            partial = f"largest batch: {search}" if search and search != str(rec.get("max_batch")) else None
            note = "; ".join(filter(None, (rec.get("error") if rec.get("status") != "ok" else rec.get("max_batch_error"),
                                           partial, rec.get("note"))))
            lines.append(row + f" {note.replace('|', '/')} |")
    if results.get("notes"):
        lines += ["", "## Notes", "", results["notes"].strip()]
    return "\n".join(lines) + "\n"


def _separate_run(entry: dict, env: dict, run_method: str) -> str:
    """For a configuration merged in from another run (``entry["environment"]``): what differs from the header."""
    other = entry.get("environment")
    if not other:
        return ""
    method = next((r["memory_method"] for r in entry["arms"].values() if r.get("memory_method")), run_method)
    parts = [f"Measured in a separate run on {other['date'][:10]} at commit {other['dptrain_commit']}"]
    if method != run_method:
        parts.append(f"memory: {method}")
    return ". " + "; ".join(parts)


def _memory_method(results: dict) -> str:
    for entry in results["configs"].values():
        for rec in entry["arms"].values():
            if rec.get("memory_method"):
                return rec["memory_method"]
    return "not measured"


def plot(results: dict, path: Path) -> None:
    """Per configuration: peak memory and throughput per arm (the papers' Figure 3 layout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = list(results["configs"].values())
    device = torch.device(results["environment"]["device"])
    fig, axes = plt.subplots(len(entries), 2, figsize=(13, 2.9 * len(entries)), squeeze=False)
    for row, entry in zip(axes, entries):
        names = list(entry["arms"])
        recs = [entry["arms"][n] for n in names]
        mem = [(_memory_of(r, device) or 0) / 2**20 for r in recs]
        thr = [r.get("throughput", 0) for r in recs]
        colors = ["0.5" if n == NON_PRIVATE else ("tab:red" if n in OPACUS_ARMS else "tab:blue") for n in names]
        for ax, values, label in ((row[0], mem, "peak memory (MiB)"), (row[1], thr, "samples / s")):
            bars = ax.bar(range(len(names)), values, color=colors)
            for bar, rec, value in zip(bars, recs, values):
                if rec.get("status") != "ok" or not value:
                    ax.text(bar.get_x() + bar.get_width() / 2, 0, "failed" if rec.get("status") == "failed" else "n/a",
                            rotation=90, ha="center", va="bottom", fontsize=7, color="tab:red")
            ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
            ax.set_ylabel(label, fontsize=8)
            ax.set_title(f"{entry['config']} (batch {entry['batch_size']})", fontsize=9)
            ax.tick_params(axis="y", labelsize=7)
    env = results["environment"]
    fig.suptitle(f"dptrain benchmark, {results['scale']} scale, {env.get('gpu') or env['cpu']}, "
                 f"{env['torch_threads']} threads, {env['date'][:10]}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(results: dict, out: Path, tag: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{tag}.json", out / f"{tag}.csv", out / f"{tag}.md", out / f"{tag}.png"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    write_csv(results, paths[1])
    paths[2].write_text(markdown(results))
    try:
        plot(results, paths[3])
    except ImportError:  # matplotlib is optional: the tables carry every figure
        paths.pop()
    return paths


def run_benchmark(configs: Sequence[BenchConfig], arms: Sequence[str], *, scale: str, device: torch.device,
                  threads: int, timeout: float = 3600, mem_limit_bytes: int | None = None,
                  max_batch_cap: int | None = None, warmup: int | None = None, steps: int | None = None,
                  previous: dict | None = None, on_config: Callable[[dict], None] | None = None,
                  isolate: bool = True, omp_wait_policy: str | None = None, max_load: float | None = None,
                  max_wait: float = 1800, log=print) -> dict:
    """Benchmark the configurations in order; ``on_config`` gets the results after each (to save progress)."""
    results = previous or {"scale": scale, "environment": environment(device, threads, omp_wait_policy),
                           "configs": {}}
    for config in configs:
        if config.name in results["configs"]:
            log(f"{config.name}: already in the results, skipped")
            continue
        if max_load is not None:
            _wait_for_load(max_load, max_wait, log)
        log(f"{config.name}: {config.description}, batch {config.batch_size}")
        results["configs"][config.name] = benchmark_config(
            config, arms, scale=scale, device=device, threads=threads, timeout=timeout,
            mem_limit_bytes=mem_limit_bytes, max_batch_cap=max_batch_cap, warmup=warmup, steps=steps,
            isolate=isolate, omp_wait_policy=omp_wait_policy, log=log)
        if on_config:
            on_config(results)
    return results


# ====================================================================== presets


@dataclass(frozen=True)
class Preset:
    """A fixed plan that fits a time budget: rows (configurations), arms, and which largest batches to search.

    The run is in two phases. Phase 1: one process per (row, arm) measures peak memory and step
    time; a process starts only while its timeout fits in the budget left after the reserve of
    phase 2. Phase 2: the largest-batch searches split what is left, each at most ``search_s``
    (and at least ``min_search_s``, else it is skipped), plus ``search_grace_s`` for its process
    to start and time the batch it found. So the run never outlasts ``budget_s``, whatever
    the machine; what did not fit is reported as skipped.
    """

    name: str
    description: str
    scale: str
    rows: tuple[str, ...]
    arms: tuple[str, ...]
    max_batch_rows: tuple[str, ...]
    max_batch_arms: tuple[str, ...]
    budget_s: float
    arm_timeout_s: float
    search_s: float
    min_search_s: float
    search_grace_s: float
    warmup: int = 3
    steps: int = 10
    max_batch_cap: int = 4096
    tolerance: float = 1 / 16  # the bisection stops once the bracket is within this fraction of the batch found

    def searches(self, arms: Sequence[str] | None = None) -> list[tuple[str, str]]:
        arms = self.arms if arms is None else arms
        return [(row, arm) for row in self.max_batch_rows for arm in self.max_batch_arms if arm in arms]

    def search_reserve_s(self, arms: Sequence[str] | None = None) -> float:
        return len(self.searches(arms)) * (self.min_search_s + self.search_grace_s)


PRESETS = {
    "gpu-quick": Preset(
        "gpu-quick",
        "the GPU speed-and-memory table in under 6 minutes on one GPU: GPT-2 small T=100 batch 32, "
        "ResNet-18 GN 224 batch 128 and 32, VGG-11 GN 224 batch 32, ViT-B/16 224 batch 32; "
        "largest batch of the two CNNs for non-private, bk-mixopt and Opacus hooks",
        scale="full",
        rows=("gpt2-t100", "resnet18-gn-224-b128", "vgg11-gn-224", "vit-224", "resnet18-gn-224"),
        arms=(NON_PRIVATE, "bk-mixopt", *OPACUS_ARMS),
        max_batch_rows=("resnet18-gn-224-b128", "vgg11-gn-224"),
        max_batch_arms=(NON_PRIVATE, "bk-mixopt", "opacus-hooks"),
        budget_s=340, arm_timeout_s=60, search_s=30, min_search_s=8, search_grace_s=16,
    ),
}


assert tuple(PRESETS) == PRESET_NAMES, "options.PRESET_NAMES names the presets, for a torch-free --help"


def preset_plan(preset: Preset, arms: Sequence[str]) -> str:
    """The plan and its time budget, as ``--dry-run`` prints it."""
    configs = configs_for(preset.scale)
    unknown = [r for r in preset.rows if r not in configs]
    if unknown:
        raise ValueError(f"preset {preset.name!r} names unknown configurations {unknown}")
    searches = preset.searches(arms)
    lines = [f"preset {preset.name}: {preset.description}", "",
             f"rows ({preset.warmup} warm-up + {preset.steps} timed steps each, one process per arm):"]
    for row in preset.rows:
        c = configs[row]
        lines.append(f"  {row:22s} batch {c.batch_size:4d}  {c.description}")
    lines += ["", f"arms: {', '.join(arms)}"]
    left_out = [a for a in preset.arms if a not in arms]
    if left_out:
        lines.append(f"left out: {', '.join(left_out)} ({_opacus_missing() or 'not asked for'})")
    phase1 = len(preset.rows) * len(arms)
    lines += [
        f"largest batch (doubling from the row's batch, then bisection to within {preset.tolerance:.0%}, "
        f"up to {preset.max_batch_cap}): " + ", ".join(f"{r} {a}" for r, a in searches),
        "",
        f"time budget: {preset.budget_s:.0f} s in all, never exceeded:",
        f"  phase 1: {phase1} processes of at most {preset.arm_timeout_s:.0f} s each, started only while "
        f"{preset.search_reserve_s(arms):.0f} s stay reserved for phase 2",
        f"  phase 2: {len(searches)} searches sharing what is left, each {preset.min_search_s:.0f}-"
        f"{preset.search_s:.0f} s of trials + {preset.search_grace_s:.0f} s to start and time the batch found",
    ]
    return "\n".join(lines) + "\n"


def run_preset(preset: Preset, arms: Sequence[str], *, device: torch.device, threads: int,
               configs: dict[str, BenchConfig] | None = None, runner: Callable[[dict, float], dict] | None = None,
               clock: Callable[[], float] = time.monotonic, on_config: Callable[[dict], None] | None = None,
               log=print) -> dict:
    """Run a preset within its time budget (see :class:`Preset`).

    ``configs`` replaces the preset's configurations (tests run the plan on tiny stand-ins),
    ``runner(task, timeout)`` replaces the worker processes and ``clock`` the time (tests of the budget).
    """
    configs = configs or configs_for(preset.scale)
    runner = runner or (lambda task, timeout: run_worker(task, timeout))
    started = clock()

    def left() -> float:
        return preset.budget_s - (clock() - started)

    results = {"scale": preset.scale, "preset": preset.name, "environment": environment(device, threads),
               "configs": {}}
    base = {"scale": preset.scale, "device": str(device), "threads": threads, "mem_limit_bytes": None}
    reserve = preset.search_reserve_s(arms)
    for row in preset.rows:
        config = configs[row]
        entry: dict[str, Any] = {"config": row, "description": config.description, "batch_size": config.batch_size,
                                 "warmup": preset.warmup, "steps": preset.steps, "arms": {}}
        log(f"{row}: {config.description}, batch {config.batch_size}")
        t0 = clock()
        for arm in arms:
            if left() - reserve < preset.arm_timeout_s:
                entry["arms"][arm] = {"status": "skipped", "error": "not started: the preset's time budget was spent"}
                continue
            res = runner({**base, "kind": "arm", "config": row, "arm": arm, "warmup": preset.warmup,
                          "steps": preset.steps}, preset.arm_timeout_s)
            if res["ok"]:
                rec = {"status": "ok", **res["result"], **_summarise_times(res["result"]["step_times_s"]),
                       "cpu_median_s": statistics.median(res["result"]["cpu_times_s"])}
                rec["throughput"] = config.batch_size / rec["median_s"]
                log(f"  {row} {arm}: {rec['median_s'] * 1e3:.1f} ms/step, peak {_memory_of(rec, device) / 2**20:.0f} MiB")
            else:
                rec = {"status": "failed", "stage": "arm", "error": res["error"], "traceback": res.get("traceback")}
                log(f"  {row} {arm}: FAILED ({res['error'][:160]})")
            entry["arms"][arm] = rec
        _add_ratios(entry, device)
        entry["wall_s"] = clock() - t0
        results["configs"][row] = entry
        if on_config:
            on_config(results)
    searches = [(r, a) for r, a in preset.searches(arms) if results["configs"][r]["arms"][a].get("status") == "ok"]
    for i, (row, arm) in enumerate(searches):
        rec = results["configs"][row]["arms"][arm]
        share = left() / (len(searches) - i) - preset.search_grace_s
        search_s = min(preset.search_s, share)
        if search_s < preset.min_search_s:
            rec["max_batch_error"] = "not searched: the preset's time budget was spent"
            continue
        res = runner({**base, "kind": "max-batch", "config": row, "arm": arm, "cap": preset.max_batch_cap,
                      "budget_s": search_s, "tolerance": preset.tolerance, "final_warmup": 1, "final_steps": 3},
                     search_s + preset.search_grace_s)
        if res["ok"]:
            rec.update(res["result"])
            log(f"  {row} {arm}: largest batch {res['result']['max_batch_search']}")
        else:
            rec["max_batch_error"] = res["error"]
        if on_config:
            on_config(results)
    results["wall_s"] = clock() - started
    return results


# ====================================================================== command line


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def published_results_dir() -> Path:
    """The checkout's committed results, benchmarks/results/ (written only with --publish)."""
    return Path(__file__).resolve().parents[1] / "results"


def _fresh_output_dir(parent: Path) -> Path:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out, n = parent / f"dptrain-bench-{stamp}", 1
    while out.exists():
        n += 1
        out = parent / f"dptrain-bench-{stamp}-{n}"
    return out


def _output_dir(args) -> Path:
    """Where this run writes: --out, --publish, or a new folder under the current directory.

    Raises ValueError (the message is the one-line error) for a choice that could overwrite the
    committed results by accident, or that needs an existing folder."""
    published = published_results_dir()
    if args.publish and args.out is not None:
        raise ValueError("give --out DIR or --publish, not both")
    if args.publish:
        if not published.is_dir():
            raise ValueError(f"--publish writes into a checkout's benchmarks/results/, and {published} does not "
                             "exist (run from a checkout, or give --out DIR)")
        return published
    if args.out is not None:
        if args.out.resolve() == published.resolve():
            raise ValueError(f"{args.out} holds the committed results: add --publish (instead of --out) to "
                             "replace them on purpose")
        return args.out
    if args.resume or args.report_only:
        what = "--resume" if args.resume else "--report-only"
        raise ValueError(f"{what} reads an earlier run's <tag>.json: name its folder with --out DIR (or --publish)")
    return _fresh_output_dir(Path.cwd())


def _error(message: str) -> int:
    print(f"dptrain bench: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker_main(argv[1], argv[2])
    args = parser().parse_args(argv)
    if args.dry_run and not args.preset:
        return _error("--dry-run goes with --preset NAME (it prints that preset's plan)")
    if args.preset:
        return _main_preset(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        return _error("--device cuda but CUDA is not available")
    scale = args.scale or ("full" if device.type == "cuda" else "cpu")
    tag = args.tag or ("gpu" if device.type == "cuda" else "cpu")
    available = configs_for(scale)
    if args.list:
        for c in available.values():
            print(f"{c.name:22s} batch {c.batch_size:4d}  {c.warmup}+{c.steps} steps  {c.description}")
        return 0
    try:
        out = _output_dir(args)
    except ValueError as exc:
        return _error(str(exc))
    json_path = out / f"{tag}.json"
    if args.report_only:
        if not json_path.exists():
            return _error(f"{json_path} does not exist")
        results = json.loads(json_path.read_text())
        if args.notes:
            results["notes"] = args.notes.read_text()
        for path in write_reports(results, out, tag):
            print(f"wrote {path}")
        return 0
    requested_arms = args.arms or list(ALL_ARMS)
    unknown = [n for n in (args.configs or []) if n not in available]
    bad_arms = [a for a in requested_arms if a not in ALL_ARMS]
    if unknown or bad_arms:
        return _error(f"unknown configuration(s) {unknown}; valid: {', '.join(available)}" if unknown
                      else f"unknown arm(s) {bad_arms}; valid: {', '.join(ALL_ARMS)}")
    configs = [available[n] for n in args.configs] if args.configs else [
        c for c in available.values() if c.name not in ("smoke-cnn", "resnet18-gn-224-b128")]
    arms = [a for a in requested_arms if not (args.no_opacus and a in OPACUS_ARMS)]
    if NON_PRIVATE not in arms:
        arms.insert(0, NON_PRIVATE)  # every ratio is relative to it
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    mem_limit = None
    if device.type == "cpu":
        avail = _available_memory_bytes()
        mem_limit = int(args.mem_limit_gb * 2**30) if args.mem_limit_gb else (avail // 2 if avail else None)
    previous = json.loads(json_path.read_text()) if args.resume and json_path.exists() else None
    notes = args.notes.read_text() if args.notes else None
    print(f"dptrain bench: results go to {out}/{tag}.{{json,csv,md,png}}")
    written: list[Path] = []

    def save(results):
        if notes:
            results["notes"] = notes
        written[:] = write_reports(results, out, tag)

    results = run_benchmark(
        configs, arms, scale=scale, device=device, threads=threads, timeout=args.timeout,
        mem_limit_bytes=mem_limit, max_batch_cap=None if args.no_max_batch else args.max_batch_cap,
        warmup=args.warmup, steps=args.steps, previous=previous, on_config=save,
        omp_wait_policy=None if device.type == "cuda" or args.omp_wait_policy == "default" else args.omp_wait_policy,
        max_load=args.max_load, max_wait=args.max_wait)
    save(results)
    print(markdown(results))
    for path in written:
        print(f"wrote {path}")
    return 0


def _main_preset(args) -> int:
    preset = PRESETS[args.preset]
    fixed = [name for name, value in (("--arms", args.arms), ("--scale", args.scale), ("--warmup", args.warmup),
                                      ("--steps", args.steps)) if value is not None]
    if fixed:
        return _error(f"--preset {preset.name} fixes its arms, scale and steps: leave out {', '.join(fixed)}")
    if args.configs:  # a subset of the rows, e.g. to finish the rows a first call had no time for
        others = [c for c in args.configs if c not in preset.rows]
        if others:
            return _error(f"--configs {' '.join(others)}: not rows of --preset {preset.name} "
                          f"(its rows: {', '.join(preset.rows)})")
        preset = dataclasses.replace(preset, rows=tuple(r for r in preset.rows if r in args.configs),
                                     max_batch_rows=tuple(r for r in preset.max_batch_rows if r in args.configs))
    arms = [a for a in preset.arms if not (a in OPACUS_ARMS and (args.no_opacus or _opacus_missing()))]
    if args.dry_run:
        print(preset_plan(preset, arms), end="")
        return 0
    device = torch.device(args.device or "cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        return _error(f"--preset {preset.name} runs on a CUDA GPU and none is available here "
                      "(--dry-run prints its plan)")
    try:
        out = _output_dir(args)
    except ValueError as exc:
        return _error(str(exc))
    tag = args.tag or "gpu"
    notes = args.notes.read_text() if args.notes else None
    print(f"dptrain bench: preset {preset.name}, results go to {out}/{tag}.{{json,csv,md,png}}")
    written: list[Path] = []

    def save(results):
        if notes:
            results["notes"] = notes
        written[:] = write_reports(results, out, tag)

    results = run_preset(preset, arms, device=device, threads=args.threads or torch.get_num_threads(),
                         on_config=save)
    save(results)
    print(markdown(results))
    print(f"preset {preset.name}: {results['wall_s']:.0f} s of a {preset.budget_s:.0f} s budget")
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
