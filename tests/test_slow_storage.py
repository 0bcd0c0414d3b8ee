"""Slow and stuck storage (issue 68): the promises re-proved on a FUSE mount whose writes are throttled or
frozen (tests/_slowfs.py). Here: a checkpoint frozen midway moves nothing and prunes nothing until it is
whole; a throttled one is whole when it returns; at 2 ranks a stuck write is one StorageStalledError on every
rank within the stall bound (a sync save, an async one at the next checkpoint call, a load behind it), never a
collective timeout, nothing published or pruned; an async save that would queue behind a slow one is skipped
with a warning naming the target and its speed."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest
import torch
from _dist import run_ranks
from _slowfs import set_control, slow_mount, why_not

import ckptools as ck
from ckptools.write.async_save import SKIP_GRACE

pytestmark = pytest.mark.skipif(why_not() is not None, reason=f"FUSE: {why_not()}")


RESTORE = """
import sys, torch, ckptools as ck
target = {"w": torch.zeros(1 << 20)}
step = ck.CheckpointManager(sys.argv[1], keep_last=2).restore(target)["step"]
print(step, torch.equal(target["w"], torch.full((1 << 20,), float(step))))
"""


def _state(step: int) -> dict:
    return {"w": torch.full((1 << 20,), float(step)), "step": step}  # 4 MiB


def test_a_save_frozen_midway_moves_nothing_and_prunes_nothing_until_it_is_whole(tmp_path):
    """The storage stops while an async save of step 3 writes (keep_last=2): while it is stuck, the run's
    checkpoints are still steps 1 and 2, whole, the newest is step 2 for a restore in another manager, and
    no file of step 3 is there under its name; thawed, step 3 is whole and only then is step 1 pruned."""
    with slow_mount(tmp_path / "fs") as fs:
        run = fs.path / "run"
        manager = ck.CheckpointManager(run, keep_last=2)
        for step in (1, 2):
            manager.save(_state(step), step)
        fs.freeze()
        manager.save(_state(3), 3, blocking=False)
        time.sleep(1.0)  # the writer is inside a write the storage holds
        assert manager.pending is not None and not manager.pending.done()
        assert [s for s, _ in manager.checkpoints()] == [1, 2]
        assert not (run / os.path.basename(manager.path_for(3))).exists()
        # another process (a relaunch, a reader): this one's loads wait for its own save in flight
        reader = subprocess.run([sys.executable, "-c", RESTORE, str(run)], capture_output=True, text=True, timeout=120)
        assert reader.returncode == 0 and reader.stdout.split() == ["2", "True"], reader.stdout + reader.stderr
        fs.thaw()
        manager.wait()
        assert [s for s, _ in manager.checkpoints()] == [2, 3]
        assert torch.equal(ck.load(manager.path_for(3), verify=True)["w"], _state(3)["w"])
        manager.close()


def test_a_save_to_a_throttled_storage_is_whole_when_it_returns(tmp_path):
    """At 10 MB/s a 4 MiB save takes its time and returns whole: verified, the previous one kept."""
    with slow_mount(tmp_path / "fs") as fs:
        manager = ck.CheckpointManager(fs.path / "run", keep_last=2)
        manager.save(_state(1), 1)
        fs.throttle(10e6)
        started = time.monotonic()
        manager.save(_state(2), 2)
        took = time.monotonic() - started
        assert took >= 0.3, took  # 4 MiB at 10 MB/s: the throttle held the writes
        assert [s for s, _ in manager.checkpoints()] == [1, 2]
        assert ck.verify(manager.path_for(2)).startswith("torch zip, every record's CRC-32 matches")
        manager.close()


# CKPTOOLS_STALL_TIMEOUT in these tests: the ranks' group times out after 60 s (run_ranks); a 4 MiB pwrite at
# 2 MB/s (2 s, no progress seen within it) stays well inside it.
BOUND = 5.0


@contextlib.contextmanager
def _stall_bound():
    """CKPTOOLS_STALL_TIMEOUT=BOUND in this rank for the block."""
    os.environ["CKPTOOLS_STALL_TIMEOUT"] = str(BOUND)
    try:
        yield
    finally:
        del os.environ["CKPTOOLS_STALL_TIMEOUT"]


def _storage_set(rank: int, by: int, control: str, **changes) -> None:
    """Every rank at one point of its scenario: rank ``by`` changes the storage (`set_control`), then all go on."""
    ck.barrier()
    if rank == by:
        set_control(control, **changes)
    ck.barrier()


def _thawed_leftovers(rank: int, run: str, control: str) -> list[str]:
    """Rank 0 (whose writer the storage holds): thaw it, then the temporary files still there after the
    given-up writer had 30 s to stop (it must remove its own)."""
    if rank != 0:
        return []
    set_control(control, frozen=False)
    deadline = time.monotonic() + 30
    while (left := [n for n in os.listdir(run) if ".ckptools-tmp-" in n]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _stuck_sync_save(rank: int, world: int, run: str, control: str) -> tuple[str, str, float, list[str]]:
    """Every rank saves step 3 to a storage that is frozen: what each raised, how long it took, and the
    temporary files left once rank 0 thawed the storage."""
    with _stall_bound():
        manager = ck.CheckpointManager(run, keep_last=2)
        return *_raised(lambda: manager.save(_state(3), 3)), _thawed_leftovers(rank, run, control)


def _whole_and_only(run, steps: list[int]) -> None:
    manager = ck.CheckpointManager(run, keep_last=2)
    assert [s for s, _ in manager.checkpoints()] == steps
    for step in steps:
        assert torch.equal(ck.load(manager.path_for(step), verify=True)["w"], _state(step)["w"])


def test_a_sync_save_to_a_stuck_storage_is_one_named_error_on_every_rank_within_the_bound(tmp_path):
    """2 ranks, rank 0 writes, its storage frozen: both ranks raise StorageStalledError within a few seconds
    of the bound (the group's own timeout is 60 s), naming the target and the fix; steps 1 and 2 stay whole
    and unpruned, no file of step 3; thawed, the given-up writer stops and removes its temporary file."""
    with slow_mount(tmp_path / "fs") as fs:
        run = fs.path / "run"
        for step in (1, 2):
            ck.CheckpointManager(run, keep_last=2).save(_state(step), step)
        fs.freeze()
        results = run_ranks(_stuck_sync_save, 2, str(run), str(fs.control), timeout=90)
        for kind, message, took, left in results:
            assert kind == "StorageStalledError", (kind, message)
            assert BOUND <= took < BOUND + 15, took
            assert "ckpt-0000000003.pt" in message and "CKPTOOLS_STALL_TIMEOUT" in message, message
            assert left == [], left
        assert results[0][1] == results[1][1]  # one message: rank 0's, as every rank raises it
        assert sorted(os.listdir(run)) == ["ckpt-0000000001.pt", "ckpt-0000000002.pt"], os.listdir(run)
        _whole_and_only(run, [1, 2])


def _slow_then_stuck_async(rank: int, world: int, run: str, control: str) -> dict:
    """Async saves every "step" to a storage throttled to 2 MB/s, then frozen."""
    import warnings

    out: dict = {}
    with _stall_bound():
        manager = ck.CheckpointManager(run, keep_last=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manager.save(_state(1), 1, blocking=False)  # 4 MiB at 2 MB/s: 2 s, in one pwrite
            started = time.monotonic()
            out["skipped"] = manager.save(_state(2), 2, blocking=False)
            out["skip_took"] = time.monotonic() - started
        out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, ck.CheckpointWarning)]
        manager.wait()
        out["after_slow"] = [s for s, _ in manager.checkpoints()]
        _storage_set(rank, 0, control, rate=0.0, frozen=True)
        manager.save(_state(3), 3, blocking=False)  # staged; rank 0's writer stops inside the storage
        started = time.monotonic()
        out["behind_stuck"] = manager.save(_state(4), 4, blocking=False)  # not yet past the bound: skipped
        out["behind_took"] = time.monotonic() - started
        time.sleep(BOUND + 1)
        # finishes the one in flight first: stuck past the bound
        kind, message, out["stuck_took"] = _raised(lambda: manager.save(_state(5), 5, blocking=False))
        out["stuck"] = (kind, message)
        out["pending_after"] = manager.pending is not None
        out["listed_stuck"] = [s for s, _ in manager.checkpoints()]
        out["left"] = _thawed_leftovers(rank, run, control)
        return out


def test_async_saves_skip_behind_a_slow_storage_and_a_stuck_one_is_a_named_error_on_every_rank(tmp_path):
    """2 ranks: at 2 MB/s a save issued while the one before is writing is skipped after SKIP_GRACE, with a warning
    naming the target and its speed, and the one before completes; frozen, the save behind the stuck one is
    skipped until the bound passes, then the next checkpoint call raises StorageStalledError on every rank;
    step 1 stays whole, nothing of step 3 published or pruned."""
    with slow_mount(tmp_path / "fs") as fs:
        run = fs.path / "run"
        fs.throttle(2e6)
        results = run_ranks(_slow_then_stuck_async, 2, str(run), str(fs.control), timeout=90)
        for out in results:
            assert out["skipped"].endswith("ckpt-0000000001.pt") and out["skip_took"] < SKIP_GRACE + 1.5, out
            assert out["after_slow"] == [1], out
            assert out["behind_stuck"].endswith("ckpt-0000000003.pt") and out["behind_took"] < SKIP_GRACE + 1.5, out
            assert out["stuck"][0] == "StorageStalledError", out["stuck"]
            assert out["stuck_took"] < BOUND + 15 and not out["pending_after"], out
            assert out["listed_stuck"] == [1] and out["left"] == [], out
        warned = results[0]["warnings"]
        assert any("of step 2 was skipped" in w and "ckpt-0000000001.pt" in w and "MB/s" in w for w in warned), warned
        assert results[1]["warnings"] == []  # rank 0 warns for the job
        assert results[0]["stuck"][1] == results[1]["stuck"][1]
        assert os.listdir(run) == ["ckpt-0000000001.pt"], os.listdir(run)
        _whole_and_only(run, [1])


def test_a_load_behind_a_stuck_async_save_of_its_own_is_a_named_error_within_the_bound(tmp_path, monkeypatch):
    """ck.load first finishes this process's save in flight (it may be the file it reads): stuck, that is a
    StorageStalledError within the bound, no longer a hang for as long as the storage is stuck."""
    monkeypatch.setenv("CKPTOOLS_STALL_TIMEOUT", str(BOUND))
    with slow_mount(tmp_path / "fs") as fs:
        run = fs.path / "run"
        manager = ck.CheckpointManager(run, keep_last=2)
        manager.save(_state(1), 1)
        fs.freeze()
        manager.save(_state(2), 2, blocking=False)
        started = time.monotonic()
        with pytest.raises(ck.StorageStalledError, match="ckpt-0000000002.pt"):
            ck.load(manager.path_for(1), {"w": torch.zeros(1 << 20)})
        assert BOUND <= time.monotonic() - started < BOUND + 10
        assert manager.pending is None
        fs.thaw()
        target = {"w": torch.zeros(1 << 20)}
        assert manager.restore(target)["step"] == 1 and torch.equal(target["w"], _state(1)["w"])
        manager.close()


def _raised(call) -> tuple[str, str, float]:
    started = time.monotonic()
    try:
        call()
        return "returned", "", time.monotonic() - started
    except ck.CheckpointError as err:
        return type(err).__name__, str(err), time.monotonic() - started


def _ckptools_threads() -> set:
    """The ckptools threads alive in this process now (the objects: an ident may be reused)."""
    import threading

    return {t for t in threading.enumerate() if t.name.startswith("ckptools-")}


def _writers_quiet(before: set, deadline: float = 30.0) -> list[str]:
    """The ckptools threads started since ``before`` and still alive after up to ``deadline`` s (given-up
    writers end once thawed). The warm ranks keep threads of earlier tests that live as long as the process
    (the node's commit thread, ckptools.node.commits), so only this test's own count."""
    end = time.monotonic() + deadline
    while (alive := sorted(t.name for t in _ckptools_threads() - before)) and time.monotonic() < end:
        time.sleep(0.1)
    return alive


def _ddp_slow_then_stuck(rank: int, world: int, run: str, control: str) -> dict:
    """A DDP model (8 MiB: writers='auto' plans a share per rank, 4 MiB each, one pwrite of 2 s at 2 MB/s):
    async saves behind a slow one skip; frozen while every rank writes its share (async, then sync), each is
    one StorageStalledError on every rank; thawed, the given-up writers end and leave nothing."""
    import threading
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(1024, 2048, bias=False))
    out: dict = {}
    before = _ckptools_threads()
    with _stall_bound():
        manager = ck.CheckpointManager(run, keep_last=2)
        manager.save({"model": ddp}, 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manager.save({"model": ddp}, 2, blocking=False)
            started = time.monotonic()
            out["skipped"] = manager.save({"model": ddp}, 3, blocking=False)
            out["skip_took"] = time.monotonic() - started
        out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, ck.CheckpointWarning)]
        manager.wait()
        out["after_slow"] = [s for s, _ in manager.checkpoints()]
        # Frozen while the background shares are written: the next save skips, the one after the bound raises.
        manager.save({"model": ddp}, 3, blocking=False)
        _storage_set(rank, 0, control, frozen=True)
        out["behind_stuck"] = manager.save({"model": ddp}, 4, blocking=False)
        time.sleep(BOUND + 1)
        out["async"] = _raised(lambda: manager.save({"model": ddp}, 5, blocking=False))
        _storage_set(rank, 0, control, frozen=False)
        out["async_left"] = _writers_quiet(before)
        ck.barrier()
        # A sync save frozen half a second in: while the shares are written (2 s at 2 MB/s).
        freezer = threading.Timer(0.5, set_control, (control,), {"frozen": True}) if rank == 0 else None
        if freezer is not None:
            freezer.start()
        out["sync"] = _raised(lambda: manager.save({"model": ddp}, 6))
        _storage_set(rank, 0, control, frozen=False)
        out["sync_left"] = _writers_quiet(before)
        out["listed"] = [s for s, _ in manager.checkpoints()]
        ck.barrier()
        out["tmps"] = [n for n in os.listdir(run) if ".ckptools-tmp-" in n]
        manager.close()
        return out


@pytest.mark.slow
def test_a_ddp_models_shares_on_a_slow_then_stuck_storage_skip_and_then_raise_one_named_error_on_every_rank(
    tmp_path,
):
    """2 ranks, a DDP model, writers='auto' (every rank writes its share into the one file): at 2 MB/s an
    async save behind the one in flight is skipped with the warning; frozen while the shares are written, the
    async save (at the next checkpoint call) and a sync save are each a StorageStalledError on every rank (each
    rank whose own write stalled names it itself), within the bound (the group's timeout is 60 s); steps 1
    and 2 stay whole, nothing of steps 3 to 6 published, and once thawed no temporary file and no ckptools
    thread is left."""
    with slow_mount(tmp_path / "fs") as fs:
        run = fs.path / "run"
        fs.throttle(2e6)
        results = run_ranks(_ddp_slow_then_stuck, 2, str(run), str(fs.control), timeout=150)
        for out in results:
            assert out["skipped"].endswith("ckpt-0000000002.pt") and out["skip_took"] < SKIP_GRACE + 1.5, out
            assert out["after_slow"] == [1, 2], out
            assert out["behind_stuck"].endswith("ckpt-0000000003.pt"), out
            for phase in ("async", "sync"):
                kind, message, took = out[phase]
                assert kind == "StorageStalledError" and "CKPTOOLS_STALL_TIMEOUT" in message, (phase, out[phase])
                assert took < BOUND + 15, (phase, took)
            assert out["async_left"] == [] and out["sync_left"] == [], out
            assert out["listed"] == [1, 2] and out["tmps"] == [], out
        for out in results:  # each rank whose own write stalled says so itself: the same error, the same save
            assert "ckpt-0000000003.pt" in out["async"][1] and "ckpt-0000000006.pt" in out["sync"][1], out
        assert any("of step 3 was skipped" in w and "MB/s" in w for w in results[0]["warnings"]), results[0]
        fs.thaw()
        fs.throttle(0)
        assert sorted(os.listdir(run)) == ["ckpt-0000000001.pt", "ckpt-0000000002.pt"], os.listdir(run)
        model = torch.nn.Linear(1024, 2048, bias=False)
        for step in (1, 2):
            ck.load(str(run / f"ckpt-{step:010d}.pt"), {"model": model}, verify=True)


def _one_rank_slow_then_stuck(rank: int, world: int, runs: list[str], control: str) -> dict:
    """Rank 0 saves through a mount that keeps up, rank 1 through one of the same directory throttled to
    2 MB/s, then frozen (``control``: rank 1's): a DDP model's shares (writers='auto'), sync and async."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(1024, 2048, bias=False))
    out: dict = {}
    before = _ckptools_threads()
    with _stall_bound():
        manager = ck.CheckpointManager(runs[rank], keep_last=2)
        started = time.monotonic()
        manager.save({"model": ddp}, 1)  # rank 1's 4 MiB share at 2 MB/s: the save waits for the slow rank
        out["slow_sync_took"] = time.monotonic() - started
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manager.save({"model": ddp}, 2, blocking=False)
            out["skipped"] = os.path.basename(manager.save({"model": ddp}, 3, blocking=False))
        out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, ck.CheckpointWarning)]
        manager.wait()
        _storage_set(rank, 1, control, frozen=True)
        out["stuck"] = _raised(lambda: manager.save({"model": ddp}, 3))
        _storage_set(rank, 1, control, frozen=False)
        out["left"] = _writers_quiet(before)
        out["listed"] = [s for s, _ in manager.checkpoints()]
        manager.close()
        return out


@pytest.mark.slow
def test_one_ranks_storage_slow_then_stuck_is_waited_for_skipped_behind_then_one_named_error_on_every_rank(
    tmp_path,
):
    """2 ranks write their shares of one file into one directory through two mounts of it (two nodes' clients
    of one filesystem); rank 1's is throttled to 2 MB/s: a sync save waits for it and is whole, an async save
    behind its share is skipped with a warning naming rank 1; then rank 1's alone is frozen: the sync save is
    one StorageStalledError on every rank, naming rank 1, within the bound, while rank 0's own storage keeps
    up; nothing of it published, steps 1 and 2 whole, and thawed nothing left."""
    shared = tmp_path / "shared"
    with slow_mount(tmp_path / "a", shared) as fast, slow_mount(tmp_path / "b", shared) as slow:
        slow.throttle(2e6)
        runs = [str(fast.path / "run"), str(slow.path / "run")]
        results = run_ranks(_one_rank_slow_then_stuck, 2, runs, str(slow.control), timeout=120)
        for out in results:
            assert out["slow_sync_took"] >= 1.5, out  # rank 1's 4 MiB at 2 MB/s: waited for
            assert out["skipped"] == "ckpt-0000000002.pt", out
            kind, message, took = out["stuck"]
            assert kind == "StorageStalledError" and message.startswith("rank 1: "), out["stuck"]
            assert "ckpt-0000000003.pt" in message and took < BOUND + 15, out["stuck"]
            assert out["left"] == [] and out["listed"] == [1, 2], out
        assert results[0]["stuck"][1] == results[1]["stuck"][1]  # rank 0's word, the same on both
        # The slowest rank named first: rank 1 (rank 0's writer, its own share long written, waits for rank 1's)
        assert any("being written: rank 1 (" in w and "MB/s" in w for w in results[0]["warnings"]), results[0]
        slow.thaw()
        slow.throttle(0)
        run = shared / "run"
        assert sorted(os.listdir(run)) == ["ckpt-0000000001.pt", "ckpt-0000000002.pt"], os.listdir(run)
        for step in (1, 2):
            ck.load(str(run / f"ckpt-{step:010d}.pt"), {"model": torch.nn.Linear(1024, 2048, bias=False)}, verify=True)


def _restore_from_stuck(rank: int, world: int, runs: list[str], controls: list[str]) -> dict:
    """Steps 1 and 2 saved (rank 0 writes through its mount); then restores by new managers while reads are
    frozen: on both mounts (rank 0's choice reads), then on rank 1's alone (its own load reads); thawed, the
    restore of step 2."""
    out: dict = {}
    with _stall_bound():
        manager = ck.CheckpointManager(runs[rank], keep_last=2)
        for step in (1, 2):
            manager.save(_state(step), step)
        manager.close()
        target = {"w": torch.zeros(1 << 20)}
        for phase, frozen in (("every", [0, 1]), ("rank1", [1])):
            for who in frozen:
                _storage_set(rank, 0, controls[who], reads_frozen=True)
            out[phase] = _raised(lambda: ck.CheckpointManager(runs[rank], keep_last=2).restore(target))
            out[f"{phase}_untouched"] = bool(torch.equal(target["w"], torch.zeros(1 << 20)))
            for control in controls:
                _storage_set(rank, 0, control, reads_frozen=False)
        restored = ck.CheckpointManager(runs[rank], keep_last=2).restore(target)
        out["thawed"] = (restored["step"], bool(torch.equal(target["w"], _state(2)["w"])))
    return out


@pytest.mark.slow  # two mounts, two bounds waited out (20 s): `make interop`
def test_a_restore_from_a_stuck_storage_is_one_named_error_on_every_rank_within_the_bound(tmp_path):
    """2 ranks, each reading one directory through its own mount of it: with every mount's reads frozen, the
    restore (rank 0 choosing, its CRC-32 reads held) is one StorageStalledError on every rank within the bound,
    never the group's timeout (60 s), nothing restored; with rank 1's alone frozen, rank 0 chooses and rank 1's
    own read of the file is held: the same, naming rank 1, and nothing restored on either rank (rank 0 read its
    file whole, but no rank restores before every rank read); thawed, step 2 is restored bit-exact."""
    shared = tmp_path / "shared"
    with slow_mount(tmp_path / "a", shared) as first, slow_mount(tmp_path / "b", shared) as second:
        runs = [str(first.path / "run"), str(second.path / "run")]
        controls = [str(first.control), str(second.control)]
        results = run_ranks(_restore_from_stuck, 2, runs, controls, timeout=120)
    for out in results:
        for phase, rank in (("every", 0), ("rank1", 1)):
            kind, message, took = out[phase]
            assert kind == "StorageStalledError" and message.startswith(f"rank {rank}: "), (phase, out[phase])
            assert "the read of " in message and "Nothing was restored" in message, (phase, message)
            assert BOUND < took < BOUND + 15, (phase, out[phase])
        assert out["every_untouched"] and out["rank1_untouched"] and out["thawed"] == (2, True), out
    assert results[0]["rank1"][1] == results[1]["rank1"][1]  # one word on both ranks


KILLED_WHILE_STUCK = """
import os, sys, torch, ckptools as ck
sys.path.insert(0, sys.argv[3])
from _slowfs import set_control
manager = ck.CheckpointManager(sys.argv[1], keep_last=2)
manager.save({"w": torch.full((1 << 20,), 1.0), "step": 1}, 1)
manager.snapshot({"w": torch.full((1 << 20,), 2.0), "step": 2}, 2)
set_control(sys.argv[2], frozen=True)
print(manager.snapshot_dir, flush=True)
os._exit(9)  # as a kill -9: node memory and its keeper left
"""


def test_the_keeper_waits_out_a_stuck_storage_says_where_the_snapshot_is_and_persists_it_once_thawed(
    tmp_path, monkeypatch
):
    """A job with step 1 durable and step 2 in node memory dies while its storage is frozen: the keeper's
    write-out waits, says (past the stall bound) that the snapshot stays in node memory and where, publishes
    nothing meanwhile; thawed, step 2 reaches the run folder whole, step 1 is kept, node memory is released."""
    from _torchrun import keepers_left

    monkeypatch.setenv("CKPTOOLS_KEEPER_GRACE", "1")
    monkeypatch.setenv("CKPTOOLS_STALL_TIMEOUT", "2")
    said = tmp_path / "keeper.log"
    monkeypatch.setenv("CKPTOOLS_KEEPER_LOG", str(said))
    with slow_mount(tmp_path / "fs") as fs:
        run = fs.path / "run"
        job = subprocess.run(
            [sys.executable, "-c", KILLED_WHILE_STUCK, str(run), str(fs.control), os.path.dirname(__file__)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert job.returncode == 9, job.stdout + job.stderr
        memory = job.stdout.split()[-1]
        try:
            deadline = time.monotonic() + 60
            while "stays in node memory" not in (said.read_text() if said.exists() else ""):
                assert time.monotonic() < deadline, said.read_text() if said.exists() else "(nothing said)"
                time.sleep(0.2)
            log = said.read_text()
            assert memory in log and "ckpt-0000000002.pt" in log and "CKPTOOLS_STALL_TIMEOUT" in log, log
            assert os.path.isdir(memory)
            assert sorted(n for n in os.listdir(run) if not n.startswith(".")) == ["ckpt-0000000001.pt"], os.listdir(
                run
            )
        finally:
            fs.thaw()
            deadline = time.monotonic() + 60
            while os.path.exists(memory) and time.monotonic() < deadline:
                time.sleep(0.2)
        assert not os.path.exists(memory), said.read_text()
        assert keepers_left(memory) == []
        assert sorted(os.listdir(run)) == ["ckpt-0000000001.pt", "ckpt-0000000002.pt"], os.listdir(run)
        assert torch.equal(ck.load(str(run / "ckpt-0000000002.pt"), verify=True)["w"], torch.full((1 << 20,), 2.0))
        assert "persisted" in said.read_text(), said.read_text()
