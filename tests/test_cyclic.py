"""Cyclic Poisson sampling (poisson_loader(..., cyclic_groups=g)): each unit only at the steps of its group, with the
within-group rate, across epochs and resumes; fixed shapes, users and data-parallel shards."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from dptrain.data import FixedShapeBatch, poisson_loader
from dptrain.data.cyclic import (
    CyclicDistributedPoissonSampler,
    CyclicPoissonSampler,
    cyclic_groups_of,
    default_cyclic_steps,
)


def dataset(n=200):
    return TensorDataset(torch.arange(n).float()[:, None], torch.arange(n))


def test_each_example_is_sampled_only_at_the_steps_of_its_group_with_the_within_group_rate():
    n, g, batch = 400, 4, 10
    loader = poisson_loader(dataset(n), batch_size=batch, cyclic_groups=g, generator=torch.Generator().manual_seed(0))
    sampler = loader.batch_sampler
    assert isinstance(sampler, CyclicPoissonSampler) and cyclic_groups_of(loader) == g
    assert loader.sample_rate == pytest.approx(batch * g / n) and loader.expected_batch_size == pytest.approx(batch)
    assert len(loader) == default_cyclic_steps(loader.sample_rate, g) == n // batch
    counts = torch.zeros(n)
    steps = 0
    for _epoch in range(30):
        for _, ids in loader:
            assert bool((sampler.group_of[ids] == steps % g).all())  # group t mod g, across epoch boundaries
            assert loader.last_batch_step == steps
            counts[ids] += 1
            steps += 1
    # each example was eligible at steps / g steps, and drawn at rate q each time: Binomial(steps / g, q)
    q, eligible = loader.sample_rate, steps / g
    mean = counts.mean().item()
    assert abs(mean - q * eligible) < 5 * (q * (1 - q) * eligible / n) ** 0.5
    sizes = torch.bincount(sampler.group_of, minlength=g)
    assert int(sizes.sum()) == n and int(sizes.min()) > 0  # independent uniform assignment


def test_epochs_need_not_be_a_multiple_of_the_groups_and_resume_keeps_groups_and_position():
    n, g = 60, 4
    loader = poisson_loader(dataset(n), batch_size=5, cyclic_groups=g, steps=7,
                            generator=torch.Generator().manual_seed(1))
    seen = []
    for epoch in range(2):
        for i, (_, ids) in enumerate(loader):
            seen.append(ids.tolist())
            if epoch == 1 and i == 2:
                state = loader.state_dict()
    # a loader built without a seed (fresh groups) continues exactly: the saved assignment and count come back
    resumed = poisson_loader(dataset(n), batch_size=5, cyclic_groups=g, steps=7)
    resumed.load_state_dict(state)
    rest = [ids.tolist() for _, ids in resumed]
    assert rest == seen[10:]
    assert resumed.last_batch_step == 13
    assert torch.equal(resumed.batch_sampler.group_of, loader.batch_sampler.group_of)
    with pytest.raises(ValueError, match="cyclic_groups=4, but this sampler has cyclic_groups=3"):
        poisson_loader(dataset(n), batch_size=5, cyclic_groups=3, steps=7).load_state_dict(state)
    with pytest.raises(ValueError, match="plain Poisson sampler"):
        resumed.load_state_dict(poisson_loader(dataset(n), batch_size=5, steps=7).state_dict())


def test_fixed_shapes_with_cyclic_groups():
    loader = poisson_loader(dataset(120), batch_size=6, cyclic_groups=3, max_batch_size=9,
                            generator=torch.Generator().manual_seed(2))
    sampler = loader.batch_sampler
    for step, ((_, ids), mask) in enumerate(loader):
        batch = FixedShapeBatch((_, ids), mask)
        assert len(batch.mask) == 9 and int(batch.mask.sum()) <= 9
        real = ids[mask]
        assert bool((sampler.group_of[real] == step % 3).all())


def test_user_level_cyclic_groups_sample_whole_users():
    users = torch.arange(90) // 3  # 30 users
    loader = poisson_loader(dataset(90), batch_size=3, users=users, cyclic_groups=3, max_examples_per_user=2,
                            generator=torch.Generator().manual_seed(3))
    sampler = loader.batch_sampler
    assert loader.sample_rate == pytest.approx(3 * 3 / 30)
    for step, ((_, ids), batch_users) in enumerate(loader):
        assert bool((sampler.group_of[batch_users] == step % 3).all())
        assert bool((users[ids] == batch_users).all())


def test_distributed_shards_sample_their_own_examples_of_the_steps_group():
    n, g, world = 100, 2, 2
    ranks = [CyclicDistributedPoissonSampler(n, 0.5, g, num_replicas=world, rank=r,
                                             generator=torch.Generator().manual_seed(4)) for r in range(world)]
    assert ranks[0].steps == ranks[1].steps
    for step, batches in enumerate(zip(*ranks)):
        for r, ids in enumerate(batches):
            ids = torch.tensor(ids, dtype=torch.long)
            assert bool((ids % world == r).all())
            assert bool((ranks[r].group_of[ids // world] == step % g).all())


def test_distributed_loaders_of_users_and_examples_with_cyclic_groups():
    users = torch.arange(120) // 3  # 40 users
    for rank in range(2):
        loader = poisson_loader(dataset(120), batch_size=4, users=users, cyclic_groups=2, distributed=True,
                                num_replicas=2, rank=rank, generator=torch.Generator().manual_seed(6))
        sampler = loader.batch_sampler
        assert type(sampler).__name__ == "CyclicDistributedUserPoissonSampler"
        for step, (_, batch_users) in enumerate(loader):
            positions = torch.searchsorted(sampler.user_ids, batch_users)
            assert bool((positions % 2 == rank).all()) and bool((sampler.group_of[positions] == step % 2).all())
        examples = poisson_loader(dataset(120), batch_size=4, cyclic_groups=3, distributed=True, num_replicas=2,
                                  rank=rank, generator=torch.Generator().manual_seed(6))
        assert type(examples.batch_sampler).__name__ == "CyclicDistributedPoissonSampler"
        assert examples.expected_batch_size == pytest.approx(4) and examples.sample_rate == pytest.approx(0.1)


def test_bad_cyclic_arguments():
    with pytest.raises(ValueError, match="batch_size \\* cyclic_groups <= 20"):
        poisson_loader(dataset(20), batch_size=6, cyclic_groups=4)
    with pytest.raises(ValueError, match="cyclic_groups must be a positive integer"):
        poisson_loader(dataset(20), batch_size=2, cyclic_groups=0)
    with pytest.raises(ValueError, match="exceeds the 5 units"):
        CyclicPoissonSampler(5, 0.5, 6)
