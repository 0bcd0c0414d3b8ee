"""The data side of an exact resume: a DistributedSampler that resumes in the middle of an epoch.

Its indices carry seed and epoch when a `ckptools.training.seeded.SeededDataset` draws from it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch.utils.data
from torch.utils.data.distributed import DistributedSampler

from .. import log
from ..owned.gradients import track
from ..rng import SampleIndex
from .generator import lend_generator, loader_iterator

__all__ = ["ResumableDistributedSampler"]

T = TypeVar("T")


class ResumableDistributedSampler(DistributedSampler[int]):
    """Drop-in ``DistributedSampler`` whose state carries epoch, seed and progress in the epoch.

    After ``load_state_dict()`` the next iteration yields exactly the rest of the epoch, in the
    order an uninterrupted run would have seen it. Iterate ``sampler.track(loader)`` instead of
    ``loader``: it counts the batches the loop *received* (workers prefetch ahead), and lends a
    DataLoader without ``generator=`` a seed of its own per epoch, so that a resumed run draws
    nothing from the global RNG there. Hazards of an untracked loop are warned about once, on
    rank 0. Restored with another world size, the rest of the epoch is dealt out again to the new
    ranks: none skipped, none repeated beyond drop_last's remainder or the padding.
    Why and how: docs/guides/resuming.md and docs/guides/world-size.md.

    Examples:
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

    def __init__(self, dataset: torch.utils.data.Dataset[Any], *args: Any, **kwargs: Any) -> None:
        track()  # the optimizer steps watched from here: an open accumulation window's gradients
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            # No process group (a script run with plain `python`): rank 0 of 1, where
            # DistributedSampler raises "Default process group has not been initialized".
            if len(args) < 1:
                kwargs.setdefault("num_replicas", 1)
            if len(args) < 2:
                kwargs.setdefault("rank", 0)
        super().__init__(dataset, *args, **kwargs)
        self._offset = 0  # where the current (or next) iteration starts in this rank's share
        # Samples of the epoch's permutation consumed before a resume at a world size that does
        # not divide it: the rest of the epoch is dealt out again from there (see _dealt).
        self._base = 0
        self._drawn = 0  # indices handed out by the current iteration
        self._reported = 0  # samples the loop reported consumed in the current iteration
        self._reporting = False  # sticky: once the loop reports, drawn indices no longer count
        self._fresh = True  # the next __iter__ starts at _offset (set by load/set_epoch)
        # The torch DataLoader iterator driving the current pass when nothing reports what the
        # loop consumed (weak: the sampler must not keep its workers alive).
        self._driver: weakref.ReferenceType[Any] | None = None
        self._driver_workers = 0
        self._rng_after_restore: torch.Tensor | None = None  # see note_rng_restored
        self._seeded = False  # a SeededDataset draws from this sampler: indices carry seed and epoch
        # Whether the loop has left the current epoch's pass: track() knows (False while it yields,
        # True once its loader is exhausted); None where nobody told (see _left_epoch).
        self._left: bool | None = None
        self._exhausted = False  # the current pass's generator ran past its last index

    @property
    def progress(self) -> int:
        """Samples of this rank's share of the current epoch that the loop has consumed."""
        return self._offset + (self._reported if self._reporting else self._drawn)

    @property
    def consumed(self) -> int:
        """Samples of the epoch consumed by all ranks together: a prefix of the epoch's order.

        Examples:
            >>> import torch, ckptools as ck
            >>> data = torch.utils.data.TensorDataset(torch.arange(10.0))
            >>> sampler = ck.ResumableDistributedSampler(data, num_replicas=2, rank=0)
            >>> sampler.record_consumed(3); sampler.consumed
            6
        """
        return self._base + self.progress * self.num_replicas

    def _share(self) -> int:
        """How many samples this rank's share of the current epoch holds."""
        if self._base == 0:
            return self.num_samples
        left = len(self.dataset) - self._base  # type: ignore[arg-type]
        if left <= 0:
            return 0
        return left // self.num_replicas if self.drop_last else -(-left // self.num_replicas)

    def _dealt(self) -> list[int]:
        """This rank's share of the rest of the epoch, after the first ``_base`` samples of its
        permutation: dealt out as DistributedSampler deals a whole epoch (rank r takes positions
        r, r+W, ...), padded from the start of the permutation or cut to a multiple of W."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)  # DistributedSampler's permutation
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        rest = order[self._base :]
        size = self._share() * self.num_replicas
        if len(rest) < size:  # padding: samples from the start of the epoch, cyclically, as torch pads
            padding = size - len(rest)
            rest += (order * (padding // max(n, 1) + 1))[:padding]
        return rest[:size][self.rank :: self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning, unless it is the epoch just restored."""
        if epoch != self.epoch:
            left = self._share() - self._offset
            if self._fresh and self.resumed_mid_epoch and left > 0 and epoch > self.epoch:
                log.warn(
                    f"set_epoch({epoch}) right after restoring epoch {self.epoch} part-way ({left} of this rank's "
                    f"samples left): the rest of epoch {self.epoch} is skipped. A checkpoint saved inside the batch "
                    f"loop resumes in its epoch: loop `for epoch in range(sampler.epoch, epochs)` rather than from "
                    "`ckpt['epoch'] + 1`",
                    once="set_epoch_skips",
                )
            self._offset = self._drawn = self._reported = self._base = 0
            self._fresh = True
            self._left = None
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        if not self._fresh and self._drawn:
            # a second pass over the same epoch starts over, as DistributedSampler does; a pass
            # that drew nothing (an iterator made and dropped, as torchdata's StatefulDataLoader
            # does while it restores) leaves the position where it was
            self._offset = self._base = 0
            if self.shuffle:
                log.warn(
                    f"a new pass over epoch {self.epoch} started without sampler.set_epoch(...) since the last "
                    "one, so it repeats the last shuffle (DistributedSampler does the same, pytorch#31771); call "
                    "sampler.set_epoch(epoch) at the start of every epoch",
                    once="set_epoch",
                )
        indices = self._dealt() if self._base else list(super().__iter__())
        self._fresh = False
        self._drawn = self._reported = 0
        self._exhausted = False
        self._check_rng_after_restore()
        loader_iter = loader_iterator()
        self._check_unseeded_workers(loader_iter, len(indices) - self._offset)
        driver = None if self._reporting else loader_iter
        self._driver = weakref.ref(driver) if driver is not None else None
        self._driver_workers = int(getattr(driver, "_num_workers", 0))
        return self._generate(indices[self._offset :])

    def __getstate__(self) -> dict[str, Any]:
        # A weak reference to a live DataLoader iterator cannot be pickled and means nothing in
        # another process (a sampler is copied into spawned workers with some loaders).
        return {**self.__dict__, "_driver": None}

    def _check_rng_after_restore(self) -> None:
        # A run resumed mid-epoch is exact only if nothing drew from the global torch RNG between
        # the restore and the first batch: the uninterrupted run drew nothing there.
        expected, self._rng_after_restore = self._rng_after_restore, None
        if expected is None or (self._offset == 0 and self._base == 0):  # at an epoch's start: it drew there too
            return
        now = torch.get_rng_state()
        if torch.equal(now, expected):
            return
        # What `iter(loader)` does to the global generator when the DataLoader has none of its own.
        replay = torch.Generator()
        replay.set_state(expected)
        torch.empty((), dtype=torch.int64).random_(generator=replay)
        if torch.equal(now, replay.get_state()):
            cause = (
                "the DataLoader drew its workers' base seed from the global torch RNG when the resumed epoch "
                "started (it has no generator of its own)"
            )
            fix = "iterate sampler.track(loader), which gives it one, or build it with generator=torch.Generator()"
        else:
            cause = "something drew from the global torch RNG between restoring the checkpoint and the first batch"
            fix = "draw random numbers before the restore (manager.restore / ck.load), or from a torch.Generator"
        log.warn(
            f"{cause}, so every random number from here on (dropout, augmentation) differs from the uninterrupted "
            f"run's: this resume is not bit-exact; {fix}",
            once="rng_after_restore",
        )

    def _check_unseeded_workers(self, loader_iter: Any, remaining: int) -> None:
        # A resumed epoch continues mid-way while the DataLoader's workers start their random
        # streams afresh: augmentation drawn in them differs from the uninterrupted run's from here
        # on. Whether __getitem__ draws anything cannot be known; a TensorDataset draws nothing.
        if loader_iter is None or remaining <= 0 or not (self._offset or self._base):
            return
        workers = int(getattr(loader_iter, "_num_workers", 0))
        dataset = getattr(loader_iter, "_dataset", None)
        if workers == 0 or self._seeded or type(dataset) is torch.utils.data.TensorDataset:
            return
        log.warn(
            f"epoch {self.epoch} resumes mid-way with {workers} DataLoader workers, whose random streams start "
            "afresh: if "
            f"{type(dataset).__name__}.__getitem__ draws random numbers (augmentation), every sample from here on "
            "is augmented differently than in the uninterrupted run, and this resume is not bit-exact. Wrap the "
            "dataset: DataLoader(ck.SeededDataset(dataset, sampler), sampler=sampler, ...) seeds each sample from "
            "(seed, epoch, index); if it draws none, ignore this warning",
            once="unseeded_workers",
        )

    def _generate(self, indices: list[int]) -> Iterator[int]:
        # A SeededDataset reads the epoch from the index it is asked for: a DataLoader worker holds
        # a copy of the dataset made when it started (persistent workers: epochs ago).
        seed, epoch = int(self.seed), int(self.epoch)
        for index in indices:
            self._drawn += 1
            yield SampleIndex(index, seed, epoch) if self._seeded else index
        self._exhausted = True  # asked for one more after the last: whoever iterates has left the pass

    def __len__(self) -> int:
        return self._share() - self._offset

    def record_consumed(self, num_samples: int) -> None:
        """Tell the sampler the loop has just taken a batch of ``num_samples`` samples.

        Needed only with DataLoader workers (see the class docstring). Call it right after
        receiving the batch, before any checkpoint is saved in that step.

        Examples:
            >>> for batch in loader:  # doctest: +SKIP
            ...     sampler.record_consumed(len(batch[0]))
            ...     train_step(batch)
        """
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self._reporting = True
        self._reported = min(self._reported + num_samples, self._share() - self._offset)

    def track(self, loader: Iterable[T]) -> Iterator[T]:
        """Iterate ``loader`` the way an exact resume needs: the loop's way to write ``in loader``.

        - Each batch is recorded as consumed when the loop receives it (before a checkpoint
          saved while processing it), not when a prefetching worker fetched it.
        - A torch ``DataLoader`` built without ``generator=`` is lent one for the moment
          ``iter(loader)`` draws its workers' base seed, seeded from the sampler's seed, the
          epoch and the rank: the global torch RNG is not drawn from, so a run resumed
          mid-epoch continues the exact random stream of the uninterrupted run.

        ``loader`` must be a ``DataLoader`` built with ``batch_size`` (its batches then hold
        ``batch_size`` samples, the last one possibly fewer) and this sampler.

        Raises:
            ValueError: ``loader`` has no ``batch_size``, or draws from another sampler.

        Examples:
            >>> for batch in sampler.track(loader):  # doctest: +SKIP
            ...     train_step(batch)
        """
        batch_size = getattr(loader, "batch_size", None)
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(
                "track() needs a DataLoader built with batch_size=...; with a custom batch_sampler call "
                "sampler.record_consumed(len(batch)) after taking each batch instead"
            )
        if isinstance(loader, torch.utils.data.DataLoader) and self not in (
            loader.sampler,
            getattr(loader.batch_sampler, "sampler", None),
        ):
            raise ValueError("track(loader): this loader does not draw from this sampler; pass sampler=this sampler")
        self._reporting = True
        self._left = False
        for batch in self._iterate(loader):
            # Recorded before the loop sees the batch: a checkpoint saved while processing it
            # must count it, or the resumed run would train on it twice.
            self.record_consumed(batch_size)
            yield batch
        # The loop asked for a batch after the last one: it is leaving the epoch, and what it does
        # next (a scheduler stepped per epoch, validation, a save) is the epoch's end.
        self._left = True

    def _iterate(self, loader: Iterable[T]) -> Iterator[T]:
        """``iter(loader)``; a torch DataLoader without a generator gets this epoch's own one for it."""
        if not isinstance(loader, torch.utils.data.DataLoader):
            return iter(loader)
        return lend_generator(loader, iter, key=(self.seed, self.epoch, self.rank))

    @property
    def resumed_mid_epoch(self) -> bool:
        """Whether the current (or next) pass continues an epoch that `load_state_dict` restored
        part-way through (until `set_epoch` moves to another epoch or a new pass starts over).

        Examples:
            >>> import ckptools as ck
            >>> sampler = ck.ResumableDistributedSampler(range(8), num_replicas=1, rank=0)
            >>> sampler.load_state_dict({"epoch": 0, "progress": 3}); sampler.resumed_mid_epoch
            True
            >>> sampler.set_epoch(1); sampler.resumed_mid_epoch
            False
        """
        return bool(self._offset or self._base)

    def _left_epoch(self) -> bool | None:
        """Whether the loop had left the current epoch's pass (True) or was still inside it, at its
        last batch (False); None where that cannot be known. Asked of a finished epoch only."""
        if self._left is not None:  # track() knows
            return self._left
        if self._reporting:  # record_consumed by hand: the sampler cannot see the loop
            return None
        if self._driver is None:  # iterated directly, no DataLoader between: its own generator knows
            return self._exhausted
        driver = self._driver()
        if driver is None:  # the loop's DataLoader iterator is gone: the `for` over it has ended
            return True
        # A live iterator: the loop is inside the pass, unless persistent workers keep it after the end.
        return None if getattr(driver, "_persistent_workers", False) else False

    def state_dict(self) -> dict[str, Any]:
        """Return epoch, seed, progress and the layout they are valid for (plain ints/bools).

        ``epoch_ended`` (a finished epoch only; else None) says whether the loop had left the
        epoch when the state was taken: True resumes at the next epoch's start, False in the
        finished epoch (the loop then runs that epoch's end again), None is unknown (see
        `load_state_dict`).
        """
        self._check_untracked_workers()
        finished = self.progress >= self._share()
        return {
            "epoch": int(self.epoch),
            "seed": int(self.seed),
            "progress": int(self.progress),
            "consumed": int(min(self.consumed, len(self.dataset))),  # type: ignore[arg-type]
            "num_replicas": int(self.num_replicas),
            "num_samples": int(self.num_samples),
            "dataset_len": len(self.dataset),  # type: ignore[arg-type]
            "shuffle": bool(self.shuffle),
            "drop_last": bool(self.drop_last),
            "epoch_ended": self._left_epoch() if finished else None,
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
        saved_world = int(state.get("num_replicas", self.num_replicas))
        # The samples consumed are a prefix of the epoch's order (files from before "consumed"
        # was saved: progress x world, which is the same thing for them).
        consumed = int(state.get("consumed", int(state.get("progress", 0)) * saved_world))
        n = len(self.dataset)  # type: ignore[arg-type]
        if saved_world != self.num_replicas:
            log.warn(
                f"sampler saved with {saved_world} replicas, restored with {self.num_replicas}: the rest of epoch "
                f"{self.epoch} ({max(n - consumed, 0)} of {n} samples) is dealt out again to the new ranks, so no "
                "sample is skipped or repeated beyond drop_last's remainder or the padding; the global batch "
                "changes with the world size (keep it with gradient accumulation, or scale the learning rate)",
            )
        finished = int(state.get("progress", 0)) >= int(state.get("num_samples", n + 1))
        self._left = None
        if (consumed >= n or finished) and state.get("epoch_ended") is not False:
            # Saved after the loop left the epoch (or not known): the run goes on at the next epoch's
            # start, so that `for epoch in range(sampler.epoch, epochs)` does not run this epoch's end
            # (its scheduler step, validation) a second time.
            if state.get("epoch_ended") is None:
                _warn_epoch_end_unknown(self.epoch)
            self.epoch += 1
            self._base = self._offset = 0
        elif consumed >= n or finished:  # saved at the epoch's last batch, inside the loop: nothing left of it
            self._base, self._offset = 0, self.num_samples
        elif consumed % self.num_replicas == 0:  # DistributedSampler's own layout continues exactly
            self._base, self._offset = 0, min(consumed // self.num_replicas, self.num_samples)
        else:
            self._base, self._offset = consumed, 0
        self._drawn = self._reported = 0
        self._fresh = True

    def _check_untracked_workers(self) -> None:
        # Called when the position is saved: wrong if workers are running ahead of the loop.
        if self._reporting or self._driver is None or self._driver_workers == 0:
            return
        # A pass whose iterator is gone was finished (everything drawn) or abandoned (a `break`);
        # persistent workers keep theirs, which may have handed out every batch already.
        driver: Any = self._driver()
        if callable(getattr(driver, "state_dict", None)):
            # torchdata's StatefulDataLoader: its own state_dict() holds this sampler's state as of
            # the batch the loop received last (it snapshots it as each batch is sent to a worker).
            return
        try:
            running = driver._num_yielded < len(driver)
        except (AttributeError, TypeError):  # gone (None), or another torch's iterator: judge by what was drawn
            running = self._drawn < self._share() - self._offset
        if running:
            log.warn(
                f"this checkpoint records sample {self.progress} of epoch {self.epoch}, but the DataLoader's "
                f"{self._driver_workers} workers fetch batches ahead of the training loop, so the loop has seen "
                "fewer: the resumed run would skip the difference. Iterate sampler.track(loader) (or call "
                "sampler.record_consumed(len(batch)) after taking each batch)",
                once="untracked_workers",
            )


def _warn_epoch_end_unknown(epoch: int) -> None:
    log.warn(
        f"this checkpoint was taken after the last batch of epoch {epoch}, and whether the training loop had "
        "already left that epoch when it saved is not recorded (a checkpoint written before ckptools 0.4.0, a loop "
        "that reports with record_consumed, or persistent DataLoader workers without track()). The run resumes at "
        f"the start of epoch {epoch + 1}: exact for a save after the epoch's loop (`for epoch in "
        "range(sampler.epoch, epochs): ...; scheduler.step(); manager.save(...)`, or `start_epoch = ckpt['epoch'] + "
        f"1`), not for a save inside the batch loop at that last batch, whose end-of-epoch code (a scheduler "
        f"stepped per epoch, validation) epoch {epoch} then never runs. Iterate sampler.track(loader): the "
        "checkpoint then records which it was",
        once="epoch_end_unknown",
    )


def note_rng_restored(sampler: ResumableDistributedSampler) -> None:
    """Called by `ckptools.load` right after it restored this process's RNG states."""
    sampler._rng_after_restore = torch.get_rng_state()


def draw_seeded(sampler: ResumableDistributedSampler) -> None:
    """From now on ``sampler`` yields indices carrying its seed and epoch (`ckptools.rng.SampleIndex`)."""
    sampler._seeded = True
