"""CheckpointManager.snapshot: the newest state in node memory (issue 35's first part).

The kill -9 of a whole torchrun job is in test_train_ddp_e2e.py (slow: `make interop` runs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
from _dist import run_ranks

import ckptools as ck
from ckptools.node import snapshot as node_snapshot
from ckptools.node.slots import NodeSlots

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(value: float) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        model.weight.fill_(value)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 64)).sum().backward()
    opt.step()  # momentum buffers: optimizer state to restore too
    return {"model": model, "optimizer": opt}


def _files(folder) -> list[str]:
    """The snapshots and temporaries in a node-memory folder (not the keeper's .pids and .keeper)."""
    return sorted(n for n in os.listdir(folder) if not n.startswith("."))


def _slot_files(folder) -> list[str]:
    """Every snapshot and slot file (committed or spare) in a node-memory folder."""
    return [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".pt") or "snapshot-slot" in n]


def _inode(path) -> int:
    return os.stat(path).st_ino


def _manager(tmp_path, **kwargs) -> ck.CheckpointManager:
    memory = tmp_path / "node-memory"  # tmp_path stands in for /dev/shm: any folder works
    return ck.CheckpointManager(tmp_path / "run", snapshot_dir=memory, **kwargs)


@pytest.mark.versions  # torch's storages mapped from node memory
def test_restore_takes_the_newest_of_node_memory_and_disk_bit_exact(tmp_path):
    manager = _manager(tmp_path)
    manager.save({**_state(1.0), "step": 10}, 10)
    for step in (11, 12, 13):
        state = _state(float(step))
        manager.snapshot({**state, "step": step}, step)
    assert [s for s, _ in manager.snapshots()] == [13]  # one snapshot between snapshots
    assert _files(manager.snapshot_dir) == ["ckpt-0000000013.pt"]
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    momentum = [s["momentum_buffer"].clone() for s in state["optimizer"].state_dict()["state"].values()]
    target = _state(0.0)
    restored = manager.restore(target)
    assert restored["step"] == 13
    for key, value in target["model"].state_dict().items():
        assert value.numpy().tobytes() == expected[key].numpy().tobytes(), key
    got = [s["momentum_buffer"] for s in target["optimizer"].state_dict()["state"].values()]
    assert all(a.numpy().tobytes() == b.numpy().tobytes() for a, b in zip(got, momentum))
    # A snapshot is the checkpoint save writes: torch's safe loader reads it.
    assert torch.load(manager.snapshots()[-1][1], weights_only=True)["step"] == 13
    manager.save({**_state(14.0), "step": 14}, 14)  # a newer durable checkpoint wins
    assert manager.restore(_state(0.0))["step"] == 14


def test_a_truncated_snapshot_is_skipped_at_restore_and_the_durable_one_read(tmp_path):
    """Restore checks a snapshot's container, not its records' CRC-32s again (its commit wrote
    them); a snapshot whose container is not whole (here cut short) is never loaded."""
    manager = _manager(tmp_path)
    manager.save({**_state(1.0), "step": 10}, 10)
    manager.snapshot({**_state(11.0), "step": 11}, 11, blocking=True)
    path = manager.snapshots()[-1][1]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    target = _state(0.0)
    assert manager.restore(target)["step"] == 10
    assert torch.equal(target["model"].weight, _state(1.0)["model"].weight)


def test_a_snapshot_holds_the_state_as_of_the_call_and_reuses_its_two_slots(tmp_path):
    manager = _manager(tmp_path)
    state = _state(3.0)
    expected = state["model"].weight.detach().clone()
    manager.snapshot({**state, "step": 1}, 1)
    manager.snapshot({**state, "step": 2}, 2)
    manager.wait()  # its commit renames files in the background: look once it is done
    slots = {_inode(p) for p in _slot_files(manager.snapshot_dir)}
    assert len(slots) == 2  # the newest and the spare
    assert manager.snapshot({**state, "step": 3}, 3).endswith("ckpt-0000000003.pt")
    with torch.no_grad():
        state["model"].weight.add_(1.0)  # at once: the snapshot keeps the weights as of the call
    manager.wait()  # the commit (CRC-32s, rename) ran in the background
    assert {_inode(p) for p in _slot_files(manager.snapshot_dir)} == slots  # no new memory: the slots are reused
    target = _state(0.0)
    assert manager.restore(target)["step"] == 3 and torch.equal(target["model"].weight, expected)
    assert _files(manager.snapshot_dir) == ["ckpt-0000000003.pt"]
    manager.close()


def test_a_snapshot_that_fails_midway_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    manager = _manager(tmp_path)
    kept = _state(5.0)
    manager.snapshot({**kept, "step": 5}, 5, blocking=True)
    real = NodeSlots.stage

    def dies(slots, source):  # a kill during the copy, as far as the folder can tell
        real(slots, source[: len(source) // 2])
        raise OSError("killed mid-copy")

    monkeypatch.setattr(NodeSlots, "stage", dies)
    manager.snapshot({**_state(6.0), "step": 6}, 6)  # returns: its commit fails in the background
    monkeypatch.undo()
    assert _files(manager.snapshot_dir) == ["ckpt-0000000005.pt"]  # no torn file
    with pytest.raises(ck.CheckpointError, match="not committed.*killed mid-copy"):
        manager.snapshot({**_state(7.0), "step": 7}, 7)  # the next call says so, on every rank
    target = _state(0.0)
    assert manager.restore(target)["step"] == 5
    assert torch.equal(target["model"].weight, kept["model"].weight)
    with pytest.raises(ck.CheckpointError, match="killed mid-copy"):  # blocking: at once
        monkeypatch.setattr(NodeSlots, "stage", dies)
        manager.snapshot({**_state(8.0), "step": 8}, 8, blocking=True)
    assert _files(manager.snapshot_dir) == ["ckpt-0000000005.pt"]


def test_a_whole_copy_whose_commit_failed_is_sealed_at_restore_and_a_partial_one_never(tmp_path, monkeypatch):
    """Every rank's copy is whole and the commit did not happen (a kill, or here a failure, during
    its CRC-32s): the restore seals that step and resumes from it. A copy some rank did not finish,
    or a damaged slot, is never sealed: the committed snapshot before it is taken (ckptools.node.sealing)."""
    from ckptools.node import checkpoint_names, finish_snapshot, sealing, settle

    manager = _manager(tmp_path)
    manager.snapshot({**_state(5.0), "step": 5}, 5, blocking=True)

    def fails(*_):
        raise OSError("killed during the CRC-32s")

    monkeypatch.setattr(node_snapshot, "crc32s", fails)
    copied = _state(6.0)
    manager.snapshot({**copied, "step": 6}, 6)  # copied whole; its commit fails in the background
    settle(manager.snapshot_dir)  # the commit thread ran (and failed) before the CRC-32s come back
    monkeypatch.undo()
    with pytest.raises(ck.CheckpointError, match="not committed.*killed during the CRC-32s"):
        finish_snapshot(manager.snapshot_dir)  # the failure is said first, on every rank
    memory = manager.snapshot_dir
    (record,) = [n for n in os.listdir(memory) if n.endswith(sealing.COPIES)]
    slot = os.path.join(memory, record[: -len(sealing.COPIES)])
    with open(slot, "rb") as f:
        before = f.read()
    names = checkpoint_names("ckpt")
    with open(slot + sealing.COPIES, "r+b") as f:
        f.write(b"\x00")  # as if rank 0 had not finished its copy
    assert sealing.seal(memory, names) is None
    with open(slot + sealing.COPIES, "r+b") as f:
        f.write(b"\x01")
    with open(slot, "r+b") as f:
        f.truncate(len(before) - 10)  # the end records cut: not a container any more
    said = []
    assert sealing.seal(memory, names, warn=said.append) is None
    assert "ckpt-0000000006.pt" in said[0] and "could not be sealed" in said[0], said
    with open(slot, "wb") as f:
        f.write(before)
    target = _state(0.0)
    assert manager.restore(target)["step"] == 6  # sealed first
    assert torch.equal(target["model"].weight, copied["model"].weight)
    assert "every record" in ck.verify(os.path.join(memory, "ckpt-0000000006.pt"))  # every CRC-32 right
    assert not any(n.endswith(sealing.COPIES) for n in os.listdir(memory))


def test_too_small_a_memory_folder_is_a_clear_error_before_anything_is_written(tmp_path):
    folder = tmp_path / "small-shm"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        manager = ck.CheckpointManager(tmp_path / "run", snapshot_dir=folder / "snaps")
        big = {"w": torch.zeros(300_000)}  # 1.2 MB: two slots need 2.3 MiB, the folder holds 1 MiB
        with pytest.raises(ck.NodeMemoryError) as raised:
            manager.snapshot(big, 1)
        text = str(raised.value)
        assert "free" in text and "two snapshot slots of this state need 2.3 MiB" in text, text
        assert "--shm-size" in text and "emptyDir" in text and "snapshot_dir" in text, text
        assert _files(folder / "snaps") == []  # nothing written
        manager.snapshot({"w": torch.zeros(1000)}, 2)  # a state that fits: fine
        assert [s for s, _ in manager.snapshots()] == [2]
        manager.close()  # unmaps the slots: the folder can be unmounted
    finally:
        subprocess.run(["umount", str(folder)], check=True)


SCRIPT = """
import os, sys, torch, ckptools as ck
manager = ck.CheckpointManager(sys.argv[1], snapshot_dir=sys.argv[2], keep_last=2)
manager.save({"w": torch.zeros(4)}, 5)
manager.snapshot({"w": torch.ones(4)}, 7, blocking=True)  # committed before the crash
if sys.argv[3] == "crash":
    os._exit(1)  # a crash: no cleanup at all
ck.exit_process(0)
"""


def _keepers(folder) -> list[str]:
    out = subprocess.run(["pgrep", "-f", f"ckptools.node.keeper {folder}"], capture_output=True, text=True).stdout
    return out.split()


def test_a_normal_end_releases_node_memory_and_a_crash_is_persisted_by_the_keeper(tmp_path):
    """A normal end removes the node memory; a crash keeps it for a relaunch, and when none comes
    within the keeper's grace, the keeper copies the snapshot into the run folder as the ordinary
    checkpoint of its step, releases the memory and exits: no process of ours remains. (Both jobs
    run at once.)"""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    said = tmp_path / "keeper.log"  # CKPTOOLS_KEEPER_LOG: what the keepers did, else said nowhere
    env = dict(os.environ, CKPTOOLS_KEEPER_GRACE="1", CKPTOOLS_KEEPER_LOG=str(said))
    jobs = {}
    for how in ("normal", "crash"):
        memory, run = tmp_path / how / "node-memory", tmp_path / how / "run"
        proc = subprocess.Popen([sys.executable, str(script), str(run), str(memory), how], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        jobs[how] = (proc, memory, run)
    for how, (proc, _memory, _run) in jobs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == (0 if how == "normal" else 1), out
    assert "ckpt-0000000007.pt" in os.listdir(jobs["crash"][1])  # kept: a relaunch would resume from it
    deadline = time.monotonic() + 30
    for how, (_, memory, _run) in jobs.items():
        while (memory.exists() or _keepers(memory)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not memory.exists() and _keepers(memory) == [], how
    _, _, run = jobs["normal"]
    assert sorted(os.listdir(run)) == ["ckpt-0000000005.pt"]  # the job's own end: nothing to persist
    _, _, run = jobs["crash"]
    assert sorted(os.listdir(run)) == ["ckpt-0000000005.pt", "ckpt-0000000007.pt"]
    persisted = torch.load(run / "ckpt-0000000007.pt", weights_only=True)
    assert persisted["w"].tolist() == [1.0] * 4 and persisted["__ckptools__"]["metadata"]["step"] == 7
    assert ck.CheckpointManager(run).restore({})["__ckptools__"]["metadata"]["step"] == 7
    log = said.read_text()
    assert f"persisted {run / 'ckpt-0000000007.pt'}" in log and f"released {jobs['crash'][1]}" in log, log
    assert "keeping " in log and os.stat(said).st_mode & 0o777 == 0o600, log


FIRST_LAUNCH = """
import os, sys, torch, ckptools as ck, ckptools.node.folder
ckptools.node.folder.start_keeper = lambda *args: None  # the test runs this folder's keeper itself
manager = ck.CheckpointManager(sys.argv[1], snapshot_dir=sys.argv[2])
manager.snapshot({"w": torch.ones(4)}, 7, blocking=True)
os._exit(1)  # killed
"""

RELAUNCH = """
import os, sys, torch, ckptools as ck
from ckptools.node.folder import watch
manager = ck.CheckpointManager(sys.argv[1], snapshot_dir=sys.argv[2])
watch(sys.argv[2])  # what its first snapshot does first: the job registered for the keeper
print("registered", flush=True)
sys.stdin.readline()
manager.snapshot({"w": torch.full((4,), 2.0)}, 9, blocking=True)  # its keeper finds the folder kept: it leaves
print("taken", flush=True)
sys.stdin.readline()
os._exit(1)  # killed in turn
"""


@pytest.mark.parametrize("copy", ["persisted", "failed"])
def test_a_relaunch_that_registers_while_the_keeper_persists_is_kept_by_that_keeper(
    tmp_path, monkeypatch, capsys, copy
):
    """The keeper, at the end of its grace, persists the dead job's snapshot; a relaunch that registers
    during that copy keeps the node memory, and its own keeper, finding this one alive, leaves. This one
    then watches the relaunch: killed in turn, its newer snapshot is persisted and the memory released
    (the keeper used to exit there, leaving the relaunch's snapshots to nobody). So too when the copy
    failed meanwhile (the relaunch's first snapshot recycles the file being copied)."""
    from ckptools.node import keeper

    memory, run = tmp_path / "node-memory", tmp_path / "run"
    env = dict(os.environ, CKPTOOLS_KEEPER_GRACE="60")
    (tmp_path / "first.py").write_text(FIRST_LAUNCH)
    (tmp_path / "relaunch.py").write_text(RELAUNCH)
    first = subprocess.run([sys.executable, str(tmp_path / "first.py"), str(run), str(memory)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert first.returncode == 1 and "ckpt-0000000007.pt" in os.listdir(memory), first.stderr[-3000:]
    relaunch: list[subprocess.Popen] = []
    persisted = threading.Event()  # the first persist has returned (or raised)
    own = keeper.persist

    def persist(*args):  # the relaunch registers while the dead job's snapshot is copied
        if persisted.is_set():
            return own(*args)
        try:
            proc = subprocess.Popen([sys.executable, str(tmp_path / "relaunch.py"), str(run), str(memory)], cwd=ROOT,
                                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
            relaunch.append((proc, proc.stdout.readline()))
            if copy == "failed":
                raise FileNotFoundError(2, "No such file or directory", str(memory / "ckpt-0000000007.pt"))
            return own(*args)
        finally:
            persisted.set()

    monkeypatch.setattr(keeper, "persist", persist)
    kept = threading.Thread(target=keeper.main, args=([str(memory), str(run), "--grace", "0.5", "--poll", "0.05"],))
    kept.start()
    assert persisted.wait(60), "the keeper did not persist within 60 s"
    proc, said = relaunch[0]
    assert said == "registered\n"
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "taken\n"
    assert kept.is_alive() and memory.exists(), capsys.readouterr().err  # kept for the relaunch, and watched
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) == 1
    kept.join(60)
    log = capsys.readouterr().err
    assert not kept.is_alive() and not memory.exists(), log
    expected = ["ckpt-0000000007.pt", "ckpt-0000000009.pt"] if copy == "persisted" else ["ckpt-0000000009.pt"]
    assert sorted(os.listdir(run)) == expected, log
    assert torch.load(run / "ckpt-0000000009.pt", weights_only=True)["w"].tolist() == [2.0] * 4
    assert "a relaunch registered" in log and "kept for it, and watched" in log and "released" in log, log


WRITER = """
import os, sys
folder, i = sys.argv[1], 0
print("writing", flush=True)
while True:  # what a keeper starting late does: a file created by name in the folder
    try:
        os.close(os.open(os.path.join(folder, f"late-{i}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileNotFoundError:
        sys.exit(0)
    i += 1
"""


def test_the_normal_end_removes_node_memory_while_another_process_still_writes_into_it(tmp_path, monkeypatch):
    """Seen in CI: the relaunch's keeper started late (under load) and created its lock file in the
    folder while the job's normal end emptied it; the last rmdir failed with "Directory not empty" and
    rank 0 exited 1 after a whole run. The release takes the folder out of its name first."""
    from ckptools.node import folder as node_folder
    from ckptools.node.names import claim

    monkeypatch.setattr(node_folder, "_REGISTERED", set())  # what this process's other tests left is theirs
    memory = str(tmp_path / "node-memory" / "ckptools-me-0123")
    claim(memory)
    for i in range(3000):  # enough that emptying it takes a while
        open(os.path.join(memory, f"f{i}"), "wb").close()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, memory], stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None and writer.stdout.readline().strip() == "writing"
    node_folder.register(memory)
    try:
        assert node_folder.release_folders() == [memory]
    finally:
        writer.kill() if writer.poll() is None and os.path.isdir(memory) else None
    assert writer.wait(timeout=30) == 0  # it found no folder to write into: none was made again
    assert os.listdir(tmp_path / "node-memory") == []  # nothing left under another name either


def test_what_a_killed_release_left_under_another_name_goes_and_a_link_of_that_name_is_not_followed(tmp_path):
    """A release killed while it emptied the folder leaves ``FOLDER.released-*`` holding memory; the next
    job's first snapshot removes it. A link of that name (another user's trap) is not followed."""
    from ckptools.node.names import claim, sweep_released

    memory = str(tmp_path / "ckptools-me-0123")
    claim(memory)
    left = memory + ".released-0a1b2c"
    claim(left)
    open(os.path.join(left, "ckpt-0000000003.pt"), "wb").close()
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep").write_text("x")
    os.symlink(precious, memory + ".released-ffffff")
    assert sweep_released(memory) == [left]
    assert not os.path.exists(left) and (precious / "keep").read_text() == "x"
    assert os.path.islink(memory + ".released-ffffff") and os.path.isdir(memory)


def test_the_default_folder_is_in_node_memory_and_per_run(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPTOOLS_NODE_MEMORY", raising=False)
    a, b = ck.CheckpointManager(tmp_path / "a"), ck.CheckpointManager(tmp_path / "b")
    assert a.snapshot_dir != b.snapshot_dir
    assert a.snapshot_dir == ck.CheckpointManager(str(tmp_path / "a")).snapshot_dir  # a relaunch finds it
    if os.path.isdir("/dev/shm"):
        assert a.snapshot_dir.startswith("/dev/shm/ckptools-")
    monkeypatch.setenv("CKPTOOLS_NODE_MEMORY", str(tmp_path / "elsewhere"))
    assert ck.CheckpointManager(tmp_path / "a").snapshot_dir.startswith(str(tmp_path / "elsewhere"))


def _orphaned_with_a_slow_share(rank: int, world: int, directory: str) -> tuple:
    """Both ranks' agent gone (as after a kill of torchrun alone); rank 1 starts copying its share of the
    node's slot a second late. The snapshot is committed without the store, checksummed by rank 0."""
    from ckptools.layouts import verify_torch_file
    from ckptools.node import Orphaned
    from ckptools.node.slots import NodeSlots

    node_snapshot.launcher_gone = lambda: True
    if rank == 1:
        stage = NodeSlots.stage

        def late(self, items):
            time.sleep(1.0)
            return stage(self, items)

        NodeSlots.stage = late
    slots = NodeSlots(os.path.join(directory, "memory"), "ckpt")
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]))
    state = {"model": model}  # its replicated weights: each rank copies a share (here about 2 MiB each)
    try:
        node_snapshot.write_snapshot(slots, "ckpt-0000000001.pt", state)
    except Orphaned as gone:
        committed = gone.committed
    else:
        raise AssertionError("not orphaned")
    path = os.path.join(directory, "memory", "ckpt-0000000001.pt")
    if rank != 0:
        return committed, None, None
    try:
        verify_torch_file(path)
        checked = "every CRC-32 matches"
    except ck.CheckpointError as err:
        checked = str(err)
    weights = torch.load(path, weights_only=True)["model"]
    return committed, checked, all(torch.equal(weights[k], v) for k, v in model.module.state_dict().items())


def test_the_last_snapshot_of_a_job_whose_agent_died_is_checksummed_after_every_share_is_copied(tmp_path):
    """torchrun's agent killed: the job's last snapshot is committed without the store, its node's leader
    computing every record's CRC-32. It did so before the other ranks' shares were copied: under load
    the "committed" snapshot failed its CRC-32s, the keeper skipped it and 7 steps were lost (CI)."""
    results = run_ranks(_orphaned_with_a_slow_share, 2, str(tmp_path))
    assert results[0] == (True, "every CRC-32 matches", True) and results[1][0] is True, results


def _two_nodes(rank: int, world: int, directory: str) -> tuple:
    """Two simulated nodes, each with a node-memory folder of its own: ranks 0 and 2 on node A,
    rank 1 alone on node B (so node B's leader receives what only rank 0 holds)."""
    import filecmp

    from torch.nn.parallel import DistributedDataParallel

    from ckptools.collective.group import barrier
    from ckptools.node.names import discard

    node = "A" if rank in (0, 2) else "B"
    memory = os.path.join(directory, f"node{node}-memory")
    manager = ck.CheckpointManager(os.path.join(directory, "run"), snapshot_dir=memory)

    def make(seed: int) -> tuple:
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
        model = DistributedDataParallel(net)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, opt = make(1)
    for _ in range(2):
        model(torch.randn(4, 16) + rank).sum().backward()  # BatchNorm's statistics differ per rank
        opt.step()
    manager.snapshot({"model": model, "optimizer": opt, "step": 2}, 2)
    for _ in range(2):
        model(torch.randn(4, 16) + rank).sum().backward()
        opt.step()
    manager.snapshot({"model": model, "optimizer": opt, "step": 3}, 3, blocking=True)
    saved = {k: v.clone() for k, v in model.module.state_dict().items()}  # rank 0's buffers are what counts
    saved_buffers = [None]
    torch.distributed.broadcast_object_list(saved_buffers if rank else [saved], src=0)
    expected = saved if rank == 0 else {**saved, **{k: v for k, v in saved_buffers[0].items() if "running" in k}}
    barrier()
    identical = filecmp.cmp(
        os.path.join(directory, "nodeA-memory", "ckpt-0000000003.pt"),
        os.path.join(directory, "nodeB-memory", "ckpt-0000000003.pt"),
        shallow=False,
    )
    manager.close()
    barrier()
    if rank == 0:  # node A was replaced: its memory is gone
        # Removed as ckptools removes it (renamed, then emptied): the keeper the first snapshot started may
        # still be starting under load, and its lock, written between rmtree's listing and its last rmdir,
        # failed the test with "Directory not empty" (CI). A replaced node's keeper is gone with it.
        discard(os.path.join(directory, "nodeA-memory"))
    barrier()
    fresh, fresh_opt = make(2)
    restored = manager.restore({"model": fresh, "optimizer": fresh_opt})
    same = all(torch.equal(v, expected[k]) for k, v in fresh.module.state_dict().items())
    return restored["step"], same, identical, _files(memory)


@pytest.mark.slow  # make interop (three spawned ranks): make test stays within its 5 minutes
def test_every_node_keeps_a_snapshot_and_a_replaced_node_gets_it_back(tmp_path):
    """Every node writes one whole snapshot (byte-identical on both, rank 0's buffers on both);
    when rank 0's node lost its memory, the relaunch sends it the snapshot from the other node,
    and every rank restores the same step, bit-exact."""
    results = run_ranks(_two_nodes, 3, str(tmp_path))
    for rank, (step, same, identical, files) in enumerate(results):
        assert step == 3 and same and identical, (rank, results)
        assert files == ["ckpt-0000000003.pt"], (rank, files)  # node A has it back in its memory


def test_the_keeper_imports_no_torch():
    """It lives beside every job that snapshots: a few MB, not torch's hundreds."""
    code = "import sys, ckptools.node.keeper; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stdout + proc.stderr


def test_ckpt_info_of_a_run_folder_lists_its_checkpoints_and_this_nodes_snapshots(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from ckptools.cli import app

    monkeypatch.setenv("CKPTOOLS_NODE_MEMORY", str(tmp_path / "shm"))
    run = tmp_path / "run"
    manager = ck.CheckpointManager(run)
    manager.save({"w": torch.ones(4)}, 10)
    manager.snapshot({"w": torch.ones(4)}, 11, blocking=True)  # committed: what another process lists
    shown = CliRunner().invoke(app, ["info", str(run)])
    assert shown.exit_code == 0, shown.output
    assert "ckpt-0000000010.pt" in shown.output and "ckpt-0000000011.pt" in shown.output
    text = " ".join(shown.output.split())  # the terminal's width may fold the line
    assert "the snapshot of step 11 is newer than every checkpoint: a restore resumes from it" in text
    report = json.loads(CliRunner().invoke(app, ["info", str(run), "--json"]).output)
    (entry,) = report["runs"]
    assert [c["step"] for c in entry["checkpoints"]] == [10] and [s["step"] for s in entry["snapshots"]] == [11]
    assert entry["snapshot_dir"] == manager.snapshot_dir
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("no checkpoint here")
    refused = CliRunner().invoke(app, ["info", str(tmp_path / "other")])
    assert refused.exit_code == 2 and "not a checkpoint layout" in refused.output


def test_ckpt_info_and_verify_of_an_hf_trainer_or_lightning_folder_show_their_snapshots(tmp_path, monkeypatch):
    """The HF Trainer's output_dir (checkpoint-N/ folders, no numbered file) and Lightning's dirpath (the
    ModelCheckpoint's files) show what the integrations keep of them in this node's memory; `verify`
    checks the Trainer's folders and the snapshots, each on a line of its own."""
    import json

    from typer.testing import CliRunner

    from ckptools.cli import app
    from ckptools.integrations import LIGHTNING_PREFIX
    from ckptools.layouts import TRAINER

    monkeypatch.setenv("CKPTOOLS_NODE_MEMORY", str(tmp_path / "shm"))
    out = tmp_path / "hf"
    folder = out / "checkpoint-10"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    torch.save({"state": {}}, folder / "optimizer.pt")
    refused = CliRunner().invoke(app, ["info", str(out)])
    assert refused.exit_code == 2 and "not a checkpoint layout" in refused.output  # nothing in memory yet
    hf = ck.CheckpointManager(out, prefix=TRAINER.prefix)
    hf.snapshot({"w": torch.ones(4)}, 13, blocking=True)
    shown = CliRunner().invoke(app, ["info", str(out)])
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())
    assert "the folder of a run of the HF Trainer (CkptoolsCallback)" in text, text
    assert "checkpoint-10" in text and "trainer-snapshot-0000000013.pt" in text, text
    assert "the snapshot of step 13 is newer than every checkpoint-N folder" in text, text
    verified = CliRunner().invoke(app, ["verify", str(out)])
    lines = verified.output.splitlines()
    assert any(str(folder) in line for line in lines), verified.output  # the folder is judged, not passed over
    assert any("trainer-snapshot-0000000013.pt" in line and line.split()[-1] != "DAMAGED" for line in lines)
    pl = tmp_path / "pl"
    pl.mkdir()
    torch.save({"state_dict": {}}, pl / "last.ckpt")
    lightning = ck.CheckpointManager(pl, prefix=LIGHTNING_PREFIX)
    lightning.snapshot({"w": torch.ones(4)}, 5, blocking=True)
    shown = CliRunner().invoke(app, ["info", str(pl), "--json"])
    (entry,) = json.loads(shown.output)["runs"]
    assert entry["of"] == "Lightning (NodeSnapshots)" and [s["step"] for s in entry["snapshots"]] == [5]
    assert entry["checkpoints"] == []
    text = " ".join(CliRunner().invoke(app, ["info", str(pl)]).output.split())
    assert "0 checkpoints" not in text and "last-snapshot-0000000005.ckpt" in text, text
    hf.close()
    lightning.close()


def test_ckpt_info_and_verify_of_an_accelerate_output_dir_show_its_snapshots(tmp_path, monkeypatch):
    """Accelerate's Snapshots keep node memory for its output_dir (save_state folders, no numbered file):
    `ckpt info` and `ckpt verify` of that folder list them, naming the framework."""
    import json

    from typer.testing import CliRunner

    from ckptools.cli import app
    from ckptools.layouts import ACCELERATE

    monkeypatch.setenv("CKPTOOLS_NODE_MEMORY", str(tmp_path / "shm"))
    out = tmp_path / "accelerate"
    (out / "step_4").mkdir(parents=True)
    manager = ck.CheckpointManager(out, prefix=ACCELERATE.prefix)
    manager.snapshot({"w": torch.ones(4)}, 6, blocking=True)
    shown = CliRunner().invoke(app, ["info", str(out), "--json"])
    assert shown.exit_code == 0, shown.output
    (entry,) = json.loads(shown.output)["runs"]
    assert entry["of"] == "Accelerate (accelerate_snapshots.Snapshots)" and [s["step"] for s in entry["snapshots"]] == [
        6
    ]
    text = " ".join(CliRunner().invoke(app, ["info", str(out)]).output.split())
    assert "accelerate-snapshot-0000000006.pt" in text and "Snapshots.latest()" in text, text
    verified = CliRunner().invoke(app, ["verify", str(out)])
    lines = verified.output.splitlines()
    assert any("accelerate-snapshot-0000000006.pt" in line and line.split()[-1] != "DAMAGED" for line in lines), lines
    manager.close()


def test_an_accelerate_snapshot_is_written_out_as_its_typed_layout_says_and_one_without_it_is_refused(
    tmp_path, monkeypatch
):
    """Issue 66: what an Accelerate snapshot holds is one typed record (`AccelerateLayout`), written by
    `Snapshots` and read by the write-out; its entries and file names come from one table. A snapshot under
    Accelerate's prefix that carries no layout is a named `CheckpointFormatError`, nothing written."""
    from ckptools.layouts import ACCELERATE, AccelerateLayout, accelerate_file
    from ckptools.node import snapshot_to_state_folder

    monkeypatch.setenv("CKPTOOLS_NODE_MEMORY", str(tmp_path / "shm"))
    out = tmp_path / "accelerate"
    manager = ck.CheckpointManager(out, prefix=ACCELERATE.prefix)
    entry = AccelerateLayout.entry
    state = {entry("model", 0): {"w": torch.arange(4.0)}, entry("model", 1): {"v": torch.ones(2)}}
    state.update({entry("optimizer", 0): {"state": {}, "param_groups": []}, entry("custom", 0): {"epoch": 3}})
    state["accelerator"] = {"step": 5}
    layout = AccelerateLayout("ep_{step}", models=2, optimizers=1, customs=1)
    folder = snapshot_to_state_folder(
        manager.snapshot(state, 5, blocking=True, metadata=layout.to_metadata()), str(out)
    )
    assert folder == str(out / "ep_5")
    names = sorted(os.listdir(folder))
    expected = [accelerate_file("custom", 0), accelerate_file("model", 0), accelerate_file("model", 1),
                accelerate_file("optimizer"), accelerate_file("random_states", rank=0)]  # fmt: skip
    assert [n for n in names if n != "ckptools-manifest.json"] == sorted(expected), names
    from safetensors.torch import load_file

    assert load_file(os.path.join(folder, "model_1.safetensors"))["v"].equal(torch.ones(2))
    assert torch.load(os.path.join(folder, "custom_checkpoint_0.pkl"), weights_only=True) == {"epoch": 3}
    assert torch.load(os.path.join(folder, "random_states_0.pkl"), weights_only=False)["step"] == 5
    bare = manager.snapshot({"w": torch.ones(1)}, 6, blocking=True)
    with pytest.raises(
        ck.CheckpointFormatError, match=r"accelerate-snapshot-0000000006\.pt holds no Accelerate layout"
    ):
        snapshot_to_state_folder(bare, str(out))
    assert sorted(os.listdir(out)) == ["ep_5"]  # nothing written, no temporary folder left
    manager.close()


def _toy_write_out(snapshot: str, run_dir: str) -> str | None:
    """The toy framework's write-out: its folder toy-N/ holding the snapshot's weights."""
    data = torch.load(snapshot, weights_only=True)
    step = int(data["__ckptools__"]["metadata"]["step"])
    folder = os.path.join(run_dir, f"toy-{step}")
    os.mkdir(folder)
    torch.save(data["w"], os.path.join(folder, "w.pt"))
    return folder


def test_a_framework_added_to_the_table_alone_is_listed_verified_and_written_out_by_the_keeper(tmp_path, monkeypatch):
    """Issue 66: a fourth framework is one entry of ckptools.layouts.frameworks, nothing else: `ckpt info`
    lists its snapshots (and its folders as its checkpoints), `ckpt verify` checks them, the keeper writes
    the newest out through the entry's function."""
    import json
    import re

    from typer.testing import CliRunner

    from ckptools.cli import app
    from ckptools.layouts import frameworks
    from ckptools.node.keeper import persist

    toy = frameworks.Framework("Toy (ToySnapshots)", "toy-snapshot", folders=re.compile(r"^toy-(\d+)$"),
                               write_out=f"{__name__}:_toy_write_out", resumes="is what Toy resumes from")  # fmt: skip
    monkeypatch.setattr(frameworks, "FRAMEWORKS", (*frameworks.FRAMEWORKS, toy))
    monkeypatch.setenv("CKPTOOLS_NODE_MEMORY", str(tmp_path / "shm"))
    run = tmp_path / "toy-run"
    (run / "toy-3").mkdir(parents=True)
    (run / "toy-3" / "w.pt").write_bytes(b"x" * 10)
    manager = ck.CheckpointManager(run, prefix="toy-snapshot")
    manager.snapshot({"w": torch.arange(4.0)}, 7, blocking=True)
    (entry,) = json.loads(CliRunner().invoke(app, ["info", str(run), "--json"]).output)["runs"]
    assert entry["of"] == "Toy (ToySnapshots)" and [s["step"] for s in entry["snapshots"]] == [7]
    assert [(c["step"], c["bytes"]) for c in entry["checkpoints"]] == [(3, 10)]
    text = " ".join(CliRunner().invoke(app, ["info", str(run)]).output.split())
    assert "the snapshot of step 7 is what Toy resumes from" in text, text
    lines = CliRunner().invoke(app, ["verify", str(run)]).output.splitlines()
    assert any("toy-snapshot-0000000007.pt" in line and line.split()[-1] != "DAMAGED" for line in lines), lines
    written = persist(manager.snapshot_dir, str(run), "toy-snapshot", 1)
    assert written == str(run / "toy-7")
    assert torch.load(run / "toy-7" / "w.pt", weights_only=True).equal(torch.arange(4.0))
    manager.close()


def test_a_snapshot_does_not_wait_for_an_async_save_in_flight(tmp_path, monkeypatch):
    """The durable async save is still writing (held here until released): the snapshot is taken
    and committed beside it; then both files are whole, and restore takes the newer snapshot."""
    import threading

    from ckptools import saving

    release = threading.Event()
    real = saving.write_alone

    def held(location, payload):
        assert release.wait(60), "the durable write was never released"
        return real(location, payload)

    monkeypatch.setattr(saving, "write_alone", held)
    manager = _manager(tmp_path)
    manager.save({**_state(1.0), "step": 10}, 10, blocking=False)
    assert not manager.pending.done()
    manager.snapshot({**_state(11.0), "step": 11}, 11, blocking=True)  # would hang if it waited for the save
    assert not manager.pending.done() and [s for s, _ in manager.snapshots()] == [11]
    release.set()
    manager.wait()
    assert [s for s, _ in manager.checkpoints()] == [10]
    target = _state(0.0)
    assert manager.restore(target)["step"] == 11
    assert torch.equal(target["model"].weight, _state(11.0)["model"].weight)
    manager.close()


def _budgeted(rank: int, world: int, directory: str, clock: bool) -> dict:
    """A loop whose tiny snapshot costs far more than the budget allows of a step: the ranks skip the
    same calls (agreed in the snapshot's exchange). ``clock``: node memory's clock is one the loop moves
    (20 ms a step, 2 ms inside each snapshot), so the cadence is exactly computable."""
    from ckptools.node import memory as memory_module

    now = [0.0]

    class Clock:
        @staticmethod
        def monotonic() -> float:
            now[0] += 0.002  # at every call's start, and at a snapshot's end: a 2 ms stall
            return now[0]

    if clock:
        memory_module.time = Clock  # type: ignore[assignment]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    manager = ck.CheckpointManager(os.path.join(directory, "run"), snapshot_dir=os.path.join(directory, "memory"))
    taken = []
    for step in range(1, 61):
        if clock:
            now[0] += 0.02  # the step
        else:
            time.sleep(0.02)
        if manager.snapshot({"model": model, "step": step}, step, budget=0.05 if clock else 0.01) is not None:
            taken.append(step)
    last = manager.snapshots()[-1][0]
    manager.close()
    return {"taken": taken, "last": last}


def test_a_budget_skips_the_same_calls_on_every_rank(tmp_path):
    results = run_ranks(_budgeted, 2, str(tmp_path), False, timeout=180)
    taken = results[0]["taken"]
    assert results[1]["taken"] == taken, results  # the same calls everywhere: nothing hangs
    assert taken[:2] == [1, 2] and len(taken) < 30 and results[0]["last"] == taken[-1], taken


def test_a_budget_keeps_the_stalls_within_it_at_the_cadence_it_computes(tmp_path):
    """A 2 ms stall, a call every 22-24 ms, 5 %: one call in ceil(2 / (0.05 * 24)) = 2 from the third
    on (the first allocates the slots, the second is the first measured), on every rank."""
    results = run_ranks(_budgeted, 2, str(tmp_path), True, timeout=180)
    taken = results[0]["taken"]
    assert results[1]["taken"] == taken
    assert taken == [1, 2, 3, *range(5, 61, 2)], taken


def test_without_a_budget_every_call_is_taken(tmp_path):
    manager = _manager(tmp_path)
    assert all(manager.snapshot({**_state(1.0), "step": s}, s) is not None for s in range(1, 6))
    with pytest.raises(ValueError, match="budget must be a fraction"):
        manager.snapshot(_state(1.0), 6, budget=2.0)
    manager.close()


def test_the_bound_the_budget_states_holds_in_a_measured_run_and_no_budget_is_advised_once(tmp_path, caplog):
    """Issue 56 (4): each change of cadence is logged with the steps a kill then loses; in a measured run
    (a 1 ms step, a budget of 2 %) no two snapshots taken are further apart than the bound last stated.
    Without a budget every call is taken and INFO says once what a budget would give."""
    import logging
    import re

    manager = _manager(tmp_path)
    taken, stated = [], {}
    with caplog.at_level(logging.INFO, logger="ckptools"):
        for step in range(1, 161):
            time.sleep(0.001)
            before = len(caplog.records)
            if manager.snapshot({**_state(1.0), "step": step}, step, budget=0.02) is not None:
                taken.append(step)
            for record in caplog.records[before:]:
                said = re.search(r"a kill loses at most (\d+) steps?, about ([\d.]+) s", record.getMessage())
                if said:
                    stated[step] = int(said.group(1))
    assert stated and len(taken) < 80, (stated, taken)  # the budget thinned the calls, and said so
    for previous, following in zip(taken, taken[1:]):
        said = [s for s in stated if s <= previous]
        bound = stated[max(said)] if said else 1  # before any change of cadence: every call
        assert following - previous <= bound, (previous, following, stated)  # what a kill between them loses
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ckptools"):
        for step in range(200, 230):
            time.sleep(0.001)
            assert manager.snapshot({**_state(1.0), "step": step}, step) is not None  # no budget: every call
    advice = [r.getMessage() for r in caplog.records if "budget=0.02) keeps them within 2%" in r.getMessage()]
    assert len(advice) == 1, [r.getMessage() for r in caplog.records]
    manager.close()


def test_huge_pages_is_read_from_the_mount_the_folder_lives_on(tmp_path, monkeypatch):
    """A restore from node memory is ~1.2x the copy with huge pages and ~1.6x without
    (docs/guides/snapshots.md): which one a folder gets is told from its mount's options."""
    from ckptools.node import folder as node_folder

    mounts = tmp_path / "mounts"
    mounts.write_text(
        "proc /proc proc rw,nosuid 0 0\n"
        "tmpfs /dev/shm tmpfs rw,relatime,size=24684084k 0 0\n"
        "tmpfs /mnt/fast\\040mem tmpfs rw,relatime,size=4194304k,huge=within_size 0 0\n"
        "tmpfs /mnt/advised tmpfs rw,huge=advise 0 0\n"
        "/dev/sda1 / ext4 rw,relatime 0 0\n"
    )
    enabled = tmp_path / "shmem_enabled"
    enabled.write_text("always within_size advise [never] deny force\n")
    monkeypatch.setattr(node_folder, "_SHMEM_ENABLED", str(enabled))
    huge = node_folder.huge_pages
    assert huge("/dev/shm/ckptools-1", str(mounts)) is False
    assert huge("/mnt/fast mem/ckptools-1", str(mounts)) is True
    assert huge("/mnt/advised/x", str(mounts)) is False  # the restore's mapping does not ask for them
    assert huge("/home/u/run", str(mounts)) is None  # not a tmpfs
    assert huge("/dev/shm", str(tmp_path / "absent")) is None
    enabled.write_text("always within_size advise never deny [force]\n")
    assert huge("/dev/shm/ckptools-1", str(mounts)) is True
    # This machine's own table is read too; its /dev/shm is a tmpfs (huge pages or not).
    if os.path.isdir("/dev/shm") and sys.platform.startswith("linux"):
        monkeypatch.undo()
        assert huge("/dev/shm") in (True, False)


def test_a_snapshot_into_a_tmpfs_without_huge_pages_says_so_once(tmp_path, caplog):
    import logging

    from ckptools.node.folder import huge_pages

    if not os.path.isdir("/dev/shm") or huge_pages("/dev/shm") is not False:
        pytest.skip("needs a /dev/shm without huge pages, as most hosts have")
    memory = tempfile.mkdtemp(dir="/dev/shm", prefix="ckptools-test-pages-")
    manager = ck.CheckpointManager(str(tmp_path / "run"), snapshot_dir=memory)
    try:
        with caplog.at_level(logging.INFO, logger="ckptools"):
            for step in range(2):
                manager.snapshot({"w": torch.ones(4)}, step)
        said = [r.getMessage() for r in caplog.records if "huge pages" in r.getMessage()]
        assert len(said) == 1 and memory in said[0] and "huge=within_size" in said[0], said
    finally:
        manager.close()
        shutil.rmtree(memory, ignore_errors=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_commit_runs_below_the_steps_priority(tmp_path):
    """The commit (CRC-32s of the whole state) runs behind every step; at the step's priority it took
    one of a 2-core machine's cores from it (docs/benchmarks.md): it runs 10 nicer than the process."""
    import threading

    manager = _manager(tmp_path)
    manager.snapshot({"w": torch.ones(3)}, 1)
    manager.wait()
    threads = [t for t in threading.enumerate() if t.name == "ckptools-snapshot"]
    assert threads
    process = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, threads[0].native_id) == min(19, process + 10)
    manager.close()


def _tensors(obj) -> list[torch.Tensor]:
    tree = obj.state_dict()
    found: list[torch.Tensor] = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(tree)
    assert found
    return found


def test_the_keeper_names_a_lightning_snapshot_as_lightning_does_and_dates_it_when_it_was_taken(tmp_path):
    """Issue 56 (3): Lightning's ckpt_path="last" takes the newest last*.ckpt by modification time. The keeper
    persists NodeSnapshots' newest snapshot as last-snapshot-N.ckpt, dated when it was taken: a last.ckpt
    Lightning saved after the snapshot stays newer (never shadowed), one saved before it is older."""
    from ckptools.integrations import LIGHTNING_PREFIX
    from ckptools.node.keeper import persist

    run = tmp_path / "run"
    run.mkdir()
    manager = ck.CheckpointManager(run, keep_last=1, prefix=LIGHTNING_PREFIX, snapshot_dir=tmp_path / "memory")
    manager.snapshot({"state_dict": {"w": torch.ones(4)}, "global_step": 30}, 30, blocking=True)
    manager.close()
    (snapshot,) = manager.snapshots()
    taken = os.stat(snapshot[1]).st_mtime_ns
    torch.save({"global_step": 31}, run / "last.ckpt")  # saved after the snapshot
    os.utime(run / "last.ckpt", ns=(taken + 10**6, taken + 10**6))  # a millisecond after it
    time.sleep(0.05)
    written = persist(manager.snapshot_dir, str(run), LIGHTNING_PREFIX, 1)
    assert written is not None and os.path.basename(written) == "last-snapshot-0000000030.ckpt"
    assert os.stat(written).st_mtime_ns == taken < os.stat(run / "last.ckpt").st_mtime_ns
    newest = max((p for p in run.iterdir() if p.name.startswith("last") and p.suffix == ".ckpt"),
                 key=lambda p: p.stat().st_mtime_ns)  # fmt: skip  # Lightning's rule for ckpt_path="last"
    assert newest.name == "last.ckpt"
    assert torch.load(written, weights_only=True)["global_step"] == 30
