"""How a save's failure on one rank becomes the same error on every rank.

Rank 0 turns what went wrong (its own exception, or another rank's report as a `RankFailure`)
into an *outcome*, a small picklable value that one broadcast carries to every rank; each rank
then raises from it: the state refusal itself (`UnsafeStateError`) or a `CheckpointError`
naming the path and the rank that failed.
"""

from __future__ import annotations

from ..errors import CheckpointError, UnsafeStateError
from .group import broadcast_object

__all__ = ["RankFailure", "outcome_of", "raise_outcome", "share_outcome"]


class RankFailure(Exception):
    """A failure on some rank, as rank 0 learnt it (its text starts with ``rank N:``).

    Examples:
        >>> outcome_of(RankFailure("rank 1: OSError: disk full"))
        (False, 'on rank 1: OSError: disk full')
    """


def outcome_of(error: BaseException | None) -> tuple[bool, str] | None:
    """What every rank needs to raise ``error`` too: whether it is a refusal of the state, and its text."""
    if error is None:
        return None
    if isinstance(error, UnsafeStateError):
        return (True, str(error))
    if isinstance(error, RankFailure):
        return (False, f"on {error}")
    return (False, f"on rank 0: {type(error).__name__}: {error}")


def raise_outcome(outcome: tuple[bool, str] | None, error: BaseException | None, path: str) -> None:
    """Raise the shared outcome (rank 0 chains its own ``error``)."""
    if outcome is None:
        return
    unsafe, message = outcome
    if unsafe:  # the same refusal on every rank: rank 0's own error, the others its text
        if error is not None:
            raise error
        raise UnsafeStateError(message)
    text = f"saving checkpoint {path} failed {message}; earlier checkpoints are untouched"
    if error is not None and not isinstance(error, RankFailure):
        raise CheckpointError(text) from error
    raise CheckpointError(text)


def share_outcome(error: BaseException | None, path: str) -> None:
    """Raise rank 0's ``error`` on every rank (collective; nothing when it is None).

    A failure on rank 0 surfaces everywhere at once instead of leaving the other ranks in a
    barrier until the collective timeout.
    """
    raise_outcome(broadcast_object(outcome_of(error)), error, path)
