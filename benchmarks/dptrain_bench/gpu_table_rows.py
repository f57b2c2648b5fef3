"""Issue 43's GPU table: its rows, their arms, and the jobs that measure them, in the order they run.

Each row is one model at one batch (at full size for a GPU, and a tiny stand-in of the same family for the CPU dry
run). Each job is one arm of one row (its first and steady steps and its peak memory), or one arm's largest-batch
search, and runs in its own process. Jobs run tier by tier, so that a spent time budget loses the least:

1. non-private and dptrain ``bk-mixopt`` on every row, the Llama rows and GPT-2 first, then ViT, then the CNNs;
2. the peers that issue 43's table shows on the Llama and GPT-2 rows (dptrain ``bk``, Opacus ghost, fastDP);
3. the largest batch of non-private and ``bk-mixopt`` on the two CNN rows that search it (ResNet-18-GN, VGG-11-GN);
4. the other peers (the long-context row's Opacus ghost, ViT's and the CNNs' fastDP and Opacus hooks);
5. the peers' largest batches; 6. peers that issue 43's table does not show (Opacus ghost on the full Llama).

The seconds each job is expected to take come from issue 43's table (an H200, torch 2.11, commit 612b47e: the step
times below) plus an estimate of each process's start (CUDA context, model build) and of dptrain's first step
(which reads every layer's rows). They decide only whether a job is started with the time left; each job's own
``wall_s`` in the results says how good they were.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from . import zoo
from .options import FASTDP_ARM, NON_PRIVATE
from .zoo import BenchConfig, Task

PRIVATE = "bk-mixopt"
CORE_ARMS = (NON_PRIVATE, PRIVATE)
SEARCH_CAP = 4096           # the largest batch tried (issue 43: "4,096, the search's cap")
SEARCH_TOLERANCE = 1 / 8    # bisection stops once the bracket is within this fraction of the batch found
ROW_ORDER_NOTE = "Llama and GPT-2 rows first, then ViT, then the CNN rows"


@dataclass(frozen=True)
class TableRow:
    """One row of issue 43's table: a model at one batch, the arms measured on it, and their expected step times."""

    key: str
    title: str                                 # as issue 43's table names it
    config: BenchConfig                        # the full-size model (GPU)
    stand_in: BenchConfig                      # a tiny model of the same family (the CPU dry run)
    step_s: dict[str, float]                   # expected steady step per arm (issue 43's H200 figures, or a guess)
    peers: tuple[tuple[str, int], ...] = ()    # (arm, tier) beyond non-private and bk-mixopt
    searched: tuple[tuple[str, int], ...] = ()  # (arm, tier) whose largest batch is searched
    start_s: float = 3.0                       # expected process start: CUDA context, model build, batches
    first_step_extra_s: float = 2.0            # expected extra time of a private arm's first step

    def arms(self) -> tuple[str, ...]:
        return (*CORE_ARMS, *(arm for arm, _ in self.peers))


@dataclass(frozen=True)
class Job:
    """One process: an arm's steps (``kind`` "arm") or its largest-batch search (``kind`` "largest-batch")."""

    row: str
    arm: str
    kind: str
    tier: int
    expected_s: float     # started only while this much of the budget is left
    timeout_s: float      # killed after this long (or when the budget is spent, if sooner)
    search_s: float = 0.0  # largest batch: no new trial starts after this many seconds

    @property
    def id(self) -> str:
        return f"{self.row}/{self.arm}" + ("/largest-batch" if self.kind == "largest-batch" else "")


def _lm(build, seq_len: int, vocab: int, batched_positions: bool) -> Task:
    return Task("lm", build, seq_len=seq_len, vocab=vocab, batched_positions=batched_positions)


def _image(build, image_size: int) -> Task:
    return Task("image", build, image_size=image_size, num_classes=1000)


def _config(name: str, description: str, batch: int, task, warmup: int = 3, steps: int = 10,
            autocast: str | None = None) -> BenchConfig:
    return BenchConfig(name, description, batch, warmup, steps, task, autocast=autocast, build_on_device=True)


TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512)


def _llama_rows(dry: dict) -> list[TableRow]:
    zoo_configs = zoo.configs_for("full")
    rows = []
    specs = (
        ("llama-1b-t256", "issue 43's Llama (0.85 B parameters), bf16 autocast, B 8, T 256, full fine-tuning",
         False, 16, 2,
         {NON_PRIVATE: 0.0704, PRIVATE: 0.2586, "bk": 0.2362, "opacus-ghost": 0.35}, (("bk", 2), ("opacus-ghost", 6))),
        ("llama-1b-lora-t256", "issue 43's Llama, LoRA r 16 on every linear layer, bf16 autocast, B 8, T 256", True,
         16, 2,
         {NON_PRIVATE: 0.108, PRIVATE: 0.3959, "opacus-ghost": 0.331}, (("opacus-ghost", 2),)),
        # not in issue 43's measured table: its step times are guesses (4x the tokens of the rows above)
        ("llama-1b-t4096", "issue 43's Llama, long context: bf16 autocast, B 2, T 4,096, full fine-tuning", False,
         64, 2,
         {NON_PRIVATE: 0.30, PRIVATE: 1.0, "opacus-ghost": 1.0}, (("opacus-ghost", 4),)),
    )
    for key, title, lora, tiny_T, tiny_B, step_s, peers in specs:
        full = zoo_configs[key]
        if key == "llama-1b-t4096":  # a slow step: fewer of them
            full = _config(full.name, full.description, full.batch_size, full.task, 2, 6, full.autocast)
        tiny_build = (lambda: zoo.with_lora(zoo.llama(**TINY_LLAMA))) if lora else (lambda: zoo.llama(**TINY_LLAMA))
        stand_in = _config(key, f"tiny Llama (2 layers, width 64, GQA 4/2, vocab 512){', LoRA r 16' if lora else ''}, "
                                f"bf16 autocast, T={tiny_T}", tiny_B,
                           lambda b=tiny_build, T=tiny_T: _lm(b, T, TINY_LLAMA["vocab_size"], False), **dry,
                           autocast="bfloat16")
        rows.append(TableRow(key, title, full, stand_in, step_s, peers, start_s=6.0 if lora else 5.0,
                             first_step_extra_s=6.0 if key == "llama-1b-t4096" else 4.0))
    return rows


def table_rows(dry_run: bool = False) -> list[TableRow]:
    """Issue 43's rows, in the order they run. The models are those of the script that measured its table
    (shared/gpu/reference_bench.py): ImageNet heads (1,000 classes), no dropout in GPT-2, in-place operations off in
    every arm of the CNN rows (Opacus' and fastDP's hooks need it), except that VGG-11-GN has its GroupNorms
    (torchvision's ``vgg11_bn`` with GroupNorm; the reference built ``vgg11``, which has no normalisation at all)."""
    dry = dict(warmup=1, steps=1)  # the dry run: the first step and one timed step
    gpt2_full = lambda: zoo.gpt2(12, 768, 12, tied=False, dropout=0.0, train_positions=False)  # noqa: E731
    gpt2_tiny = lambda: zoo.gpt2(2, 64, 4, vocab=512, tied=False, dropout=0.0, train_positions=False)  # noqa: E731
    vit_full = lambda: zoo.timm_vit("vit_base_patch16_224", num_classes=1000)  # noqa: E731
    vit_tiny = lambda: _tiny_vit()  # noqa: E731
    resnet = lambda: zoo.without_inplace_ops(zoo.resnet18_gn(num_classes=1000))  # noqa: E731
    vgg_full = lambda: zoo.without_inplace_ops(zoo.vgg11_gn(num_classes=1000, head="imagenet"))  # noqa: E731
    vgg_tiny = lambda: zoo.without_inplace_ops(zoo.vgg11_gn(num_classes=1000, head="imagenet", hidden=64))  # noqa: E731
    resnet_title = "ResNet-18-GN 224 (torchvision, GroupNorm), "
    rows = _llama_rows(dry)
    rows += [
        TableRow("gpt2-small-t100", "GPT-2 small, fp32, B 32, T 100",
                 _config("gpt2-small-t100", "GPT-2 small (12 layers, 768), untied head, position embedding frozen, "
                         "position ids [B, T] in every arm, no dropout, vocab 50257, T=100", 32,
                         lambda: _lm(gpt2_full, 100, 50257, True)),
                 _config("gpt2-small-t100", "tiny GPT-2 (2 layers, width 64, vocab 512), untied, T=16", 2,
                         lambda: _lm(gpt2_tiny, 16, 512, True), **dry),
                 {NON_PRIVATE: 0.0679, PRIVATE: 0.106, "opacus-ghost": 0.1932, FASTDP_ARM: 0.117},
                 (("opacus-ghost", 2), (FASTDP_ARM, 2))),
        TableRow("vit-b16-224", "ViT-B/16 224, fp32, B 32",
                 _config("vit-b16-224", "ViT-B/16 (timm vit_base_patch16_224), random weights, 224x224, 1,000 classes",
                         32, lambda: _image(vit_full, 224)),
                 _config("vit-b16-224", "tiny ViT (timm, 2 blocks of vit_tiny_patch16), 32x32", 2,
                         lambda: _image(vit_tiny, 32), **dry),
                 {NON_PRIVATE: 0.089, PRIVATE: 0.110, FASTDP_ARM: 0.1433}, ((FASTDP_ARM, 4),)),
        TableRow("resnet18-gn-224-b128", "ResNet-18-GN 224, fp32, B 128",
                 _config("resnet18-gn-224-b128", resnet_title + "1,000 classes", 128,
                         lambda: _image(resnet, 224)),
                 _config("resnet18-gn-224-b128", resnet_title.replace("224", "at 32x32") + "1,000 classes", 2,
                         lambda: _image(resnet, 32), **dry),
                 {NON_PRIVATE: 0.022, PRIVATE: 0.0583, "opacus-hooks": 0.0565, FASTDP_ARM: 0.0758},
                 (("opacus-hooks", 4), (FASTDP_ARM, 4)),
                 ((NON_PRIVATE, 3), (PRIVATE, 3), ("opacus-hooks", 5), (FASTDP_ARM, 5))),
        TableRow("resnet18-gn-224-b128-bf16", "ResNet-18-GN 224, bf16 autocast, B 128",
                 _config("resnet18-gn-224-b128-bf16", resnet_title + "1,000 classes, bf16 autocast", 128,
                         lambda: _image(resnet, 224), autocast="bfloat16"),
                 _config("resnet18-gn-224-b128-bf16",
                         resnet_title.replace("224", "at 32x32") + "1,000 classes, bf16 autocast", 2,
                         lambda: _image(resnet, 32), autocast="bfloat16", **dry),
                 {NON_PRIVATE: 0.0213, PRIVATE: 0.0636}),
        TableRow("resnet18-gn-224-b32", "ResNet-18-GN 224, fp32, B 32",
                 _config("resnet18-gn-224-b32", resnet_title + "1,000 classes", 32, lambda: _image(resnet, 224)),
                 _config("resnet18-gn-224-b32", resnet_title.replace("224", "at 32x32") + "1,000 classes", 2,
                         lambda: _image(resnet, 32), **dry),
                 {NON_PRIVATE: 0.0092, PRIVATE: 0.050}),
        TableRow("vgg11-gn-224-b32", "VGG-11-GN 224, fp32, B 32",
                 _config("vgg11-gn-224-b32", "VGG-11 (vgg11_bn with GroupNorm), torchvision head (4096), "
                         "1,000 classes, 224x224", 32, lambda: _image(vgg_full, 224)),
                 _config("vgg11-gn-224-b32", "VGG-11-GN, torchvision head of width 64, 32x32", 2,
                         lambda: _image(vgg_tiny, 32), **dry),
                 {NON_PRIVATE: 0.0147, PRIVATE: 0.0413, FASTDP_ARM: 0.0425}, ((FASTDP_ARM, 4),),
                 ((NON_PRIVATE, 3), (PRIVATE, 3), (FASTDP_ARM, 5))),
    ]
    return rows


def _tiny_vit():
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=1000, img_size=32, depth=2)


def rows_by_key(dry_run: bool = False) -> dict[str, TableRow]:
    return {row.key: row for row in table_rows(dry_run)}


def row_config(row: TableRow, dry_run: bool) -> BenchConfig:
    return row.stand_in if dry_run else row.config


#: seconds of trials per largest-batch search (core arms, peers); its process gets SEARCH_GRACE_S more to start and
#: to finish the trial in flight at that time
SEARCH_S = {NON_PRIVATE: 16.0, PRIVATE: 22.0}
PEER_SEARCH_S = 16.0
SEARCH_GRACE_S = 14.0


def plan_jobs(rows: list[TableRow], dry_run: bool = False) -> list[Job]:
    """Every job of the table, tier by tier (see the module's docstring), rows in table order within a tier."""
    jobs = []
    for row in rows:
        config = row_config(row, dry_run)
        n_steps = config.warmup + config.steps
        for arm, tier in ((NON_PRIVATE, 1), (PRIVATE, 1), *row.peers):
            first_extra = 0.0 if arm == NON_PRIVATE else row.first_step_extra_s
            expected = row.start_s + first_extra + n_steps * row.step_s[arm]
            jobs.append(Job(row.key, arm, "arm", tier, round(expected, 1), round(max(30.0, 2.5 * expected), 1)))
        for arm, tier in row.searched:
            search_s = SEARCH_S.get(arm, PEER_SEARCH_S)
            jobs.append(Job(row.key, arm, "largest-batch", tier, search_s + 4.0, search_s + SEARCH_GRACE_S, search_s))
    order = {row.key: i for i, row in enumerate(rows)}
    return sorted(jobs, key=lambda job: (job.tier, order[job.row]))  # stable: arms keep their order within a row


def select_jobs(jobs: list[Job], patterns: list[str] | None) -> list[Job]:
    """The jobs whose id matches one of ``patterns`` (shell-style: ``vgg11-gn-224-b32/*``); all without patterns."""
    if not patterns:
        return jobs
    chosen = [job for job in jobs if any(fnmatch.fnmatchcase(job.id, p) for p in patterns)]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(job.id, p) for job in jobs)]
    if unmatched:
        raise ValueError(f"--only {' '.join(unmatched)} matches no job; the jobs: {', '.join(j.id for j in jobs)}")
    return chosen
