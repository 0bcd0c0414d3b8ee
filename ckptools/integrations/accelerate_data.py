"""An Accelerate-prepared DataLoader that resumes in the middle of an epoch, exactly.

``accelerator.prepare(loader)`` shards the loader's batches (``BatchSamplerShard``), draws each
epoch's order from a generator it keeps in step across processes, and reads one batch ahead.
Accelerate's ``save_state`` keeps none of it: neither where the epoch was nor the generator, so a
resume takes ``skip_first_batches(loader, n)`` with an ``n`` the script works out itself, and a new
order for every later epoch. `ResumableLoader` wraps the prepared loader and is registered for
checkpointing (``save_state`` writes it as ``custom_checkpoint_<i>.pkl``); the next pass after a
``load_state`` draws the saved epoch's order again and starts after the batches the loop had taken:

- **The order**: the innermost sampler's generator (Accelerate's synchronized one; a
  ``RandomSampler`` without one is given one, seeded from the run's seed) is saved as it was when
  the epoch began, and put back before the resumed pass draws from it.
- **The position**: the batches the loop *received* in the epoch (counted as each is handed over,
  not when it was read ahead), skipped by index on resume (``accelerate.skip_first_batches``):
  nothing skipped is read.
- **The workers' base seed**: each pass's loader iterator is lent a generator of (seed, epoch,
  rank), so starting a pass draws nothing from the global torch RNG (which Accelerate restores
  to where the save was: a draw there would shift every later dropout mask).
- **Random augmentation**: a dataset wrapped in `ckptools.SeededDataset` before ``prepare`` gets
  each index with its epoch (`ckptools.rng.SampleIndex`), so item ``i`` of epoch ``e`` is
  augmented alike whichever process reads it and whenever: exact at any worker count, and the
  read-ahead batch leaves the global RNG alone. Without it a resume mid-epoch warns once (a
  dataset that draws random numbers resumes inexactly).

Every process makes and iterates its own; rank 0's state is the one saved (every rank takes the same
number of batches).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data

from .. import log
from ..collective.group import broadcast_object, dist_ready, get_rank
from ..errors import CheckpointFormatError
from ..rng import SampleIndex
from ..training.generator import lent_generator
from ..training.seeded import SeededDataset

try:
    from accelerate import skip_first_batches  # the prepared loader's own index-level skip
except ImportError as err:  # pragma: no cover - the interop extra
    raise ImportError("ckptools.integrations.accelerate_data needs Accelerate: pip install accelerate") from err

__all__ = ["ResumableLoader", "resumable"]

_END = object()
_KEYS = ("epoch", "batches", "generator", "seed")


class _EpochIndices(torch.utils.data.Sampler[int]):
    """The sampler ``inner`` whose indices carry the owner's seed and epoch (for a `SeededDataset`)."""

    def __init__(self, inner: Any, owner: ResumableLoader) -> None:
        self.inner, self.owner = inner, owner

    def __iter__(self) -> Iterator[int]:
        seed, epoch = self.owner.seed, self.owner.epoch
        for index in self.inner:
            yield SampleIndex(int(index), seed, epoch)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:  # set_epoch, generator, data_source: the inner sampler's
        if name in ("inner", "owner"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def _innermost(loader: Any) -> tuple[Any, Any]:
    """The batch sampler that holds the index sampler, and that sampler (Accelerate nests
    ``BatchSamplerShard`` or ``SkipBatchSampler`` around the loader's own ``BatchSampler``)."""
    holder = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    for _ in range(8):
        inner = getattr(holder, "batch_sampler", None)
        if inner is None:
            break
        holder = inner
    sampler = getattr(holder, "sampler", None)
    if sampler is None:
        raise TypeError(
            f"ResumableLoader: {type(loader).__name__} has no index sampler inside its batch sampler "
            "(an IterableDataset, or a custom batch_sampler): it cannot be resumed by index"
        )
    return holder, sampler


class ResumableLoader:
    """A prepared Accelerate DataLoader that resumes mid-epoch exactly (see the module docstring).

    Iterate it where the loop iterated the prepared loader; `epoch` is the epoch the current (or
    next) pass belongs to, the one a resumed script starts its epoch loop at. Register it with
    ``accelerator.register_for_checkpointing`` before ``load_state`` (`resumable` does both).

    Examples:
        >>> import torch
        >>> loader = torch.utils.data.DataLoader(range(6), batch_size=2, shuffle=True)
        >>> data = ResumableLoader(loader, seed=0)
        >>> it = iter(data); first = next(it)  # the loop took one batch of three, then was killed
        >>> resumed = ResumableLoader(torch.utils.data.DataLoader(range(6), batch_size=2, shuffle=True), seed=0)
        >>> resumed.load_state_dict(data.state_dict())
        >>> len([b for b in resumed]), resumed.epoch  # the two batches the first pass had not taken
        (2, 1)
    """

    def __init__(self, loader: Any, *, seed: int | None = None) -> None:
        self.loader = loader
        if seed is None:
            dataset = getattr(loader, "dataset", None)
            seed = dataset.seed if isinstance(dataset, SeededDataset) else torch.initial_seed()
            if dist_ready():  # one seed for the job: rank 0's
                seed = int(broadcast_object(int(seed)))
        self.seed = int(seed)
        self._epoch = int(getattr(loader, "iteration", 0) or 0)
        self._consumed = 0
        self._inside = False
        self._start: torch.Tensor | None = None  # the order's generator as the current pass began
        self._pending: dict[str, Any] | None = None  # a loaded state the next pass resumes
        holder, sampler = _innermost(loader)
        if isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None:
            # It would draw each epoch's order from the global RNG, at a point a resume cannot replay.
            sampler.generator = torch.Generator().manual_seed(self.seed)
        self._sampler = sampler
        if isinstance(getattr(loader, "dataset", None), SeededDataset) and not isinstance(sampler, _EpochIndices):
            holder.sampler = _EpochIndices(sampler, self)

    @property
    def epoch(self) -> int:
        """The epoch of the current pass, or of the next one between passes (a restored one included)."""
        return self._epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        # The prepared loader's own attributes (batch_size, dataset, total_batch_size, ...); never this
        # wrapper's (absent only while it is being made).
        if name.startswith("_") or name in ("loader", "seed"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def _generator(self) -> torch.Generator | None:
        generator = getattr(self._sampler, "generator", None)
        return generator if isinstance(generator, torch.Generator) else None

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the batches the loop took in it, the order's generator as the epoch began, the seed."""
        if self._pending is not None:  # restored and not iterated yet: pass it on unchanged
            return dict(self._pending)
        generator = self._generator()
        if self._inside:
            start, batches = self._start, self._consumed
        else:
            start, batches = (generator.get_state() if generator is not None else None), 0
        return {"epoch": self._epoch, "batches": batches, "generator": start, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (`state_dict`'s) with the next pass.

        Raises:
            CheckpointFormatError: ``state`` is not a `ResumableLoader`'s.
        """
        if not isinstance(state, dict) or any(key not in state for key in _KEYS):
            raise CheckpointFormatError(
                f"ResumableLoader.load_state_dict: expected a dict with {', '.join(_KEYS)}, got "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}: register the same objects "
                "for checkpointing, in the same order, as the run that saved"
            )
        self._pending = dict(state)
        self.seed = int(state["seed"])
        self._epoch, self._consumed, self._inside = int(state["epoch"]), 0, False
        if hasattr(self.loader, "iteration"):
            self.loader.iteration = self._epoch

    def __iter__(self) -> Iterator[Any]:
        skip = 0
        generator = self._generator()
        if self._pending is not None:
            state, self._pending = self._pending, None
            skip = int(state["batches"])
            if generator is not None and state["generator"] is not None:
                generator.set_state(state["generator"])
        elif hasattr(self.loader, "iteration"):
            self._epoch = int(self.loader.iteration)
        epoch = self._epoch
        self._start = generator.get_state() if generator is not None else None
        self._consumed, self._inside = skip, True
        if skip and skip >= len(self.loader):  # saved after the pass's last batch: the pass is over
            # Not iterated (an empty prepared loader yields None in Accelerate 1.7); its order is drawn all the
            # same, so the next epoch's draws from the generator where the uninterrupted run's did.
            for _ in self._sampler:
                pass
            self._finished(epoch)
            return
        if skip:
            self._warn_unseeded()
        source = self.loader
        if skip:
            source = skip_first_batches(self.loader, skip)
        it = iter(source)
        base = getattr(source, "base_dataloader", source)
        # Accelerate's iterator starts (syncs the generator, makes the loader iterator) at its first next().
        with lent_generator(base, key=(self.seed, epoch, get_rank())):
            batch = next(it, _END)
        while batch is not _END:
            self._consumed += 1  # before the loop has it: a save while it works on it counts it
            yield batch
            batch = next(it, _END)
        self._finished(epoch)

    def _finished(self, epoch: int) -> None:
        self._inside, self._consumed, self._epoch = False, 0, epoch + 1
        if hasattr(self.loader, "iteration"):
            self.loader.iteration = epoch + 1

    def _warn_unseeded(self) -> None:
        dataset = getattr(self.loader, "dataset", None)
        if isinstance(dataset, (SeededDataset, torch.utils.data.TensorDataset)):
            return
        log.warn(
            f"epoch {self._epoch} resumes after batch {self._consumed}: if {type(dataset).__name__}.__getitem__ "
            "draws random numbers (augmentation), its items from here on are drawn differently than in the "
            "uninterrupted run (Accelerate reads a batch ahead, and workers start afresh), and this resume is not "
            "bit-exact. Wrap the dataset before prepare: DataLoader(ck.SeededDataset(dataset, seed=seed), ...); if "
            "it draws none, ignore this warning",
            once="accelerate-unseeded",
        )


def resumable(accelerator: Any, loader: Any) -> ResumableLoader:
    """``loader`` (as ``accelerator.prepare`` returned it) made a `ResumableLoader` and registered with
    ``accelerator.register_for_checkpointing``: call it before ``load_state``, on every process.

    Examples:
        >>> from ckptools.integrations.accelerate_data import resumable
        >>> train_dataloader = resumable(accelerator, train_dataloader)  # doctest: +SKIP
    """
    wrapped = ResumableLoader(loader)
    accelerator.register_for_checkpointing(wrapped)
    return wrapped
