"""User-level Poisson sampling: poisson_loader(..., users=...) and its samplers and batches.

The statistical checks are seeded (deterministic) and use wide margins (5 standard deviations, or a chi-square
quantile far in the tail), so they fail for a wrong rate or a biased choice, not by chance.
"""

import itertools
import math
import sys
from collections import Counter
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dptrain
from dptrain.data import (
    DistributedPoissonSampler,
    DistributedUserPoissonSampler,
    FixedShapeUserBatch,
    PoissonSampler,
    UserBatch,
    UserPoissonSampler,
    is_poisson_loader,
    masked_losses,
    poisson_loader,
    split_batches,
)
from helpers import free_port


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


def indexed_dataset(num_examples):
    """Features [i, 2i] and target i: every row says which example it is."""
    index = torch.arange(num_examples)
    return TensorDataset(torch.stack([index, 2 * index], dim=1).float(), index)


# Users with 1 to 6 examples each, ids not contiguous and not in dataset order.
EXAMPLES_PER_USER = [1, 2, 3, 4, 5, 6] * 5
USER_IDS = [1000 - 7 * u for u in range(len(EXAMPLES_PER_USER))]
USER_IDS_SORTED = sorted(USER_IDS)


def interleaved_users():
    """One user id per example, a user's examples scattered over the dataset."""
    owners = [uid for uid, count in zip(USER_IDS, EXAMPLES_PER_USER) for _ in range(count)]
    order = torch.randperm(len(owners), generator=seeded(1)).tolist()
    return [owners[i] for i in order]


def binomial_bounds(trials, p, width=5.0):
    mean, sd = trials * p, math.sqrt(trials * p * (1 - p))
    return mean - width * sd, mean + width * sd


# ------------------------------------------------------------------------ sampling


def test_each_user_is_included_with_probability_q_independently():
    users = interleaved_users()
    q, steps = 0.2, 3000
    sampler = UserPoissonSampler(users, q, steps=steps, generator=seeded(0))
    included = Counter()
    both_of_first_two = 0
    for batch in sampler:
        present = {users[i] for i in batch}
        included.update(present)
        both_of_first_two += USER_IDS[0] in present and USER_IDS[1] in present
    low, high = binomial_bounds(steps, q)
    for uid in USER_IDS:  # every user, whatever their number of examples
        assert low < included[uid] < high, (uid, included[uid], (low, high))
    low, high = binomial_bounds(steps * len(USER_IDS), q)  # all users together: a sharper check of q
    assert low < sum(included.values()) < high
    low, high = binomial_bounds(steps, q * q)  # independent users: both in a batch with q^2
    assert low < both_of_first_two < high


def test_a_sampled_user_brings_min_of_m_and_their_examples():
    users = interleaved_users()
    count_of = dict(zip(USER_IDS, EXAMPLES_PER_USER))
    for cap in (1, 3, None):
        sampler = UserPoissonSampler(users, 0.5, steps=40, generator=seeded(2), max_examples_per_user=cap)
        seen_users = set()
        for batch in sampler:
            assert len(set(batch)) == len(batch)  # without replacement
            rows_of = Counter(users[i] for i in batch)
            seen_users |= set(rows_of)
            for uid, rows in rows_of.items():
                assert rows == (count_of[uid] if cap is None else min(cap, count_of[uid]))
        assert seen_users == set(USER_IDS)


def test_chosen_examples_are_a_uniform_subset_of_the_users_examples():
    # One user with 5 examples, m = 2: the 10 pairs should be equally likely (chi-square, 9 dof).
    users = [3, 9, 3, 3, 9, 3, 3]
    mine = [i for i, u in enumerate(users) if u == 3]
    steps = 5000
    sampler = UserPoissonSampler(users, 1.0, steps=steps, generator=seeded(3), max_examples_per_user=2)
    pairs = Counter()
    for batch in sampler:
        chosen = tuple(sorted(i for i in batch if users[i] == 3))
        assert len(chosen) == 2 and set(chosen) <= set(mine)
        assert [i for i in batch if users[i] == 9] == [1, 4]  # 2 examples <= m: all of them
        pairs[chosen] += 1
    assert set(pairs) == set(itertools.combinations(mine, 2))
    expected = steps / 10
    chi_square = sum((count - expected) ** 2 / expected for count in pairs.values())
    assert chi_square < 40.0, pairs  # P(chi2_9 > 40) ~ 7e-6


def test_every_example_of_a_user_is_equally_likely():
    # The marginal view of the same property, on a user with many examples: each of 20 is chosen
    # with probability m / 20 = 0.25 when the user is in the batch.
    users = [0] * 20 + [1]
    steps = 4000
    sampler = UserPoissonSampler(users, 1.0, steps=steps, generator=seeded(4), max_examples_per_user=5)
    chosen = Counter(i for batch in sampler for i in batch if i < 20)
    low, high = binomial_bounds(steps, 0.25)
    assert all(low < chosen[i] < high for i in range(20)), chosen


def test_batches_group_users_in_increasing_id_order_and_examples_in_dataset_order():
    users = interleaved_users()
    for batch in UserPoissonSampler(users, 0.3, steps=20, generator=seeded(5), max_examples_per_user=4):
        owners = [users[i] for i in batch]
        runs = [uid for uid, _ in itertools.groupby(owners)]
        assert runs == sorted(set(owners))
        for uid in runs:
            rows = [i for i in batch if users[i] == uid]
            assert rows == sorted(rows)


def test_same_seed_same_batches_and_epochs_differ():
    users = interleaved_users()

    def batches(generator):
        return list(UserPoissonSampler(users, 0.3, steps=10, generator=generator, max_examples_per_user=2))

    assert batches(seeded(6)) == batches(seeded(6))
    assert batches(seeded(6)) != batches(seeded(7))
    sampler = UserPoissonSampler(users, 0.3, steps=10, generator=seeded(6), max_examples_per_user=2)
    assert list(sampler) != list(sampler)


def test_sampler_counts_users_not_examples():
    sampler = UserPoissonSampler([5, 5, 5, 8, 2, 2], 0.5)
    assert (sampler.num_users, sampler.num_samples, sampler.num_examples) == (3, 3, 6)
    assert sampler.user_ids.tolist() == [2, 5, 8]
    assert sampler.privacy_unit == "user" and len(sampler) == 2
    assert sampler.max_rows_per_user == 3
    assert UserPoissonSampler([5, 5, 5, 8], 0.5, max_examples_per_user=2).max_rows_per_user == 2


# ------------------------------------------------------------------------- loaders


def test_loader_returns_user_batches_with_each_rows_user():
    users = interleaved_users()
    loader = poisson_loader(indexed_dataset(len(users)), batch_size=6, users=users, max_examples_per_user=3,
                            generator=seeded(8))
    batches = list(loader)
    assert sum(len(batch.users) for batch in batches) > 0
    for batch in batches:
        assert isinstance(batch, UserBatch)
        (features, index), row_users = batch  # unpacks as (data, users)
        assert row_users.dtype == torch.int64 and row_users.shape == index.shape
        assert row_users.tolist() == [users[i] for i in index.tolist()]
        assert torch.equal(features[:, 0].long(), index)


def test_loader_attributes_report_the_user_rate():
    users = interleaved_users()
    loader = poisson_loader(indexed_dataset(len(users)), batch_size=6, users=users, max_examples_per_user=3)
    assert is_poisson_loader(loader)
    assert loader.privacy_unit == "user"
    assert loader.num_users == 30 and loader.max_examples_per_user == 3
    assert loader.sample_rate == pytest.approx(6 / 30)
    assert loader.expected_batch_size == pytest.approx(6.0)  # users per batch
    assert len(loader) == 5  # round(1 / q)
    assert loader.max_batch_size is None
    assert isinstance(loader.batch_sampler, UserPoissonSampler)
    by_rate = poisson_loader(indexed_dataset(len(users)), sample_rate=0.5, users=users, steps=3)
    assert by_rate.sample_rate == 0.5 and len(by_rate) == 3 and by_rate.max_examples_per_user is None
    examples = poisson_loader(indexed_dataset(10), batch_size=2)
    assert (examples.privacy_unit, examples.num_users, examples.max_examples_per_user) == ("example", None, None)


def test_users_as_tensor_numpy_or_list_give_the_same_batches():
    users = interleaved_users()
    dataset = indexed_dataset(len(users))
    runs = [
        [batch.users.tolist() for batch in poisson_loader(dataset, batch_size=5, users=given, generator=seeded(9))]
        for given in (users, torch.tensor(users, dtype=torch.int32), np.array(users))
    ]
    assert runs[0] == runs[1] == runs[2]


def test_empty_batches_keep_the_structure():
    dataset = TensorDataset(torch.randn(4, 3, 2), torch.tensor([1, 0, 1, 1]))
    loader = poisson_loader(dataset, sample_rate=1e-6, steps=3, users=[0, 0, 1, 1], generator=seeded(10))
    for (features, targets), row_users in loader:
        assert features.shape == (0, 3, 2) and features.dtype == torch.float32
        assert targets.shape == (0,) and targets.dtype == torch.int64
        assert row_users.shape == (0,) and row_users.dtype == torch.int64


def test_workers_keep_each_rows_user():
    users = interleaved_users()
    loader = poisson_loader(indexed_dataset(len(users)), batch_size=10, users=users, num_workers=1,
                            generator=seeded(11), steps=4)
    for (_, index), row_users in loader:
        assert row_users.tolist() == [users[i] for i in index.tolist()]


def test_custom_collate_fn_is_used_for_the_data():
    def collate(items):
        return {"index": torch.stack([target for _, target in items])}

    users = [0, 0, 1, 2]
    loader = poisson_loader(indexed_dataset(4), sample_rate=1.0, steps=1, users=users, collate_fn=collate)
    batch = next(iter(loader))
    assert batch.data["index"].tolist() == [0, 1, 2, 3] and batch.users.tolist() == users


def test_loader_resumes_mid_epoch_with_the_same_batches():
    users = interleaved_users()

    def loader():
        return poisson_loader(indexed_dataset(len(users)), batch_size=8, users=users, max_examples_per_user=2,
                              generator=seeded(12), steps=6)

    reference = [batch.data[1].tolist() for batch in loader()]
    stopped = loader()
    iterator = iter(stopped)
    first = [next(iterator).data[1].tolist() for _ in range(2)]
    state = stopped.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert first + [batch.data[1].tolist() for batch in resumed] == reference


def test_states_of_another_unit_or_cap_are_refused():
    users = interleaved_users()
    user_state = UserPoissonSampler(users, 0.2, max_examples_per_user=2).state_dict()
    with pytest.raises(ValueError, match="max_examples_per_user"):
        UserPoissonSampler(users, 0.2, max_examples_per_user=3).load_state_dict(user_state)
    with pytest.raises(ValueError, match="samplers? of users, but this one samples examples"):
        PoissonSampler(30, 0.2).load_state_dict(user_state)
    with pytest.raises(ValueError, match="samplers? of examples, but this one samples users"):
        UserPoissonSampler(users, 0.2).load_state_dict(PoissonSampler(30, 0.2).state_dict())


# ----------------------------------------------------------------- physical batches


def test_split_batches_never_cut_a_user():
    users = interleaved_users()

    def loader():
        return poisson_loader(indexed_dataset(len(users)), batch_size=15, users=users, max_examples_per_user=4,
                              generator=seeded(13), steps=8)

    logical_batches = list(loader())
    split = list(split_batches(loader(), 5))
    assert len(split) == len(logical_batches)
    for logical, physical in zip(logical_batches, split):
        assert all(isinstance(part, UserBatch) and len(part.users) <= 5 for part in physical)
        assert torch.equal(torch.cat([part.users for part in physical]), logical.users)
        assert torch.equal(torch.cat([part.data[1] for part in physical]), logical.data[1])
        owners = [set(part.users.tolist()) for part in physical]
        assert all(not (a & b) for a, b in itertools.combinations(owners, 2))  # no user in two parts
        if len(logical.users) > 5:
            assert len(physical) > 1


def test_split_of_an_empty_user_batch_is_one_empty_batch():
    loader = poisson_loader(indexed_dataset(4), sample_rate=1e-6, steps=1, users=[0, 0, 1, 1])
    [[part]] = list(split_batches(loader, 2))
    assert part.users.shape == (0,) and part.data[0].shape == (0, 2)


def test_split_refuses_a_cap_above_the_physical_size():
    users = [0, 0, 0, 1]
    with pytest.raises(ValueError, match="max_examples_per_user <= 2"):
        split_batches(poisson_loader(indexed_dataset(4), batch_size=1, users=users), 2)
    with pytest.raises(ValueError, match="max_examples_per_user <= 2"):
        split_batches(poisson_loader(indexed_dataset(4), batch_size=1, users=users, max_examples_per_user=3), 2)
    split_batches(poisson_loader(indexed_dataset(4), batch_size=1, users=users, max_examples_per_user=2), 2)


def test_split_refuses_a_user_batch_whose_users_are_scattered():
    batch = UserBatch(torch.zeros(3, 1), torch.tensor([4, 5, 4]))
    with pytest.raises(ValueError, match="not next to each other"):
        list(split_batches([batch], 2))
    with pytest.raises(ValueError, match="a user has 3 rows"):
        list(split_batches([UserBatch(torch.zeros(3, 1), torch.tensor([4, 4, 4]))], 2))


# ------------------------------------------------------------- fixed-shape batches


def test_fixed_shape_batches_have_k_slots_of_m_rows():
    users = interleaved_users()
    count_of = dict(zip(USER_IDS, EXAMPLES_PER_USER))
    slots, cap = 7, 3
    loader = poisson_loader(indexed_dataset(len(users)), batch_size=5, users=users, max_examples_per_user=cap,
                            max_batch_size=slots, generator=seeded(18), steps=40)
    assert loader.max_batch_size == slots and loader.batch_sampler.max_rows_per_user == cap
    drawn_counts = []
    for batch in loader:
        assert isinstance(batch, FixedShapeUserBatch)
        (features, index), row_users, mask = batch
        assert features.shape == (slots * cap, 2) and index.shape == row_users.shape == mask.shape == (slots * cap,)
        assert mask.dtype == torch.bool and row_users.dtype == torch.int64
        assert torch.all(features[~mask] == 0) and torch.all(index[~mask] == 0)  # padding: zero rows
        assert row_users[mask].tolist() == [users[i] for i in index[mask].tolist()]
        slot_users = row_users.view(slots, cap)
        assert torch.all(slot_users == slot_users[:, :1])  # one user per slot, on all m rows
        slot_ids = slot_users[:, 0].tolist()
        assert len(set(slot_ids)) == slots
        real = [uid for uid in slot_ids if uid in count_of]
        assert slot_ids[: len(real)] == real == sorted(real)  # drawn users first, then empty slots
        assert all(uid > max(USER_IDS) for uid in slot_ids[len(real):])  # empty slots: ids of no real user
        real_rows = mask.view(slots, cap).sum(1).tolist()
        assert real_rows == [min(cap, count_of[uid]) for uid in real] + [0] * (slots - len(real))
        assert all(mask.view(slots, cap)[k].tolist() == sorted(mask.view(slots, cap)[k].tolist(), reverse=True)
                   for k in range(slots))  # a slot's real rows come first
        drawn_counts.append(len(real))
    assert slots in drawn_counts and min(drawn_counts) < slots  # full batches and part-empty ones


def test_empty_fixed_shape_user_batch_is_all_padding():
    loader = poisson_loader(indexed_dataset(4), sample_rate=1e-6, steps=2, users=[5, 5, 9, 9],
                            max_examples_per_user=2, max_batch_size=3)
    for (features, index), row_users, mask in loader:
        assert features.shape == (6, 2) and index.shape == (6,) and not mask.any()
        assert row_users.tolist() == [10, 10, 11, 11, 12, 12]  # one id per empty slot, above every user's


def test_more_users_than_slots_keeps_a_uniform_k_of_them():
    users = interleaved_users()
    slots, steps = 10, 3000
    sampler = UserPoissonSampler(users, 1.0, steps=steps, generator=seeded(19), max_examples_per_user=2,
                                 max_batch_size=slots)
    kept = Counter()
    for batch in sampler:
        present = {users[i] for i in batch}
        assert len(present) == slots  # q = 1 draws all 30 users: always truncated to K
        kept.update(present)
    low, high = binomial_bounds(steps, slots / len(USER_IDS))
    assert all(low < kept[uid] < high for uid in USER_IDS), kept


def test_padding_contributes_nothing_and_split_keeps_slots_whole():
    """Training on fixed-shape batches with masked losses equals training on their real rows alone (noise 0,
    clipping binding), also cut into physical batches of two slots."""
    users = torch.randint(0, 20, (60,), generator=seeded(20))
    generator = seeded(21)
    dataset = TensorDataset(torch.randn(60, 4, generator=generator), torch.randint(0, 3, (60,), generator=generator))
    loader = poisson_loader(dataset, batch_size=5, users=users, max_examples_per_user=3, max_batch_size=8,
                            generator=seeded(22), steps=6)
    start = loader.state_dict()

    def train(physical_size, real_rows_only):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        engine = dptrain.PrivacyEngine(model, privacy_unit="user", sample_size=loader.num_users, batch_size=5,
                                       noise_multiplier=0.0, max_grad_norm=0.05, max_batch_size=8)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        engine.attach(optimizer, data_loader=loader)
        loader.load_state_dict(start)
        for physical_batches in split_batches(loader, physical_size):
            for (x, y), row_users, mask in physical_batches:
                assert len(row_users) == physical_size
                if real_rows_only:
                    x, y, row_users, mask = x[mask], y[mask], row_users[mask], mask[mask]
                losses = F.cross_entropy(model(x), y, reduction="none")
                engine.backward(masked_losses(losses, mask), users=row_users)
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    reference = train(24, real_rows_only=True)
    torch.manual_seed(0)
    untrained = [p.detach() for p in nn.Linear(4, 3).parameters()]
    assert all(not torch.equal(p, q) for p, q in zip(reference, untrained))  # the steps moved the model
    for physical_size in (24, 6):
        for mine, theirs in zip(train(physical_size, real_rows_only=False), reference):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-7)


def test_fixed_shape_split_needs_whole_slots():
    loader = poisson_loader(indexed_dataset(4), batch_size=1, users=[0, 0, 0, 1], max_examples_per_user=2,
                            max_batch_size=2)
    assert loader.batch_sampler.max_rows_per_user == 2  # slots are m rows, whatever the users have
    with pytest.raises(ValueError, match="max_examples_per_user <= 1"):
        split_batches(loader, 1)


# ------------------------------------------------------------------ across ranks


def rank_samplers(users, q, world, **kwargs):
    # The same seed on every rank, as the docs tell users to do: the ranks' generators still differ.
    return [DistributedUserPoissonSampler(users, q, world, rank, generator=seeded(14), **kwargs)
            for rank in range(world)]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_ranks_own_disjoint_users_with_all_of_their_examples(world):
    users = interleaved_users()
    count_of = dict(zip(USER_IDS, EXAMPLES_PER_USER))
    samplers = rank_samplers(users, 1.0, world, max_examples_per_user=4)
    owned = [{USER_IDS_SORTED[u] for u in s.own_users.tolist()} for s in samplers]
    assert sorted(uid for share in owned for uid in share) == USER_IDS_SORTED  # each user on exactly one rank
    for sampler, share in zip(samplers, owned):
        batch = next(iter(sampler))  # q = 1: all of the rank's users, each with min(m, n_u) rows
        assert Counter(users[i] for i in batch) == {uid: min(4, count_of[uid]) for uid in share}


def test_union_over_ranks_includes_each_user_with_probability_q_independently():
    users = interleaved_users()
    q, steps, world = 0.2, 3000, 3
    per_rank = [[{users[i] for i in batch} for batch in sampler]
                for sampler in rank_samplers(users, q, world, steps=steps)]
    union = [set().union(*step_sets) for step_sets in zip(*per_rank)]
    included = Counter(uid for present in union for uid in present)
    low, high = binomial_bounds(steps, q)
    assert all(low < included[uid] < high for uid in USER_IDS), included
    low, high = binomial_bounds(steps * len(USER_IDS), q)
    assert low < sum(included.values()) < high
    # Two users on different ranks (positions 0 and 1 of the sorted ids): independent draws.
    first, second = USER_IDS_SORTED[0], USER_IDS_SORTED[1]
    low, high = binomial_bounds(steps, q * q)
    assert low < sum(first in present and second in present for present in union) < high


def test_distributed_user_loader_reports_global_values():
    users = interleaved_users()
    loader = poisson_loader(indexed_dataset(len(users)), batch_size=6, users=users, distributed=True,
                            num_replicas=4, rank=1, max_examples_per_user=2, generator=seeded(15))
    assert isinstance(loader.batch_sampler, DistributedUserPoissonSampler)
    assert (loader.privacy_unit, loader.num_users, loader.max_examples_per_user) == ("user", 30, 2)
    assert loader.sample_rate == pytest.approx(6 / 30) and loader.expected_batch_size == pytest.approx(6.0)
    assert len(loader) == 5
    mine = {USER_IDS_SORTED[u] for u in loader.batch_sampler.own_users.tolist()}
    for (_, index), row_users in loader:
        assert row_users.tolist() == [users[i] for i in index.tolist()]
        assert set(row_users.tolist()) <= mine


def test_distributed_user_states_load_only_into_the_same_rank():
    users = interleaved_users()
    rank0, rank1 = rank_samplers(users, 0.3, 2, steps=6)
    iterator = iter(rank0)
    next(iterator)
    state = rank0.state_dict()
    rest = list(iterator)
    resumed = rank_samplers(users, 0.3, 2, steps=6)[0]
    resumed.load_state_dict(state)
    assert list(resumed) == rest
    with pytest.raises(ValueError, match="saved by rank 0 of num_replicas=2"):
        rank1.load_state_dict(state)
    with pytest.raises(ValueError, match="non-distributed"):
        rank1.load_state_dict(UserPoissonSampler(users, 0.3, steps=6).state_dict())
    with pytest.raises(ValueError, match="samplers? of examples, but this one samples users"):
        rank1.load_state_dict(DistributedPoissonSampler(30, 0.3, 2, 1, steps=6).state_dict())


def _ddp_step_worker(rank, world_size, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world_size, rank=rank,
                            timeout=timedelta(seconds=60))
    try:
        dataset, users, model = _ddp_setup()
        ddp = nn.parallel.DistributedDataParallel(model)
        loader = poisson_loader(dataset, batch_size=8, users=users, max_examples_per_user=3, distributed=True,
                                generator=seeded(16))
        engine = dptrain.PrivacyEngine(ddp, privacy_unit="user", sample_size=loader.num_users, batch_size=8,
                                       noise_multiplier=0.0, max_grad_norm=0.05, loss_reduction="sum")
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        engine.attach(optimizer, data_loader=loader)
        batches = []
        for (x, y), row_users in itertools.islice(loader, 3):
            engine.backward(F.cross_entropy(ddp(x), y, reduction="none"), users=row_users)
            optimizer.step()
            optimizer.zero_grad()
            batches.append((x, y, row_users))
        torch.save({"batches": batches, "weights": [p.detach().clone() for p in model.parameters()]},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _ddp_setup():
    users = interleaved_users()
    generator = seeded(17)
    dataset = TensorDataset(torch.randn(len(users), 4, generator=generator),
                            torch.randint(0, 3, (len(users),), generator=generator))
    torch.manual_seed(0)
    return dataset, users, nn.Linear(4, 3)


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_ddp_steps_on_rank_batches_equal_one_process_on_their_union(tmp_path):
    """What distributed user sampling is for: each rank clips its own users, so the all-reduced step is the
    one-process step on the union of the ranks' batches (noise 0, clipping binding)."""
    world_size = 2
    start_method = "fork" if sys.platform.startswith("linux") else "spawn"
    mp.start_processes(_ddp_step_worker, args=(world_size, free_port(), str(tmp_path)), nprocs=world_size,
                       join=True, start_method=start_method)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    _, _, model = _ddp_setup()
    engine = dptrain.PrivacyEngine(model, privacy_unit="user", sample_size=30, batch_size=8, noise_multiplier=0.0,
                                   max_grad_norm=0.05, loss_reduction="sum")
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(optimizer)
    initial = [p.detach().clone() for p in model.parameters()]
    for step in range(3):
        x, y, row_users = (torch.cat(parts) for parts in zip(*(r["batches"][step] for r in ranks)))
        rank_users = [set(r["batches"][step][2].tolist()) for r in ranks]
        assert not rank_users[0] & rank_users[1]  # no user on two ranks
        engine.backward(F.cross_entropy(model(x), y, reduction="none"), users=row_users)
        optimizer.step()
        optimizer.zero_grad()
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), initial))
    for rank in ranks:
        for theirs, mine in zip(rank["weights"], model.parameters()):
            torch.testing.assert_close(theirs, mine.detach(), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 1, "users": [0, 1, 2]}, "one user id per example: the dataset has 4 examples, users has "
                                                "shape \\[3\\]"),
        ({"batch_size": 1, "users": [[0, 1], [2, 3]]}, "one user id per example"),
        ({"batch_size": 1, "users": [0.0, 1.0, 2.0, 3.0]}, "integer user ids, got a torch.float32"),
        ({"batch_size": 1, "users": [True, False, True, True]}, "integer user ids, got a torch.bool"),
        ({"batch_size": 1, "users": ["ann", "bob", "ann", "cy"]}, "integer user ids"),
        ({"batch_size": 1, "users": "abcd"}, "sequence of integer user ids, got str"),
        ({"batch_size": 1, "users": 7}, "sequence of integer user ids, got int"),
        ({"batch_size": 1, "users": [0, 0, 1, 1], "max_examples_per_user": 0}, "max_examples_per_user must be a "
                                                                              "positive integer"),
        ({"batch_size": 1, "users": [0, 0, 1, 1], "max_examples_per_user": -2}, "max_examples_per_user"),
        ({"batch_size": 1, "users": [0, 0, 1, 1], "max_examples_per_user": 1.5}, "max_examples_per_user"),
        ({"batch_size": 3, "users": [0, 0, 1, 1]}, "batch_size=3 exceeds the number of users 2"),
        ({"batch_size": 1, "max_examples_per_user": 2}, "only applies to user-level sampling: pass users="),
        ({"batch_size": 1, "users": [0, 0, 1, 1], "max_batch_size": 2}, "need max_examples_per_user=m too"),
        ({"batch_size": 1, "users": [0, 0, 1, 2**63 - 2], "max_examples_per_user": 1, "max_batch_size": 2},
         "renumber the users from 0"),
        ({"batch_size": 1, "users": [0, 0, 1, 1], "distributed": True, "max_batch_size": 2}, "max_batch_size"),
        ({"batch_size": 1, "users": [0, 0, 1, 1], "distributed": True, "num_replicas": 3, "rank": 0},
         "num_replicas=3 exceeds the number of users 2"),
        ({"batch_size": 1, "users": [0, 0, 1, 1], "distributed": True, "num_replicas": 2, "rank": 2},
         "0 <= rank < num_replicas=2"),
        ({"batch_size": 1, "users": [0, 0, 1, 1], "num_replicas": 2, "rank": 0}, "pass distributed=True"),
    ],
)
def test_bad_input_is_refused_with_what_to_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        poisson_loader(indexed_dataset(4), **kwargs)


def test_collate_that_does_not_keep_one_row_per_example_is_refused():
    def merge_all(items):
        return torch.stack([features for features, _ in items]).sum(0, keepdim=True)

    loader = poisson_loader(indexed_dataset(4), sample_rate=1.0, steps=1, users=[0, 0, 1, 1], collate_fn=merge_all)
    with pytest.raises(ValueError, match="made 1 rows of 4 examples"):
        next(iter(loader))


def test_sampler_refuses_no_users():
    with pytest.raises(ValueError, match="users is empty"):
        UserPoissonSampler([], 0.5)
