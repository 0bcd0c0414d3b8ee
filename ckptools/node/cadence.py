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
        self.last_step: int | None = None  # the step of the last snapshot taken
        self.advised = False  # without a budget: the advice given once

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
        """A snapshot was taken at ``at`` (stalling ``stall`` s); the next ``skip`` calls are skipped.
        Rank 0 says at INFO each change of cadence under a budget, with the bound it gives a kill, and
        once, without a budget, when the snapshots stall more than a tenth of the loop's time."""
        per_call, steps_per_call = self._rates(at, step)
        if get_rank() == 0 and per_call is not None:
            measured = self.stall or stall
            if budget is not None and skip != self.skip_was:
                every = "every call" if skip == 0 else f"one call in {skip + 1}"
                lost = math.ceil((skip + 1) * steps_per_call)
                log.logger.info(
                    "snapshots: %s from step %d (a snapshot stalls %.1f ms; a budget of %.0f%% of the loop's "
                    "time): a kill loses at most %d %s, about %.1f s", every, step, measured * 1000, budget * 100,
                    lost, "step" if lost == 1 else "steps", (skip + 1) * per_call,
                )  # fmt: skip
            elif budget is None and self.stall is not None and not self.advised and stall > 0.1 * per_call:
                self.advised = True
                log.logger.info(
                    "snapshots stall %.0f%% of the loop's time (%.1f ms each, %.1f ms between calls): "
                    "snapshot(..., budget=0.02) keeps them within 2%%, and a kill then loses at most about %d steps",
                    100 * stall / per_call, stall * 1000, per_call * 1000,
                    math.ceil(stall / (0.02 * per_call) * steps_per_call),
                )  # fmt: skip
        self.skip_was = skip
        self.stall = stall if self.last is not None else None
        self.last = (at, self.calls)
        self.last_step = step
        self.skip = skip

    def _rates(self, at: float, step: int) -> tuple[float | None, float]:
        """The loop's seconds per call and steps per call since the last snapshot taken (None, 1: unknown)."""
        if self.last is None:
            return None, 1.0
        calls = max(self.calls - self.last[1], 1)
        steps = (step - self.last_step) / calls if self.last_step is not None and step > self.last_step else 1.0
        return (at - self.last[0]) / calls or None, steps
