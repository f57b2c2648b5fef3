"""Tests for Poisson sampling across ranks (dptrain.data, ``distributed=True``).

Most tests pass ``num_replicas`` / ``rank`` explicitly and need no process group; one test
runs a real two-process gloo group.
"""

import io
import math
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import Dataset, TensorDataset

from dptrain.data import (
    DistributedPoissonSampler,
    PoissonSampler,
    is_poisson_loader,
    poisson_loader,
)
from helpers import free_port


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


def index_dataset(n):
    return TensorDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n))


def shard_masks(sampler, epochs=1):
    """[steps * epochs, shard_size] 0/1 masks of the sampler's draws, in shard-local order."""
    rows = []
    for _ in range(epochs):
        for batch in sampler:
            local = torch.tensor(batch, dtype=torch.long)
            assert torch.all((local - sampler.rank) % sampler.num_replicas == 0)
            row = torch.zeros(sampler.shard_size)
            row[(local - sampler.rank) // sampler.num_replicas] = 1
            rows.append(row)
    return torch.stack(rows)


# --------------------------------------------------------------------------- shards


@pytest.mark.parametrize("n, world", [(100, 4), (103, 4), (7, 7), (10, 3), (5, 1)])
def test_shards_are_disjoint_and_cover_the_dataset(n, world):
    samplers = [DistributedPoissonSampler(n, 1.0, world, r, generator=seeded(0)) for r in range(world)]
    shards = [list(s.indices) for s in samplers]
    assert sorted(i for shard in shards for i in shard) == list(range(n))
    assert [len(shard) for shard in shards] == [s.shard_size for s in samplers]
    assert max(map(len, shards)) - min(map(len, shards)) <= 1  # no padding, sizes differ by <= 1
    # q = 1: every rank's batch is exactly its shard, so the union is the dataset, once.
    batches = [next(iter(s)) for s in samplers]
    assert batches == shards
    for s in samplers:
        assert all(batch == sorted(set(batch)) for batch in s)


@pytest.mark.parametrize("n, world, batch_size, steps", [(1000, 4, 50, None), (103, 8, 7, None), (30, 3, 1, 17)])
def test_every_rank_runs_the_same_number_of_steps(n, world, batch_size, steps):
    dataset = index_dataset(n)
    loaders = [
        poisson_loader(dataset, batch_size=batch_size, steps=steps, distributed=True,
                       num_replicas=world, rank=r, generator=seeded(r))
        for r in range(world)
    ]
    expected = steps if steps is not None else round(n / batch_size)
    assert [len(loader) for loader in loaders] == [expected] * world
    assert [sum(1 for _ in loader) for loader in loaders] == [expected] * world


def test_loader_reports_the_global_sample_rate_and_expected_batch_size():
    dataset = index_dataset(1000)
    loader = poisson_loader(dataset, batch_size=64, distributed=True, num_replicas=4, rank=3)
    assert is_poisson_loader(loader)
    assert isinstance(loader.poisson_sampler, DistributedPoissonSampler)
    assert isinstance(loader.poisson_sampler, PoissonSampler)
    assert loader.sample_rate == 64 / 1000  # what the engine checks: batch_size / sample_size
    assert loader.expected_batch_size == pytest.approx(64.0)  # global: the divisor
    assert loader.poisson_sampler.shard_size == 250
    assert len(loader) == round(1000 / 64)
    by_rate = poisson_loader(dataset, sample_rate=0.01, distributed=True, num_replicas=2, rank=0)
    assert by_rate.sample_rate == 0.01 and len(by_rate) == 100


def test_empty_batches_on_a_rank_keep_their_structure():
    dataset = TensorDataset(torch.randn(6, 3), torch.arange(6))
    # Shard of 2 examples at q = 0.05: P(empty) = 0.9025 per batch, over 20 steps.
    loader = poisson_loader(dataset, sample_rate=0.05, distributed=True, num_replicas=3, rank=1,
                            generator=seeded(4))
    sizes = []
    for x, y in loader:
        assert x.shape[1:] == (3,) and x.dtype == torch.float32 and y.dtype == torch.int64
        assert set(y.tolist()) <= {1, 4}
        sizes.append(len(y))
    assert len(sizes) == 20 and 0 in sizes


# ---------------------------------------------------------------------- statistics


def test_inclusion_frequency_of_every_index_is_q_and_global_batches_are_binomial():
    n, world, q, steps = 1001, 4, 0.05, 2000
    samplers = [DistributedPoissonSampler(n, q, world, r, steps=steps, generator=seeded(1)) for r in range(world)]
    per_rank = [list(s) for s in samplers]
    counts = torch.zeros(n)
    global_sizes = torch.zeros(steps, dtype=torch.float64)
    for batches in per_rank:
        for t, batch in enumerate(batches):
            counts[batch] += 1
            global_sizes[t] += len(batch)
    # Deterministic (fixed seeds). Every index is included Binomial(steps, q) times; the
    # max deviation over 1001 indices exceeds 5.5 standard deviations with probability
    # < 1e-4 for a random seed.
    assert (counts - steps * q).abs().max().item() <= 5.5 * math.sqrt(steps * q * (1 - q))
    # The union over ranks is Poisson sampling of the dataset: Binomial(n, q) global batches.
    mean, variance = n * q, n * q * (1 - q)
    assert abs(global_sizes.mean().item() - mean) <= 5 * math.sqrt(variance / steps)
    assert abs(global_sizes.var().item() - variance) <= 5 * variance * math.sqrt(2 / (steps - 1))


def test_ranks_draw_independently_from_the_same_base_seed():
    n, world, q, steps = 1000, 2, 0.5, 200
    masks = [shard_masks(DistributedPoissonSampler(n, q, world, r, steps=steps, generator=seeded(7)))
             for r in range(world)]
    assert not torch.equal(masks[0], masks[1])  # not mirrored: the same stream would give equal masks
    # Correlation between rank 0's and rank 1's inclusions at the same step and local
    # position: 0 for independent draws, standard error 1/sqrt(100000) ~ 0.003.
    a, b = masks[0].flatten(), masks[1].flatten()
    correlation = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(correlation) < 0.02
    # Joint inclusion of one example of each rank in the same step: q^2.
    assert abs((a * b).mean().item() - q * q) < 0.02


def test_per_rank_generators_are_distinct_and_deterministic():
    world = 64
    seeds = [DistributedPoissonSampler(100, 0.1, world, r, generator=seeded(3)).generator.initial_seed()
             for r in range(world)]
    assert len(set(seeds)) == world  # a guarantee of the derivation, not a probability
    again = [DistributedPoissonSampler(100, 0.1, world, r, generator=seeded(3)).generator.initial_seed()
             for r in range(world)]
    assert seeds == again
    other_base = DistributedPoissonSampler(100, 0.1, world, 0, generator=seeded(4)).generator.initial_seed()
    assert other_base != seeds[0]
    defaults = [DistributedPoissonSampler(100, 0.1, world, r).generator.initial_seed() for r in range(world)]
    assert len(set(defaults)) == world  # os.urandom bases: still distinct by construction


def test_same_base_seed_reproduces_each_ranks_batches_and_default_is_random():
    dataset = index_dataset(500)

    def run(rank, generator):
        loader = poisson_loader(dataset, sample_rate=0.5, steps=3, distributed=True,
                                num_replicas=2, rank=rank, generator=generator)
        return [y.tolist() for _, y in loader]

    assert run(1, seeded(5)) == run(1, seeded(5))
    assert run(1, seeded(5)) != run(1, seeded(6))
    assert run(1, None) != run(1, None)  # agree with probability 2^-750


def test_explicit_generator_is_advanced_by_one_draw_and_keeps_its_device():
    generator = seeded(9)
    reference = seeded(9)
    sampler = DistributedPoissonSampler(100, 0.1, 2, 0, generator=generator)
    torch.randint(0, 2**32, (1,), generator=reference)
    assert torch.equal(generator.get_state(), reference.get_state())
    assert sampler.generator is not generator and sampler.generator.device == generator.device


def test_one_replica_samples_the_whole_dataset():
    sampler = DistributedPoissonSampler(50, 1.0, 1, 0, steps=2, generator=seeded(0))
    assert list(sampler) == [list(range(50))] * 2


# ---------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_rank_resumes_from_its_own_checkpoint(num_workers):
    dataset = index_dataset(300)

    def loader(rank, seed):
        return poisson_loader(dataset, sample_rate=0.1, steps=8, distributed=True, num_replicas=3,
                              rank=rank, generator=seeded(seed), num_workers=num_workers)

    states, rests, next_epochs = [], [], []
    for rank in range(3):
        running = loader(rank, 11)
        iterator = iter(running)
        consumed = [next(iterator)[1].tolist() for _ in range(3)]
        state = running.state_dict()
        assert state["position"] == 3 and state["rank"] == rank and state["num_replicas"] == 3
        rest = [y.tolist() for _, y in iterator]
        assert len(consumed) + len(rest) == 8
        states.append(state)
        rests.append(rest)
        next_epochs.append([y.tolist() for _, y in running])

    for rank in range(3):
        buffer = io.BytesIO()
        torch.save(states[rank], buffer)  # survives torch.save / torch.load (weights_only)
        buffer.seek(0)
        resumed = loader(rank, 999)
        resumed.load_state_dict(torch.load(buffer))
        assert [y.tolist() for _, y in resumed] == rests[rank]
        assert [y.tolist() for _, y in resumed] == next_epochs[rank]


def test_checkpoints_only_load_into_the_same_rank():
    state = DistributedPoissonSampler(100, 0.2, 2, 0, steps=5, generator=seeded(0)).state_dict()
    with pytest.raises(ValueError, match="rank 0 of num_replicas=2"):
        DistributedPoissonSampler(100, 0.2, 2, 1, steps=5).load_state_dict(state)
    with pytest.raises(ValueError, match="rank 0 of num_replicas=2"):
        DistributedPoissonSampler(100, 0.2, 4, 0, steps=5).load_state_dict(state)
    with pytest.raises(ValueError, match="DistributedPoissonSampler"):
        PoissonSampler(100, 0.2, steps=5).load_state_dict(state)
    plain = PoissonSampler(100, 0.2, steps=5, generator=seeded(0)).state_dict()
    with pytest.raises(ValueError, match="non-distributed"):
        DistributedPoissonSampler(100, 0.2, 2, 0, steps=5).load_state_dict(plain)
    with pytest.raises(ValueError, match="num_samples, sample_rate, steps"):
        DistributedPoissonSampler(101, 0.2, 2, 0, steps=5).load_state_dict(state)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_replicas": 0, "rank": 0}, "num_replicas must be a positive integer"),
        ({"num_replicas": 2.0, "rank": 0}, "num_replicas must be a positive integer"),
        ({"num_replicas": 11, "rank": 0}, "exceeds the dataset size 10"),
        ({"num_replicas": 2, "rank": 2}, r"0 <= rank < num_replicas=2"),
        ({"num_replicas": 2, "rank": -1}, r"0 <= rank < num_replicas=2"),
        ({"num_replicas": 2, "rank": 0.0}, r"0 <= rank < num_replicas=2"),
        ({"num_replicas": 2, "rank": True}, r"0 <= rank < num_replicas=2"),
        ({"num_replicas": 2, "rank": 0, "generator": 42}, "generator"),
        ({"num_replicas": 2, "rank": 0, "sample_rate": 1.5, "batch_size": None}, r"\(0, 1\]"),
        ({"num_replicas": 2, "rank": 0, "steps": 0}, "steps"),
        ({"num_replicas": 2, "rank": 0, "batch_size": 11}, "exceeds the dataset size 10"),
    ],
)
def test_distributed_validation(kwargs, message):
    kwargs = {"batch_size": 2, **kwargs}
    if kwargs["batch_size"] is None:
        del kwargs["batch_size"]
    with pytest.raises(ValueError, match=message):
        poisson_loader(index_dataset(10), distributed=True, **kwargs)


def test_invalid_rank_does_not_consume_the_callers_generator():
    generator = seeded(0)
    before = generator.get_state()
    with pytest.raises(ValueError):
        DistributedPoissonSampler(10, 0.1, 2, 5, generator=generator)
    with pytest.raises(ValueError):
        DistributedPoissonSampler(10, 1.5, 2, 0, generator=generator)
    assert torch.equal(generator.get_state(), before)


def test_replicas_without_distributed_is_an_error():
    with pytest.raises(ValueError, match="distributed=True"):
        poisson_loader(index_dataset(10), batch_size=2, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="distributed=True"):
        poisson_loader(index_dataset(10), batch_size=2, rank=0)
    with pytest.raises(ValueError, match="distributed must be True or False"):
        poisson_loader(index_dataset(10), batch_size=2, distributed=1)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_defaults_need_an_initialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        poisson_loader(index_dataset(10), batch_size=2, distributed=True)
    with pytest.raises(RuntimeError, match="needs rank"):
        poisson_loader(index_dataset(10), batch_size=2, distributed=True, num_replicas=2)
    with pytest.raises(RuntimeError, match="needs num_replicas"):
        DistributedPoissonSampler(10, 0.1, rank=0)


# ------------------------------------------------------------ real process group


class IndexDataset(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return torch.tensor([float(index)]), index


def _worker(rank, world_size, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world_size, rank=rank,
        timeout=timedelta(seconds=60),
    )
    try:
        loader = poisson_loader(IndexDataset(101), batch_size=20, distributed=True, generator=seeded(0))
        sampler = loader.poisson_sampler
        batches = []
        for _, y in loader:
            batches.append(y.tolist())
            total = torch.tensor([float(len(y))])
            dist.all_reduce(total)  # a collective every step: deadlocks if step counts differ
        torch.save(
            {"num_replicas": sampler.num_replicas, "rank": sampler.rank, "batches": batches,
             "sample_rate": loader.sample_rate, "steps": len(loader)},
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_two_process_gloo_group_defaults_and_disjoint_union(tmp_path):
    world_size = 2
    # torch.multiprocessing.spawn's machinery; "fork" where it is the platform's default
    # (Linux), so the children inherit the imported modules instead of re-importing
    # torch and dptrain (seconds each), which keeps this test at a few seconds.
    start_method = "fork" if sys.platform.startswith("linux") else "spawn"
    mp.start_processes(_worker, args=(world_size, free_port(), str(tmp_path)), nprocs=world_size,
                       join=True, start_method=start_method)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    assert [(r["num_replicas"], r["rank"]) for r in results] == [(2, 0), (2, 1)]
    assert all(r["sample_rate"] == 20 / 101 and r["steps"] == round(101 / 20) for r in results)
    assert len(results[0]["batches"]) == len(results[1]["batches"]) == 5
    assert all(i % 2 == 0 for b in results[0]["batches"] for i in b)
    assert all(i % 2 == 1 for b in results[1]["batches"] for i in b)
    for step in range(5):
        union = results[0]["batches"][step] + results[1]["batches"][step]
        assert len(union) == len(set(union))  # no example twice in a global batch
    # Same base seed on both ranks, yet different streams: the shard-local masks differ.
    local = [[[i // 2 for i in b] for b in r["batches"]] for r in results]
    assert local[0] != local[1]
