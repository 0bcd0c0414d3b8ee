"""A dataset wrapper that makes each sample's random augmentation a function of the sample.

Item ``i`` of epoch ``e`` is made with python's, numpy's and torch's CPU streams seeded from
(sampler's seed, e, i), in whatever process fetches it: exact resume at any worker count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch.utils.data

from .. import rng
from ..rng import SampleIndex, item_seeds
from .sampler import ResumableDistributedSampler, draw_seeded

__all__ = ["SeededDataset"]

T = TypeVar("T")


class SeededDataset(torch.utils.data.Dataset[T], Generic[T]):
    """Wrap a map-style dataset so that item ``i`` of epoch ``e`` is made with random numbers that
    depend on (the sampler's seed, ``e``, ``i``) alone, in whatever process fetches it.

    Random augmentation in ``__getitem__`` (``torch.rand*``, ``random.*``, ``np.random.*``) then
    resumes exactly at any point of an epoch, at any number of workers and world size. Around each
    item python's, numpy's and torch's CPU streams are seeded from the triple and then put back, so
    with ``num_workers=0`` everything else draws what it would without the wrapper. Use the sampler
    the DataLoader draws from (its indices carry the epoch to the workers); without one, give
    ``seed`` and call `set_epoch` before each epoch's iterator is made (workers that start again
    every epoch). A transform that owns its generator is not reseeded. How, and the limits:
    docs/guides/resuming.md.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        sampler: the `ResumableDistributedSampler` the DataLoader is built with; None: the epoch
            is the one given to `set_epoch` (0 until then).
        seed: without a sampler, the seed of every item's draws (with one: the sampler's seed).

    Raises:
        TypeError: ``dataset`` is an ``IterableDataset`` (it has no index to seed from: seed inside
            its ``__iter__`` from the worker id and position), or ``sampler`` is neither None nor a
            `ResumableDistributedSampler`.
        ValueError: the sampler was built over a dataset of another length.

    Examples:
        >>> import random, torch, ckptools as ck
        >>> class Noisy(torch.utils.data.Dataset):
        ...     def __len__(self): return 8
        ...     def __getitem__(self, i): return i + random.random()  # random augmentation
        >>> sampler = ck.ResumableDistributedSampler(range(8), num_replicas=1, rank=0, seed=1)
        >>> data = ck.SeededDataset(Noisy(), sampler)
        >>> data[3] == data[3]  # item 3 of epoch 0: the same draws, whichever process fetches it
        True
        >>> before = data[3]; sampler.set_epoch(1); data[3] == before  # another epoch, other draws
        False
        >>> loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
        >>> for batch in sampler.track(loader):  # doctest: +SKIP
        ...     train_step(batch)
    """

    def __init__(
        self, dataset: torch.utils.data.Dataset[T], sampler: ResumableDistributedSampler | None = None, *, seed: int = 0
    ) -> None:
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError(
                f"SeededDataset wraps map-style datasets (__getitem__ and __len__); {type(dataset).__name__} is an "
                "IterableDataset, which has no index to seed from: seed its random numbers inside __iter__ from "
                "torch.utils.data.get_worker_info().id and the position in the stream"
            )
        if sampler is not None and not isinstance(sampler, ResumableDistributedSampler):
            raise TypeError(
                f"SeededDataset(dataset, sampler) needs the ck.ResumableDistributedSampler the DataLoader draws from "
                f"(its indices carry the epoch to the workers), got {type(sampler).__name__}"
            )
        if sampler is not None and len(dataset) != len(sampler.dataset):  # type: ignore[arg-type]
            raise ValueError(
                f"SeededDataset: the dataset has {len(dataset)} items but the sampler was built over "  # type: ignore[arg-type]
                f"{len(sampler.dataset)}; build the sampler over this dataset"  # type: ignore[arg-type]
            )
        self.dataset = dataset
        self.sampler = sampler
        self.seed = int(seed)
        self.epoch = 0  # without a sampler: the epoch items belong to (set_epoch)
        if sampler is not None:
            draw_seeded(sampler)

    def set_epoch(self, epoch: int) -> None:
        """Without a sampler: the epoch the next items belong to (with one, its epoch counts).

        Call it before the epoch's DataLoader iterator is made: workers copy it when they start.

        Examples:
            >>> import random, ckptools as ck
            >>> data = ck.SeededDataset([0, 1, 2], seed=7)
            >>> data.set_epoch(4); data.epoch
            4
        """
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # Only for names this wrapper lacks; never for its own fields (absent while unpickling).
        if name in ("dataset", "sampler", "seed", "epoch") or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __repr__(self) -> str:
        return f"SeededDataset({self.dataset!r})"

    def __getitem__(self, index: int) -> T:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[T]:
        """The items at ``indices``, each seeded from its own (seed, epoch, index).

        The DataLoader calls this once per batch: the process's streams are saved once and put back
        once (saving numpy's costs ~70 µs), each item is seeded on its own.
        """
        saved = rng.capture_cpu_streams()
        try:
            items = []
            for index in indices:
                rng.seed_cpu_streams(*item_seeds(*self._epoch_of(index), int(index)))
                items.append(self.dataset[int(index)])
            return items
        finally:
            rng.restore_cpu_streams(saved)

    def _epoch_of(self, index: int) -> tuple[int, int]:
        """The (seed, epoch) item ``index`` belongs to."""
        if isinstance(index, SampleIndex):
            return index.seed, index.epoch
        if self.sampler is None:
            return self.seed, self.epoch  # in a worker: as it was when the worker started
        if torch.utils.data.get_worker_info() is not None:
            # This worker's copy of the sampler is as old as the worker: it may be epochs behind.
            raise ValueError(
                f"SeededDataset was asked for index {index} in a DataLoader worker, but that index did not come "
                "from the sampler it was built with, so its epoch is unknown there; build the DataLoader with "
                "sampler=<that ResumableDistributedSampler> (or a batch_sampler drawing from it)"
            )
        return int(self.sampler.seed), int(self.sampler.epoch)
