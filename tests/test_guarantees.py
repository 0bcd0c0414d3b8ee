"""The guarantees matrix (issue 65): each promise of docs/guarantees.md on each way in, one cell each.

A cell is *promise* x *storage* (local disk, S3 through moto, node memory) x *who wrote the file*
(ckptools with ``writers="rank0"`` or ``"all"``, a user's ``torch.save``, a framework's own save) x
*entry point* (``ck.load``, ``CheckpointManager.restore``, an integration's load, a CLI command) x
*world size*. A cell is run here (on the warm ranks of tests/_warm.py: seconds, not a launch), held by
a test elsewhere that needs fresh processes (a kill, a framework's own launcher: named, and this
file checks that it exists), or does not apply (the reason is the cell). Each of issue 65's six
failures is a cell that failed before its fix. docs/guarantees.md's table is `table()`, checked
below; ``python tests/test_guarantees.py`` prints it.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _matrix import PROMISES, Cell

import ckptools as ck

ROOT = pathlib.Path(__file__).resolve().parent.parent

# --- the rank functions (module level: the warm ranks receive them by name) -----------------------------


def _mlp() -> torch.nn.Module:
    """The README's Quick start model in kind: an MLP of ~3 MB, so DDP uses several buckets."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10))  # fmt: skip


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 256, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(n)]


def _steps(ddp: Any, opt: Any, batches: list[Any], start: int, stop: int) -> None:
    for x, y in batches[start:stop]:
        loss = torch.nn.functional.cross_entropy(ddp(torch.nn.functional.dropout(x, 0.1)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _resume_exact(rank: int, world: int, root: str, how: str) -> dict[str, Any]:
    """An uninterrupted run of 8 steps beside one saved after step 4 (``how``: a durable save, or a
    snapshot in node memory; DDP rebuilt its buckets at step 2) and resumed by a new DDP, as a relaunched
    process makes it; whether the final weights are the same bits, and what the restore warned."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = _batches(rank, 8)
    run = os.path.join(root, "run")
    manager = ck.CheckpointManager(run, snapshot_dir=os.path.join(root, "shm"))
    ddp = DDP(_mlp())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    state = {"model": ddp, "optimizer": opt}
    _steps(ddp, opt, batches, 0, 4)
    if how == "snapshot":
        manager.snapshot({**state, "step": 3}, step=3, blocking=True)
    else:
        manager.save({**state, "step": 3}, step=3)
    _steps(ddp, opt, batches, 4, 8)
    straight = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    torch.manual_seed(1234)  # the relaunched process's own streams: the restore must put back the saved ones
    again = DDP(_mlp())
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        restored = manager.restore({"model": again, "optimizer": opt2})
    _steps(again, opt2, batches, restored["step"] + 1, 8)
    resumed = again.module.state_dict()
    manager.close()
    return {"exact": all(torch.equal(straight[k], resumed[k]) for k in straight),
            "warned": [str(w.message) for w in said if "bucket layout" in str(w.message)]}  # fmt: skip


def _resume_with_a_hook(rank: int, world: int, root: str) -> list[str]:
    """A restore into a DDP whose reducer carries a communication hook: its buckets are left as DDP
    made them, and the restore says so (never silently)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = _batches(rank, 4)
    manager = ck.CheckpointManager(os.path.join(root, "run"))
    ddp = DDP(_mlp())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _steps(ddp, opt, batches, 0, 3)
    manager.save({"model": ddp, "optimizer": opt}, step=2)
    again = DDP(_mlp())
    again.register_comm_hook(None, default_hooks.allreduce_hook)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        manager.restore({"model": again, "optimizer": torch.optim.SGD(again.parameters(), lr=0.1)})
    manager.close()
    return [str(w.message) for w in said if "bucket layout" in str(w.message)]


def _flip(path: str) -> None:
    """One byte of a weight's record flipped (past the zip's first records: inside a storage)."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x10
        f.seek(0)
        f.write(data)


def _linear(value: float) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def _fallback(rank: int, world: int, root: str, shm: str, writers: str, storage: str) -> tuple[Any, float, bool]:
    """Steps 1 and 2 saved, step 2's newest copy damaged (its file, or its snapshot in node memory);
    what a restore on every rank gives: the step, a weight, whether it warned about the damage."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if storage == "s3":
        _fresh_s3_client()
    manager = ck.CheckpointManager(root, snapshot_dir=shm)
    for step in (1, 2):
        model = DDP(_linear(float(step)))
        if storage == "memory" and step == 2:
            manager.snapshot({"model": model, "step": step}, step=2, blocking=True)
        else:
            manager.save({"model": model, "step": step}, step, writers=writers)
    torch.distributed.barrier()
    if rank == 0:
        if storage == "s3":
            import s3fs

            fs = s3fs.S3FileSystem()
            key = manager.path_for(2).removeprefix("s3://")
            data = bytearray(fs.cat_file(key))
            data[len(data) // 2] ^= 0x10
            fs.pipe_file(key, bytes(data))
        elif storage == "memory":
            _flip(manager.snapshots()[-1][1])
        else:
            _flip(manager.path_for(2))
    torch.distributed.barrier()
    target = _linear(0.0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = ck.CheckpointManager(root, snapshot_dir=manager.snapshot_dir).restore({"model": target})
    manager.close()
    return (None if got is None else got["step"], target.weight[0, 0].item(),
            any("skipping damaged" in str(w.message) for w in said))  # fmt: skip


def _replicas(rank: int, world: int, root: str, call: str) -> str | None:
    """One rank's copy of a weight changed after a healthy save: the first durable save refuses."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_linear(1.0))
    manager = ck.CheckpointManager(os.path.join(root, "run"))
    manager.save({"model": ddp}, step=1)
    if rank == world - 1:
        with torch.no_grad():
            ddp.module.weight.view(-1)[100_000] += 1e-3  # far from the first 1/50 of the bytes
    try:
        if call == "manager.save":
            manager.save({"model": ddp}, step=2)
        else:
            ck.save(os.path.join(root, "all.pt"), {"model": ddp}, writers="all")
    except ck.ReplicaMismatchError as err:
        return err.where
    finally:
        manager.close()
    return None


def _fresh_s3_client() -> None:
    """A warm rank may hold an s3fs client of another module's moto server (s3fs caches its instances):
    this module's server, through the environment the rank was given."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def _restore_s3(rank: int, world: int, url: str, manager: bool) -> tuple[int, bool]:
    os.environ["AWS_SDK_UA_APP_ID"] = f"rank{rank}"  # the server's record names who read what
    _fresh_s3_client()
    from test_s3 import _big_ddp  # three 6 MiB weights: what the ranks share dwarfs what each reads alone

    model = _big_ddp()
    for p in model.parameters():
        p.data.zero_()
    got = ck.CheckpointManager(url).restore({"model": model}) if manager else ck.load(url, {"model": model})
    expected = _big_ddp().state_dict()
    return got["step"], all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def _save_s3(rank: int, world: int, run: str, writers: str) -> None:
    from test_s3 import _big_ddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    _fresh_s3_client()
    ck.CheckpointManager(run).save({"model": DDP(_big_ddp()), "step": 5}, 5, writers=writers)


# --- the cells ----------------------------------------------------------------------------------------


def _exact(world: int, how: str = "save") -> Callable[..., None]:
    def run(tmp_path: pathlib.Path, request: Any) -> None:
        got = run_ranks(_resume_exact, world, str(tmp_path), how)
        assert all(r["exact"] for r in got) and not any(r["warned"] for r in got), got

    return run


def _hook_warns(tmp_path: pathlib.Path, request: Any) -> None:
    said = run_ranks(_resume_with_a_hook, 3, str(tmp_path))
    assert said[0] and "a communication hook is registered" in said[0][0], said  # rank 0 warns, once
    assert said[1:] == [[], []], said


def _falls_back(world: int, writers: str, storage: str) -> Callable[..., None]:
    def run(tmp_path: pathlib.Path, request: Any) -> None:
        root = str(tmp_path / "run")
        if storage == "s3":
            request.getfixturevalue("s3_env")
            from _s3 import BUCKET

            root = f"s3://{BUCKET}/fallback-{writers}-{world}-{tmp_path.name}"
        got = run_ranks(_fallback, world, root, str(tmp_path / "shm"), writers, storage)
        assert all(r[0] == 1 and r[1] == 1.0 for r in got), got  # step 1's weights on every rank
        assert got[0][2], got  # and it said so

    return run


def _replicas_refused(world: int, call: str) -> Callable[..., None]:
    def run(tmp_path: pathlib.Path, request: Any) -> None:
        said = run_ranks(_replicas, world, str(tmp_path), call)
        assert said == ["model.weight"] * world, said
        assert sorted(os.listdir(tmp_path / "run")) == ["ckpt-0000000001.pt"]  # nothing of the refused save
        assert not (tmp_path / "all.pt").exists()

    return run


def _read_once(world: int, writers: str) -> Callable[..., None]:
    def run(tmp_path: pathlib.Path, request: Any) -> None:
        request.getfixturevalue("s3_env")
        import s3fs
        from _s3 import BUCKET, recorded
        from test_s3 import _big_ddp, _downloaded_by_rank

        folder = f"once-{writers}-{world}-{tmp_path.name}"
        if writers == "torch.save":  # a user's own file, uploaded as it is
            path = tmp_path / "ckpt.pt"
            torch.save({"model": _big_ddp().state_dict(), "step": 5}, path)
            s3fs.S3FileSystem().put_file(str(path), f"{BUCKET}/{folder}/ckpt.pt")
            key, url, manager = f"{folder}/ckpt.pt", f"s3://{BUCKET}/{folder}/ckpt.pt", False
        else:
            run_ranks(_save_s3, 2, f"s3://{BUCKET}/{folder}", writers)
            key, url, manager = f"{folder}/ckpt-0000000005.pt", f"s3://{BUCKET}/{folder}", True
        size = s3fs.S3FileSystem().size(f"{BUCKET}/{key}")
        with recorded() as requests:
            got = run_ranks(_restore_s3, world, url, manager)
        assert got == [(5, True)] * world, got
        read = _downloaded_by_rank(requests, key, size)
        print(f"{writers}, {world} ranks: bytes per rank {read} of {size}")
        assert sorted(read) == list(range(world)), read
        assert sum(read.values()) <= 1.05 * size and max(read.values()) <= size * (1 / world + 0.05), (read, size)

    return run


from _guarantee_payloads import PAYLOAD_CELLS  # noqa: E402  # the weights-only cells (their own module)

SLOW = (pytest.mark.slow,)
# fmt: off
CELLS: list[Cell] = [
    # whole or absent: a kill needs processes of its own
    Cell("whole", "local", "ckptools", "CheckpointManager.save", 1,
         held_by="tests/test_crash.py::test_kill_minus_9_during_saves_loses_nothing"),
    Cell("whole", "local", "ckptools", "async_save", 1,
         held_by="tests/test_crash.py::test_kill_minus_9_during_background_saves_loses_nothing"),
    Cell("whole", "s3", "ckptools all", "ck.save", 3,
         held_by="tests/test_s3.py::test_a_rank_killed_mid_upload_leaves_the_previous_object_and_no_upload"),
    Cell("whole", "memory", "ckptools", "snapshot", 2,
         held_by="tests/test_kill_matrix.py::test_a_kill_after_the_copy_and_before_its_commit_loses_no_step_of_it"),
    Cell("whole", "local", "Accelerate", "save_state", 1, held_by="tests/test_accelerate_state.py::"
         "test_a_save_state_killed_before_its_seal_is_never_resumed_from_and_the_relaunch_is_bit_identical"),
    Cell("whole", "local", "torch.save", "any", 1,
         na="a user's own torch.save is not atomic; ckptools can only refuse what it tore (the cells below)"),
    # every byte checked on the way in
    Cell("checked", "local", "ckptools, torch.save", "ck.load(verify), ckpt verify", 1,
         held_by="tests/test_bitrot.py::test_every_flip_is_caught"),
    Cell("checked", "local", "ckptools all", "ck.load(read=once)", 2,
         held_by="tests/test_read_once.py::test_a_flipped_byte_is_one_clear_error_on_every_rank"),
    Cell("checked", "s3", "ckptools all", "ck.load", 2,
         held_by="tests/test_s3.py::test_a_flipped_byte_in_an_object_read_once_is_one_clear_error_on_every_rank"),
    Cell("checked", "memory", "ckptools", "CheckpointManager.restore", 2,
         na="the same cell as fallback on node memory, which flips a snapshot's byte: found, skipped"),
    # a damaged newest falls back
    Cell("fallback", "local", "ckptools all", "CheckpointManager.restore", 2, run=_falls_back(2, "all", "local")),
    Cell("fallback", "local", "ckptools rank0", "CheckpointManager.restore", 3, run=_falls_back(3, "rank0", "local"),
         marks=SLOW),
    Cell("fallback", "s3", "ckptools all", "CheckpointManager.restore", 2, run=_falls_back(2, "all", "s3")),
    Cell("fallback", "s3", "ckptools rank0", "CheckpointManager.restore", 2, run=_falls_back(2, "rank0", "s3")),
    Cell("fallback", "memory", "ckptools", "CheckpointManager.restore", 2, run=_falls_back(2, "all", "memory")),
    Cell("fallback", "local", "torch.save", "ck.load", 1,
         na="ck.load is given one file: a damaged one is a named error (the checked and weights_only cells)"),
    # read once between the ranks (an object store: ranged GETs, each rank its share)
    Cell("once", "s3", "ckptools rank0", "CheckpointManager.restore", 2, run=_read_once(2, "rank0")),
    Cell("once", "s3", "ckptools rank0", "CheckpointManager.restore", 3, run=_read_once(3, "rank0"), marks=SLOW),
    Cell("once", "s3", "torch.save", "ck.load", 2, run=_read_once(2, "torch.save")),
    Cell("once", "s3", "ckptools all", "CheckpointManager.restore", 3, held_by="tests/test_s3.py::"
         "test_the_managers_restore_from_s3_downloads_each_byte_once_between_the_ranks"),
    Cell("once", "memory", "ckptools", "CheckpointManager.restore", 2,
         na="every node reads its own memory (no bytes cross the network to share)"),
    Cell("once", "local", "any", "ck.load", 2,
         na="one node's ranks share its page cache: read once only across nodes (read='auto')"),
    # replicas compared
    Cell("replicas", "local", "ckptools", "CheckpointManager.save", 2, run=_replicas_refused(2, "manager.save")),
    Cell("replicas", "local", "ckptools all", "ck.save", 3, run=_replicas_refused(3, "ck.save"), marks=SLOW),
    Cell("replicas", "memory", "ckptools", "snapshot", 2,
         held_by="tests/test_replicas.py::test_a_learning_rate_changed_on_one_rank_is_caught_at_the_first_call"),
    Cell("replicas", "local", "Accelerate, Trainer, Lightning", "their saves", 2, held_by="tests/"
         "test_replicas_frameworks.py::test_a_copy_changed_on_one_rank_is_refused_on_every_rank_and_the_last_good_step_kept"),
    # a resume is bit-exact
    Cell("exact", "local", "ckptools", "CheckpointManager.restore", 2, run=_exact(2)),
    Cell("exact", "local", "ckptools", "CheckpointManager.restore", 3, run=_exact(3)),
    Cell("exact", "local", "ckptools", "CheckpointManager.restore", 4, run=_exact(4), marks=SLOW),
    Cell("exact", "local", "ckptools", "CheckpointManager.restore", 8,
         held_by="tests/test_guarantees.py::test_a_resume_at_8_ranks_is_bit_exact"),
    Cell("exact", "memory", "ckptools", "CheckpointManager.restore", 3, run=_exact(3, "snapshot")),
    Cell("exact", "local", "ckptools", "restore into a DDP with a comm hook", 3, run=_hook_warns, marks=SLOW),
    Cell("exact", "memory", "Accelerate", "snapshot in an accumulate window", 1,
         held_by="tests/test_accelerate_load.py::test_a_snapshot_in_a_window_without_the_accelerator_is_refused"),
    # bad input is a named error and nothing changes
    Cell("named", "local", "Accelerate", "load_state (attached)", 1,
         held_by="tests/test_accelerate_load.py::test_a_torn_folder_accelerate_wrote_alone_is_refused_before_loading"),
    Cell("named", "local", "any", "every ckpt command", 1,
         held_by="tests/test_cli.py::test_bad_inputs_exit_2_one_line_no_traceback_nothing_written"),
    Cell("named", "local", "a file built to attack", "every reader, every command", 1,
         held_by="tests/test_hostile.py::test_cli_refuses_hostile_files_one_line_exit_2"),
    Cell("named", "local", "another user", "every reader", 1,
         held_by="tests/test_second_user.py::test_a_folder_swapped_during_loads_never_gives_tensors_of_neither_file"),
    Cell("named", "local", "ckptools", "save (a rank fails to write)", 2,
         held_by="tests/test_faults.py::test_rank0_write_failures_raise_everywhere_and_lose_nothing"),
    # slow and stuck storage: a FUSE mount throttled or frozen (tests/_slowfs.py)
    Cell("stalled", "FUSE, frozen", "ckptools", "CheckpointManager.save", 2,
         held_by="tests/test_slow_storage.py::"
         "test_a_sync_save_to_a_stuck_storage_is_one_named_error_on_every_rank_within_the_bound"),
    Cell("stalled", "FUSE, 2 MB/s then frozen", "ckptools", "CheckpointManager.save(blocking=False)", 2,
         held_by="tests/test_slow_storage.py::"
         "test_async_saves_skip_behind_a_slow_storage_and_a_stuck_one_is_a_named_error_on_every_rank"),
    Cell("stalled", "FUSE, 2 MB/s then frozen", "ckptools all (DDP)", "CheckpointManager.save, both kinds", 2,
         held_by="tests/test_slow_storage.py::"
         "test_a_ddp_models_shares_on_a_slow_then_stuck_storage_skip_and_then_raise_one_named_error_on_every_rank"),
    Cell("stalled", "FUSE, one rank's mount 2 MB/s then frozen", "ckptools all (DDP)", "CheckpointManager.save", 2,
         held_by="tests/test_slow_storage.py::"
         "test_one_ranks_storage_slow_then_stuck_is_waited_for_skipped_behind_then_one_named_error_on_every_rank"),
    Cell("stalled", "FUSE, frozen", "ckptools", "ck.load behind its own async save", 1,
         held_by="tests/test_slow_storage.py::"
         "test_a_load_behind_a_stuck_async_save_of_its_own_is_a_named_error_within_the_bound"),
    Cell("stalled", "FUSE, reads frozen: every mount, then one rank's", "ckptools", "CheckpointManager.restore", 2,
         held_by="tests/test_slow_storage.py::"
         "test_a_restore_from_a_stuck_storage_is_one_named_error_on_every_rank_within_the_bound"),
    Cell("whole", "FUSE, frozen while the job dies, then thawed", "ckptools", "the keeper's write-out", 1,
         held_by="tests/test_slow_storage.py::"
         "test_the_keeper_waits_out_a_stuck_storage_says_where_the_snapshot_is_and_persists_it_once_thawed"),
    Cell("whole", "FUSE, frozen then thawed", "ckptools", "CheckpointManager.save(blocking=False)", 1,
         held_by="tests/test_slow_storage.py::"
         "test_a_save_frozen_midway_moves_nothing_and_prunes_nothing_until_it_is_whole"),
    *PAYLOAD_CELLS,
]
# fmt: on


@pytest.mark.parametrize(
    "cell", [pytest.param(c, id=c.id, marks=c.marks) for c in CELLS if c.run is not None]
)  # fmt: skip
def test_cell(cell: Cell, tmp_path: pathlib.Path, request: Any) -> None:
    assert cell.run is not None
    cell.run(tmp_path, request)


@pytest.mark.slow  # 8 processes on this 2-core machine: make interop
def test_a_resume_at_8_ranks_is_bit_exact(tmp_path: pathlib.Path) -> None:
    got = run_ranks(_resume_exact, 8, str(tmp_path), "save", timeout=600)
    assert all(r["exact"] for r in got) and not any(r["warned"] for r in got), got


def test_every_cell_held_elsewhere_names_a_test_that_exists() -> None:
    for cell in CELLS:
        assert (cell.run is not None) + bool(cell.held_by) + bool(cell.na) == 1, cell
        if cell.held_by:
            file, name = cell.held_by.split("::")
            assert re.search(rf"^def {name}\(", (ROOT / file).read_text(), re.M), cell.held_by
        assert cell.promise in PROMISES, cell


def table() -> str:
    """docs/guarantees.md's matrix: each promise with its cell counts, then a row per cell."""
    lines = []
    for key, promise in PROMISES.items():
        cells = [c for c in CELLS if c.promise == key]
        here = sum(c.run is not None for c in cells)
        lines.append(f"- `{key}`: {promise}. {len(cells)} cells: {here} run here, "
                     f"{sum(bool(c.held_by) for c in cells)} held by other tests, {sum(bool(c.na) for c in cells)} "
                     "do not apply")  # fmt: skip
    lines += ["", "| promise | storage | who wrote it | entry point | ranks | cell |", "|---|---|---|---|---|---|"]
    for cell in CELLS:
        lines.append(
            f"| `{cell.promise}` | {cell.storage} | {cell.writer} | {cell.entry} | {cell.world} | {cell.how} |"
        )
    here = sum(c.run is not None for c in CELLS)
    held = sum(bool(c.held_by) for c in CELLS)
    na = sum(bool(c.na) for c in CELLS)
    lines.append("")
    lines.append(f"{len(CELLS)} cells: {here} run in tests/test_guarantees.py, {held} held by the tests named, "
                 f"{na} that do not apply (the reason is the cell).")  # fmt: skip
    return "\n".join(lines)


def test_the_docs_hold_this_matrix() -> None:
    text = (ROOT / "docs" / "guarantees.md").read_text(encoding="utf-8")
    block = text.split("<!-- matrix: python tests/test_guarantees.py -->\n", 1)[1].split("\n<!-- /matrix -->", 1)[0]
    assert block == table(), "docs/guarantees.md's matrix is out of date: python tests/test_guarantees.py"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    print(table())
