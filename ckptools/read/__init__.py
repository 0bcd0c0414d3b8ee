"""The read wing: a checkpoint back into a job, from any layout, once or by every rank.

===================  ==========================================================================
module               its one job
===================  ==========================================================================
loading.py           `load` (a checkpoint into objects, who reads decided once) and
                     `load_state_dict` (the weights alone)
restoring.py         a loaded tree into the caller's objects: models, optimizers, samplers, RNG,
                     `PerRank` entries, a ZeRO optimizer's own partition
once.py              ``read="once"``: each rank reads about 1/N of a file and receives the rest
remote_zip.py        an object in a store read in ranges: its directory and a local stand-in
loaded.py            what a tree torch loaded holds (ckptools' metadata, the weights, placeholders)
===================  ==========================================================================

The operations and the integrations import from this package, never from its modules; it reads
bytes through the layouts' face (`ckptools.layouts`) and the storage door. Its names are imported on
first use (PEP 562): what a loaded tree holds (`loaded_weights`) is asked by readers that import no
torch (``ckpt info``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names resolve to, for type checkers
    from .loaded import LIGHTNING_VERSION_KEY, META_KEY, loaded_weights, placeholder_name
    from .loading import load, load_state_dict
    from .once import ReadAnotherWay, once_pays, plan_reads, read_once
    from .remote_zip import check_in_ranges, reads_in_ranges
    from .restoring import restore_rank_rng

_LAZY = {
    "LIGHTNING_VERSION_KEY": ".loaded",
    "META_KEY": ".loaded",
    "ReadAnotherWay": ".once",
    "check_in_ranges": ".remote_zip",
    "reads_in_ranges": ".remote_zip",
    "load": ".loading",
    "load_state_dict": ".loading",
    "loaded_weights": ".loaded",
    "once_pays": ".once",
    "placeholder_name": ".loaded",
    "plan_reads": ".once",
    "read_once": ".once",
    "restore_rank_rng": ".restoring",
}

__all__ = [
    "LIGHTNING_VERSION_KEY",
    "META_KEY",
    "ReadAnotherWay",
    "check_in_ranges",
    "load",
    "load_state_dict",
    "loaded_weights",
    "once_pays",
    "placeholder_name",
    "plan_reads",
    "read_once",
    "reads_in_ranges",
    "restore_rank_rng",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptools.read' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value
