"""A DistributedSampler that can resume in the middle of an epoch."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch.utils.data
from torch.utils.data.distributed import DistributedSampler

__all__ = ["ResumableDistributedSampler"]

T = TypeVar("T")


class ResumableDistributedSampler(DistributedSampler):
    """Drop-in ``DistributedSampler`` whose state carries epoch, seed and progress in the epoch.

    ``state_dict()`` records how many of this rank's samples of the current epoch the training
    loop has consumed; after ``load_state_dict()`` the next iteration yields exactly the rest of
    that epoch, in the order an uninterrupted run would have seen it (the order depends only on
    ``seed``, ``epoch``, the dataset length and the world size, as in ``DistributedSampler``).

    Progress is counted in samples handed to the training loop:

    - ``num_workers=0``: the DataLoader draws indices only when the loop asks for the next batch,
      so the sampler counts them itself; nothing else is needed.
    - ``num_workers > 0``: workers prefetch, so the sampler has handed out more indices than the
      loop has seen (with 2 workers, 40 drawn for 20 consumed). Either iterate
      ``sampler.track(loader)`` instead of ``loader``, or call ``sampler.record_consumed(n)`` right
      after taking each batch of ``n`` samples. Once either is used, the sampler counts only what
      is reported.

    Every rank consumes the same number of batches under DDP, so the progress rank 0 saves is
    every rank's progress. An epoch whose progress equals ``num_samples`` is complete: resuming
    it yields nothing. Restoring under a different world size resumes each rank at
    ``progress * old_world // new_world`` of its new share: no sample of the epoch is skipped,
    up to ``new_world - 1`` are seen twice (a warning says so).

    Example:
        >>> import torch, ckptools as ck
        >>> data = torch.utils.data.TensorDataset(torch.arange(8.0))
        >>> sampler = ck.ResumableDistributedSampler(data, num_replicas=1, rank=0, shuffle=False)
        >>> it = iter(sampler); [next(it) for _ in range(3)]
        [0, 1, 2]
        >>> state = sampler.state_dict()
        >>> resumed = ck.ResumableDistributedSampler(data, num_replicas=1, rank=0, shuffle=False)
        >>> resumed.load_state_dict(state); list(resumed)
        [3, 4, 5, 6, 7]
    """

    def __init__(self, dataset: torch.utils.data.Dataset, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self._offset = 0  # where the current (or next) iteration starts in this rank's share
        self._drawn = 0  # indices handed out by the current iteration
        self._reported = 0  # samples the loop reported consumed in the current iteration
        self._reporting = False  # sticky: once the loop reports, drawn indices no longer count
        self._fresh = True  # the next __iter__ starts at _offset (set by load/set_epoch)

    @property
    def progress(self) -> int:
        """Samples of this rank's share of the current epoch that the loop has consumed."""
        return self._offset + (self._reported if self._reporting else self._drawn)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning, unless it is the epoch just restored."""
        if epoch != self.epoch:
            self._offset = self._drawn = self._reported = 0
            self._fresh = True
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        if not self._fresh:
            self._offset = 0  # a second pass over the same epoch starts over, as DistributedSampler does
        self._fresh = False
        self._drawn = self._reported = 0
        return self._generate(indices[self._offset :])

    def _generate(self, indices: list[int]) -> Iterator[int]:
        for index in indices:
            self._drawn += 1
            yield index

    def __len__(self) -> int:
        return self.num_samples - self._offset

    def record_consumed(self, num_samples: int) -> None:
        """Tell the sampler the loop has just taken a batch of ``num_samples`` samples.

        Needed only with DataLoader workers (see the class docstring). Call it right after
        receiving the batch, before any checkpoint is saved in that step.

        Example:
            >>> for batch in loader:  # doctest: +SKIP
            ...     sampler.record_consumed(len(batch[0]))
            ...     train_step(batch)
        """
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self._reporting = True
        self._reported = min(self._reported + num_samples, self.num_samples - self._offset)

    def track(self, loader: Iterable[T]) -> Iterator[T]:
        """Iterate ``loader``, recording each batch as consumed when the loop receives it.

        ``loader`` must be a ``DataLoader`` built with ``batch_size`` (its batches then hold
        ``batch_size`` samples, the last one possibly fewer).

        Example:
            >>> for batch in sampler.track(loader):  # doctest: +SKIP
            ...     train_step(batch)
        """
        batch_size = getattr(loader, "batch_size", None)
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(
                "track() needs a DataLoader built with batch_size=...; with a custom batch_sampler call "
                "sampler.record_consumed(len(batch)) after taking each batch instead"
            )
        self._reporting = True
        for batch in loader:
            # Recorded before the loop sees the batch: a checkpoint saved while processing it
            # must count it, or the resumed run would train on it twice.
            self.record_consumed(batch_size)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Return epoch, seed, progress and the layout they are valid for (plain ints/bools)."""
        return {
            "epoch": int(self.epoch),
            "seed": int(self.seed),
            "progress": int(self.progress),
            "num_replicas": int(self.num_replicas),
            "num_samples": int(self.num_samples),
            "dataset_len": len(self.dataset),  # type: ignore[arg-type]
            "shuffle": bool(self.shuffle),
            "drop_last": bool(self.drop_last),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s epoch and progress; the next iteration yields the rest of it.

        Raises:
            ValueError: the dataset length, ``shuffle`` or ``drop_last`` differ from the saved
                ones, so the saved position means nothing for this sampler (leave the sampler out
                of the state to be restored to start the epoch over).
        """
        for name in ("dataset_len", "shuffle", "drop_last"):
            current = len(self.dataset) if name == "dataset_len" else getattr(self, name)  # type: ignore[arg-type]
            if name in state and state[name] != current:
                raise ValueError(
                    f"cannot resume the sampler: checkpoint has {name}={state[name]!r}, this sampler has "
                    f"{current!r}; use the same dataset and options, or do not restore the sampler"
                )
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state["epoch"])
        progress = int(state.get("progress", 0))
        saved_world = int(state.get("num_replicas", self.num_replicas))
        if saved_world != self.num_replicas:
            progress = progress * saved_world // self.num_replicas
            warnings.warn(
                f"sampler saved with {saved_world} replicas, restored with {self.num_replicas}: resuming each "
                f"rank at sample {progress} of its share; a few samples of this epoch may be seen twice",
                stacklevel=2,
            )
        self._offset = min(progress, self.num_samples)
        self._drawn = self._reported = 0
        self._fresh = True
