"""Pure state-dict transforms: the ``module.`` prefix and unwrapping DDP/compile wrappers."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    import torch

__all__ = ["add_prefix", "strip_prefix", "unwrap_model"]

M = TypeVar("M", bound="Mapping[Any, Any]")


def _copy_mapping(state_dict: Mapping[str, Any], items: list[tuple[str, Any]]) -> Any:
    # Keep the caller's mapping type (OrderedDict from state_dict(), plain dict from json, ...).
    try:
        out = type(state_dict)(items)  # type: ignore[call-arg]  # dict, OrderedDict and the like
    except TypeError:
        out = dict(items)
    return out


def _refuse_collisions(state_dict: Mapping[str, Any], items: list[tuple[Any, Any]], what: str) -> None:
    """Raise when two keys of ``state_dict`` are renamed to one (a value would be lost)."""
    if len({k for k, _ in items}) == len(items):
        return
    first: dict[Any, Any] = {}
    for old, (new, _) in zip(state_dict, items):
        if new in first:
            raise ValueError(
                f"{what} would give {first[new]!r} and {old!r} the same name {new!r}, and one tensor would be lost; "
                "rename or drop one of them first (nothing was changed)"
            )
        first[new] = old


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty string such as 'module.', got {prefix!r}")


def strip_prefix(state_dict: M, prefix: str = "module.") -> M:
    """Return a copy of ``state_dict`` with ``prefix`` removed once from every key that has it.

    Keys without the prefix are kept unchanged. The ``_metadata`` attribute that
    ``nn.Module.state_dict()`` attaches (per-module versions, used by BatchNorm and others when
    loading) is carried over with its keys renamed exactly as torch's
    ``consume_prefix_in_state_dict_if_present`` renames them: the bare ``module`` entry becomes
    the root ``""``. The input is never modified; tensors are shared, not copied. Keys that
    would collide once stripped (``module.w`` beside ``w``) raise ``ValueError`` naming both:
    torch's ``consume_prefix_in_state_dict_if_present`` keeps one of the two tensors silently.
    torch also renames in place, one key after another, so a renamed key can be renamed again on
    the way (``module.module.w`` -> ``module.w`` -> ``w``): here each key loses the prefix once.

    Args:
        state_dict: a mapping of string keys, typically ``ddp_model.state_dict()``.
        prefix: the prefix to remove.

    Returns:
        A new mapping of the same type.

    Examples:
        >>> import ckptools as ck
        >>> ck.strip_prefix({"module.fc.weight": 1, "step": 2})
        {'fc.weight': 1, 'step': 2}
    """
    _check_prefix(prefix)
    items = [(k[len(prefix) :] if isinstance(k, str) and k.startswith(prefix) else k, v) for k, v in state_dict.items()]
    _refuse_collisions(state_dict, items, f"removing the prefix {prefix!r}")
    out = _copy_mapping(state_dict, items)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        # torch's consume_prefix_in_state_dict_if_present, step for step, on a copy: keys are
        # renamed one after another in place, so a renamed key can replace one not yet visited
        # ("module.module" -> "module" before "module" -> ""), and the result depends on that order.
        renamed = _copy_mapping(metadata, [(k, copy.copy(v)) for k, v in metadata.items()])
        bare = prefix.replace(".", "")
        for key in list(renamed.keys()):
            if len(key) == 0:
                continue
            if key == bare or key.startswith(prefix):
                renamed[key[len(prefix) :]] = renamed.pop(key)
        out._metadata = renamed
    return cast(M, out)


def add_prefix(state_dict: M, prefix: str = "module.") -> M:
    """Return a copy of ``state_dict`` with ``prefix`` added to every key that lacks it.

    The inverse of `strip_prefix`, and idempotent: keys that already carry the prefix are
    left alone, so ``add_prefix(add_prefix(sd)) == add_prefix(sd)``. ``w`` beside ``module.w``
    raises ``ValueError`` naming both (one of them would be lost). ``_metadata`` is renamed
    likewise (the root ``""`` becomes the bare ``module`` entry). The input is never modified.

    Args:
        state_dict: a mapping of string keys, typically ``model.state_dict()``.
        prefix: the prefix to add.

    Returns:
        A new mapping of the same type.

    Examples:
        >>> import ckptools as ck
        >>> ck.add_prefix({"fc.weight": 1, "module.fc.bias": 2})
        {'module.fc.weight': 1, 'module.fc.bias': 2}
    """
    _check_prefix(prefix)
    items = [(k if not isinstance(k, str) or k.startswith(prefix) else prefix + k, v) for k, v in state_dict.items()]
    _refuse_collisions(state_dict, items, f"adding the prefix {prefix!r}")
    out = _copy_mapping(state_dict, items)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        bare = prefix[:-1] if prefix.endswith(".") else prefix
        renamed: dict[str, Any] = {}
        for key, value in metadata.items():
            if key == bare or key.startswith(prefix):
                new = key
            elif key == "":
                new = bare
            else:
                new = prefix + key
            renamed[new] = copy.copy(value)
        out._metadata = _copy_mapping(metadata, list(renamed.items()))
    return cast(M, out)


# Prefixes wrappers put in front of a model's keys: DDP/DataParallel, torch.compile, both nested.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module.")


def strip_wrappers(state_dict: M) -> M:
    """Strip every wrapper's prefix (``module.``, ``_orig_mod.``, nested ones first) from the keys having it."""
    for prefix in WRAPPER_PREFIXES[::-1]:
        state_dict = strip_prefix(state_dict, prefix)
    return state_dict


def strip_for_reading(state_dict: M, strip: str | None) -> M:
    """What weights-only readers do with their ``strip`` argument: None keeps the keys; the
    default ``"module."`` removes every wrapper's prefix (DDP's and torch.compile's); any other
    prefix is removed as given."""
    if not strip:
        return state_dict
    return strip_wrappers(state_dict) if strip == "module." else strip_prefix(state_dict, strip)


def shared_prefix(names: Iterable[str]) -> str | None:
    """The first component every name starts with, with its dot (``"net."``), or None.

    A LightningModule holding ``self.net`` saves ``net.0.weight``, ``net.0.bias``, ...: the plain
    network's own names are those without it. None when the names start differently, when one
    has no dot, or when there are none.

    Examples:
        >>> shared_prefix(["net.0.weight", "net.0.bias"]), shared_prefix(["a.w", "b.w"]), shared_prefix(["net"])
        ('net.', None, None)
    """
    heads = set()
    for name in names:
        if "." not in name:
            return None
        heads.add(name.split(".", 1)[0])
    return f"{heads.pop()}." if len(heads) == 1 else None


def tensor_identity(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors one (tied: the same memory viewed the same way, conjugation and
    negation included); None for a tensor with no memory to share (empty, on the meta device,
    sparse or nested).

    Examples:
        >>> import torch
        >>> w = torch.ones(2)
        >>> tensor_identity(w) == tensor_identity(w.view(2)), tensor_identity(w) == tensor_identity(w.clone())
        (True, False)
    """
    import torch

    if tensor.layout != torch.strided or tensor.is_nested or tensor.device.type == "meta" or tensor.numel() == 0:
        return None  # sparse and nested tensors have no one storage to compare
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),
            tensor.dtype, tensor.device, tensor.is_conj(), tensor.is_neg())  # fmt: skip


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Return the plain module under any nesting of DDP, DataParallel and ``torch.compile``.

    Args:
        model: a module, possibly wrapped (``DDP(torch.compile(net))``, ``torch.compile(DDP(net))``, ...).

    Returns:
        The innermost module, whose ``state_dict()`` keys carry no ``module.``/``_orig_mod.`` prefix.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Examples:
        >>> import torch, ckptools as ck
        >>> net = torch.nn.Linear(2, 2)
        >>> ck.unwrap_model(torch.nn.DataParallel(net)) is net
        True
    """
    import torch  # here, not at module level: the key transforms must not need torch (the CLI)

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"unwrap_model expects an nn.Module, got {type(model).__name__}")
    wrappers: tuple[type, ...] = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    while True:
        if isinstance(model, wrappers):
            model = cast(torch.nn.Module, model.module)
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            # torch._dynamo.eval_frame.OptimizedModule; checked by attribute so that importing
            # torch._dynamo (slow) is not needed.
            model = cast(torch.nn.Module, model._orig_mod)
        else:
            return model
