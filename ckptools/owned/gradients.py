"""Gradient-accumulation windows: what a save or a snapshot keeps of a window that is open.

A loop that steps the optimizer every k batches first sums k batches' gradients into ``.grad``
(under DDP's ``no_sync`` each rank its own, until the window's last backward all-reduces them).
Saved between two steps of such a window, the weights and the optimizer are those of the
window's start, and the sums so far are in no state: a resume from there starts the window over
with nothing summed, and ends it with other weights. So every save and snapshot keeps them:

- **Open or closed.** After every optimizer step (torch's global step post-hook, registered by the
  calls that come before a loop: ``ck.init_distributed``, `CheckpointManager`, `ResumableDistributedSampler` and
  `ResumableDataLoader`, the integrations' classes, and every save, snapshot and load; never by
  ``import ckptools``) each of its parameters' gradient tensor and its version counter are noted: what
  that step consumed. At a save, a parameter's ``.grad`` is open when it is another tensor or
  changed since (a backward added to it), and when a restore put it there; a ``.grad`` of None, or
  the one the last step consumed, is closed: whatever the loop does with it next (``zero_grad``), it
  adds nothing to the weights. A ``.grad`` no step was seen to consume is open when no optimizer of
  the state holds state for its parameter (never stepped: the first window; a plain SGD holds none, so
  its parameters count as never stepped), else closed (ckptools began watching
  after the loop's first steps), and a warning says so once.
- **Kept as each rank's own.** The open gradients of the state's models are saved under
  ``ckptools.gradients`` in `PerRank`'s layout (one dict per rank, ``{entry: {parameter: grad}}``),
  every rank writing its own records as a ZeRO partition is written (rank 0 pickles placeholders
  for the others' tensors, `ckptools.owned.zero`). A closed window costs nothing: the entry is absent.
- **Restored** into ``.grad`` by `ckptools.load` (and every restore built on it), each rank its own.
- **The window's position** is the loop's: a loop that counts batches restores its counter; an
  Accelerate ``Accelerator`` in the state is saved as its ``step`` (what ``accelerator.accumulate``
  counts windows with, as Accelerate's own ``save_state`` keeps it) and put back.

Where every rank cannot write its own records (``writers="rank0"``, an object store, a folder the
ranks do not share) a save inside an open window is refused on every rank, naming the fix; a
snapshot over several nodes skips that call (a node's copy must be whole, and holds only its
ranks'). Why, with the measurements: docs/guides/snapshots.md, "Gradient accumulation".
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from .. import log
from ..collective.group import get_rank, get_world_size
from ..errors import CheckpointError, CheckpointFormatError
from ..per_rank import PER_RANK_KEY
from ..state_dict import unwrap_model
from .zero import TensorMeta, has_partitions, refusal, tensor_meta

__all__ = [
    "GRADIENTS_KEY",
    "GradientsEntry",
    "accumulation_counter",
    "describe_gradients",
    "has_gradients",
    "mark_restored",
    "open_gradients",
    "owned_gradients",
    "owned_refusal",
    "put_back_gradients",
    "restore_counter",
    "restore_gradients",
    "track",
    "with_gradients",
]

GRADIENTS_KEY = "ckptools.gradients"

# Per parameter (by id): (the parameter, the gradient the last step consumed, its version then), weakly.
_CONSUMED: dict[int, tuple[Any, Any, int]] = {}
# Per parameter (by id) whose .grad a restore put back: (the parameter), open until a step consumes it.
_RESTORED: dict[int, Any] = {}
_HOOK: list[Any] = []


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # Every step of every optimizer: about 1 µs per parameter tensor here (docs/guides/snapshots.md).
    consumed, ref = _CONSUMED, weakref.ref
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if _RESTORED:
                _RESTORED.pop(id(param), None)
            # No gradient at the step (a parameter the loss did not reach): one that appears later is unconsumed.
            consumed[id(param)] = (
                ref(param),
                None if grad is None else ref(grad),
                0 if grad is None else grad._version,
            )


def track() -> None:
    """Note what every optimizer step consumes from now on (idempotent; the first save, snapshot
    or restore of a process calls it).

    Examples:
        >>> track(); track()  # registered once
    """
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_after_step))
    if len(_CONSUMED) > 4096:  # parameters of models long gone
        for key in [k for k, (param, _, _) in _CONSUMED.items() if param() is None]:
            del _CONSUMED[key]


def _is_open(param: torch.Tensor) -> bool | None:
    """Whether ``param.grad`` holds sums no step consumed; None when no step was seen at all."""
    grad = param.grad
    if grad is None:
        return False
    restored = _RESTORED.get(id(param))
    if restored is not None and restored() is param:
        return True
    seen = _CONSUMED.get(id(param))
    if seen is None or seen[0]() is not param:
        return None
    if seen[1] is None:  # it had no gradient at the last step (or the restore): all it holds came since
        return True
    return seen[1]() is not grad or grad._version != seen[2]


def mark_restored(state: Mapping[str, Any]) -> None:
    """A restore of ``state``: its models' gradients as they are now are consumed (nothing summed since
    the restore is in them), so a resumed process whose first window is open keeps that window's sums
    at its next save, whether or not it has stepped yet. `put_back_gradients` then marks the saved ones open.

    Examples:
        >>> import torch
        >>> mark_restored({"model": torch.nn.Linear(2, 2)})
    """
    ref = weakref.ref
    for obj in state.values():
        if isinstance(obj, torch.nn.Module):
            for param in unwrap_model(obj).parameters():
                grad = param.grad
                _CONSUMED[id(param)] = (
                    ref(param),
                    None if grad is None else ref(grad),
                    0 if grad is None else grad._version,
                )
                _RESTORED.pop(id(param), None)


def _copied(grad: torch.Tensor) -> bool:
    """Whether a save writes a copy of ``grad`` rather than ``grad`` itself: where it views a larger
    storage (DDP's ``gradient_as_bucket_view``: each would otherwise carry the whole bucket)."""
    return grad.untyped_storage().nbytes() != grad.nbytes or bool(grad.storage_offset()) or not grad.is_contiguous()


def _kept(grad: torch.Tensor) -> torch.Tensor:
    """The tensor a save writes for ``grad`` (`_copied`)."""
    grad = grad.detach()
    return grad.clone(memory_format=torch.contiguous_format) if _copied(grad) else grad


def _kept_meta(grad: torch.Tensor) -> TensorMeta:
    """`_kept`'s tensor described, without making the copy (the opening exchange needs only this)."""
    if _copied(grad):
        return tensor_meta(torch.empty_like(grad, device="meta", memory_format=torch.contiguous_format))
    return tensor_meta(grad)


def _open_gradients(state: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The open gradients of the state's models, as they are (``{entry: {parameter: grad}}``)."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    stepped = {id(param) for obj in state.values() if isinstance(obj, torch.optim.Optimizer)
               for param, values in getattr(obj, "state", {}).items() if values}  # fmt: skip
    for name, obj in state.items():
        if not isinstance(obj, torch.nn.Module):
            continue
        named = list(unwrap_model(obj).named_parameters())
        verdicts = {key: _is_open(param) for key, param in named}
        for key, param in named:  # never stepped by an optimizer of the state: all it holds is unconsumed
            if verdicts[key] is None and id(param) not in stepped:
                verdicts[key] = True
        unseen = [key for key, verdict in verdicts.items() if verdict is None]
        if unseen:
            log.warn(
                f"state[{name!r}] holds gradients no optimizer step was seen to consume ({', '.join(unseen[:3])}"
                f"{', ...' if len(unseen) > 3 else ''}): ckptools notes the steps from its first call that needs "
                "them (ck.init_distributed, a CheckpointManager, a sampler, a save), which came after this loop's "
                "first steps, so they are taken as consumed and not kept. If this save is inside a "
                "gradient-accumulation window, a resume from it starts the window over: call ck.init_distributed "
                "or make the CheckpointManager before the loop",
                once="gradients-unseen",
            )
        grads = {key: param.grad for key, param in named if verdicts[key]}
        if grads:
            sparse = [key for key, grad in grads.items() if grad is not None and grad.layout != torch.strided]
            if sparse:
                raise CheckpointError(
                    f"state[{name!r}] has sparse gradients in an open accumulation window ({', '.join(sparse[:3])}), "
                    "which ckptools cannot keep; save or snapshot after optimizer.step() (once the window closed)"
                )
            found[name] = {key: grad for key, grad in grads.items() if grad is not None}
    return found


def describe_gradients(state: Mapping[str, Any]) -> tuple[dict[str, dict[str, TensorMeta]] | None, str | None]:
    """This rank's part of a save's opening exchange: its open gradients, each described (never its
    data), None when it has none; and what makes them unsavable, to raise on every rank.

    Examples:
        >>> describe_gradients({"step": 3})
        (None, None)
    """
    track()
    try:
        found = _open_gradients(state)
    except CheckpointError as err:
        return None, str(err)
    if found and not any(_is_accelerator(obj) for obj in state.values()):
        steps = _accelerate_window()
        if steps > 1:
            return None, (
                f"a save inside an open accelerator.accumulate window (gradient_accumulation_steps={steps}) holds "
                "the model's gradients summed so far but not the Accelerator, which counts where in the window the "
                "loop is: a resume from it would step the optimizer at other batches. Put the Accelerator in the "
                "state (state['accelerator'] = accelerator), or take Accelerate's snapshots with "
                "ckptools.integrations.accelerate.Snapshots; nothing was written"
            )
    described = {name: {key: _kept_meta(grad) for key, grad in grads.items()} for name, grads in found.items()}
    return described or None, None


def _accelerate_window() -> int:
    """The ``gradient_accumulation_steps`` of the Accelerator this process made (Accelerate's
    ``GradientState``, one per process), 1 without one. Never imports accelerate."""
    import sys

    module = sys.modules.get("accelerate.state")
    shared = getattr(getattr(module, "GradientState", None), "_shared_state", None)
    if not shared:
        return 1
    try:
        return int((shared.get("plugin_kwargs") or {}).get("num_steps", 1))
    except (TypeError, ValueError, AttributeError):
        return 1


class GradientsEntry:
    """The open gradients of every rank as one save sees them on this rank: its ``state_dict()`` is
    ``{PER_RANK_KEY: [rank 0's, rank 1's, ...]}``, this rank's tensors where they are and
    placeholders (``meta``, no memory) for the others'."""

    def __init__(self, own: dict[str, dict[str, torch.Tensor]], described: list[dict[str, dict[str, TensorMeta]]]):
        self.own = own
        self.described = described

    def state_dict(self) -> dict[str, Any]:
        rank = get_rank()
        values: list[Any] = []
        for owner, part in enumerate(self.described):
            if owner == rank:
                values.append(self.own)
            else:
                values.append({n: {k: meta.placeholder() for k, meta in grads.items()} for n, grads in part.items()})
        return {PER_RANK_KEY: values}


def with_gradients(state: Mapping[str, Any], gathered: list[Any]) -> Mapping[str, Any]:
    """``state`` with a `GradientsEntry` under `GRADIENTS_KEY` when any rank's window is open
    (``gathered``: every rank's `describe_gradients`); the same ``state`` otherwise."""
    if not any(gathered):
        return state
    if GRADIENTS_KEY in state:
        raise TypeError(f"{GRADIENTS_KEY!r} is reserved for ckptools' own entry; rename that entry of state")
    own = open_gradients(state)
    return {**state, GRADIENTS_KEY: GradientsEntry(own, [dict(g or {}) for g in gathered])}


def has_gradients(state: Mapping[str, Any]) -> bool:
    """Whether a save of ``state`` (as `with_gradients` made it) keeps open gradients."""
    return isinstance(state.get(GRADIENTS_KEY), GradientsEntry)


def owned_gradients(state: Mapping[str, Any], payload: Mapping[str, Any]) -> dict[int, tuple[int, tuple[Any, ...]]]:
    """Rank 0: each open gradient's storage (by ``_cdata``) in ``payload``, with the rank that owns it
    and where it sits in ``state`` (`ckptools.owned.zero.owned_tensors`' shape)."""
    found: dict[int, tuple[int, tuple[Any, ...]]] = {}
    if not has_gradients(state):
        return found
    for owner, part in enumerate(payload[GRADIENTS_KEY][PER_RANK_KEY]):
        for name, grads in part.items():
            for key, grad in grads.items():
                where = (GRADIENTS_KEY, PER_RANK_KEY, owner, name, key)
                found.setdefault(grad.untyped_storage()._cdata, (owner, where))
    return found


def owned_refusal(state: Mapping[str, Any], obstacle: str, fix: str) -> str:
    """Why a save of ``state`` whose ranks each write their own records (a ZeRO partition, an open
    window's gradients) cannot be done some way: ``obstacle``, and ``fix``.

    Examples:
        >>> "use 'auto', or save after optimizer.step()" in owned_refusal({}, "rank0 does not allow", "use 'auto'")
        True
    """
    if has_partitions(state):
        return refusal(obstacle, fix)
    return (
        "it is inside a gradient-accumulation window: each rank's gradients summed since the last optimizer step "
        f"are its own and each rank writes them, which {obstacle}; {fix}, or save after optimizer.step() (where "
        "the window closes)"
    )


def restore_gradients(ckpt: Mapping[str, Any], state: Mapping[str, Any], path: str) -> bool:
    """Put this rank's saved open gradients back into ``.grad`` of the state's models; whether any
    were. Saved by another number of ranks they are dropped with a warning (a rank's sums mean
    nothing to another rank: that window ends with other weights than the run that saved it).

    Raises:
        CheckpointFormatError: a saved gradient has no parameter, or another shape.
    """
    track()
    mark_restored(state)
    entry = ckpt.get(GRADIENTS_KEY)
    if not isinstance(entry, Mapping) or not isinstance(entry.get(PER_RANK_KEY), list):
        return False
    values = entry[PER_RANK_KEY]
    if len(values) != get_world_size():
        log.warn(
            f"{path} was saved inside a gradient-accumulation window by {len(values)} ranks, and this job has "
            f"{get_world_size()}: each rank's gradients summed so far cannot be shared out again, so they are "
            "dropped and that window ends with other weights than an uninterrupted run's",
            once="gradients-resized",
        )
        return False
    return put_back_gradients(values[get_rank()] or {}, state, path)


def open_gradients(state: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's open gradients of the state's models, as a save writes them (``{entry:
    {parameter: grad}}``; empty when every window is closed), for a writer of its own files.

    Raises:
        CheckpointError: a model holds sparse gradients in an open window.

    Examples:
        >>> open_gradients({"step": 3})
        {}
    """
    track()
    return {name: {key: _kept(grad) for key, grad in grads.items()} for name, grads in _open_gradients(state).items()}


def put_back_gradients(own: Mapping[str, Mapping[str, torch.Tensor]], state: Mapping[str, Any], path: str) -> bool:
    """Put ``own`` (`open_gradients`' shape, read back) into ``.grad`` of the state's models, each open
    until a step consumes it; whether any were.

    Raises:
        CheckpointFormatError: a saved gradient has no parameter, or another shape (naming ``path``).
    """
    track()
    restored = False
    for name, grads in own.items():
        obj = state.get(name)
        if not isinstance(obj, torch.nn.Module):
            continue
        params = dict(unwrap_model(obj).named_parameters())
        for key, saved in grads.items():
            param = params.get(key)
            if param is None or tuple(param.shape) != tuple(saved.shape):
                raise CheckpointFormatError(
                    f"{path}: the saved gradient of {name}.{key} has no parameter of its shape in state[{name!r}]; "
                    "restore into the model that was saved"
                )
            with torch.no_grad():
                if param.grad is not None and param.grad.dtype == saved.dtype:
                    param.grad.copy_(saved)
                else:
                    param.grad = saved.to(device=param.device, copy=True)
            _RESTORED[id(param)] = weakref.ref(param)  # open until a step consumes it
            restored = True
    return restored


def _is_accelerator(obj: Any) -> bool:
    return type(obj).__name__ == "Accelerator" and type(obj).__module__.startswith("accelerate")


def accumulation_counter(obj: Any) -> dict[str, int] | None:
    """An Accelerate ``Accelerator``'s entry in a save: its ``step``, the position in the window
    ``accelerator.accumulate`` counts (None for anything else).

    Examples:
        >>> accumulation_counter(object()) is None
        True
    """
    return {"step": int(obj.step)} if _is_accelerator(obj) else None


def restore_counter(obj: Any, entry: Any) -> bool:
    """Put back an ``Accelerator``'s ``step`` (`accumulation_counter`); whether ``obj`` is one."""
    if not _is_accelerator(obj):
        return False
    obj.step = int(entry["step"])
    return True
