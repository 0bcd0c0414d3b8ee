"""Putting a loaded checkpoint into the objects ``state`` names: `ckptools.load`'s second half.

A model gets its weights whether it and the file carry ``module.`` (or ``_orig_mod.``, or a
shared leading component) or not, decided against the model's own keys, and its tied weights
filled; every other object its entry through ``load_state_dict``; this rank its RNG on a resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data.distributed import DistributedSampler

from .. import log, rng
from ..collective.group import get_rank, get_world_size
from ..errors import CheckpointError, CheckpointFormatError, KeyMismatchError, UnsafeCheckpointError
from ..owned.gradients import restore_counter, restore_gradients
from ..owned.zero import prefetch_partition
from ..per_rank import PER_RANK_KEY, PerRank, is_per_rank_entry
from ..state_dict import (
    WRAPPER_PREFIXES,
    add_prefix,
    shared_prefix,
    strip_prefix,
    strip_wrappers,
    tensor_identity,
    unwrap_model,
)
from ..write import adopt_layout
from .loaded import LIGHTNING_VERSION_KEY, META_KEY, loaded_weights, placeholder_name, record_of

__all__ = ["own_value", "restore_all", "restore_rank_rng", "restore_rng_state"]


def _model_keys(model: torch.nn.Module) -> list[str]:
    return list(model.state_dict().keys())


def _prefix_candidates(weights: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """``weights`` with wrapper prefixes stripped or added, and with a leading component every
    key shares (a LightningModule holding ``self.model`` saves ``model.0.weight``) stripped."""

    def renamed(rename: Any, *args: Any) -> list[Mapping[str, Any]]:
        try:
            return [rename(*args)]
        except ValueError:  # two keys would become one: not a candidate
            return []

    bases = [weights, *(w for p in WRAPPER_PREFIXES for w in renamed(strip_prefix, weights, p))]
    found = [*bases, *renamed(add_prefix, weights, "module.")]
    for base in bases:
        head = shared_prefix(base)
        if head is not None:
            inner = strip_prefix(base, head)  # every key has it: no two collide
            found += [inner, *renamed(strip_wrappers, inner)]  # "model._orig_mod.": a compiled inner network
    return found


def _fit_prefix(weights: Mapping[str, Any], target_keys: list[str]) -> Mapping[str, Any]:
    """Strip or add prefixes so ``weights`` match ``target_keys``, judged by the keys themselves.

    Candidates: ``module.``, ``_orig_mod.`` (``torch.compile``) and their nestings stripped,
    ``module.`` added, and a leading component every key shares stripped. A candidate is taken
    only when it makes more keys match, so a model whose own submodule is really named
    ``module`` (or ``_orig_mod``, or ``model``) keeps its keys.
    """
    target = set(target_keys)
    best = weights
    best_hits = len(target.intersection(weights))
    for candidate in _prefix_candidates(weights):
        hits = len(target.intersection(candidate))
        if hits > best_hits:
            best, best_hits = candidate, hits
    return best


def _load_model(model: torch.nn.Module, weights: Mapping[str, Any], *, strict: bool, path: str, name: str) -> None:
    inner = unwrap_model(model)
    target_keys = _model_keys(inner)
    weights = _fit_prefix(weights, target_keys)
    weights = _fill_ties(inner, weights)
    missing = sorted(set(target_keys) - set(weights))
    unexpected = sorted(set(weights) - set(target_keys))
    if strict and (missing or unexpected):
        raise KeyMismatchError(
            f"{path}: entry {name!r} does not match the model: missing keys {_short(missing)}, unexpected keys "
            f"{_short(unexpected)}; check the architecture, or pass strict=False to load the matching keys",
            missing=missing,
            unexpected=unexpected,
        )
    try:
        inner.load_state_dict(weights, strict=strict)
    except RuntimeError as err:  # shape mismatches
        raise KeyMismatchError(f"{path}: entry {name!r} cannot be loaded into the model: {err}") from err


def _fill_ties(model: torch.nn.Module, weights: Mapping[str, Any]) -> Mapping[str, Any]:
    """``weights`` with each key the model ties to a loaded key (the same tensor: transformers'
    ``lm_head.weight`` and ``transformer.wte.weight``) filled from it: files store a tie once."""
    own = model.state_dict(keep_vars=True)
    absent = [k for k in own if k not in weights]
    if not absent:
        return weights
    loaded: dict[tuple[Any, ...], str] = {}
    for k, v in own.items():
        ident = tensor_identity(v) if k in weights else None
        if ident is not None:
            loaded.setdefault(ident, k)
    filled = dict(weights)
    for k in absent:
        ident = tensor_identity(own[k])
        if ident is not None and ident in loaded:
            filled[k] = weights[loaded[ident]]
    return filled


def _short(keys: list[str], limit: int = 10) -> str:
    if not keys:
        return "[]"
    shown = ", ".join(keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}] ({len(keys)})"


def _restore(obj: Any, entry: Any, *, strict: bool, path: str, name: str) -> None:
    if isinstance(obj, PerRank):
        obj.value = own_value(entry, path=path, name=name)
    elif isinstance(obj, torch.nn.Module):
        if not isinstance(entry, Mapping):
            raise CheckpointFormatError(f"{path}: entry {name!r} is a {type(entry).__name__}, not a model state dict")
        _load_model(obj, entry, strict=strict, path=path, name=name)
    elif isinstance(obj, torch.Tensor):
        with torch.no_grad():
            obj.copy_(entry)
    elif restore_counter(obj, entry):  # an Accelerate Accelerator: the window's position
        pass
    elif callable(getattr(obj, "load_state_dict", None)):
        prefetch_partition(obj, entry)  # a ZeRO optimizer: read its own partition's pages, not its neighbours'
        obj.load_state_dict(entry)
    elif isinstance(obj, DistributedSampler):
        obj.set_epoch(int(entry["epoch"]))


def _find_weights(ckpt: Any, *, key: str | None, path: str) -> Mapping[str, Any]:
    """The model weights inside a loaded checkpoint (see `ckptools.read.loaded.loaded_weights`)."""
    return loaded_weights(ckpt, key, path)


# What Lightning's Trainer.save_checkpoint writes (lightning/pytorch/trainer/connectors/checkpoint_connector.py).
_LIGHTNING_LISTS: tuple[tuple[str, tuple[type, ...], str], ...] = (
    ("optimizer_states", (torch.optim.Optimizer,), "optimizer"),
    ("lr_schedulers", (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau), "scheduler"),
)


def _lightning_entries(ckpt: Mapping[str, Any], state: Mapping[str, Any], path: str) -> dict[str, Any]:
    """For a Lightning checkpoint: the entry of each optimizer and LR scheduler in ``state``.

    Lightning keeps them in lists (``optimizer_states[i]``, ``lr_schedulers[i]``, in the order
    ``configure_optimizers`` returned them). An optimizer named as the list (``{"optimizer_states":
    opt}``) takes its only element; otherwise the optimizers of ``state`` the file has no entry for
    take the list's elements in their order in ``state``, and so do the schedulers.
    """
    if LIGHTNING_VERSION_KEY not in ckpt:
        return {}
    found: dict[str, Any] = {}
    for key, types, what in _LIGHTNING_LISTS:
        stored = ckpt.get(key)
        if not isinstance(stored, list):
            continue
        named = key in state and isinstance(state[key], types)
        if named:
            if len(stored) != 1:
                raise CheckpointFormatError(
                    f"{path}: {key} holds {len(stored)} {what}s' states; name each {what} in state under a name of "
                    f"its own, in the order configure_optimizers returned them (they take {key}[0], [1], ...)"
                )
            found[key] = stored[0]
            continue
        wanted = [name for name, obj in state.items() if isinstance(obj, types) and name not in ckpt]
        if len(wanted) > len(stored):
            raise KeyMismatchError(
                f"{path} is a Lightning checkpoint with {len(stored)} {what} state(s) in {key}, and state names "
                f"{len(wanted)} {what}s ({', '.join(wanted)}); pass as many as configure_optimizers returned",
                missing=wanted[len(stored) :],
            )
        found.update(zip(wanted, stored))
    return found


def own_value(entry: Any, *, path: str, name: str) -> Any:
    """This rank's value of a per-rank entry (`PerRank`).

    Raises:
        CheckpointFormatError: ``entry`` holds no value per rank.
        CheckpointError: it holds one per rank of another number of ranks.
    """
    if not is_per_rank_entry(entry):
        raise CheckpointFormatError(
            f"{path}: entry {name!r} holds one value for every rank (a {type(entry).__name__}), not one per rank: "
            f"restore it as state[{name!r}] = the object it was, or save it as ck.PerRank(...)"
        )
    values = entry[PER_RANK_KEY]
    world = get_world_size()
    if len(values) != world:
        raise CheckpointError(
            f"{path}: entry {name!r} holds one value per rank for {len(values)} ranks, and this job has {world}: a "
            f"rank's own value has no meaning for the ranks of another world size. Leave {name!r} out of the state "
            "to restore (it is in the checkpoint load returns, every rank's), or resume with the same number of ranks"
        )
    return values[get_rank()]


def _adopt_buckets(ckpt: Mapping[str, Any], state: Mapping[str, Any], path: str) -> None:
    """Each DDP model of ``state`` reduces on the gradient buckets its saving run had
    (`ckptools.write.buckets`): at 3 ranks or more the resume is then bit-exact; where that cannot be
    done, a warning says why (at 2 ranks the layout changes no bit, and nothing is said)."""
    record = record_of(ckpt, path)
    layouts = record.ddp_buckets if record is not None else None
    if layouts is None:
        return
    for name, layout in layouts.items():
        obj = state.get(name)
        if obj is None:
            continue
        why = adopt_layout(obj, layout)
        if why is not None and get_world_size() > 2:
            log.warn(
                f"{path}: DDP model {name!r} reduces its gradients on another bucket layout than the run that saved "
                f"it ({why}): at {get_world_size()} ranks its weights may then differ from an uninterrupted run's "
                "in the last bits. For a bit-exact resume, restore before the first step and leave the reducer as "
                "DDP makes it (docs/guarantees.md, 'Bit-exact resume')",
                once=f"buckets:{name}",
            )


def restore_all(ckpt: dict[str, Any], state: Mapping[str, Any], *, strict: bool, path: str) -> None:
    models = [name for name, obj in state.items() if isinstance(obj, torch.nn.Module)]
    lightning = _lightning_entries(ckpt, state, path)
    for name, obj in state.items():
        if name in lightning:
            entry = lightning[name]
        elif name in ckpt:
            entry = ckpt[name]
        elif META_KEY not in ckpt and len(models) == 1 and name == models[0]:
            # A file written without ckptools: the weights may be bare or nested (a Lightning checkpoint's
            # "state_dict", whose LightningModule attribute _load_model fits to the model's keys).
            try:
                entry = _find_weights(ckpt, key=None, path=path)
            except CheckpointFormatError:
                raise CheckpointFormatError(
                    f"cannot find model weights in {path}: entries are {sorted(map(str, ckpt))[:20]}; name the entry "
                    f"that holds them in state (ck.load(path, {{'ENTRY': model}})), or for a nested one "
                    f"model.load_state_dict(ck.load_state_dict(path, key='a.b'))"
                ) from None
        elif strict:
            raise KeyMismatchError(
                f"{path} has no entry {name!r} (it has {sorted(map(str, ckpt))}); rename the entry in state, "
                "or pass strict=False to skip it",
                missing=[name],
            )
        else:
            continue
        placeholder = _placeholder_in(entry)
        if placeholder is not None:
            raise UnsafeCheckpointError(
                f"{path}: entry {name!r} needs {placeholder}, which could run arbitrary code, so it was read as an "
                "inert placeholder and cannot be restored. Only for a file you trust: pass weights_only=False"
            )
        try:
            _restore(obj, entry, strict=strict, path=path, name=name)
        except CheckpointError:
            raise
        except (ValueError, KeyError, RuntimeError, TypeError, IndexError) as err:
            hint = ""
            if isinstance(obj, torch.optim.Optimizer) and "parameter group" in str(err):
                # torch's words name the mismatch, not the fix (a group added later, add_param_group).
                hint = "; give the optimizer the parameter groups it had at that save (add_param_group) before loading"
            raise CheckpointFormatError(
                f"{path}: cannot restore entry {name!r} into {type(obj).__name__}: {err}{hint}"
            ) from err
    _adopt_buckets(ckpt, state, path)
    restore_gradients(ckpt, state, path)  # an open accumulation window's sums, each rank its own
    # Each rank's own value of a per-rank entry, in the checkpoint returned too (where the world size allows).
    for name, entry in ckpt.items():
        if is_per_rank_entry(entry) and len(entry[PER_RANK_KEY]) == get_world_size():
            ckpt[name] = entry[PER_RANK_KEY][get_rank()]


def _placeholder_in(entry: Any) -> str | None:
    """The class of the first inert placeholder inside ``entry`` (see `load_without_code`), if any."""

    stack = [entry]
    while stack:
        node = stack.pop()
        name = placeholder_name(node)
        if name is not None:
            return name
        if isinstance(node, Mapping):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple, set, frozenset)):
            stack.extend(node)
    return None


def restore_rng_state(ckpt: dict[str, Any], path: str) -> bool:
    """Restore this rank's RNG states from ``ckpt``; whether they were restored."""
    record = record_of(ckpt, path)
    if record is None or record.rng is None:
        return False
    return restore_rank_rng(record.rng, path)


def restore_rank_rng(states: list[Any], path: str, *, skip: str = "load with restore_rng=False to skip it") -> bool:
    """Put back this rank's entry of ``states`` (every rank's `ckptools.rng.get_rng_state`, by
    rank); whether they were restored. Saved by another number of ranks, nothing is restored (a
    rank's streams mean nothing to another rank) and a warning says so.

    Raises:
        CheckpointFormatError: this rank's entry is not an RNG state; nothing was changed. Its
            message ends with ``skip``, how to go on without the streams.

    Examples:
        >>> import torch
        >>> from ckptools import rng
        >>> states = [rng.get_rng_state()]
        >>> first = torch.rand(1); restore_rank_rng(states, "ckpt.pt"); torch.equal(torch.rand(1), first)
        True
        True
    """
    world = get_world_size()
    if len(states) != world:
        log.warn(
            f"{path} was saved by {len(states)} ranks and is loaded by {world}: RNG states are per rank, "
            "so they are not restored (the run continues, but not bit-exactly)",
        )
        return False
    before = rng.get_rng_state()
    try:
        rng.set_rng_state(states[get_rank()])
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, AttributeError, RuntimeError) as err:
        rng.set_rng_state(before)  # all or nothing: no generator is left half-restored
        raise CheckpointFormatError(
            f"{path}: the RNG state stored for rank {get_rank()} is corrupt ({type(err).__name__}: {err}); {skip}"
        ) from err
    return True
