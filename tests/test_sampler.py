from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ckptools as ck

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
