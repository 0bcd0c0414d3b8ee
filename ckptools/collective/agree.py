"""The one way a failure on one rank becomes the same error on every rank.

Every collective operation of ckptools (a save, a load, the manager's choice of a checkpoint, an
async save's ``wait``) ends the same way: whatever went wrong on some rank is raised on *every*
rank at once, naming the operation and the rank, instead of one rank raising while the others
wait in the next collective until the timeout. `Agreement` is that ending, in the shape of DCP's
``_DistWrapper``: run a step on rank 0 (`Agreement.on_rank0`) or look at every rank's error
(`Agreement.on_every_rank`), and raise the same error everywhere. Where the ranks' problems
arrive as text in replies an exchange already gathered (a save's opening, a write's report), the
first one is raised the same way (`first_failure`, `Agreement.raise_first`), with no exchange more.

An *outcome* is the small picklable value one collective carries: ``(kept, text)`` where
``text`` starts with ``rank N:`` and ``kept`` names the class of an error that is raised as
itself on every rank because it names what to fix rather than a failure (`UnsafeStateError`:
the state was refused; `NodeMemoryError`: the node-memory folder is too small; `StorageStalledError`: the
storage made no progress for the stall bound), else None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Optional, TypeVar

from ..errors import CheckpointError, NodeMemoryError, StorageStalledError, UnsafeStateError
from .group import all_gather_object, broadcast_object, get_rank

__all__ = ["Agreement", "Outcome", "RankFailure", "first_failure", "outcome_of", "saving"]

T = TypeVar("T")
Outcome = tuple[Optional[str], str]
# Errors every rank raises as themselves, with the text of the rank where they happened.
_KEPT: dict[str, type[CheckpointError]] = {
    cls.__name__: cls for cls in (UnsafeStateError, NodeMemoryError, StorageStalledError)
}


class RankFailure(Exception):
    """A failure on some rank, as another rank learnt it (its text starts with ``rank N:``).

    Examples:
        >>> outcome_of(RankFailure("rank 1: OSError: disk full"))
        (None, 'rank 1: OSError: disk full')
    """


def outcome_of(error: BaseException | None, rank: int = 0) -> Outcome | None:
    """What every rank needs to raise ``error`` (raised on ``rank``) too; None for no error."""
    if error is None:
        return None
    kept = type(error).__name__
    if _KEPT.get(kept) is type(error):
        text = str(error)
        if kept == "StorageStalledError" and not text.startswith("rank "):  # whose storage: named on every rank
            text = f"rank {rank}: {text}"
        return (kept, text)
    if isinstance(error, RankFailure):
        return (None, str(error))
    return (None, f"rank {rank}: {type(error).__name__}: {error}")


def first_failure(gathered: list[Any], problem: Callable[[Any], str | None]) -> str | None:
    """The first rank's ``problem`` among every rank's gathered replies, as ``rank N: text``; None
    for none. Every rank holds the same list, so every rank finds the same one.

    Examples:
        >>> first_failure([{"p": None}, {"p": "OSError: disk full"}], lambda reply: reply["p"])
        'rank 1: OSError: disk full'
    """
    for rank, reply in enumerate(gathered):
        text = problem(reply)
        if text:
            return f"rank {rank}: {text}"
    return None


class Agreement:
    """How one collective operation fails: the same error on every rank.

    Args:
        what: the operation, as the message starts (``"saving checkpoint /ckpt/step_10.pt"``).
        tail: what the message ends with (``"; earlier checkpoints are untouched"``).
        failed: what the operation did on the rank the message names (``"failed"``).
        own: how the rank where it happened raises: ``"chain"`` a `CheckpointError` with the
            message every other rank raises, from the original (saves: one message everywhere);
            ``"as_is"`` the original exception itself (loads: a `CheckpointNotFoundError` stays one).

    Examples:
        >>> Agreement("saving checkpoint /tmp/a.pt").on_rank0(lambda: 42)  # no process group: rank 0
        42
        >>> Agreement("loading checkpoint /tmp/a.pt").message((None, "rank 1: OSError: gone"))
        'loading checkpoint /tmp/a.pt failed on rank 1: OSError: gone'
    """

    def __init__(
        self, what: str, *, tail: str = "", own: Literal["chain", "as_is"] = "chain", failed: str = "failed"
    ) -> None:
        self.what, self.tail, self.own, self.failed = what, tail, own, failed

    def message(self, outcome: Outcome) -> str:
        """The text every rank raises for ``outcome``."""
        kept, text = outcome
        return text if kept else f"{self.what} {self.failed} on {text}{self.tail}"

    def failure(self, verdict: str) -> CheckpointError:
        """The error for a ``verdict`` every rank reached alike (no rank to name): raise it everywhere."""
        return CheckpointError(f"{self.what} {self.failed}: {verdict}{self.tail}")

    def raise_first(self, gathered: list[Any], problem: Callable[[Any], str | None]) -> None:
        """Local, on replies every rank gathered: raise the first rank's ``problem`` (`first_failure`)
        as this operation's error; the same one on every rank."""
        text = first_failure(gathered, problem)
        if text is not None:
            raise CheckpointError(self.message((None, text)))

    def raise_outcome(self, outcome: Outcome | None, error: BaseException | None = None) -> None:
        """Raise ``outcome`` (nothing when None); ``error`` is this rank's own, if it had one."""
        if outcome is None:
            return
        kept, text = outcome
        if error is not None and (kept or self.own == "as_is") and not isinstance(error, RankFailure):
            if kept and text != str(error):  # its rank named: the words every other rank raises
                raise _KEPT[kept](text) from error
            raise error
        if kept:
            raise _KEPT[kept](self.message(outcome))
        if error is not None and not isinstance(error, RankFailure):
            raise CheckpointError(self.message(outcome)) from error
        raise CheckpointError(self.message(outcome))

    def broadcast(self, error: BaseException | None) -> Outcome | None:
        """Collective: rank 0's ``error`` (the other ranks pass None) as an outcome on every rank."""
        return broadcast_object(outcome_of(error) if get_rank() == 0 else None)  # type: ignore[no-any-return]

    def share(self, error: BaseException | None) -> None:
        """Collective: raise rank 0's ``error`` on every rank (nothing when it is None)."""
        self.raise_outcome(self.broadcast(error), error)

    def on_rank0(self, step: Callable[[], T], *, send: bool = False) -> T | None:
        """Collective: run ``step`` on rank 0; an error there is raised on every rank.

        Returns ``step``'s result on rank 0 (the same object) and, with ``send``, a copy of it on
        every other rank (in the same broadcast as the outcome); None there otherwise.
        """
        result: T | None = None
        error: BaseException | None = None
        if get_rank() == 0:
            try:
                result = step()
            except Exception as err:  # noqa: BLE001 - raised on every rank below
                error = err
        if send:
            outcome, result = broadcast_object((outcome_of(error), result))
        else:
            outcome = self.broadcast(error)
        self.raise_outcome(outcome, error)
        return result

    def on_every_rank(
        self,
        error: BaseException | None,
        *,
        amend: Callable[[BaseException, list[Outcome | None]], BaseException | None] | None = None,
    ) -> None:
        """Collective: every rank's ``error`` gathered; the first failing rank's raised on every rank.

        A rank that failed itself raises as ``own`` says; ``amend(error, outcomes)`` may replace
        its own error once every rank's outcome is known (a file rank 0 read but this rank cannot).
        """
        outcomes = all_gather_object(outcome_of(error, get_rank()))
        if error is not None and amend is not None:
            replacement = amend(error, outcomes)
            if replacement is not None:
                raise replacement from error
        if error is not None:
            self.raise_outcome(outcomes[get_rank()], error)
        failed = [outcome for outcome in outcomes if outcome is not None]
        if failed:
            self.raise_outcome(failed[0])


def saving(path: str, *, how: str = "") -> Agreement:
    """How every save fails: the same `CheckpointError` on every rank, naming the path and the rank.

    Examples:
        >>> saving("/tmp/a.pt").message((None, "rank 1: OSError: disk full"))
        'saving checkpoint /tmp/a.pt failed on rank 1: OSError: disk full; earlier checkpoints are untouched'
    """
    return Agreement(f"saving checkpoint {path}{how}", tail="; earlier checkpoints are untouched")
