"""A DataLoader that is its own resume point: the data side of an exact resume in one object.

Built for loops that someone else runs (Lightning's fit loop, Fabric's, torchdata-style code):
they save and restore any loader that has ``state_dict`` and ``load_state_dict``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch.utils.data

from ..collective.group import get_rank, get_world_size, settle_at_exit
from .generator import lend_generator
from .sampler import ResumableDistributedSampler
from .seeded import SeededDataset

__all__ = ["ResumableDataLoader"]


class _Sampler(ResumableDistributedSampler):
    """A `ResumableDistributedSampler` that tells its loader when `set_epoch` moves to another epoch."""

    loader: weakref.ReferenceType[ResumableDataLoader] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The loader counts what the loop received (record_consumed): never "workers running ahead".
        self._reporting = True

    def set_epoch(self, epoch: int) -> None:
        moved = epoch != self.epoch
        super().set_epoch(epoch)
        loader = self.loader() if self.loader is not None else None
        if moved and loader is not None:
            loader._epoch_moved()

    def __getstate__(self) -> dict[str, Any]:
        # Copied into workers with the SeededDataset that holds it: the loader stays here.
        return {**super().__getstate__(), "loader": None}

    def _left_epoch(self) -> bool | None:
        # The framework that drives the loader (Lightning's fit loop) decides when an epoch ends and
        # saves its own count of it; a finished epoch is one with no batch left, and the framework
        # sets the next one (Lightning's fetcher also reads a batch ahead, so exhaustion says nothing).
        return False


class ResumableDataLoader(torch.utils.data.DataLoader[Any]):
    """A ``DataLoader`` whose ``state_dict()`` is its position in the epoch, for an exact resume
    of a loop you do not write yourself (Lightning, Fabric), or of your own.

    It is the recipe of docs/guides/resuming.md in one object: it draws from a
    `ResumableDistributedSampler` (the ranks from the process group), wraps the dataset in
    `SeededDataset` (``seeded=True``), counts each batch as the loop receives it and lends its
    workers a seed of the epoch's own; ``state_dict()`` is the sampler's state and the batches
    consumed (``ck.save``, Lightning's loops and ``fabric.save`` take it); ``len()`` is an epoch's
    batches at this world size. Every other argument is the ``DataLoader``'s; ``sampler`` and
    ``batch_sampler`` are its own; ``.dataset`` is the `SeededDataset` (whose ``.dataset`` is yours).

    Args:
        dataset: a map-style dataset.
        batch_size: samples per batch (per rank).
        shuffle: a new order every epoch, drawn from ``seed`` and the epoch.
        seed: the seed of the order and of the augmentation; the same on every rank.
        drop_last: drop the end of the epoch that does not fill a batch on every rank (no
            sample padded, no short batch); otherwise the sampler pads from the start of the epoch
            so every rank has as many samples, as ``DistributedSampler`` does, and the last batch
            may be short.
        seeded: wrap ``dataset`` in `SeededDataset` (leave True unless ``__getitem__`` draws no
            random numbers and the ~0.1 ms per batch matters).
        num_replicas: the number of ranks (default: the process group's size, 1 without one).
        rank: this rank (default: its rank in the process group, 0 without one).

    Raises:
        TypeError: ``sampler`` or ``batch_sampler`` was given.

    Examples:
        >>> import torch, ckptools as ck
        >>> data = torch.utils.data.TensorDataset(torch.arange(12.0))
        >>> loader = ck.ResumableDataLoader(data, batch_size=4, shuffle=False)
        >>> it = iter(loader); first = next(it)
        >>> state = loader.state_dict()  # after one batch of 4
        >>> again = ck.ResumableDataLoader(data, batch_size=4, shuffle=False)
        >>> again.load_state_dict(state)
        >>> len(again), [batch[0].tolist() for batch in again]  # len: the epoch's 3 batches
        (3, [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]])
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[Any],
        batch_size: int = 1,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        seeded: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
        **kwargs: Any,
    ) -> None:
        for taken in ("sampler", "batch_sampler"):
            if kwargs.get(taken) is not None:
                raise TypeError(
                    f"ResumableDataLoader makes its own {taken} (a ck.ResumableDistributedSampler); to use another, "
                    "build a torch DataLoader over it and iterate sampler.track(loader)"
                )
        sampler = _Sampler(
            dataset,
            num_replicas=get_world_size() if num_replicas is None else num_replicas,
            rank=get_rank() if rank is None else rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        sampler.loader = weakref.ref(self)
        wrapped = SeededDataset(dataset, sampler) if seeded else dataset
        super().__init__(wrapped, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)
        self.resumable_sampler = sampler  # `.sampler`, typed as what it is
        # (epoch, batches of it the loop received, those before a resume included)
        self._position = (sampler.epoch, 0)
        self._resumed_epoch: int | None = None  # the epoch load_state_dict restored part-way, while it lasts
        self._waiting = False  # a pass was asked for (iter) and has not yielded yet
        self._next_pass: Iterator[Any] | None = None  # torch's iterator for that pass, once made

    def _consumed(self) -> int:
        """Batches of the sampler's current epoch the loop received."""
        epoch, batches = self._position
        return batches if epoch == self.resumable_sampler.epoch else 0

    def _resuming(self) -> bool:
        """Whether the current (or next) pass continues the epoch `load_state_dict` restored."""
        sampler = self.resumable_sampler
        return self._resumed_epoch == sampler.epoch and sampler.resumed_mid_epoch

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator over torch's iterator, which counts
        # The workers start now, as with iter(DataLoader): a worker forked right after a collective
        # can deadlock on CPython < 3.11.10 (see collective/group.py), and a loop asks for its first
        # batch right after one (Lightning's per-step SIGTERM broadcast). Except when nothing is
        # left of a restored epoch: Lightning makes its iterator while setting up and only then sets
        # the next epoch, so that pass starts when the epoch is set (or at its first batch).
        self._waiting = True
        self._next_pass = None if self._resuming() and super().__len__() == 0 else self._start()
        return self._counted()

    def _start(self) -> Iterator[Any]:
        """Torch's iterator for the pass over the sampler's epoch, the count of batches set for it."""
        sampler = self.resumable_sampler
        resuming = self._resuming()
        if not resuming:
            self._resumed_epoch = None
        self._position = (sampler.epoch, self._consumed() if resuming else 0)
        if self.num_workers > 0:
            settle_at_exit()  # the fork hook, also where no ckptools collective ran yet
        # The workers draw their base seed from the lent generator, not the global stream.
        key = (sampler.seed, sampler.epoch, sampler.rank)
        return lend_generator(self, torch.utils.data.DataLoader.__iter__, key=key)

    def _epoch_moved(self) -> None:
        """The sampler moved to another epoch (`set_epoch`): a pass not begun yet is made anew."""
        if self._waiting:
            self._next_pass = self._start()  # the previous one's workers end with it

    def _counted(self) -> Iterator[Any]:
        iterator = self._next_pass if self._next_pass is not None else self._start()
        self._next_pass, self._waiting = None, False
        sampler = self.resumable_sampler
        size = self.batch_size if self.batch_size is not None else 1
        for batch in iterator:
            # Counted before the loop sees the batch: a checkpoint saved while it is processed
            # must count it, or the resumed run would train on it twice.
            epoch, batches = self._position
            self._position = (epoch, batches + 1)
            sampler.record_consumed(size)
            yield batch
        self._resumed_epoch = None  # that epoch is done: the next pass starts one from its beginning

    def __len__(self) -> int:
        # An epoch's batches at this world size, whatever part of it is left: the count Lightning
        # takes once, at set-up, for every epoch (and torchdata's StatefulDataLoader reports).
        samples = self.resumable_sampler.num_samples
        size = self.batch_size or 1
        return samples // size if self.drop_last else -(-samples // size)

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch: the sampler's state and the batches consumed (plain ints).

        Examples:
            >>> import torch, ckptools as ck
            >>> loader = ck.ResumableDataLoader(torch.utils.data.TensorDataset(torch.zeros(8)), batch_size=2)
            >>> sorted(loader.state_dict())
            ['batches', 'sampler']
        """
        return {"sampler": self.resumable_sampler.state_dict(), "batches": self._consumed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position: the next pass yields the rest of that epoch.

        Raises:
            ValueError: the dataset's length, ``shuffle`` or ``drop_last`` differ from the saved
                ones (see `ResumableDistributedSampler.load_state_dict`).
        """
        sampler = self.resumable_sampler
        # A file written before ckptools 0.4.0 has no "epoch_ended": for this loader it was always False.
        sampler.load_state_dict({"epoch_ended": False, **state["sampler"]})
        # Counted so that the batches done and the batches left make an epoch at this world size
        # (the saved count, when it is the saving world size; after a change, what the rest of the
        # epoch dealt out to the new ranks leaves of one).
        left = torch.utils.data.DataLoader.__len__(self)
        self._position = (sampler.epoch, max(len(self) - left, 0))
        self._resumed_epoch = sampler.epoch
