"""`PerRank`: a value of each rank's own in a checkpoint's state.

Everything else in a state is saved as rank 0 holds it, and every rank gets that back: right for
what DDP keeps equal (weights, optimizer, step), wrong for what each rank holds for itself (the
batch a loop fetched ahead, a per-rank counter, a data shard's cursor). Wrapped in `PerRank`, every
rank's value is gathered into the file (``{"ckptools.per_rank": [rank 0's, rank 1's, ...]}``, an
ordinary list `torch.load(weights_only=True)` reads), and a restore gives each rank its own.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PER_RANK_KEY", "PerRank", "is_per_rank_entry"]

PER_RANK_KEY = "ckptools.per_rank"


class PerRank:
    """A state entry whose value differs per rank: every rank's is saved, each gets its own back.

    Put it in the state given to `ckptools.save`, `ckptools.load` and `CheckpointManager`: on a
    save, each rank's ``value`` is gathered (CPU copies of its tensors); on a restore, ``value``
    becomes this rank's saved value (its tensors on the load's ``map_location``), and the
    checkpoint `ckptools.load` returns holds this rank's value under that name too. The values
    ride the save's opening exchange, so keep them small (a batch, counters), and of the types
    `torch.load(weights_only=True)` reads. A restore with another number of ranks raises
    `CheckpointError`: a value of rank 3 of 4 has no meaning for rank 3 of 6.

    Examples:
        >>> import ckptools as ck
        >>> seen = ck.PerRank(7)  # e.g. the samples this rank skipped
        >>> path = ck.save("/tmp/ckptools-doc-per-rank.pt", {"seen": seen})
        >>> restored = ck.PerRank()
        >>> ck.load(path, {"seen": restored})["seen"], restored.value
        (7, 7)
    """

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


def is_per_rank_entry(entry: Any) -> bool:
    """Whether ``entry`` (as read from a file) holds one value per rank.

    Examples:
        >>> is_per_rank_entry({"ckptools.per_rank": [1, 2]}), is_per_rank_entry({"a": 1})
        (True, False)
    """
    return isinstance(entry, dict) and list(entry) == [PER_RANK_KEY] and isinstance(entry[PER_RANK_KEY], list)
