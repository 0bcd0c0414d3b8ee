"""Exact resume inside Lightning and Fabric: `ExactResume` (every rank's random streams) beside
`ckptools.ResumableDataLoader` (the position in the epoch).

    >>> from ckptools.integrations.lightning import ExactResume  # doctest: +SKIP
    >>> checkpoints = ModelCheckpoint(save_last=True, every_n_train_steps=50)  # doctest: +SKIP
    >>> trainer = Trainer(callbacks=[ExactResume(), checkpoints])  # doctest: +SKIP

What Lightning restores of a checkpoint (weights, optimizers, schedulers, its loops' counters, and a
train loader's ``state_dict`` when it has one) leaves two things out, and each breaks a resume with
randomness:

- the random streams (torch CPU and CUDA, numpy, python) of every rank: dropout, a sampler that
  draws from the global RNG, and anything else random continue from wherever the relaunch left
  them. `ExactResume` saves every rank's streams into the checkpoint (an all-gather as the
  checkpoint is made, on every rank) and puts each rank's back when training starts, after
  Lightning's own set-up drew from them;
- the position in the epoch: a plain DataLoader restarts the epoch (or Lightning skips batches).
  A `ckptools.ResumableDataLoader` is a loader with ``state_dict``, which Lightning saves and
  restores with its loops.

Validation inside ``fit`` draws from the global RNG (every ``iter`` of a DataLoader draws its
workers' base seed), and a run resumed right after a checkpoint does not repeat the validation that
followed it: with `ExactResume` a validation leaves the streams as it found them (captured at each
``on_train_batch_end``, put back at ``on_validation_end``), so training draws the same numbers
whether or not, and however often, validation ran.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from typing import Any

from .. import log, rng
from ..collective.arrival import checked_in
from ..collective.group import all_gather_object, get_world_size
from ..errors import CheckpointError
from ..owned.gradients import track
from ..read import restore_rank_rng
from ..training.loader import ResumableDataLoader
from ..write import compare_replicas, plain_optimizer, replica_digests, replica_module, replicas_switch
from . import NEEDS_LIGHTNING, installed, lightning_classes, release_numbers

__all__ = ["ExactResume"]

_CALLBACKS = lightning_classes("Callback", "pytorch_lightning.callbacks", "lightning.pytorch.callbacks")
# Fabric alone (lightning_fabric without the Trainer) needs no base: fabric.save and fabric.load
# take any object with state_dict and load_state_dict.
_BASE: type = _CALLBACKS[0] if _CALLBACKS else object
if not _CALLBACKS and not any(importlib.util.find_spec(name) for name in ("lightning_fabric", "lightning")):
    raise ImportError(NEEDS_LIGHTNING)

# The oldest Lightning whose resumes ExactResume makes exact, measured: with 2.4.0 the killed-and-
# resumed fits of tests/test_lightning_resume.py end with other weights than the uninterrupted one;
# with 2.5.0 (make compat's old end) and every later release tried they are bit-identical.
OLDEST_LIGHTNING = (2, 5)
# The newest Lightning the loop-counter corrections below were verified with (2.6.6). On a newer one
# they run only where the loop still has the counters they assume (checked at run time, else skipped
# with a warning), never written blindly.
NEWEST_VERIFIED = (2, 6)


def _lightning_release() -> tuple[str, str]:
    """The distribution that holds the Trainer this module uses (Fabric's where there is none), and its version."""
    module = _BASE.__module__.split(".")[0] if _CALLBACKS else "lightning_fabric"
    for dist in {"pytorch_lightning": ("pytorch-lightning",), "lightning": ("lightning",)}.get(
        module, ("lightning-fabric", "lightning")
    ):
        found = installed(dist)
        if found is not None:
            return dist, found
    return "lightning", "unknown"


def _counters_missing(trainer: Any) -> list[str]:
    """What the loop-counter corrections assume of Lightning's loops (as in 2.5 and 2.6) and this
    trainer's loops lack; empty when all is there."""
    fit_loop = getattr(trainer, "fit_loop", None)
    epoch_loop = getattr(fit_loop, "epoch_loop", None)
    current = getattr(getattr(epoch_loop, "batch_progress", None), "current", None)
    wanted = {
        "fit_loop.epoch_progress.increment_ready": getattr(getattr(fit_loop, "epoch_progress", None),
                                                           "increment_ready", None),
        "fit_loop.restarted_mid_epoch": getattr(fit_loop, "restarted_mid_epoch", None),
        "fit_loop.epoch_loop.restarted_on_train_batch_end": getattr(epoch_loop, "restarted_on_train_batch_end", None),
        "fit_loop.epoch_loop.batch_progress.is_last_batch": getattr(getattr(epoch_loop, "batch_progress", None),
                                                                    "is_last_batch", None),
        **{f"fit_loop.epoch_loop.batch_progress.current.{n}": getattr(current, n, None)
           for n in ("ready", "started", "processed", "completed")},
    }  # fmt: skip
    return [name for name, value in wanted.items() if value is None]


def _counters_as_verified(trainer: Any) -> bool:
    """Whether the loop-counter corrections may run: the loops have what they assume. On a Lightning
    newer than `NEWEST_VERIFIED`, said once either way."""
    missing = _counters_missing(trainer)
    dist, found = _lightning_release()
    numbers = release_numbers(found)
    if missing:
        log.warn(
            f"{dist} {found}'s loops lack {', '.join(missing)}, which ExactResume's corrections of Lightning's "
            f"counts after a resume assume (verified with 2.5 to {'.'.join(map(str, NEWEST_VERIFIED))}): they are "
            "skipped, so a resume from an epoch's last batch or on another world size may count batches as Lightning "
            "alone does",
            once="exact_resume_counters",
        )
        return False
    if len(numbers) == 2 and numbers > NEWEST_VERIFIED:
        log.warn(
            f"ExactResume's corrections of Lightning's counts after a resume were verified with 2.5 to "
            f"{'.'.join(map(str, NEWEST_VERIFIED))}; {dist} {found} has the counters they assume, so they run",
            once="exact_resume_newer",
        )
    return True


def check_lightning_version() -> None:
    """Raise `CheckpointError` where the installed Lightning is older than ExactResume was made exact for."""
    dist, found = _lightning_release()
    numbers = release_numbers(found)
    if len(numbers) == 2 and numbers < OLDEST_LIGHTNING:
        wanted = ".".join(map(str, OLDEST_LIGHTNING))
        raise CheckpointError(
            f"ExactResume needs {dist} >= {wanted}, found {found}: fits resumed with older releases were measured "
            f"to end with other weights than a fit never stopped. Upgrade: pip install '{dist}>={wanted}'"
        )


class ExactResume(_BASE):  # type: ignore[misc,valid-type,unused-ignore]  # a class from a list: Any to mypy
    """Every rank's random streams in the checkpoint, put back where the run resumes: with
    `ckptools.ResumableDataLoader`, ``fit(..., ckpt_path="last")`` after a kill at any step is
    bit-identical to a run never killed.

    **Lightning**: add it to the ``Trainer``'s callbacks and return a `ckptools.ResumableDataLoader`
    from ``train_dataloader()``. Each checkpoint then holds every rank's streams (torch CPU and
    CUDA, numpy, python; gathered on every rank as the checkpoint is made), and ``fit`` resumed
    from it puts each rank's back in ``on_train_start``. Restored on another number of ranks, the
    streams are not restored (a rank's streams mean nothing to another rank: a warning says so) and
    the loader deals the rest of the epoch out to the new ranks (every sample once). At the start
    of training it checks what it cannot fix itself and says so: a train loader that is not
    resumable (a warning: mid-epoch resumes restart or skip the epoch) or that was built for another
    number of ranks (an error).

    Under DDP the same exchange compares the ranks' replicas of the model and the optimizers (``replicas=``:
    ``"auto"`` and ``"all"`` every byte, `ckptools.check_replicas`'s; ``"sample"`` a rotating 1/50; ``"off"``
    none): when one rank's copy changed alone, `ReplicaMismatchError` on every rank before anything is
    written. ``check_replicas=False``, the old spelling of ``"off"``, warns and goes in 0.6.

    **Fabric**: put it in the state you save and load, beside the loader; ``fabric.load`` puts the
    streams back at once (call it last, right before the loop). Give it the model and the optimizer
    (``compare``) for the replicas' comparison; Fabric has no trainer to find them in::

        resume = ExactResume(compare={"model": model, "optimizer": optimizer})
        state = {"model": model, "optimizer": optimizer, "loader": loader, "rng": resume}
        fabric.save(path, state)  # every rank, as Fabric requires
        fabric.load(path, state)

    Examples:
        >>> from ckptools.integrations.lightning import CkptoolsCheckpointIO, ExactResume  # doctest: +SKIP
        >>> trainer = Trainer(plugins=[CkptoolsCheckpointIO()], callbacks=[ExactResume(),  # doctest: +SKIP
        ...     ModelCheckpoint(dirpath="ckpt", save_last=True, every_n_train_steps=100)])
        >>> trainer.fit(model, ckpt_path="last")  # doctest: +SKIP
    """

    def __init__(
        self, compare: Mapping[str, Any] | None = None, *, replicas: str = "auto", check_replicas: bool | None = None
    ) -> None:
        track()  # the optimizer steps watched from here: an open accumulation window's gradients
        check_lightning_version()
        super().__init__()
        # DDP's replicas compared in the checkpoint's exchange: the Trainer's (setup), or Fabric's objects.
        self._compare = dict(compare) if compare is not None else None
        self.replicas = replicas_switch(replicas, "ExactResume", check_replicas=check_replicas)
        self._trainer: Any = None
        self._restored: dict[str, Any] | None = None  # the checkpoint's state, until training starts
        self._before_validation: tuple[Any, Any] | None = None
        self._lent: list[Any] = []  # validation loaders lent a generator between the restore and the first batch
        self._resumed_without_streams = False

    @property
    def state_key(self) -> str:
        """Where Lightning keeps this callback's state in a checkpoint (``checkpoint["callbacks"]``)."""
        return "ckptools.ExactResume"

    @checked_in("ExactResume.state_dict")
    def state_dict(self) -> dict[str, Any]:
        """Every rank's random streams, by rank: a collective (Lightning makes a checkpoint on
        every rank, Fabric's ``save`` runs on every rank), of weights-only types. Under DDP the same
        exchange compares the replicas (every byte, `ckptools.check_replicas`): when they differ,
        `ReplicaMismatchError` on every rank before anything is written."""
        mode = "all" if self.replicas == "auto" else self.replicas  # a durable save: every byte
        skip = COMPARED_BY_SNAPSHOT[0] or mode == "off"
        objects = None if skip else replicas_to_compare(self._trainer, self._compare)
        digests = replica_digests(objects, sample=mode == "sample") if objects else None
        gathered = all_gather_object((rng.get_rng_state(), digests))
        if digests is not None:
            failure = compare_replicas([theirs for _, theirs in gathered])
            if failure is not None:
                raise failure
        states = [state for state, _ in gathered]
        return {"rng": states, "world_size": len(states)}

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Remember the ``Trainer``: its DDP model and optimizers are compared as each checkpoint is made."""
        self._trainer = trainer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put this rank's streams back now (Fabric's ``load``); inside ``fit`` once more when
        training starts (`on_train_start`), after Lightning's set-up has drawn from them."""
        self._restored = state
        self._put_back(state, warn=False)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Note a checkpoint that holds no state of this callback (saved without it)."""
        self._resumed_without_streams = self.state_key not in (checkpoint.get("callbacks") or {})

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Check the train loaders; put back the streams of the checkpoint ``fit`` resumed from."""
        _check_loaders(trainer)
        _load_the_stashed_loader_states(trainer)
        counters = _counters_as_verified(trainer)
        if counters:
            _count_the_new_epoch(trainer)
        state, self._restored = self._restored, None
        if state is not None:
            self._put_back(state, warn=True)
            if state.get("world_size", trainer.world_size) != trainer.world_size and counters:
                _recount_the_resumed_epoch(trainer)
            # Resumed at a batch after which validation was due, Lightning does not repeat that
            # validation but fast-forwards its counters, and in doing so makes each validation
            # loader's iterator, which draws from the global torch stream (the uninterrupted run's
            # validation drew too, and was undone: on_validation_end). Until the first batch, such
            # loaders draw from a generator of their own instead.
            self._lent = _lend_generators(trainer)
        elif self._resumed_without_streams:
            log.warn(
                "the checkpoint fit resumed from holds no random streams of ExactResume (saved without it): dropout "
                "and everything else random continue from the relaunch's streams, so this resume is not bit-exact",
                once="exact_resume_no_rng",
            )

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Take back the generators lent to the validation loaders at the restore."""
        self._take_back()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Take back the generators lent to the validation loaders at the restore."""
        self._take_back()

    def _take_back(self) -> None:
        lent, self._lent = self._lent, []
        for loader in lent:
            loader.generator = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The streams as the batch ends: what a validation run after it puts back."""
        # ~50 µs (numpy's state is the cost); a checkpoint of this batch holds these same streams.
        self._before_validation = rng.capture_streams()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """Put back the streams the training batch before this validation ended with."""
        self._take_back()
        saved, self._before_validation = self._before_validation, None
        if saved is not None and not getattr(trainer, "sanity_checking", False):
            rng.restore_streams(saved)

    def _put_back(self, state: dict[str, Any], *, warn: bool) -> None:
        states = state.get("rng")
        if not isinstance(states, list):
            return
        if len(states) != get_world_size() and not warn:
            return  # said once, when training starts
        restore_rank_rng(
            states,
            "the checkpoint ExactResume restores",
            skip="take ExactResume out of the callbacks to resume without them",
        )


COMPARED_BY_SNAPSHOT = [False]  # True while NodeSnapshots makes its checkpoint: the snapshot compares them


def replicas_to_compare(trainer: Any, objects: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The live objects DDP keeps alike on every rank: a ``Trainer``'s DDP-wrapped model and its
    optimizers, or Fabric's (its modules' DDP, its optimizers); empty under another strategy."""
    if objects is not None:  # Fabric: _FabricModule wraps DDP (_forward_module), _FabricOptimizer the optimizer
        found = {name: getattr(obj, "_forward_module", obj) for name, obj in objects.items()}
        found = {name: getattr(obj, "optimizer", obj) if plain_optimizer(obj) else obj for name, obj in found.items()}
        return {name: obj for name, obj in found.items() if replica_module(obj) or plain_optimizer(obj)}
    model = getattr(getattr(trainer, "strategy", None), "model", None)
    if not replica_module(model):
        return {}
    return {"model": model, **{f"optimizer_{i}": opt for i, opt in enumerate(trainer.optimizers)}}


def _load_the_stashed_loader_states(trainer: Any) -> None:
    """Hand the train loaders the positions the checkpoint saved, where Lightning kept them back.

    A ``configure_optimizers`` that sizes a schedule with ``trainer.estimated_stepping_batches``
    (OneCycleLR, Lightning's own recipe) sets the train loaders up before the checkpoint is restored;
    Lightning then stashes the loaders' saved states and never loads them (Lightning#20550, 2.6):
    the resumed epoch would start again from its first batch while Lightning counts it as partly
    done (samples trained twice, others never). Loaded here, before the first batch, and the loop's
    iterator made anew, as Lightning's own resume does.
    """
    fit_loop = trainer.fit_loop
    if not getattr(fit_loop, "_combined_loader_states_to_load", None) or fit_loop._combined_loader is None:
        return
    fit_loop._load_combined_loader_states()  # only where Lightning would have (a restart mid-epoch)
    fetcher = getattr(fit_loop, "_data_fetcher", None)
    if not fit_loop._combined_loader_states_to_load and fetcher is not None:
        iter(fetcher)


def _count_the_new_epoch(trainer: Any) -> None:
    """Resumed from a checkpoint made at the last batch of an epoch, Lightning (2.6) counts that
    epoch as processed and completed and goes on with the next one as if it were the restored one,
    never counting it as ready and started: the next checkpoint records an epoch that was never
    begun, and a resume from *that* checkpoint runs one epoch more than the run was given,
    repeating the last one's data. Count it, as the uninterrupted run did."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    progress = getattr(fit_loop, "epoch_progress", None)
    if (
        progress is not None
        and getattr(fit_loop, "restarted_mid_epoch", False)
        and getattr(epoch_loop, "restarted_on_train_batch_end", False)
        and epoch_loop.batch_progress.is_last_batch
        and progress.current.ready == progress.current.completed  # Lightning's reset just completed it
    ):
        progress.increment_ready()
        progress.increment_started()


def _recount_the_resumed_epoch(trainer: Any) -> None:
    """Resumed on another number of ranks: count the batches Lightning restored as the loader does.

    Lightning counts an epoch's batches once, at set-up (``len`` of the loader: an epoch at the new
    world size), and resumes its count of the epoch's batches from the checkpoint (batches at the
    old world size). The rest of the epoch, dealt out to the new ranks, is another number of
    batches than what that leaves: the epoch would end before it is consumed (or after). The loader
    counts the batches done as an epoch's less the rest (`ResumableDataLoader.load_state_dict`);
    Lightning's count of the epoch's batches is shifted to it, so the epoch ends at its last batch
    (with validation and the epoch's LR step there). What counts steps (``global_step``) is untouched.
    """
    loader = trainer.train_dataloader
    if not isinstance(loader, ResumableDataLoader):
        return  # several loaders, or another kind: Lightning's count is left as it is
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = loader.state_dict()["batches"] - current.ready
    current.ready += shift
    current.started += shift
    current.processed += shift
    current.completed += shift


def _each(loaders: Any) -> list[Any]:
    """The loaders of what a ``Trainer``'s ``train_dataloader`` or ``val_dataloaders`` is: one
    loader, a list or tuple of them, a dict of them, or None."""
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def _lend_generators(trainer: Any) -> list[Any]:
    """Give each validation DataLoader without a generator one of its own; the loaders lent one."""
    import torch

    lent = []
    for loader in _each(trainer.val_dataloaders):
        if isinstance(loader, torch.utils.data.DataLoader) and loader.generator is None:
            loader.generator = torch.Generator().manual_seed(0)
            lent.append(loader)
    return lent


def _check_loaders(trainer: Any) -> None:
    """Warn about a train loader a mid-epoch resume cannot continue; refuse one built for another
    number of ranks (every rank would see every sample)."""
    for loader in _each(trainer.train_dataloader):
        if isinstance(loader, ResumableDataLoader):
            sampler = loader.resumable_sampler
            if sampler.num_replicas != trainer.world_size or sampler.rank != trainer.global_rank:
                raise ValueError(
                    f"the train ResumableDataLoader was built for rank {sampler.rank} of {sampler.num_replicas}, but "
                    f"this is rank {trainer.global_rank} of {trainer.world_size}: build it in train_dataloader() (the "
                    "process group exists there), or pass num_replicas=trainer.world_size, rank=trainer.global_rank"
                )
        elif not callable(getattr(loader, "state_dict", None)):
            log.warn(
                f"the train loader ({type(loader).__name__}) has no state_dict, so Lightning cannot resume it "
                "mid-epoch (it restarts the epoch's data or skips batches): return ckptools.ResumableDataLoader("
                "dataset, batch_size, shuffle=..., num_workers=...) from train_dataloader() for an exact resume",
                once="exact_resume_loader",
            )
