"""ResumableDataLoader: a DataLoader whose state_dict is its position in the epoch, for loops that
someone else runs (Lightning, Fabric) and for ck.save/ck.load."""

from __future__ import annotations

import pytest
import torch

import ckptools as ck

pytestmark = pytest.mark.versions  # the DataLoader's iterator and its workers


class Augmented(torch.utils.data.Dataset):
    """Random augmentation in __getitem__, drawn from the fetching process's global streams."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), torch.rand(1)


def _loader(**kw) -> ck.ResumableDataLoader:
    defaults = dict(batch_size=4, shuffle=True, seed=3, num_replicas=1, rank=0)
    return ck.ResumableDataLoader(Augmented(), **{**defaults, **kw})


def _as_lists(batches) -> list:
    return [[t.tolist() for t in batch] for batch in batches]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_mid_epoch_yields_what_the_uninterrupted_run_did_augmentation_included(tmp_path, workers):
    straight = _loader(num_workers=workers)
    expected = []
    for epoch in (0, 1):
        straight.resumable_sampler.set_epoch(epoch)
        expected += _as_lists(straight)
    # Interrupted after 3 batches of epoch 0, saved with ck.save, resumed in a fresh loader.
    first = _loader(num_workers=workers)
    first.resumable_sampler.set_epoch(0)
    it = iter(first)
    seen = _as_lists([next(it) for _ in range(3)])
    ck.save(tmp_path / "ckpt.pt", {"loader": first})
    del it
    resumed = _loader(num_workers=workers)
    ck.load(tmp_path / "ckpt.pt", {"loader": resumed})
    assert len(resumed) == 8  # the epoch's batches, the 3 before the resume included
    resumed.resumable_sampler.set_epoch(0)  # as Lightning does: the restored epoch keeps its place
    seen += _as_lists(resumed)
    resumed.resumable_sampler.set_epoch(1)
    assert len(resumed) == 8
    seen += _as_lists(resumed)
    assert seen == expected


def test_an_epoch_set_after_iter_of_a_finished_restored_epoch_is_the_one_iterated():
    # Lightning makes the loader's iterator during its set-up and sets the next epoch afterwards;
    # a resumed epoch that was already finished must not leave the new one empty.
    loader = _loader(num_workers=2)
    loader.resumable_sampler.set_epoch(0)
    whole = _as_lists(loader)
    state = loader.state_dict()  # epoch 0, every batch consumed
    resumed = _loader(num_workers=2)
    resumed.load_state_dict(state)
    it = iter(resumed)
    resumed.resumable_sampler.set_epoch(1)
    fresh = _loader(num_workers=2)
    fresh.resumable_sampler.set_epoch(1)
    assert _as_lists(it) == _as_lists(fresh) != whole


def test_iterating_draws_nothing_from_the_global_torch_stream():
    # A DataLoader iterator draws its workers' base seed from the global RNG unless it has a
    # generator: a resumed run would draw it at another point of the restored stream.
    loader = _loader(num_workers=2)
    before = torch.get_rng_state()
    for _ in loader:
        pass
    assert torch.equal(torch.get_rng_state(), before)


def test_a_state_saved_on_two_ranks_resumes_on_three_with_every_sample_once():
    ranks = [_loader(num_replicas=2, rank=r, shuffle=True, drop_last=True, seeded=False) for r in (0, 1)]
    its = [iter(loader) for loader in ranks]
    before = [int(i) for it in its for _ in range(2) for i in next(it)[0].flatten()]
    state = ranks[0].state_dict()
    assert state["batches"] == 2
    after = []
    for r in range(3):
        loader = _loader(num_replicas=3, rank=r, shuffle=True, drop_last=True, seeded=False)
        with pytest.warns(ck.CheckpointWarning, match="replicas"):
            loader.load_state_dict(state)
        # An epoch here is 2 batches (10 samples a rank); this rank's share of the rest (14 / 3 = 4)
        # is 1 of them, so the batches before count as 1.
        assert len(loader) == 2 and loader.state_dict()["batches"] == 1
        after += [int(i) for batch in loader for i in batch[0].flatten()]
    seen = before + after
    assert len(seen) == len(set(seen)) == 16 + 12  # none twice; drop_last's remainder (2) left out


def test_its_own_sampler_cannot_be_replaced():
    with pytest.raises(TypeError, match="makes its own sampler"):
        ck.ResumableDataLoader(Augmented(), batch_size=2, sampler=range(30))
    with pytest.raises(TypeError, match="makes its own batch_sampler"):
        ck.ResumableDataLoader(Augmented(), batch_sampler=[[0, 1]])


def test_without_a_process_group_it_is_rank_0_of_1():
    loader = ck.ResumableDataLoader(Augmented(), batch_size=10, shuffle=False)
    assert (loader.resumable_sampler.num_replicas, loader.resumable_sampler.rank) == (1, 0)
    assert isinstance(loader.dataset, ck.SeededDataset) and isinstance(loader.dataset.dataset, Augmented)
    assert next(batch[0].flatten().tolist() for batch in loader) == [float(i) for i in range(10)]
