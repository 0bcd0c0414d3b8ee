"""A hostile second user on the same node (issue 54): node memory is this user's alone, every file is
read once, and nothing a file or another user does reaches the process or its snapshots.

``/dev/shm`` is shared by every local user. Where these tests run as root, the other user is a real
throw-away Unix user (``useradd``, removed after), running the system's Python; elsewhere the same user
stands in for it, and what only another user can show is left out (each test says which part).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass

import pytest
import torch

import ckptools as ck
from ckptools.storage import make_private

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SYSTEM_PYTHON = "/usr/bin/python3"  # readable by any user (this venv's interpreter may live under /root)


@dataclass
class Other:
    """Who plays the other user: a throw-away user (``uid`` set) or this user standing in."""

    uid: int | None
    gid: int | None
    name: str

    @property
    def real(self) -> bool:
        return self.uid is not None

    def popen(self, code: str, *args: str) -> subprocess.Popen:
        python = SYSTEM_PYTHON if self.real else sys.executable
        return subprocess.Popen([python, "-c", code, *args], user=self.uid, group=self.gid,
                                extra_groups=[] if self.real else None, cwd="/", stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip

    def run(self, code: str, *args: str) -> str:
        proc = self.popen(code, *args)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        return out


@pytest.fixture(scope="module")
def other():
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    if not (root and shutil.which("useradd") and os.access(SYSTEM_PYTHON, os.X_OK)):
        yield Other(None, None, "this user")
        return
    import pwd

    name = f"ckpt{secrets.token_hex(4)}"
    subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)  # fmt: skip
    try:
        info = pwd.getpwnam(name)
        yield Other(info.pw_uid, info.pw_gid, name)
    finally:
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
        subprocess.run(["userdel", name], capture_output=True)


def _shared_scratch() -> str:
    """A folder every user may write into: ``/dev/shm`` where there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


# (1) A file that would change the process: refused by the one reader, through node memory too.

BUILD_JOB = """
import collections, io, json, os, sys, torch, torch._utils
sys.path.insert(0, sys.argv[3])
import ckptools as ck
from _corpus import torch_save_building

manager = ck.CheckpointManager(sys.argv[1], snapshot_dir=sys.argv[2])
manager.snapshot({"w": torch.arange(4.0)}, 3, blocking=True)
path = manager.snapshots()[-1][1]
seen = []
for target, state in ((torch._utils._rebuild_tensor_v2, {"__module__": "this"}),
                      (collections.Counter, {"most_common": None})):
    with open(path + ".new", "wb") as f:  # this user's own snapshot, its bytes now those of a hostile file
        f.write(torch_save_building(target, state))
    os.replace(path + ".new", path)
    for how, read in (("restore", lambda: manager.restore({"w": torch.zeros(4)})),
                      ("load", lambda: ck.load(path)),
                      ("load(state)", lambda: ck.load(path, {"w": torch.zeros(4)})),
                      ("torch.load(weights_only=True)", lambda: torch.load(path, weights_only=True))):
        try:
            read()
            seen.append([how, "loaded"])
        except Exception as err:
            seen.append([how, type(err).__name__])
untouched = torch._utils._rebuild_tensor_v2.__module__ == "torch._utils" and callable(collections.Counter.most_common)
ck.save(os.path.join(sys.argv[1], "after.pt"), {"w": torch.ones(2)})
torch.save({"w": torch.ones(2)}, io.BytesIO())
print(json.dumps({"seen": seen, "untouched": untouched}))
"""


def test_a_snapshot_that_would_change_the_process_is_refused_and_nothing_changes(tmp_path):
    """(1) The own-snapshot reader (the C unpickler with an allowlist) loaded a BUILD onto an
    allowlisted global without a word: `_rebuild_tensor_v2.__module__ = "this"` and the process could no
    longer save. Now every file, node memory's included, is read by torch's weights-only unpickler
    (after ckptools' own reader, which refuses the same): the restore, `ck.load` and torch's own
    `torch.load(weights_only=True)` all refuse, nothing changed, and the next save works."""
    script = tmp_path / "job.py"
    script.write_text(BUILD_JOB)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), str(tmp_path / "memory"), HERE],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["untouched"], report
    ours = [outcome for how, outcome in report["seen"] if how != "torch.load(weights_only=True)"]
    assert ours == ["UnsafeCheckpointError"] * 6, report["seen"]
    assert [o for how, o in report["seen"] if how.startswith("torch.load")] == ["UnpicklingError"] * 2


# (2) Checked by path, opened by path: a folder swapped between the opens.

SWAPPER = """
import os, sys, time
base, seconds = sys.argv[1], float(sys.argv[2])
a, b, t = (os.path.join(base, n) for n in ("mem", "other", "swap"))
end, swaps = time.monotonic() + seconds, 0
while time.monotonic() < end:
    try:
        os.rename(a, t); os.rename(b, a); os.rename(t, b)
        swaps += 1
    except OSError:
        pass
print(swaps)
"""


def _race_files() -> tuple[dict, dict]:
    """Two checkpoints whose pickles, read with the other's records, give tensors of neither."""
    one = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.arange(300, dtype=torch.float64)}
    two = {"a": -torch.arange(300, dtype=torch.float64), "b": -torch.arange(1000, dtype=torch.float32) - 1}
    return one, two


def _which(loaded: dict, files: tuple[dict, dict]) -> str:
    loaded = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    for index, expected in enumerate(files):
        if set(loaded) == set(expected) and all(
            loaded[k].dtype == v.dtype and loaded[k].shape == v.shape and torch.equal(loaded[k], v)
            for k, v in expected.items()
        ):
            return f"file {index}"
    return "neither"


def test_a_folder_swapped_during_loads_never_gives_tensors_of_neither_file(tmp_path, other):
    """(2) Another user swaps two folders in a base others may write into (a shared scratch), as fast
    as it can, for 10 s. Every load opens the file once and reads the pickle, the records, the
    checks and the mapped storages through that one open: each load gives one file's own tensors,
    or a clean error (the path was between names), never the pickle of one and the bytes of the
    other. A node-memory folder in such a base is refused outright."""
    seconds = float(os.environ.get("CKPTOOLS_RACE_SECONDS", "10"))
    base = tempfile.mkdtemp(prefix="ckptools-race-", dir=_shared_scratch())
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, base, ignore_errors=True)
        os.chmod(base, 0o777)  # writable by everyone, not sticky: anyone may rename what is in it
        files = _race_files()
        for name, tensors in zip(("mem", "other"), files):
            os.mkdir(os.path.join(base, name))
            torch.save(tensors, os.path.join(base, name, "ckpt-0000000001.pt"))
        manager = ck.CheckpointManager(tmp_path / "run", snapshot_dir=os.path.join(base, "mine"))
        with pytest.raises(ck.NodeMemoryError, match="not yours alone.*can be written by other users"):
            manager.snapshot({"w": torch.ones(2)}, 1)
        path = os.path.join(base, "mem", "ckpt-0000000001.pt")
        swapper = stack.enter_context(other.popen(SWAPPER, base, str(seconds)))
        stack.callback(swapper.kill)  # before the folders go, whatever happens
        seen: dict[str, int] = {}
        end = time.monotonic() + seconds - 0.5
        ways = [lambda: ck.load(path, restore_rng=False), lambda: ck.load_state_dict(path),
                lambda: ck.load(path, verify=True, restore_rng=False)]  # fmt: skip
        calls = 0
        while time.monotonic() < end:
            try:
                outcome = _which(dict(ways[calls % len(ways)]()), files)
            except ck.CheckpointError as err:
                outcome = type(err).__name__
            calls += 1
            seen[outcome] = seen.get(outcome, 0) + 1
        out, _ = swapper.communicate(timeout=60)
        assert swapper.returncode == 0, out
        assert int(out.strip()) > 100, out  # the swapper did swap
        assert seen.get("neither", 0) == 0, seen
        assert seen.get("file 0", 0) and seen.get("file 1", 0), seen  # both files were read: the race ran
        assert set(seen) <= {"file 0", "file 1", "CheckpointNotFoundError"}, seen


# (3) The node-memory folder made first by someone else.

FORGED = 666.0


def test_a_node_memory_folder_another_user_made_first_is_never_used(tmp_path, other, monkeypatch):
    """(3) The default folder's name can be computed from the run folder. Another user who makes it
    first, open to all, and drops a CRC-valid forged snapshot in it: the restore reads nothing from
    it (a warning names it; the durable checkpoint is resumed), the snapshot is refused with the
    fix, nothing of this user's is written into it, the keeper persists nothing from it, and
    ``ckpt info`` of the run lists no snapshot. (Standing in for the other user, this user's own
    folder open to all is refused the same way.)"""
    monkeypatch.delenv("CKPTOOLS_NODE_MEMORY", raising=False)
    run = str(tmp_path / "run")
    manager = ck.CheckpointManager(run)
    folder = manager.snapshot_dir
    assert os.path.basename(folder).startswith("ckptools-") and os.path.dirname(folder) == _shared_scratch()
    handle, forged = tempfile.mkstemp(dir=_shared_scratch())  # where the other user can read it
    with os.fdopen(handle, "wb") as f:
        torch.save({"w": torch.full((4,), FORGED), "step": 99, "__ckptools__": {"metadata": {"step": 99}}}, f)
    os.chmod(forged, 0o644)
    try:
        squat = ("import os, shutil, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777); "
                 "shutil.copy(sys.argv[2], os.path.join(sys.argv[1], 'ckpt-0000000099.pt'))")  # fmt: skip
        other.run(squat, folder, forged)
        os.unlink(forged)
        before = sorted(os.listdir(folder))
        manager.save({"w": torch.zeros(4)}, 5)
        target = {"w": torch.full((4,), -1.0)}
        with pytest.warns(ck.CheckpointWarning, match="is not yours alone"):
            restored = manager.restore(target)
        assert restored["__ckptools__"]["metadata"]["step"] == 5 and torch.equal(target["w"], torch.zeros(4))
        assert manager.snapshots() == []
        with pytest.raises(ck.NodeMemoryError, match=f"{folder} is not yours alone.*snapshot_dir"):
            manager.snapshot({"w": torch.ones(4)}, 6)
        assert sorted(os.listdir(folder)) == before  # nothing of this user's went into it
        keeper = subprocess.run([sys.executable, "-m", "ckptools.node.keeper", folder, run, "--grace", "0"],
                                capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
        assert keeper.returncode == 1 and "not this user's alone" in keeper.stderr, keeper.stderr
        assert sorted(os.listdir(run)) == ["ckpt-0000000005.pt"]
        info = subprocess.run([sys.executable, "-m", "ckptools", "info", run], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)  # fmt: skip
        assert "ckpt-0000000099" not in info.stdout, info.stdout
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(forged)
        shutil.rmtree(folder, ignore_errors=True)  # root: the other user's too
        if os.path.exists(folder):
            other.run("import shutil, sys; shutil.rmtree(sys.argv[1])", folder)


def test_node_memory_is_made_this_users_alone_and_only_such_a_folder_is_used(tmp_path, other):
    """Node memory's folder and files are made 0700/0600 by this user; a folder that is another
    user's, open to others, a link, or below a folder others may rename in, is refused with the fix."""
    manager = ck.CheckpointManager(tmp_path / "run", snapshot_dir=tmp_path / "memory")
    manager.snapshot({"w": torch.ones(4)}, 1, blocking=True)
    manager.snapshot({"w": torch.ones(4)}, 2, blocking=True)  # a spare slot now too
    memory = str(tmp_path / "memory")
    assert stat.S_IMODE(os.stat(memory).st_mode) == 0o700
    for name in os.listdir(memory):
        mode = stat.S_IMODE(os.lstat(os.path.join(memory, name)).st_mode)
        assert mode & 0o077 == 0, (name, oct(mode))
    manager.close()

    def refused(folder, match):
        with pytest.raises(ck.NodeMemoryError, match=match):
            ck.CheckpointManager(tmp_path / "run", snapshot_dir=folder).snapshot({"w": torch.ones(1)}, 3)

    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)
    refused(open_to_all, "can be written by its group or other users")
    group = tmp_path / "group"
    group.mkdir()
    os.chmod(group, 0o770)
    refused(group, "can be written by its group")
    (tmp_path / "target").mkdir(mode=0o700)
    os.symlink(tmp_path / "target", tmp_path / "link")
    refused(tmp_path / "link", "is a symbolic link")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # not sticky: anyone may rename what is in it
    refused(shared / "mine", "can be written by other users and is not sticky")
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # as /dev/shm: only an entry's owner may rename it
    assert make_private(str(sticky / "mine")) is None
    assert stat.S_IMODE(os.stat(sticky / "mine").st_mode) == 0o700
    older = tmp_path / "older"  # an older ckptools made it 0755: this user's, tightened
    older.mkdir(mode=0o755)
    os.chmod(older, 0o755)
    assert make_private(str(older)) is None and stat.S_IMODE(os.stat(older).st_mode) == 0o700
    if other.real:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, other.uid, other.gid)
        refused(theirs, f"belongs to {other.name}")
        below = tmp_path / "below"
        below.mkdir(mode=0o755)
        os.chown(below, other.uid, other.gid)
        refused(below / "mine", f"{below} belongs to {other.name}")


# (4) The keeper's liveness.

KEEPER_JOB = """
import os, sys, torch, ckptools as ck
run, memory, planted = sys.argv[1], sys.argv[2], sys.argv[3:]
manager = ck.CheckpointManager(run, snapshot_dir=memory)
manager.snapshot({"w": torch.ones(4)}, 7, blocking=True)
for entry in planted:  # what the keeper must not count: pid=start time
    pid, _, started = entry.partition("=")
    with open(os.path.join(memory, ".pids", pid), "w") as f:
        f.write(started)
os._exit(1)  # killed: the keeper takes over
"""


def test_the_keeper_counts_only_this_users_own_processes(tmp_path, other):
    """(4) The keeper waited while any pid in ``.pids`` lived: a planted ``.pids/1`` kept it waiting as
    long as init lives. It counts a registration only for a process of this user that started when
    the registration says (a pid given since to another process is not it): with init, this test's own
    process under a wrong start time and (as root) a live process of another user planted, it still
    persists the snapshot within its grace and exits."""
    from ckptools.storage import process_start

    planted = ["1=", f"{os.getpid()}=1"]
    sleeper = None
    if other.real:
        sleeper = other.popen("import time; time.sleep(120)")
        planted.append(f"{sleeper.pid}={process_start(sleeper.pid)}")
    try:
        script = tmp_path / "job.py"
        script.write_text(KEEPER_JOB)
        env = dict(os.environ, CKPTOOLS_KEEPER_GRACE="1")
        run, memory = tmp_path / "run", tmp_path / "memory"
        proc = subprocess.run([sys.executable, str(script), str(run), str(memory), *planted], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 1, proc.stderr[-3000:]
        deadline = time.monotonic() + 30
        while memory.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not memory.exists(), sorted(os.listdir(memory))
        assert sorted(os.listdir(run)) == ["ckpt-0000000007.pt"]
        assert sleeper is None or sleeper.poll() is None  # the other user's process lived all along
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()


# (5) A named pipe, a device.


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_or_a_device_is_a_clean_error_at_once(tmp_path):
    """(5) ``open()`` of a named pipe waits for a writer: every reader hung. Every command and ``ck.load``
    now refuse it at once (opened without waiting, checked on the descriptor), exit 2, one line."""
    valid = tmp_path / "valid.pt"
    torch.save({"w": torch.ones(2)}, valid)
    for name in ("x.pt", "x.safetensors", "x.json"):
        os.mkfifo(tmp_path / name)
    folder = tmp_path / "hf"
    folder.mkdir()
    ck.convert_to_safetensors(valid, folder / "model.safetensors")
    os.mkfifo(folder / "config.json")
    out = str(tmp_path / "out.safetensors")
    commands = [["info", "x.pt"], ["verify", "x.pt"], ["diff", "x.pt", "valid.pt"], ["convert", "x.pt", out],
                ["strip-module", "x.pt", "-o", str(tmp_path / "out.pt")], ["info", "x.safetensors"],
                ["verify", "x.safetensors"], ["info", "x.json"], ["verify", "hf"]]  # fmt: skip
    # Every command in one process (CliRunner, as the CLI's own tests run it); a hang is the timeout.
    cli = textwrap.dedent("""
        import json, sys
        from typer.testing import CliRunner
        from ckptools.cli import app
        runs = [CliRunner().invoke(app, command) for command in json.loads(sys.argv[1])]
        print(json.dumps([[r.exit_code, r.stdout, r.stderr, r.exception is None or isinstance(r.exception, SystemExit)]
                          for r in runs]))
    """)
    proc = subprocess.run([sys.executable, "-c", cli, json.dumps(commands)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for command, (code, stdout, stderr, clean) in zip(commands, json.loads(proc.stdout.splitlines()[-1])):
        assert code in (1, 2) and "named pipe" in stdout + stderr and clean, (command, code, stdout, stderr)
        assert code == 2 or command == ["verify", "hf"], (command, stdout)  # a folder holding one: damaged
        assert len(stderr.strip().splitlines()) <= 1, (command, stderr)
    code = textwrap.dedent("""
        import sys, ckptools as ck
        for path in sys.argv[1:]:
            for read in (ck.load, ck.load_state_dict, ck.verify, ck.inspect):
                try:
                    read(path)
                    print("read", path)
                except ck.CheckpointLayoutError as err:
                    print("refused", str(err).split(",")[0])
    """)
    paths = [str(tmp_path / "x.pt"), str(tmp_path / "x.safetensors")]
    if os.path.exists("/dev/zero"):
        paths.append("/dev/zero")
    proc = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout.splitlines()
    assert len(said) == 4 * len(paths) and all(line.startswith("refused") for line in said), said
    assert sum("named pipe" in line for line in said) == 8 and (len(paths) == 2 or "character device" in said[-1])
    assert not os.path.exists(out) and not (tmp_path / "out.pt").exists()


# (6) A killed writer's temporary file.


def _temps(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if ".ckptools-tmp-" in n)


STALLED_CONVERT = """
import sys, time
import ckptools.storage.writes as writes
writes.publish = lambda *args, **kwargs: time.sleep(600)  # killed here: the temporary file written, not renamed
from ckptools.cli import app
sys.argv = ["ckpt", "convert", *sys.argv[1:]]
app()
"""


def test_a_convert_killed_mid_write_leaves_no_temporary_after_the_next_one(tmp_path):
    """(6) A killed ``ckpt convert`` left its hidden temporary file, and later converts to the same
    output left it too (406 MB after two kills). The next write of an output removes the temporaries
    of writers that are gone (the second killed convert took the first's away; a whole one takes the
    second's); a live writer's stays."""
    src, dst = tmp_path / "model.pt", tmp_path / "model.safetensors"
    torch.save({"w": torch.randn(256, 256)}, src)
    left: list[list[str]] = []
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-c", STALLED_CONVERT, str(src), str(dst)], cwd=ROOT)
        deadline = time.monotonic() + 60
        while _temps(tmp_path) in ([], *left[-1:]) and time.monotonic() < deadline:  # its own temporary
            time.sleep(0.02)
        time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        left.append(_temps(tmp_path))
    # Each kill left one: the second write took the first one's away before writing its own.
    assert len(left[0]) == len(left[1]) == 1 and left[0] != left[1], left
    from ckptools.storage import tmp_name

    live = tmp_path / tmp_name(dst.name)  # a live writer's (this process's): never removed
    live.write_bytes(b"in progress")
    proc = subprocess.run([sys.executable, "-m", "ckptools", "convert", str(src), str(dst)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == sorted([src.name, dst.name, live.name])
    assert ck.load_state_dict(dst)["w"].shape == (256, 256)
    with contextlib.suppress(FileNotFoundError):
        live.unlink()
