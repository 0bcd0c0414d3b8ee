"""ck.async_save and the manager's blocking=False: snapshot semantics, one in flight, errors on every rank."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from _dist import run_ranks
from _same import assert_same_tree

import ckptools as ck
from ckptools.saving import async_save_with_hooks as _async_save
from ckptools.storage import TMP_MARKER
from ckptools.write import async_save as background


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_file_holds_the_state_as_of_the_call_bit_for_bit(tmp_path):
    model, opt = _trained()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 7}
    ck.save(tmp_path / "sync.pt", state)
    gate = threading.Event()
    # The write is held back until training has moved on, so the test cannot pass by luck.
    handle = _async_save(tmp_path / "async.pt", state, before_write=gate.wait)
    assert not handle.done()
    for _ in range(3):  # the optimizer steps in place: parameters, moments, step counters, lr
        _step(model, opt)
        sched.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    gate.set()
    assert handle.wait() == str(tmp_path / "async.pt") and handle.done()
    sync, other = torch.load(tmp_path / "sync.pt"), torch.load(tmp_path / "async.pt")
    for name in ("model", "optimizer", "scheduler", "step"):
        assert_same_tree(sync[name], other[name], name)
    assert other["model"]._metadata == sync["model"]._metadata  # BatchNorm's version survives
    assert_same_tree(sync["__ckptools__"]["rng"], other["__ckptools__"]["rng"], "rng")
    assert background.pending() is None


def test_shared_storage_parameters_and_requires_grad_are_kept(tmp_path):
    base = torch.arange(12.0)
    param = torch.nn.Parameter(torch.ones(3))
    state = {"base": base, "view": base[2:8].view(2, 3), "tied": base, "param": param}
    ck.async_save(tmp_path / "a.pt", state).wait()
    ck.save(tmp_path / "s.pt", state)
    a, s = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "s.pt")
    assert a["view"].untyped_storage().data_ptr() == a["base"].untyped_storage().data_ptr()
    assert a["tied"] is a["base"]
    assert type(a["param"]) is torch.nn.Parameter and a["param"].requires_grad
    assert os.path.getsize(tmp_path / "a.pt") == os.path.getsize(tmp_path / "s.pt")
    for k in ("base", "view", "param"):
        assert torch.equal(a[k], s[k])


def test_staging_buffers_are_reused_while_shapes_stay_and_can_be_released(tmp_path):
    model, opt = _trained()
    state = {"model": model, "optimizer": opt}
    ck.async_save(tmp_path / "1.pt", state).wait()
    first = [s.data_ptr() for s in background.SAVES.stager._storages]
    held = background.SAVES.stager.nbytes
    assert held >= 3 * sum(p.numel() * 4 for p in model.parameters())  # params + two AdamW moments
    _step(model, opt)
    ck.async_save(tmp_path / "2.pt", state).wait()
    assert [s.data_ptr() for s in background.SAVES.stager._storages] == first  # no new allocation
    assert ck.release_staging_buffers() == held
    assert background.SAVES.stager.nbytes == 0
    ck.async_save(tmp_path / "3.pt", {"w": torch.ones(5)}).wait()
    # 20 bytes of w and the RNG states' tensors; nothing of the model's buffers kept.
    assert 20 < background.SAVES.stager.nbytes < 20_000 < held


def test_both_stagers_copy_through_one_protocol_and_release_what_they_held(tmp_path):
    """The async save's host buffers and node memory's slots are one `Stager`: stage, wait, then the copy
    is the source's bytes while the source moves on; release gives back the bytes held (a slot's spare
    file goes with it)."""
    import collections

    from ckptools.node.slots import NodeSlots
    from ckptools.write import Stager, StagingBuffers

    source = torch.arange(16, dtype=torch.float32)
    expected = source.clone()
    folder = tmp_path / "node-memory"
    folder.mkdir(mode=0o700)
    slots = NodeSlots(str(folder), "ckpt")
    slot = slots.prepare(64)
    slots.open(slot, 64)
    share = collections.namedtuple("Share", "offset nbytes")(0, 64)
    stagers: list[tuple[Stager, object]] = [(StagingBuffers(), {"w": source}), (slots, [(share, source)])]
    copies = []
    for stager, what in stagers:
        copies.append(stager.stage(what))
        stager.wait()
    source.add_(1)  # training moves on: the copies stay as of the stage
    assert torch.equal(copies[0]["w"], expected)
    assert copies[1].bytes[:64].numpy().tobytes() == expected.numpy().tobytes()
    slots.keep_spare(slot)
    assert [stager.release() for stager, _ in stagers] == [64, 64]
    assert os.listdir(folder) == []  # the spare slot went with the release


def test_the_old_names_of_staging_still_work_with_a_deprecation_warning(tmp_path):
    handle = ck.async_save(tmp_path / "a.pt", {"w": torch.ones(5)})
    handle.wait()
    with pytest.warns(DeprecationWarning, match="use stall_seconds"):
        assert handle.snapshot_seconds == handle.stall_seconds > 0
    with pytest.warns(DeprecationWarning, match="use ckptools.release_staging_buffers"):
        release = ck.release_snapshot_buffers
    assert release is ck.release_staging_buffers and release() > 0


def test_unsafe_state_is_refused_at_the_call_and_nothing_is_in_flight(tmp_path):
    import argparse

    with pytest.raises(ck.UnsafeStateError, match="vars"):
        ck.async_save(tmp_path / "a.pt", {"args": argparse.Namespace(lr=1)})
    assert background.pending() is None and not (tmp_path / "a.pt").exists()


def test_failed_background_write_is_raised_by_wait_and_again(tmp_path):
    (tmp_path / "file").write_text("x")
    handle = ck.async_save(tmp_path / "file" / "a.pt", {"w": torch.ones(3)})  # parent is a file
    with pytest.raises(ck.CheckpointError, match="in the background failed on rank 0: NotADirectoryError"):
        handle.wait()
    with pytest.raises(ck.CheckpointError, match="NotADirectoryError"):
        handle.wait()  # remembered, not lost
    assert background.pending() is None


def test_failed_background_write_surfaces_at_the_next_checkpoint_call(tmp_path):
    ck.save(tmp_path / "good.pt", {"w": torch.ones(3)})
    (tmp_path / "file").write_text("x")
    ck.async_save(tmp_path / "file" / "a.pt", {"w": torch.ones(3)})
    with pytest.raises(ck.CheckpointError, match=r"file/a\.pt in the background failed"):
        ck.save(tmp_path / "next.pt", {"w": torch.zeros(3)})
    assert not (tmp_path / "next.pt").exists()  # the new save did not run
    assert torch.equal(ck.load(tmp_path / "good.pt", map_location="cpu")["w"], torch.ones(3))


def test_a_later_call_finishes_the_save_in_flight_first(tmp_path):
    gate = threading.Event()
    first = _async_save(tmp_path / "1.pt", {"w": torch.ones(3)}, before_write=gate.wait)
    threading.Timer(0.3, gate.set).start()
    second = ck.async_save(tmp_path / "2.pt", {"w": torch.zeros(3)})
    assert first.done() and (tmp_path / "1.pt").exists()  # finished before the second began
    assert background.pending() is second
    # load finishes the one in flight too: the file it asks for may be that one.
    assert torch.equal(ck.load(tmp_path / "2.pt", map_location="cpu")["w"], torch.zeros(3))
    assert background.pending() is None


_EXITS_WITH_SAVE_IN_FLIGHT = """
import sys, torch, ckptools as ck
handle = ck.async_save(sys.argv[1], {"w": torch.full((32 << 20,), 3.0)})
print("returned", handle.done(), flush=True)
"""


def test_a_script_that_ends_with_a_save_in_flight_still_gets_its_file(tmp_path):
    path = tmp_path / "a.pt"
    out = subprocess.run(
        [sys.executable, "-c", _EXITS_WITH_SAVE_IN_FLIGHT, str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "returned False" in out.stdout  # the interpreter exited while the write was running
    assert torch.equal(torch.load(path)["w"], torch.full((32 << 20,), 3.0))
    assert not [p for p in tmp_path.iterdir() if TMP_MARKER in p.name]


def _two_ranks(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(rank)
    w = torch.full((1000,), float(rank))
    out: dict = {}
    handle = ck.async_save(f"{directory}/a.pt", {"w": w, "rank_of_writer": rank})
    w.fill_(-1.0)
    out["path"] = handle.wait()
    out["loaded"] = ck.load(f"{directory}/a.pt", restore_rng=False, map_location="cpu")["w"][0].item()
    # Rank 0's write fails: every rank learns it, at the next checkpoint call.
    open(f"{directory}/file", "w").close()
    ck.async_save(f"{directory}/file/b.pt", {"w": w})
    try:
        ck.save(f"{directory}/c.pt", {"w": w})
    except ck.CheckpointError as err:
        out["error"] = str(err)
    # The manager: background saves, pruned after commit; restore finishes the one in flight.
    manager = ck.CheckpointManager(f"{directory}/run", keep_last=2)
    for step in (1, 2, 3):
        w.fill_(float(step))
        manager.save({"w": w}, step, blocking=False)
        w.fill_(-5.0)
    box = torch.zeros(1000)
    out["restored"] = manager.restore({"w": box}, map_location="cpu")["__ckptools__"]["metadata"]["step"]
    out["box"] = box[0].item()
    out["files"] = sorted(p for p in os.listdir(f"{directory}/run"))
    manager.close()
    out["buffers"] = background.SAVES.stager.nbytes
    return out


def test_two_ranks_rank0_writes_and_everyone_agrees(tmp_path):
    results = run_ranks(_two_ranks, 2, str(tmp_path))
    for out in results:
        assert out["path"] == f"{tmp_path}/a.pt" and out["loaded"] == 0.0  # rank 0's values, pre-mutation
        assert "file/b.pt in the background failed on rank 0: NotADirectoryError" in out["error"]
        assert out["restored"] == 3 and out["box"] == 3.0
        assert out["files"] == ["ckpt-0000000002.pt", "ckpt-0000000003.pt"]
        assert out["buffers"] == 0
    assert not (tmp_path / "c.pt").exists()


def test_manager_blocking_false_prunes_only_after_the_commit(tmp_path):
    manager = ck.CheckpointManager(tmp_path, keep_last=1)
    manager.save({"w": torch.ones(2)}, 1)
    gate = threading.Event()
    from ckptools.write import zip_writer

    real = zip_writer.write_shares

    def slow(plan, chunks):  # the write of step 2 waits until the test has looked
        gate.wait()
        return real(plan, chunks)

    zip_writer.write_shares = slow
    try:
        assert manager.save({"w": torch.zeros(2)}, 2, blocking=False).endswith("ckpt-0000000002.pt")
        assert manager.pending is not None and not manager.pending.done()
        assert [s for s, _ in manager.checkpoints()] == [1]  # step 1 is still there mid-write
        gate.set()
        assert manager.latest().endswith("ckpt-0000000002.pt")  # joins the local write first
        assert [s for s, _ in manager.checkpoints()] == [2]  # pruned after the commit
        assert manager.wait().endswith("ckpt-0000000002.pt") and manager.pending is None
    finally:
        zip_writer.write_shares = real
        gate.set()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_background_write_runs_below_the_steps_priority_and_a_sync_save_leaves_it_alone(tmp_path, monkeypatch):
    """Issue 67: while an async save's write runs, the loop's step took a core from it on 2 cores; the write
    (its page-cache copies and CRC-32s) runs 10 nicer than the process; a sync save, which the caller waits for,
    runs at the caller's priority and changes nothing of it."""
    from ckptools import saving

    seen: list[tuple[str, int]] = []
    real = saving.write_alone

    def recording(location, payload):
        seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return real(location, payload)

    monkeypatch.setattr(saving, "write_alone", recording)
    process = os.getpriority(os.PRIO_PROCESS, 0)
    ck.async_save(tmp_path / "a.pt", {"w": torch.ones(4)}).wait()
    ck.save(tmp_path / "s.pt", {"w": torch.ones(4)})
    (background_name, background_nice), (caller_name, caller_nice) = seen
    assert background_name != threading.current_thread().name and background_nice == min(19, process + 10)
    # A sync save writes in a thread of its own (watched for the stall bound, issue 68) at the caller's priority:
    # the loop waits for it, so it must not yield; the caller's own priority is untouched.
    assert caller_name == "ckptools-save" and caller_nice == process
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == process
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == process
