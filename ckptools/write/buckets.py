"""DDP's gradient buckets as the saving run had them: recorded in the checkpoint, adopted at a restore.

DDP sums each gradient over the ranks bucket by bucket, and after its first iteration rebuilds its buckets
in the order the gradients became ready (`torch.nn.parallel.DistributedDataParallel`, ``_rebuild_buckets``).
A relaunched job's DDP is new: its first iteration after the restore runs on the initial layout, where the
uninterrupted run had the rebuilt one. An element's place in its bucket decides which rank's part of the
ring allreduce sums it first; at 2 ranks ``a + b == b + a``, at 3 or more the sums are associated another
way and the weights drift by a few ulps. So a save records the rebuilt layout (each bucket's parameter
indices, in the reducer's order) and a restore into a DDP that has not rebuilt yet builds its reducer on
that layout, as torch's own ``DistributedDataParallel.__setstate__`` rebuilds one: the resumed run reduces
exactly as the uninterrupted one did (measured bit-identical at 3, 4 and 8 ranks: docs/guarantees.md).

Examples:
    >>> import torch
    >>> bucket_layout(torch.nn.Linear(2, 2)) is None  # not DDP: nothing to record
    True
"""

from __future__ import annotations

from typing import Any

import torch

# DDP's reducer as torch's own __setstate__ rebuilds it: private, untyped names (Any here)
_DIST: Any = torch.distributed

__all__ = ["adopt_layout", "bucket_layout"]

_CACHE = "_ckptools_bucket_layout"  # set on the DDP object: its layout no longer changes once rebuilt


def bucket_layout(module: Any) -> list[list[int]] | None:
    """The rebuilt bucket layout of a DDP ``module`` (each bucket's parameter indices), or None: not
    DDP, not rebuilt yet (its layout is still the initial one, which a new DDP has too), or a reducer
    this torch does not show. Computed once per DDP object (torch shows a bucket's parameters only
    through a zeroed copy of the bucket, freed at once)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    if not isinstance(module, ddp) or not getattr(module, "_has_rebuilt_buckets", False):
        return None
    cached = module.__dict__.get(_CACHE)
    if cached is not None:
        return list(cached)
    try:
        params, _ = module._build_params_for_reducer()  # type: ignore[no-untyped-call]
        index = {id(p): i for i, p in enumerate(params)}
        buckets = module.reducer._get_zeros_like_grad_buckets()
        layout = [[index[id(p)] for p in bucket.parameters()] for bucket in buckets]
    except (AttributeError, KeyError, RuntimeError, TypeError):  # another torch's reducer: nothing recorded
        return None
    del buckets
    module.__dict__[_CACHE] = layout
    return list(layout)


def adopt_layout(module: Any, layout: Any) -> str | None:
    """Build a DDP ``module``'s reducer on the saved ``layout``; None when done or nothing to do, else
    why it was not (for a warning: the resume may then differ from the uninterrupted run in the last bits).

    Done only where it changes nothing else: a DDP that has not rebuilt its own buckets yet, the same
    parameters, no communication hook (a hook lives on the reducer), neither ``static_graph`` nor
    ``find_unused_parameters`` (DDP rebuilds otherwise there), torch's C++ reducer."""
    ddp = torch.nn.parallel.DistributedDataParallel
    if not isinstance(module, ddp) or not layout:
        return None
    if getattr(module, "_has_rebuilt_buckets", True):
        return None  # it ran already: its own rebuild is the one the run continues with
    reasons = []
    try:
        hook = module._get_ddp_logging_data().get("comm_hook")  # type: ignore[no-untyped-call]  # also a built-in one, which _comm_hooks misses
    except (AttributeError, RuntimeError):
        hook = None
    if getattr(module, "_comm_hooks", None) or hook:
        reasons.append("a communication hook is registered")
    if module.static_graph or module.find_unused_parameters:
        reasons.append("static_graph or find_unused_parameters is set")
    if getattr(module, "_use_python_reducer", False) or getattr(module, "mixed_precision", None) is not None:
        reasons.append("the Python reducer or DDP's mixed precision is in use")
    try:
        params, sparse = module._build_params_for_reducer()  # type: ignore[no-untyped-call]
    except AttributeError:
        return "this torch's DDP does not show its reducer's parameters"
    flat = sorted(i for bucket in layout for i in bucket)
    if flat != list(range(len(params))):
        return f"the checkpoint's layout covers {len(flat)} parameters and this model has {len(params)}"
    if reasons:
        return "; ".join(reasons)
    names = module._build_debug_param_to_name_mapping(params)  # type: ignore[no-untyped-call]
    limits = [module.bucket_bytes_cap] * len(layout)
    real = _DIST._compute_bucket_assignment_by_size

    def assigned(*args: Any, **kwargs: Any) -> tuple[list[list[int]], list[int]]:
        return [list(b) for b in reversed(layout)], limits  # _ddp_init_helper reverses them back

    _DIST._compute_bucket_assignment_by_size = assigned
    try:
        module._ddp_init_helper(params, sparse, names, module.static_graph)  # type: ignore[no-untyped-call]
    finally:
        _DIST._compute_bucket_assignment_by_size = real
    return None
