"""The loader the framework integrations share (dptrain.integrations.loaders): one Poisson draw per step, shared
out to micro-batches and processes.

The specification is the single-process draw: ``PoissonSampler`` with the same generator and K. The pieces of
a step, over every (micro-batch, process), must be exactly its indices (each once), every piece ``K / shares``
rows, and a checkpoint taken anywhere must continue with the batches the uninterrupted run draws.
"""
from __future__ import annotations

import pytest
import torch

from dptrain.data import FixedShapeBatch, PoissonSampler
from dptrain.integrations.loaders import (
    MASK_KEY,
    ShardedPoissonSampler,
    fixed_shape_rows,
    sharded_poisson_loader,
)

N = 40


def _spec(q, steps, K, seed, epochs=1):
    sampler = PoissonSampler(N, q, steps=steps, generator=torch.Generator().manual_seed(seed), max_batch_size=K)
    return [batch for _ in range(epochs) for batch in sampler]


def _pieces(q, steps, K, seed, micro, world, epochs=1):
    """[rank][step] -> the index lists of that step's micro-batches."""
    out = []
    for rank in range(world):
        sampler = ShardedPoissonSampler(N, q, micro_batches=micro, num_replicas=world, rank=rank, steps=steps,
                                        generator=torch.Generator().manual_seed(seed), max_batch_size=K)
        flat = [piece for _ in range(epochs) for piece in sampler]
        assert len(flat) == epochs * len(sampler) == epochs * steps * micro
        out.append([flat[i:i + micro] for i in range(0, len(flat), micro)])
    return out


@pytest.mark.parametrize("micro, world, K", [(1, 1, None), (2, 1, 12), (1, 2, 12), (2, 2, 8), (3, 2, None)])
def test_the_pieces_of_a_step_are_the_single_process_draw(micro, world, K):
    # q = 0.3: 12 expected, so K = 8 truncates most steps and K = 12 some
    spec = _spec(0.3, 6, K, seed=3, epochs=2)
    pieces = _pieces(0.3, 6, K, seed=3, micro=micro, world=world, epochs=2)
    for step, drawn in enumerate(spec):
        got = sorted(i for rank in range(world) for piece in pieces[rank][step] for i in piece)
        assert got == drawn  # each index once, nothing else
        if K is not None:
            assert all(len(piece) <= K // (micro * world) for rank in range(world) for piece in pieces[rank][step])
    if K == 8:
        assert any(len(b) == 8 for b in spec)  # truncation happened


def test_fixed_shape_pieces_and_the_mask():
    x = torch.arange(N, dtype=torch.float64)[:, None].expand(N, 3).clone()
    data = torch.utils.data.TensorDataset(x, torch.arange(N))
    spec = _spec(0.25, 4, 12, seed=5)
    loaders = [sharded_poisson_loader(data, 10, max_batch_size=12, micro_batches=2, num_replicas=2, rank=r,
                                      steps=4, generator=torch.Generator().manual_seed(5)) for r in range(2)]
    batches = [list(loader) for loader in loaders]
    for step, drawn in enumerate(spec):
        real = []
        for r in range(2):
            for micro in range(2):
                batch = batches[r][2 * step + micro]
                assert isinstance(batch, FixedShapeBatch)
                (xs, ids), mask = batch
                assert xs.shape == (3, 3) and mask.shape == (3,)  # K / (2 * 2) rows, always
                n = int(mask.sum())
                assert mask[:n].all() and not mask[n:].any()  # real rows first
                assert (xs[n:] == 0).all()
                real += ids[:n].tolist()
        assert sorted(real) == drawn


def test_dict_batches_carry_the_mask_under_the_key():
    data = [{"x": torch.tensor([float(i)]), "y": torch.tensor(i)} for i in range(N)]
    loader = sharded_poisson_loader(data, 8, max_batch_size=12, num_replicas=1, steps=2,
                                    generator=torch.Generator().manual_seed(0), mask_key=MASK_KEY)
    batch = next(iter(loader))
    assert set(batch) == {"x", "y", MASK_KEY} and batch["x"].shape == (12, 1) and batch[MASK_KEY].dtype == torch.bool


def test_several_processes_without_a_process_group_or_a_shared_generator_are_refused():
    sampler = ShardedPoissonSampler(N, 0.2, num_replicas=2, rank=1)  # the secret seed cannot be agreed
    with pytest.raises(RuntimeError, match="initialise torch.distributed .* or pass a generator seeded the same"):
        next(iter(sampler))


def test_a_max_batch_size_that_does_not_split_is_refused_with_the_multiple():
    with pytest.raises(ValueError, match="use a multiple of 4, e.g. 12"):
        ShardedPoissonSampler(N, 0.2, micro_batches=2, num_replicas=2, rank=0, max_batch_size=10)
    assert fixed_shape_rows(N, 8, 1e-3, 10, shares=4) % 4 == 0


@pytest.mark.parametrize("stop_after", [3, 4, 8, 11])  # micro-batches: in step 2, after it, after epoch 1, in epoch 2
def test_a_checkpoint_continues_the_uninterrupted_batches(stop_after):
    data = torch.utils.data.TensorDataset(torch.arange(N))

    def loader():  # 4 steps of 2 micro-batches per epoch
        return sharded_poisson_loader(data, 8, max_batch_size=12, micro_batches=2, num_replicas=1, steps=4,
                                      generator=torch.Generator().manual_seed(1))

    def real(batch):
        return batch.data[0][batch.mask].tolist()

    whole = loader()
    uninterrupted = [real(b) for _ in range(2) for b in whole]
    first = loader()
    handed = [real(b) for b in first][:stop_after] if stop_after >= 8 else []
    it = iter(first)
    for _ in range(stop_after - len(handed)):
        handed.append(real(next(it)))
    assert handed == uninterrupted[:stop_after]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    steps_done = stop_after // 2  # a step cut in the middle is drawn again whole: its sum was never applied
    epoch_end = 8 if steps_done < 4 else 16
    assert [real(b) for b in resumed] == uninterrupted[2 * steps_done:epoch_end]


def test_the_position_a_framework_gives_wins_over_what_was_prefetched():
    """The Trainer checkpoints with its own count of steps (``state_in_epoch``): whatever a prefetching loader
    drew ahead, the saved state is the epoch's start and that count."""
    sampler = ShardedPoissonSampler(N, 0.2, micro_batches=1, num_replicas=1, rank=0, steps=5,
                                    generator=torch.Generator().manual_seed(2))
    spec = _spec(0.2, 5, None, seed=2)
    it = iter(sampler)
    drawn = [next(it) for _ in range(5)]  # all of the epoch drawn ahead
    state = sampler.state_in_epoch(2)     # ... but only two steps trained
    again = ShardedPoissonSampler(N, 0.2, micro_batches=1, num_replicas=2, rank=0, steps=5)  # another world size
    again.load_state_dict(state)
    spec_rest = spec[2:]
    got = list(again)
    other = ShardedPoissonSampler(N, 0.2, micro_batches=1, num_replicas=2, rank=1, steps=5)
    other.load_state_dict(state)
    merged = [sorted(a + b) for a, b in zip(got, other)]
    assert drawn == spec and merged == spec_rest


def test_the_loader_records_the_real_rows_of_its_last_two_batches():
    """What the engine checks a backward without the mask against: the fewest real rows of the last two pieces that
    carry padding, the dict batch's mask included (``mask_key``)."""
    data = torch.utils.data.TensorDataset(torch.arange(N, dtype=torch.float32))
    for mask_key in (None, MASK_KEY):
        collate = (lambda items: {"x": torch.stack([x for (x,) in items])}) if mask_key else None
        loader = sharded_poisson_loader(data, 10, max_batch_size=24, micro_batches=2, num_replicas=1, rank=0,
                                        generator=torch.Generator().manual_seed(0), mask_key=mask_key,
                                        collate_fn=collate)
        assert loader.recent_real_rows is None and loader.batches_handed_out == 0
        reals = []
        for batch in loader:
            mask = batch[MASK_KEY] if mask_key else batch.mask
            reals.append(int(mask.sum()))
            assert loader.recent_masks[-1] is mask and loader.batches_handed_out == len(reals)
            padded = [r for r in reals[-2:] if r < 12]
            assert loader.recent_real_rows == (min(padded) if padded else None)


def test_find_padding_mask_reads_the_batch_whatever_its_type():
    import dataclasses

    from dptrain.integrations.common import find_padding_mask

    mask, other = torch.arange(6) < 4, torch.arange(6) < 2
    data = (torch.zeros(6, 3), torch.zeros(6))

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        real: torch.Tensor

    where = "the batch"
    assert find_padding_mask(FixedShapeBatch(data, mask), [mask], where) is mask
    assert find_padding_mask({"a": [data, {"m": mask}]}, [other, mask], where) is mask
    assert find_padding_mask(Batch(data[0], mask.clone()), [mask], where).equal(mask)
    looped = [data, mask]
    looped.append(looped)  # a structure that contains itself
    assert find_padding_mask(looped, [mask], where) is mask
    assert find_padding_mask((data, ~mask, mask), [mask], where) is mask  # ~mask is no mask the loader made
    assert find_padding_mask(data, [torch.ones(6, dtype=torch.bool)], where) is None  # no padding: none needed
    with pytest.raises(ValueError, match=r"the batch \(a tuple\) holds no fixed-shape mask"):
        find_padding_mask((data, ~mask), [mask], where)
    with pytest.raises(ValueError, match=r"holds 2 different fixed-shape masks"):
        find_padding_mask([FixedShapeBatch(data, mask), FixedShapeBatch(data, other)], [mask, other], where)


def test_set_max_batch_size_redraws_with_the_new_k_and_refuses_what_cannot_change():
    data = torch.utils.data.TensorDataset(torch.arange(N, dtype=torch.float32))

    def loader(K):
        return sharded_poisson_loader(data, 10, max_batch_size=K, micro_batches=2, num_replicas=1, rank=0,
                                      generator=torch.Generator().manual_seed(0))

    resized = loader(24)
    resized.set_max_batch_size(12)
    assert resized.max_batch_size == 12 and [b.mask.tolist() for b in resized] == [b.mask.tolist() for b in loader(12)]
    with pytest.raises(ValueError, match="does not split into 2 micro-batch"):
        resized.set_max_batch_size(13)
    assert resized.max_batch_size == resized.poisson_sampler.max_batch_size == 12  # unchanged
    with pytest.raises(RuntimeError, match="while the loader is being iterated"):
        for _ in resized:
            resized.set_max_batch_size(24)
    with pytest.raises(ValueError, match="batches of varying size"):
        sharded_poisson_loader(data, 10, num_replicas=1, rank=0).set_max_batch_size(12)
