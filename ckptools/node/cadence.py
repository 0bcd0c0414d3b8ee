"""How often `CheckpointManager.snapshot` takes a snapshot under a budget of the loop's time."""

from __future__ import annotations

import math

from .. import log
from ..collective.group import get_rank

__all__ = ["Cadence"]


class Cadence:
    """How often `CheckpointManager.snapshot` takes a snapshot under a budget (see there)."""

    def __init__(self) -> None:
        self.calls = 0  # snapshot() calls so far
        self.skip = 0  # calls still to skip (agreed)
        self.checked_in = False
        self.last: tuple[float, int] | None = None  # (time, call) of the last snapshot taken
        self.stall: float | None = None  # its stall, seconds (None: the first, which allocates the slots)
        self.skip_was = 0  # the last cadence agreed (a change is logged)

    def propose(self, now: float, budget: float) -> int:
        """Rank 0's proposal: how many calls to skip after this one, so that stalls stay within
        ``budget`` of the loop's time per call, measured since the last snapshot taken."""
        if self.last is None or self.stall is None:
            return 0
        per_call = (now - self.last[0]) / max(self.calls - self.last[1], 1)
        if per_call <= 0:
            return 0
        return max(math.ceil(self.stall / (budget * per_call)) - 1, 0)

    def taken(self, at: float, stall: float, skip: int, step: int, budget: float | None) -> None:
        """A snapshot was taken at ``at`` (stalling ``stall`` s); the next ``skip`` calls are skipped."""
        if budget is not None and skip != self.skip_was and get_rank() == 0:
            every = "every call" if skip == 0 else f"one call in {skip + 1}"
            log.logger.info(
                "snapshots: %s from step %d (a snapshot stalls %.1f ms; a budget of %.0f%% of the loop's time)",
                every, step, (self.stall or stall) * 1000, budget * 100,
            )  # fmt: skip
        self.skip_was = skip
        self.stall = stall if self.last is not None else None
        self.last = (at, self.calls)
        self.skip = skip
