"""Tests for dptrain.data: Poisson sampling, empty batches, physical batches, resuming."""

import io
import math
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from dptrain.data import (
    DPDataLoader,
    PoissonSampler,
    is_poisson_loader,
    poisson_loader,
    split_batches,
)


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


class ListDataset(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


Pair = namedtuple("Pair", ["features", "target"])


# ------------------------------------------------------------------------ sampling


def test_batch_sizes_are_binomial_and_inclusion_is_uniform():
    n, q, steps = 1000, 0.05, 2000
    batches = list(PoissonSampler(n, q, steps=steps, generator=seeded(1)))
    assert len(batches) == steps
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    mean, variance = n * q, n * q * (1 - q)
    # Bounds of 5 standard errors: a correct sampler fails them with probability < 1e-6
    # for a random seed (normal approximations; Binomial(1000, 0.05) is close to normal).
    assert abs(sizes.mean().item() - mean) <= 5 * math.sqrt(variance / steps)
    assert abs(sizes.var().item() - variance) <= 5 * variance * math.sqrt(2 / (steps - 1))
    # Every index is included Binomial(steps, q) times (max of 1000: 5.5 standard deviations).
    counts = torch.zeros(n)
    for batch in batches:
        assert batch == sorted(set(batch)) and all(0 <= i < n for i in batch)
        counts[batch] += 1
    assert (counts - steps * q).abs().max().item() <= 5.5 * math.sqrt(steps * q * (1 - q))


def test_batches_can_be_empty_and_q_one_takes_everything():
    batches = list(PoissonSampler(20, 0.01, steps=100, generator=seeded(0)))
    # P(empty) = 0.99^20 = 0.82 per batch; all 100 non-empty has probability ~1e-74.
    assert any(len(b) == 0 for b in batches)
    assert list(PoissonSampler(7, 1.0, steps=3, generator=seeded(0))) == [list(range(7))] * 3


def test_default_steps_is_one_expected_epoch():
    assert len(PoissonSampler(100, 0.3)) == 3  # round(1 / 0.3)
    assert len(PoissonSampler(60000, 256 / 60000)) == round(60000 / 256)
    assert len(PoissonSampler(10, 1.0)) == 1
    assert len(PoissonSampler(10, 0.9)) == 1
    assert len(PoissonSampler(10, 0.5, steps=7)) == 7


def test_same_generator_seed_gives_same_batches_and_default_is_random():
    first = list(PoissonSampler(500, 0.5, steps=3, generator=seeded(7)))
    second = list(PoissonSampler(500, 0.5, steps=3, generator=seeded(7)))
    assert first == second
    # generator=None seeds from os.urandom: two samplers agree with probability 2^-1500.
    assert list(PoissonSampler(500, 0.5, steps=3)) != list(PoissonSampler(500, 0.5, steps=3))


def test_consecutive_epochs_differ():
    sampler = PoissonSampler(200, 0.5, steps=2, generator=seeded(0))
    assert list(sampler) != list(sampler)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((0, 0.1), {}, "num_samples"),
        ((10, 0.0), {}, "sample_rate"),
        ((10, 1.5), {}, "sample_rate"),
        ((10, -0.1), {}, "sample_rate"),
        ((10, 0.1), {"steps": 0}, "steps"),
        ((10, 0.1), {"steps": 2.5}, "steps"),
        ((10, 0.1), {"generator": 42}, "generator"),
    ],
)
def test_sampler_validation(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoissonSampler(*args, **kwargs)


# ---------------------------------------------------------------------- checkpoints


def test_sampler_resumes_mid_epoch_with_the_same_batches():
    sampler = PoissonSampler(300, 0.1, steps=10, generator=seeded(3))
    iterator = iter(sampler)
    seen = [next(iterator) for _ in range(3)]
    state = sampler.state_dict()
    rest_of_epoch = list(iterator)
    next_epoch = list(sampler)
    assert len(seen) + len(rest_of_epoch) == 10

    buffer = io.BytesIO()
    torch.save(state, buffer)  # survives torch.save / torch.load (weights_only)
    buffer.seek(0)
    resumed = PoissonSampler(300, 0.1, steps=10, generator=seeded(999))
    resumed.load_state_dict(torch.load(buffer))
    assert list(resumed) == rest_of_epoch
    assert list(resumed) == next_epoch


def test_sampler_state_between_epochs():
    sampler = PoissonSampler(100, 0.2, steps=5, generator=seeded(4))
    list(sampler)
    state = sampler.state_dict()
    assert state["position"] == 0
    resumed = PoissonSampler(100, 0.2, steps=5, generator=seeded(5))
    resumed.load_state_dict(state)
    assert list(resumed) == list(sampler)


def test_sampler_refuses_state_of_another_configuration():
    state = PoissonSampler(100, 0.2, steps=5, generator=seeded(0)).state_dict()
    with pytest.raises(ValueError, match="num_samples, sample_rate, steps"):
        PoissonSampler(101, 0.2, steps=5).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        PoissonSampler(100, 0.2, steps=5).load_state_dict({"position": 0})
    with pytest.raises(ValueError, match="position"):
        PoissonSampler(100, 0.2, steps=5).load_state_dict({**state, "position": 5})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resumes_at_the_consumed_batch_even_with_prefetching_workers(num_workers):
    dataset = TensorDataset(torch.arange(200).float().unsqueeze(1), torch.arange(200))
    loader = poisson_loader(dataset, 0.1, steps=8, generator=seeded(11), num_workers=num_workers)
    iterator = iter(loader)
    consumed = [next(iterator)[1].tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state["position"] == 3
    if num_workers:  # the case this test is about: the sampler ran ahead of the consumer
        assert loader.poisson_sampler.state_dict()["position"] > 3
    rest = [y.tolist() for _, y in iterator]
    assert len(consumed) + len(rest) == 8

    resumed = poisson_loader(dataset, 0.1, steps=8, generator=seeded(0), num_workers=num_workers)
    resumed.load_state_dict(state)
    assert [y.tolist() for _, y in resumed] == rest
    # ...and the following epoch matches too.
    assert [y.tolist() for _, y in resumed] == [y.tolist() for _, y in loader]


# -------------------------------------------------------------------- empty batches


def _is_per_sample_list(value):
    return isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value)


def _assert_empty_like(empty, full):
    if isinstance(full, torch.Tensor):
        assert isinstance(empty, torch.Tensor)
        assert empty.shape == (0, *full.shape[1:]) and empty.dtype == full.dtype
    elif _is_per_sample_list(full):  # default_collate keeps strings as a list
        assert empty == []
    elif isinstance(full, dict):
        assert type(empty) is type(full) and empty.keys() == full.keys()
        for key in full:
            _assert_empty_like(empty[key], full[key])
    else:  # tuple, namedtuple, or list of tensors (default_collate turns tuples into lists)
        assert type(empty) is type(full) and len(empty) == len(full)
        for e, f in zip(empty, full):
            _assert_empty_like(e, f)


DATASETS = {
    "tensor": ListDataset([torch.randn(2, 5) for _ in range(6)]),
    "tuple": TensorDataset(torch.randn(6, 3), torch.arange(6) % 2),
    "namedtuple": ListDataset([Pair(torch.randn(3), i % 2) for i in range(6)]),
    "dict": ListDataset([{"x": torch.randn(3), "y": i % 2} for i in range(6)]),
    "numbers": ListDataset([(float(i), i) for i in range(6)]),
    "nested": ListDataset(
        [
            {
                "inputs": (torch.randn(4), torch.ones(2, 2, dtype=torch.float16)),
                "meta": {"id": i, "name": f"sample{i}", "mask": torch.tensor([True, False])},
            }
            for i in range(6)
        ]
    ),
}


@pytest.mark.parametrize("kind", list(DATASETS))
def test_empty_batches_keep_structure_shapes_and_dtypes(kind):
    dataset = DATASETS[kind]
    loader = poisson_loader(dataset, sample_rate=0.5, generator=seeded(0))
    full = loader.collate_fn([dataset[i] for i in range(len(dataset))])
    empty = loader.collate_fn([])
    _assert_empty_like(empty, full)


def test_python_numbers_become_empty_tensors():
    loader = poisson_loader(DATASETS["numbers"], sample_rate=0.5)
    x, y = loader.collate_fn([])
    assert x.shape == (0,) and x.dtype == torch.float64
    assert y.shape == (0,) and y.dtype == torch.int64


@pytest.mark.parametrize("kind", ["tuple", "namedtuple", "dict"])
def test_empty_batches_from_iteration_run_through_a_model(kind):
    dataset = DATASETS[kind]
    # q = 0.01 over 6 examples: most of the 50 batches are empty (P = 0.94 each).
    loader = poisson_loader(dataset, sample_rate=0.01, steps=50, generator=seeded(2))
    model = torch.nn.Linear(3, 2)
    batches = list(loader)
    assert len(batches) == 50
    sizes = []
    for batch in batches:
        x, y = (batch["x"], batch["y"]) if kind == "dict" else batch
        loss = F.cross_entropy(model(x), y, reduction="none")
        assert loss.shape == (len(y),)
        loss.sum().backward()
        sizes.append(len(y))
    assert 0 in sizes and any(size > 0 for size in sizes)
    assert model.weight.grad is not None


def test_custom_collate_fn_is_used_and_empty_batch_follows_it():
    def collate(items):  # stacks features, and returns one-hot targets
        features = torch.stack([x for x, _ in items])
        targets = F.one_hot(torch.stack([y for _, y in items]), 2).float()
        return {"features": features, "targets": targets}

    dataset = DATASETS["tuple"]
    loader = poisson_loader(dataset, sample_rate=1.0, collate_fn=collate, generator=seeded(0))
    (batch,) = list(loader)
    assert batch["targets"].shape == (6, 2)
    empty = loader.collate_fn([])
    assert empty["features"].shape == (0, 3) and empty["targets"].shape == (0, 2)


# ------------------------------------------------------------------------- loaders


def test_loader_attributes():
    dataset = TensorDataset(torch.randn(1000, 2))
    by_batch = poisson_loader(dataset, batch_size=50)
    assert isinstance(by_batch, DataLoader) and isinstance(by_batch, DPDataLoader)
    assert by_batch.sample_rate == 0.05
    assert by_batch.expected_batch_size == pytest.approx(50.0)
    assert len(by_batch) == 20
    by_rate = poisson_loader(dataset, sample_rate=0.01, steps=3)
    assert by_rate.sample_rate == 0.01 and len(by_rate) == 3
    assert len(list(by_rate)) == 3


def test_is_poisson_loader():
    dataset = TensorDataset(torch.randn(10, 2))
    assert is_poisson_loader(poisson_loader(dataset, 0.5))
    assert is_poisson_loader(DataLoader(dataset, batch_sampler=PoissonSampler(10, 0.5)))
    assert not is_poisson_loader(DataLoader(dataset, batch_size=5, shuffle=True))
    assert not is_poisson_loader([torch.randn(3, 2)])


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize(
    "dataset, kwargs, message",
    [
        (TensorDataset(torch.randn(10, 2)), {}, "exactly one"),
        (TensorDataset(torch.randn(10, 2)), {"sample_rate": 0.1, "batch_size": 1}, "exactly one"),
        (TensorDataset(torch.randn(10, 2)), {"sample_rate": 0.0}, r"\(0, 1\]"),
        (TensorDataset(torch.randn(10, 2)), {"sample_rate": 1.2}, r"\(0, 1\]"),
        (TensorDataset(torch.randn(10, 2)), {"batch_size": 11}, "exceeds the dataset size 10"),
        (TensorDataset(torch.randn(10, 2)), {"batch_size": 0}, "batch_size"),
        (TensorDataset(torch.randn(10, 2)), {"batch_size": 2.5}, "batch_size"),
        (TensorDataset(torch.randn(0, 2)), {"sample_rate": 0.1}, "empty"),
        (Stream(), {"sample_rate": 0.1}, "map-style"),
    ],
)
def test_loader_validation(dataset, kwargs, message):
    with pytest.raises(ValueError, match=message):
        poisson_loader(dataset, **kwargs)


# ----------------------------------------------------------------- physical batches


def _concatenate(parts):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if _is_per_sample_list(first):
        return [item for part in parts for item in part]
    if isinstance(first, dict):
        return {key: _concatenate([part[key] for part in parts]) for key in first}
    columns = [_concatenate(list(column)) for column in zip(*parts)]
    return type(first)(*columns) if hasattr(first, "_fields") else type(first)(columns)


def _num_samples(batch):
    if isinstance(batch, torch.Tensor) or _is_per_sample_list(batch):
        return len(batch)
    return _num_samples(next(iter(batch.values())) if isinstance(batch, dict) else batch[0])


def _assert_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) and a.dtype == b.dtype
    elif isinstance(a, dict):
        assert type(a) is type(b) and a.keys() == b.keys()
        for key in a:
            _assert_equal(a[key], b[key])
    elif _is_per_sample_list(a):
        assert a == b
    else:
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)


@pytest.mark.parametrize("kind", ["tensor", "tuple", "namedtuple", "dict", "numbers", "nested"])
def test_split_batches_concatenate_back_to_the_logical_batch(kind):
    base = DATASETS[kind]
    dataset = ListDataset([base[i % len(base)] for i in range(40)])
    loader = poisson_loader(dataset, sample_rate=0.5, steps=4, generator=seeded(5))
    logical_batches = list(poisson_loader(dataset, sample_rate=0.5, steps=4, generator=seeded(5)))
    split = list(split_batches(loader, 7))
    assert len(split) == len(logical_batches) == 4
    for logical, physical in zip(logical_batches, split):
        size = _num_samples(logical)
        assert size > 0  # q = 0.5 of 40: an empty batch here has probability 2^-40
        assert len(physical) == math.ceil(size / 7)
        assert all(_num_samples(part) <= 7 for part in physical)
        _assert_equal(_concatenate(physical), logical)


def test_split_batch_sizes_and_views():
    x, y = torch.randn(20, 3), torch.arange(20)
    (physical,) = list(split_batches([(x, y)], 8))
    assert [len(p[1]) for p in physical] == [8, 8, 4]
    assert physical[1][0].data_ptr() == x[8:].data_ptr()  # views: no copies


def test_empty_logical_batch_gives_exactly_one_empty_physical_batch():
    empty = {"x": torch.empty(0, 3), "y": torch.empty(0, dtype=torch.long)}
    (physical,) = list(split_batches([empty], 4))
    assert len(physical) == 1
    _assert_equal(physical[0], empty)


def test_split_batches_usage_pattern_with_a_model():
    dataset = TensorDataset(torch.randn(64, 3), torch.randint(0, 2, (64,)))
    loader = poisson_loader(dataset, sample_rate=0.25, steps=6, generator=seeded(8))
    model = torch.nn.Linear(3, 2)
    logical_steps = 0
    for logical in split_batches(loader, 5):
        for x, y in logical:
            assert len(x) <= 5
            F.cross_entropy(model(x), y, reduction="none").sum().backward()
        logical_steps += 1
    assert logical_steps == 6


def test_split_batches_validation():
    with pytest.raises(ValueError, match="max_physical_batch_size"):
        split_batches([], 0)
    with pytest.raises(ValueError, match="sizes"):
        list(split_batches([(torch.randn(4, 2), torch.randn(3))], 2))
    with pytest.raises(ValueError, match="0-dimensional"):
        list(split_batches([(torch.randn(4, 2), torch.tensor(1.0))], 2))
    with pytest.raises(TypeError, match="object"):
        list(split_batches([(torch.randn(4, 2), object())], 2))
