"""What ckptools holds in this process between calls, and its two ends: the save in flight
(`finish_pending`), and the node memory at the job's normal end (`end_job`). The one place the
read side, the training loop and the operations ask for either; they import neither wing for it.

Examples:
    >>> from ckptools.lifecycle import finish_pending
    >>> finish_pending() is None  # no save in flight
    True
"""

from __future__ import annotations

from .collective.group import barrier
from .node import release
from .storage import finish_pending

__all__ = ["end_job", "finish_pending"]


def end_job() -> list[str]:
    """Collective, every rank at its last checkpoint call: finish the save in flight, barrier, then
    remove the node-memory snapshots (their state is in the folder; a job that failed keeps them for
    its relaunch). The node-memory folders this rank removed.
    """
    finish_pending()
    barrier()
    return release()
