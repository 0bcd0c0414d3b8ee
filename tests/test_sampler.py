from __future__ import annotations

import pickle
import random
import warnings

import numpy as np
import pytest
import torch
from _dist import run_ranks
from torch.utils.data import DataLoader, TensorDataset

import ckptools as ck
from ckptools import log as _log
from ckptools.rng import item_seeds as _item_seeds

pytestmark = pytest.mark.versions  # the DataLoader's iterator, its workers and torchdata's loader

DATA = TensorDataset(torch.arange(50))  # 50 samples over 2 ranks: 25 each, padded not dropped


def _sampler(rank=0, world=2, **kw):
    return ck.ResumableDistributedSampler(DATA, num_replicas=world, rank=rank, seed=7, **kw)


def _batches(loader):
    return [b[0].tolist() for b in loader]


def _uninterrupted(rank, epochs=(0, 1), batch_size=4, num_workers=0):
    sampler = _sampler(rank)
    out = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        out += _batches(DataLoader(DATA, batch_size=batch_size, sampler=sampler, num_workers=num_workers))
    return out


@pytest.mark.parametrize("stop_after", [0, 1, 3, 6, 7])  # 7 batches per epoch: 7 = at the epoch's end
@pytest.mark.parametrize("rank", [0, 1])
def test_mid_epoch_resume_matches_uninterrupted(rank, stop_after):
    expected = _uninterrupted(rank)
    sampler = _sampler(rank)
    sampler.set_epoch(0)
    batches = iter(DataLoader(DATA, batch_size=4, sampler=sampler))
    # The loop trains on `stop_after` batches and saves right after the last of them.
    seen = [next(batches)[0].tolist() for _ in range(stop_after)]
    state = sampler.state_dict()
    assert state["progress"] == min(4 * stop_after, 25)

    resumed = _sampler(rank)
    resumed.load_state_dict(state)
    for epoch in (state["epoch"], 1):
        resumed.set_epoch(epoch)  # the same epoch keeps the restored position
        seen += _batches(DataLoader(DATA, batch_size=4, sampler=resumed))
    assert seen == expected


def test_workers_draw_ahead_and_track_reports_what_the_loop_consumed():
    sampler = _sampler(0)
    loader = DataLoader(DATA, batch_size=2, sampler=sampler, num_workers=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    # Prefetching workers took more indices than the loop has seen.
    assert sampler.progress > 6
    del it

    expected = _uninterrupted(0, num_workers=2, batch_size=2)
    sampler = _sampler(0)
    sampler.set_epoch(0)
    loader = DataLoader(DATA, batch_size=2, sampler=sampler, num_workers=2)
    seen = []
    for i, batch in enumerate(sampler.track(loader)):
        seen.append(batch[0].tolist())
        if i == 4:
            state = sampler.state_dict()  # saved while processing the 5th batch: it counts
            break
    assert state["progress"] == 10
    resumed = _sampler(0)
    resumed.load_state_dict(state)
    for epoch in (0, 1):
        resumed.set_epoch(epoch)
        seen += _batches(resumed.track(DataLoader(DATA, batch_size=2, sampler=resumed, num_workers=2)))
    assert seen == expected


def test_record_consumed_with_workers():
    expected = _uninterrupted(1, batch_size=3, num_workers=2)
    sampler = _sampler(1)
    seen = []
    for i, batch in enumerate(DataLoader(DATA, batch_size=3, sampler=sampler, num_workers=2)):
        sampler.record_consumed(len(batch[0]))
        seen.append(batch[0].tolist())
        if i == 2:
            break
    state = sampler.state_dict()
    assert state["progress"] == 9
    resumed = _sampler(1)
    resumed.load_state_dict(state)
    for epoch in (0, 1):
        resumed.set_epoch(epoch)
        for batch in DataLoader(DATA, batch_size=3, sampler=resumed, num_workers=2):
            resumed.record_consumed(len(batch[0]))
            seen.append(batch[0].tolist())
    assert seen == expected
    assert resumed.progress == 25


def test_new_epoch_and_second_pass_start_over():
    sampler = _sampler(0, shuffle=False)
    it = iter(sampler)
    [next(it) for _ in range(5)]
    state = sampler.state_dict()
    resumed = _sampler(0, shuffle=False)
    resumed.load_state_dict(state)
    assert len(resumed) == 20
    resumed.set_epoch(1)  # a different epoch: the restored position does not apply
    assert len(list(resumed)) == 25
    assert len(list(resumed)) == 25


def test_world_size_change_skips_nothing():
    full = list(range(50))
    old = [_sampler(r, world=2, shuffle=False) for r in range(2)]
    consumed = []
    for s in old:
        it = iter(s)
        consumed += [next(it) for _ in range(9)]
    state = old[0].state_dict()
    rest = []
    with pytest.warns(UserWarning, match="saved with 2 replicas, restored with 3"):
        new = [_sampler(r, world=3, shuffle=False) for r in range(3)]
        for s in new:
            s.load_state_dict(state)
    for s in new:
        rest += list(s)
    assert set(consumed) | set(rest) == set(full)


def test_incompatible_state_is_refused():
    state = _sampler(0).state_dict()
    other = ck.ResumableDistributedSampler(TensorDataset(torch.arange(10)), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="dataset_len=50.*do not restore the sampler"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        next(iter(_sampler(0).track([1, 2])))


def test_sampler_through_a_checkpoint(tmp_path):
    sampler = _sampler(0)
    sampler.set_epoch(3)
    it = iter(sampler)
    [next(it) for _ in range(4)]
    ck.save(tmp_path / "c.pt", {"sampler": sampler})
    raw = torch.load(tmp_path / "c.pt", weights_only=True)["sampler"]
    assert raw["epoch"] == 3 and raw["progress"] == 4 and raw["seed"] == 7
    resumed = _sampler(0)
    ck.load(tmp_path / "c.pt", {"sampler": resumed})
    assert list(resumed) == list(it)
    # A plain DistributedSampler gets its epoch back.
    plain = torch.utils.data.DistributedSampler(DATA, num_replicas=2, rank=0)
    plain.set_epoch(5)
    ck.save(tmp_path / "p.pt", {"sampler": plain})
    assert torch.load(tmp_path / "p.pt", weights_only=True)["sampler"] == {"epoch": 5, "seed": 0}
    fresh = torch.utils.data.DistributedSampler(DATA, num_replicas=2, rank=0)
    ck.load(tmp_path / "p.pt", {"sampler": fresh})
    assert fresh.epoch == 5


# --- the exact path, and a warning for every way off it --------------------------------------------


def _training(*, loader_kw=None):
    """A one-process training set-up: a dropout model, a sampler, a loader over DATA."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.Dropout(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ck.ResumableDistributedSampler(DATA, num_replicas=1, rank=0, seed=7)
    loader = DataLoader(DATA, batch_size=4, sampler=sampler, **(loader_kw or {}))
    return {"model": model, "optimizer": opt, "sampler": sampler}, loader


def _dropout_after_resume(tmp_path, iterate, loader_kw=None):
    """Dropout noise drawn after batch 4 of epoch 1: uninterrupted, and resumed from a save after batch 3."""
    state, loader = _training(loader_kw=loader_kw)
    sampler = state["sampler"]
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        for i, _ in enumerate(iterate(sampler, loader)):
            if epoch == 1 and i == 2:
                ck.save(tmp_path / "c.pt", state)
            if epoch == 1 and i == 3:
                expected = torch.rand(4)
    state, loader = _training(loader_kw=loader_kw)
    torch.manual_seed(123)  # a restart: the process starts with other streams
    ck.load(tmp_path / "c.pt", state)
    state["sampler"].set_epoch(1)
    for _ in iterate(state["sampler"], loader):
        return expected, torch.rand(4)


def _track(sampler, loader):
    return sampler.track(loader)


def _plain(sampler, loader):
    return loader


def test_track_resumes_the_random_streams_exactly_and_quietly(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ck.CheckpointWarning)
        expected, got = _dropout_after_resume(tmp_path, _track)
        assert torch.equal(expected, got)
        # A DataLoader with a generator of its own is exact without track() as well.
        expected, got = _dropout_after_resume(tmp_path, _plain, {"generator": torch.Generator().manual_seed(1)})
        assert torch.equal(expected, got)


def test_loader_without_generator_warns_at_the_resumed_epoch(tmp_path):
    with pytest.warns(ck.CheckpointWarning, match="base seed from the global torch RNG.*sampler.track") as seen:
        expected, got = _dropout_after_resume(tmp_path, _plain)
    assert not torch.equal(expected, got), "the hazard is real: the stream moved"
    assert len(seen) == 1 and seen[0].filename == __file__, "once, pointing at the user's loop"


def test_drawing_between_restore_and_first_batch_warns(tmp_path):
    state, loader = _training(loader_kw={"generator": torch.Generator()})
    state["sampler"].set_epoch(0)
    batches = iter(state["sampler"].track(loader))
    next(batches)
    ck.save(tmp_path / "c.pt", state)
    ck.load(tmp_path / "c.pt", state)
    torch.randn(3)  # e.g. building something random after the restore
    with pytest.warns(ck.CheckpointWarning, match="something drew from the global torch RNG"):
        next(iter(state["sampler"].track(loader)))


def test_untracked_workers_warn_when_a_checkpoint_is_saved_mid_epoch(tmp_path):
    state, loader = _training(loader_kw={"num_workers": 2})
    sampler = state["sampler"]
    sampler.set_epoch(0)
    for i, _ in enumerate(loader):
        if i == 1:
            assert pickle.loads(pickle.dumps(sampler)).progress == sampler.progress  # picklable while driven
            with pytest.warns(ck.CheckpointWarning, match="2 workers fetch batches ahead.*sampler.track"):
                ck.save(tmp_path / "c.pt", state)
            assert torch.load(tmp_path / "c.pt", weights_only=True)["sampler"]["progress"] > 8  # ran ahead
    # The same loop with track() is exact and silent, mid-epoch and after a `break`.
    _log._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ck.CheckpointWarning)
        sampler.set_epoch(1)
        for i, _ in enumerate(sampler.track(loader)):
            if i == 1:
                ck.save(tmp_path / "c.pt", state)
                break
        assert torch.load(tmp_path / "c.pt", weights_only=True)["sampler"]["progress"] == 8
        # Untracked, but saved at the epoch's end: every batch was consumed, nothing to warn about.
        other, loader = _training(loader_kw={"num_workers": 2})
        other["sampler"].set_epoch(0)
        assert len(list(loader)) == 13
        ck.save(tmp_path / "c.pt", other)


def test_untracked_workers_warn_after_a_break(tmp_path):
    state, loader = _training(loader_kw={"num_workers": 2})
    for i, _ in enumerate(loader):
        if i == 1:
            break
    with pytest.warns(ck.CheckpointWarning, match="workers fetch batches ahead"):
        state["sampler"].state_dict()


def test_a_new_pass_without_set_epoch_warns_once(tmp_path):
    state, loader = _training()
    sampler = state["sampler"]
    first = _batches(loader)
    with pytest.warns(ck.CheckpointWarning, match=r"without sampler.set_epoch.*repeats the last shuffle") as seen:
        assert _batches(loader) == first
        _batches(loader)
    assert len(seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", ck.CheckpointWarning)
        for epoch in (1, 2):
            sampler.set_epoch(epoch)
            assert _batches(loader) != first
        unshuffled = _sampler(0, shuffle=False)
        list(unshuffled), list(unshuffled)  # the same order every time is what shuffle=False asks for


def test_track_refuses_a_loader_of_another_sampler():
    loader = DataLoader(DATA, batch_size=2, sampler=_sampler(1))
    with pytest.raises(ValueError, match="does not draw from this sampler"):
        next(iter(_sampler(0).track(loader)))


def _hazards_per_rank(rank: int, world: int) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sampler = ck.ResumableDistributedSampler(DATA, seed=3)
        list(sampler), list(sampler)  # a second pass without set_epoch
        state = {**sampler.state_dict(), "num_replicas": 3}
        ck.ResumableDistributedSampler(DATA).load_state_dict(state)  # saved by another world size
    return [str(w.message) for w in seen if issubclass(w.category, ck.CheckpointWarning)]


def test_warnings_come_from_rank_0_only():
    rank0, rank1 = run_ranks(_hazards_per_rank, 2)
    assert len(rank0) == 2 and "set_epoch" in rank0[0] and "saved with 3 replicas" in rank0[1]
    assert rank1 == []


def _consume(samplers, p):
    """Each rank takes its next p samples (the same p everywhere, as DDP's equal batch counts)."""
    taken = []
    for sampler in samplers:
        it = iter(sampler)
        taken.append([next(it) for _ in range(p)])
    return taken


def _resize(state, n, world, **kw):
    data = TensorDataset(torch.arange(n))
    new = [ck.ResumableDistributedSampler(data, num_replicas=world, rank=r, seed=3, **kw) for r in range(world)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "saved with W replicas, restored with W'"
        for sampler in new:
            sampler.load_state_dict(state)
    return new


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_a_new_world_size_resumes_exactly(shuffle, drop_last):
    kw = {"shuffle": shuffle, "drop_last": drop_last}
    cases = 0
    for n in (1, 5, 12, 13, 31, 64):
        for old_world, new_world in ((1, 4), (4, 1), (2, 3), (8, 5), (3, 2), (3, 3), (5, 8), (2, 7)):
            data = TensorDataset(torch.arange(n))
            old = [ck.ResumableDistributedSampler(data, num_replicas=old_world, rank=r, seed=3, **kw)
                   for r in range(old_world)]  # fmt: skip
            share = old[0].num_samples
            for p in sorted({0, min(1, share), share // 2, max(share - 1, 0), share}):
                old = [ck.ResumableDistributedSampler(data, num_replicas=old_world, rank=r, seed=3, **kw)
                       for r in range(old_world)]  # fmt: skip
                for s in old:
                    s.set_epoch(2)
                before = _consume(old, p)
                state = old[0].state_dict()
                new = _resize(state, n, new_world, **kw)
                after = [list(s) for s in new]
                assert len({len(a) for a in after}) == 1, (n, old_world, new_world, p, after)  # equal batch counts
                assert all(len(s) == len(a) for s, a in zip(new, after))
                seen = [i for rank in before + after for i in rank]
                what = (n, old_world, new_world, p, shuffle, drop_last)
                if drop_last:  # nothing twice; only the remainder of a world size is dropped
                    assert len(seen) == len(set(seen)), what
                    dropped = n - len(seen)
                    assert 0 <= dropped < max(old_world, new_world), what
                    if p < share:  # resumed mid-epoch: only the new world's remainder is dropped
                        assert dropped < new_world, what
                else:  # nothing skipped; only padding repeats
                    assert set(seen) == set(range(n)), what
                    assert len(seen) - n <= (old_world - 1) + (new_world - 1), what
                if old_world == new_world:  # the uninterrupted run's own order, exactly
                    fresh = [ck.ResumableDistributedSampler(data, num_replicas=old_world, rank=r, seed=3, **kw)
                             for r in range(old_world)]  # fmt: skip
                    for s in fresh:
                        s.set_epoch(2)
                    assert [b + a for b, a in zip(before, after)] == [list(s) for s in fresh], what
                for r, s in enumerate(new):  # the next epoch: what a fresh run at the new size sees
                    s.set_epoch(3)
                    plain = torch.utils.data.DistributedSampler(data, num_replicas=new_world, rank=r, seed=3, **kw)
                    plain.set_epoch(3)
                    assert list(s) == list(plain), what
                cases += 1
    assert cases > 150


def test_two_world_size_changes_in_one_epoch_still_cover_it_once():
    n, kw = 61, {"shuffle": True, "drop_last": True}
    data = TensorDataset(torch.arange(n))
    first = [ck.ResumableDistributedSampler(data, num_replicas=8, rank=r, seed=3, **kw) for r in range(8)]
    seen = [i for rank in _consume(first, 2) for i in rank]  # 8 ranks x 2
    second = _resize(first[0].state_dict(), n, 5, **kw)
    seen += [i for rank in _consume(second, 3) for i in rank]  # 5 ranks x 3
    assert second[0].state_dict()["consumed"] == 8 * 2 + 5 * 3
    third = _resize(second[0].state_dict(), n, 3, **kw)
    seen += [i for rank in (list(s) for s in third) for i in rank]
    assert len(seen) == len(set(seen)) and n - len(seen) < 3


# --- SeededDataset: augmentation as a function of (seed, epoch, index) ------------------------------


class Augmented(torch.utils.data.Dataset):
    """Each item drawn from all three global streams, as real augmentation pipelines draw."""

    def __len__(self):
        return 24

    def __getitem__(self, index):
        draws = (torch.rand(()).item(), random.random(), float(np.random.rand()))
        return torch.tensor([float(index), *draws], dtype=torch.float64)


def _augmented(epochs=(0, 1), *, wrap=True, resume_after=None, **loader_kw):
    """{(epoch, index): the item's draws} over ``epochs``; optionally stopped after
    ``resume_after`` batches of the first epoch and resumed from the sampler's saved state into a
    fresh sampler and loader built with the same options."""

    def build():
        sampler = ck.ResumableDistributedSampler(Augmented(), num_replicas=1, rank=0, seed=11)
        data = ck.SeededDataset(Augmented(), sampler) if wrap else Augmented()
        return sampler, DataLoader(data, batch_size=4, sampler=sampler, **loader_kw)

    def record(epoch, batch):
        for row in batch.tolist():
            seen[epoch, int(row[0])] = tuple(row[1:])

    sampler, loader = build()
    seen = {}
    for epoch in epochs:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(sampler.track(loader)):
            record(epoch, batch)
            if epoch == epochs[0] and i + 1 == resume_after:
                state = sampler.state_dict()
                sampler, loader = build()
                sampler.load_state_dict(state)
                sampler.set_epoch(epoch)
                for rest in sampler.track(loader):
                    record(epoch, rest)
                break
    return seen


@pytest.mark.slow  # ~10 s of processes: make interop (make test stays within its 5 minutes)
def test_seeded_dataset_gives_every_item_the_same_draws_with_any_workers():
    expected = _augmented()
    assert len(expected) == 48 and len(set(expected.values())) == 48  # every item of every epoch its own draws
    assert expected[0, 5] != expected[1, 5], "another epoch, other augmentation"
    assert _augmented(num_workers=2) == expected
    assert _augmented(num_workers=2, resume_after=2) == expected  # resumed mid-epoch, workers start afresh
    # Persistent workers were started in epoch 0 and fetch epoch 1's items too; spawned ones
    # import everything anew.
    assert _augmented(num_workers=2, persistent_workers=True, multiprocessing_context="spawn") == expected
    assert _augmented(num_workers=3, persistent_workers=True) == expected
    # Without the wrapper a resume mid-epoch with workers augments differently (and warns).
    with pytest.warns(ck.CheckpointWarning, match="resumes mid-way with 2 DataLoader workers.*ck.SeededDataset"):
        unwrapped = _augmented(wrap=False, num_workers=2, resume_after=2)
    assert unwrapped != _augmented(wrap=False, num_workers=2)


def test_seeded_dataset_puts_the_processs_streams_back():
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    np.random.randn()  # a cached Gaussian is part of numpy's state
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()
    sampler = ck.ResumableDistributedSampler(Augmented(), num_replicas=1, rank=0, seed=11)
    data = ck.SeededDataset(Augmented(), sampler)
    item = data[3]
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    after = np.random.get_state()
    assert after[0] == before[2][0] and (after[1] == before[2][1]).all() and after[2:] == before[2][2:]
    sampler.set_epoch(4)
    assert not torch.equal(data[3], item) and torch.equal(data.__getitems__([3])[0], data[3])


def test_seeded_dataset_streams_restored_after_an_error():
    class Failing(Augmented):
        def __getitem__(self, index):
            torch.rand(3)
            raise KeyError(index)

    sampler = ck.ResumableDistributedSampler(Failing(), num_replicas=1, rank=0)
    before = torch.get_rng_state()
    with pytest.raises(KeyError):
        ck.SeededDataset(Failing(), sampler)[2]
    assert torch.equal(torch.get_rng_state(), before)


def test_seeded_dataset_item_seed_is_torch_initial_seed_and_seeds_differ():
    sampler = ck.ResumableDistributedSampler(Augmented(), num_replicas=1, rank=0, seed=11)

    class OwnGenerator(Augmented):
        def __getitem__(self, index):  # the documented way for a transform that owns a generator
            return torch.rand(2, generator=torch.Generator().manual_seed(torch.initial_seed()))

    data = ck.SeededDataset(OwnGenerator(), sampler)
    assert torch.equal(data[1], data[1]) and not torch.equal(data[1], data[2])
    # A real mixing function: no collisions between neighbouring seeds, epochs and indices.
    seeds = {_item_seeds(seed, epoch, index) for seed in range(3) for epoch in range(30) for index in range(300)}
    assert len(seeds) == 3 * 30 * 300
    assert len({s[0] for s in seeds}) == len({s[1] for s in seeds}) == len(seeds)


def test_seeded_dataset_forwards_and_refuses():
    sampler = ck.ResumableDistributedSampler(DATA, num_replicas=1, rank=0)
    data = ck.SeededDataset(DATA, sampler)
    assert len(data) == 50 and data.tensors is DATA.tensors and data.dataset is DATA
    assert "TensorDataset" in repr(data)
    copy = pickle.loads(pickle.dumps(data))  # how spawned workers get it
    assert len(copy) == 50 and torch.equal(copy[3][0], DATA[3][0])
    with pytest.raises(AttributeError):
        data.no_such_attribute  # noqa: B018
    with pytest.raises(TypeError, match="IterableDataset"):
        ck.SeededDataset(torch.utils.data.IterableDataset(), sampler)
    with pytest.raises(TypeError, match="ResumableDistributedSampler"):
        ck.SeededDataset(DATA, torch.utils.data.DistributedSampler(DATA, num_replicas=1, rank=0))
    with pytest.raises(ValueError, match="50 items but the sampler was built over 10"):
        ck.SeededDataset(DATA, ck.ResumableDistributedSampler(range(10), num_replicas=1, rank=0))
    # Indices from the sampler are ints that carry the seed and epoch, also through pickle.
    sampler.set_epoch(3)
    index = next(iter(sampler))
    assert isinstance(index, int) and pickle.loads(pickle.dumps(index)) == index
    assert (pickle.loads(pickle.dumps(index)).seed, pickle.loads(pickle.dumps(index)).epoch) == (0, 3)


def test_seeded_dataset_refuses_indices_of_another_sampler_in_a_worker():
    sampler = ck.ResumableDistributedSampler(Augmented(), num_replicas=1, rank=0)
    loader = DataLoader(ck.SeededDataset(Augmented(), sampler), batch_size=4, num_workers=1)  # a SequentialSampler
    with pytest.raises(ValueError, match="did not come from the sampler it was built with"):
        next(iter(loader))


def test_unseeded_warning_only_where_a_resume_can_differ(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ck.CheckpointWarning)
        _augmented(num_workers=2, resume_after=2)  # wrapped: exact, silent
        _augmented(wrap=False, resume_after=2)  # no workers: the main process's streams are restored
        _augmented(wrap=False, num_workers=2)  # no resume mid-epoch
        # A TensorDataset draws nothing.
        sampler = ck.ResumableDistributedSampler(DATA, num_replicas=1, rank=0)
        sampler.load_state_dict({**sampler.state_dict(), "progress": 8, "consumed": 8})
        next(iter(sampler.track(DataLoader(DATA, batch_size=4, sampler=sampler, num_workers=2))))


def test_stateful_dataloader_from_torchdata_resumes_exactly(tmp_path):
    """torchdata's StatefulDataLoader instead of sampler.track: its state_dict() saved with the
    sampler; a resume mid-epoch with 2 workers gives the weights of the uninterrupted run."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = ck.ResumableDistributedSampler(Augmented(), num_replicas=1, rank=0, seed=3)
        loader = stateful.StatefulDataLoader(
            ck.SeededDataset(Augmented(), sampler), batch_size=4, sampler=sampler, num_workers=2,
            generator=torch.Generator(),  # iter(loader) draws nothing from the global stream
        )  # fmt: skip
        return {"model": model, "optimizer": opt, "sampler": sampler, "loader": loader}

    def train(state, start=0, stop_at=None):
        step = start
        for epoch in range(state["sampler"].epoch, 3):
            state["sampler"].set_epoch(epoch)
            for batch in state["loader"]:
                x = torch.cat([batch[:, :1] / 24, batch[:, 1:]], dim=1).float()
                loss = torch.nn.functional.cross_entropy(state["model"](x), batch[:, 0].long() % 2)
                state["optimizer"].zero_grad()
                loss.backward()
                state["optimizer"].step()
                step += 1
                if step == stop_at:
                    ck.save(tmp_path / "c.pt", {**state, "step": step})
                    return
        return state["model"].state_dict()

    with warnings.catch_warnings():
        warnings.simplefilter("error", ck.CheckpointWarning)
        expected = train(build())
        train(build(), stop_at=9)  # mid-epoch 1 (6 batches per epoch)
        state = build()
        torch.manual_seed(99)  # a new process: other streams until the restore
        step = ck.load(tmp_path / "c.pt", state)["step"]
        assert state["sampler"].epoch == 1
        got = train(state, start=step)
    for name, tensor in expected.items():
        assert tensor.isfinite().all() and torch.equal(got[name], tensor), name


def test_seeded_dataset_without_a_sampler_takes_its_epoch_from_set_epoch():
    """A loop that brings its own sampler (the HF Trainer's): seed given, set_epoch before each
    epoch's iterator; the same items as with ck's sampler of that seed, whichever process fetches."""
    expected = _augmented()  # ck's sampler, seed 11
    for workers in (0, 2):
        data = ck.SeededDataset(Augmented(), seed=11)
        shuffle = torch.Generator().manual_seed(5)  # its own order; nothing drawn from the global streams
        loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=workers, generator=shuffle)
        seen = {}
        for epoch in (0, 1):
            data.set_epoch(epoch)  # before iter(loader): the workers copy it when they start
            before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())
            for batch in loader:
                for row in batch.tolist():
                    seen[epoch, int(row[0])] = tuple(row[1:])
            after = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())
            assert torch.equal(before[0], after[0]) and before[1:] == after[1:]  # put back in the main process
        assert seen == expected, workers
    with pytest.raises(TypeError, match="ResumableDistributedSampler"):
        ck.SeededDataset(Augmented(), torch.utils.data.SequentialSampler(Augmented()))


# --- a save after the epoch (issue 44) ---------------------------------------------------------------


def _epoch_loop(folder, epochs: int, *, start: str, inside: bool = False, stop_after: int | None = None,
                tracked: bool = True, workers: int = 0) -> tuple[list[bytes], float] | None:  # fmt: skip
    """The loop tutorials teach: a scheduler stepped per epoch, ``manager.save`` after each epoch's
    batch loop (``inside``: from inside it, at the epoch's last batch, before the scheduler steps).
    ``start``: "sampler" (``range(sampler.epoch, epochs)``) or "ckpt" (``ckpt["epoch"] + 1``). Returns
    None once it saved epoch ``stop_after`` (the process killed there), else the final weights and lr."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 2, generator=g))
    sampler = ck.ResumableDistributedSampler(data, num_replicas=1, rank=0, seed=1)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=workers,
                        persistent_workers=workers > 0)  # fmt: skip
    manager = ck.CheckpointManager(folder)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    ckpt = manager.restore(state)
    first = sampler.epoch if start == "sampler" else (ckpt["epoch"] + 1 if ckpt is not None else 0)
    for epoch in range(first, epochs):
        sampler.set_epoch(epoch)
        batches = sampler.track(loader) if tracked else loader
        for i, (x, y) in enumerate(batches):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if inside and i == len(loader) - 1:
                manager.save({**state, "epoch": epoch}, epoch)
                if stop_after == epoch:
                    return None
        scheduler.step()
        if not inside:
            manager.save({**state, "epoch": epoch}, epoch)
            if stop_after == epoch:
                return None
    return [p.detach().numpy().tobytes() for p in model.parameters()], scheduler.get_last_lr()[0]


@pytest.mark.parametrize("start", ["sampler", "ckpt"])
@pytest.mark.parametrize("tracked", [True, False])
def test_a_save_after_the_epoch_resumes_at_the_next_epoch_exactly(tmp_path, start, tracked):
    """Killed between epochs (after epoch 1's save) and relaunched: the same weights and lr as the
    uninterrupted run (before: the sampler came back at epoch 1 finished, the loop re-entered it with no
    batch and stepped the scheduler again, lr 0.003125 for 0.00625, other weights), and no warning."""
    straight = _epoch_loop(tmp_path / "straight", 4, start=start, tracked=tracked)
    assert _epoch_loop(tmp_path / "run", 4, start=start, tracked=tracked, stop_after=1) is None
    saved = torch.load(ck.CheckpointManager(tmp_path / "run").latest(), weights_only=True)["sampler"]
    assert saved["epoch_ended"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("error", ck.CheckpointWarning)
        resumed = _epoch_loop(tmp_path / "run", 4, start=start, tracked=tracked)
    assert resumed == straight and straight[1] == 0.1 * 0.5**4


def test_a_save_inside_the_batch_loop_at_an_epochs_last_batch_resumes_in_that_epoch(tmp_path):
    """The other pattern: saved at the epoch's last batch, before its end-of-epoch code; the relaunch
    re-enters that epoch with no batch left and runs its end (the scheduler's step) once, as it should."""
    straight = _epoch_loop(tmp_path / "straight", 4, start="sampler", inside=True)
    assert _epoch_loop(tmp_path / "run", 4, start="sampler", inside=True, stop_after=1) is None
    saved = torch.load(ck.CheckpointManager(tmp_path / "run").latest(), weights_only=True)["sampler"]
    assert saved["epoch_ended"] is False and saved["epoch"] == 1
    assert _epoch_loop(tmp_path / "run", 4, start="sampler", inside=True) == straight


def test_where_the_epochs_end_is_not_known_the_resume_says_so_naming_both_patterns(tmp_path):
    """Persistent workers without track(): the iterator outlives the loop, so the sampler cannot tell
    whether the loop had left the epoch. It resumes at the next epoch (right for a save after the
    loop) and warns at the resume, naming both patterns and the fix."""
    straight = _epoch_loop(tmp_path / "straight", 3, start="sampler", tracked=False, workers=2)
    assert _epoch_loop(tmp_path / "run", 3, start="sampler", tracked=False, workers=2, stop_after=0) is None
    assert (
        torch.load(ck.CheckpointManager(tmp_path / "run").latest(), weights_only=True)["sampler"]["epoch_ended"] is None
    )
    with pytest.warns(ck.CheckpointWarning, match=r"last batch of epoch 0.*not recorded.*start of epoch 1.*after the "
                      r"epoch's loop.*inside the batch loop.*sampler.track\(loader\)"):  # fmt: skip
        assert _epoch_loop(tmp_path / "run", 3, start="sampler", tracked=False, workers=2) == straight


def test_set_epoch_past_an_epoch_restored_part_way_warns_that_its_rest_is_skipped():
    sampler = _sampler(0)
    it = iter(sampler)
    [next(it) for _ in range(5)]
    resumed = _sampler(0)
    resumed.load_state_dict(sampler.state_dict())
    with pytest.warns(ck.CheckpointWarning, match=r"set_epoch\(1\) right after restoring epoch 0 part-way \(20 of"):
        resumed.set_epoch(1)


def test_without_a_process_group_the_sampler_is_rank_0_of_1():
    """A script run with plain `python` (no torchrun, no init_distributed): DistributedSampler raises
    "Default process group has not been initialized"; this one deals the whole epoch to rank 0 of 1."""
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="process group"):
        torch.utils.data.DistributedSampler(DATA)
    sampler = ck.ResumableDistributedSampler(DATA, shuffle=False)
    assert (sampler.num_replicas, sampler.rank, list(sampler)) == (1, 0, list(range(50)))
