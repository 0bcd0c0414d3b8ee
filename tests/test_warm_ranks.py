"""The warm ranks of the multi-process tests (tests/_warm.py): a test that leaves its processes
changed (environment, directory, RNG streams, a signal handler, an injected fault, ckptools' caches,
node memory with its keeper, a module, a group with a collective unmatched) does not change the next
test's outcome: the next test sees what fresh ranks see, on the same processes where everything
could be put back, on new ones where not."""

from __future__ import annotations

import os
import random
import signal
import sys
import types
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import ckptools as ck


def _model() -> torch.nn.parallel.DistributedDataParallel:
    # Unseeded on purpose: every rank draws the same weights only from the same RNG state, as
    # fresh ranks forked from one forkserver do.
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))


def _leaves_a_mess(rank: int, world: int, root: str) -> int:
    from ckptools.collective import group
    from ckptools.write import zip_writer

    manager = ck.CheckpointManager(os.path.join(root, "run"), snapshot_dir=os.path.join(root, "memory"))
    model = _model()
    manager.snapshot({"model": model, "step": 1}, 1, blocking=True)  # node memory, a keeper watching it
    os.environ["CKPTOOLS_LEFT_BEHIND"] = "1"
    os.chdir(root)
    torch.manual_seed(1000 + rank)
    np.random.seed(rank)
    random.seed(rank)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    warnings.simplefilter("error")
    torch.set_default_dtype(torch.float64)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device (left behind by the previous test)")

    zip_writer.write_shares = broken  # a fault injected and never taken back
    group._NODE.append((0, 99))  # a node guessed for another test's layout
    sys.modules["left_behind"] = types.ModuleType("left_behind")
    return os.getpid()


def _leaves_the_group_unmatched(rank: int, world: int, root: str) -> int:
    if rank == 0:
        dist.broadcast(torch.ones(1), 0, async_op=True)  # its peers never join this one
    return os.getpid()


def _observes(rank: int, world: int, root: str) -> dict:
    """What a rank sees as a test starts, and what a save and a restore give it."""
    from ckptools.collective import group
    from ckptools.node.folder import _REGISTERED

    seen = {
        "pid": os.getpid(),
        "left behind": os.environ.get("CKPTOOLS_LEFT_BEHIND"),
        "rank": os.environ["RANK"],
        "cwd is the tests'": os.getcwd() != root,
        # torch's and numpy's streams as the forkserver left them (Python's own `random` is seeded
        # afresh in every forked child, so no test can count on it).
        "rng": (torch.rand(3).tolist(), float(np.random.rand())),
        "SIGUSR1": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
        "warnings filters": [f for f in warnings.filters if f[0] == "error"],
        "dtype": str(torch.get_default_dtype()),
        "node guessed": list(group._NODE),
        "modules": "left_behind" in sys.modules,
        "node memory registered": sorted(_REGISTERED),
    }
    model = _model()
    # The next collective pairs with its peers' (an unmatched one left behind would pair with it).
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    seen["sum"] = total.item()
    path = os.path.join(root, "w.pt")
    ck.save(path, {"model": model}, writers="all")  # the injected fault would refuse it
    seen["saved"] = {k: v.tolist() for k, v in torch.load(path, weights_only=True)["model"].items()}
    manager = ck.CheckpointManager(os.path.join(root, "run"), snapshot_dir=os.path.join(root, "memory"))
    seen["restored"] = manager.restore({"model": model})  # nothing of the last test's snapshot: a fresh start
    dist.barrier()  # every rank's survey of node memory is written
    seen["memory"] = (
        sorted(os.listdir(os.path.join(root, "memory"))) if os.path.isdir(os.path.join(root, "memory")) else []
    )
    return seen


def _without(seen: list[dict], *keys: str) -> list[dict]:
    return [{k: v for k, v in s.items() if k not in keys} for s in seen]


def test_a_test_that_changes_its_processes_leaves_the_next_one_what_fresh_ranks_see(tmp_path):
    """Everything here can be put back: the next test runs on the same warm processes."""
    for name in ("fresh", "mess", "after"):
        (tmp_path / name).mkdir()
    fresh = run_ranks(_observes, 2, str(tmp_path / "fresh"), fresh="what fresh ranks see, to compare with")
    messed = run_ranks(_leaves_a_mess, 2, str(tmp_path / "mess"))
    # The mess's node memory went with its test, as at a job's normal end (its snapshot is not
    # the next test's), and its keeper with it.
    assert not (tmp_path / "mess" / "memory").exists()
    after = run_ranks(_observes, 2, str(tmp_path / "after"))
    assert [s["pid"] for s in after] == messed, "the pool was not reused: the reset path went untested"
    assert _without(after, "pid") == _without(fresh, "pid")
    assert fresh[0]["saved"] == fresh[1]["saved"] and fresh[0]["restored"] is None
    assert [s["sum"] for s in after] == [3.0, 3.0] and after[0]["left behind"] is None


def test_a_group_left_with_a_collective_unmatched_is_not_handed_to_the_next_test(tmp_path):
    """What cannot be put back (a collective one rank made alone) ends the pool: the next test gets
    fresh ranks, and their collectives pair as they should."""
    for name in ("fresh", "mess", "after"):
        (tmp_path / name).mkdir()
    fresh = run_ranks(_observes, 2, str(tmp_path / "fresh"), fresh="what fresh ranks see, to compare with")
    messed = run_ranks(_leaves_the_group_unmatched, 2, str(tmp_path / "mess"))
    after = run_ranks(_observes, 2, str(tmp_path / "after"))
    assert not set(messed) & {s["pid"] for s in after}, "ranks with an unmatched collective were reused"
    assert _without(after, "pid") == _without(fresh, "pid")


def _raises_on_rank_1(rank: int, world: int, root: str) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails its test")
    dist.barrier()  # rank 0 waits for a peer that has left: it fails at once, not at the group's timeout
    return os.getpid()


def test_a_rank_that_fails_fails_the_call_on_time_and_the_next_test_gets_fresh_ranks(tmp_path):
    with pytest.raises(AssertionError, match="rank 1: ValueError: rank 1 fails its test"):
        run_ranks(_raises_on_rank_1, 2, str(tmp_path), timeout=30)
    (tmp_path / "after").mkdir()
    (tmp_path / "fresh").mkdir()
    after = run_ranks(_observes, 2, str(tmp_path / "after"))
    fresh = run_ranks(_observes, 2, str(tmp_path / "fresh"), fresh="what fresh ranks see, to compare with")
    assert _without(after, "pid") == _without(fresh, "pid")
