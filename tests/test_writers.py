"""``writers="all"``: every rank writes its share of the replicated tensors into the one torch file.

Real gloo ranks on 127.0.0.1; the files are read back with ``torch.load(weights_only=True)`` and
compared bit for bit with the file ``writers="rank0"`` writes from the same state.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest
import torch
from _dist import run_ranks
from _faults import dies_midway
from _same import assert_same_tree

import ckptools as ck
from ckptools.codecs.record import META_KEY
from ckptools.storage import TMP_MARKER


def _state(rank: int, seed_steps: int = 2) -> dict:
    """A DDP model with BatchNorm (whose running statistics differ per rank), Adam after a few
    steps on each rank's own data, a CPU GradScaler, a scheduler and plain values; each rank's
    RNG differs."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 64),
        torch.nn.BatchNorm1d(64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.Linear(64, 64),
    )
    net[4].weight = net[3].weight  # tied: one storage under two names, stored once
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**rank)  # differs per rank: rank 0's is stored
    g = torch.Generator().manual_seed(rank)
    for _ in range(seed_steps):
        model(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    torch.manual_seed(1000 + rank)
    np.random.seed(1000 + rank)
    return {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "step": seed_steps, "rank": rank}


def _count_writes() -> dict:
    """Wrap ckptools' share writer to count the bytes this rank writes (the real writer runs)."""
    import ckptools.write.zip_writer as zip_writer

    counted = {"bytes": []}
    real = zip_writer.write_shares

    def counting(plan, chunks):
        counted["bytes"].append(sum(share.nbytes for share, _ in chunks))
        return real(plan, chunks)

    zip_writer.write_shares = counting
    return counted


def _same_files(rank: int, world: int, directory: str) -> dict:
    state = _state(rank)
    counted = _count_writes()
    ck.save(f"{directory}/rank0.pt", state, writers="rank0")
    assert len(counted["bytes"]) == (1 if rank == 0 else 0)  # rank 0's writer wrote all of it
    counted["bytes"].clear()
    ck.save(f"{directory}/all.pt", state, writers="all", replicas="all")
    on_disk = sorted(os.listdir(directory))
    # Async: the file holds the state as of the call, whatever training does before wait().
    handle = ck.async_save(f"{directory}/async.pt", state, writers="all", replicas="all")
    from ckptools.write import async_save as background

    snapshot = background.SAVES.stager.nbytes
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1.0)
    handle.wait()
    with torch.no_grad():
        for p in state["model"].parameters():
            p.sub_(1.0)
    replicated = sum(p.numel() * p.element_size() for p in state["model"].parameters())
    replicated += sum(
        t.numel() * t.element_size() for s in state["optimizer"].state.values() for t in s.values() if t.numel() > 1
    )
    ck.release_staging_buffers()
    return {"written": counted["bytes"], "on_disk": on_disk, "snapshot": snapshot, "replicated": replicated}


def _assert_same(a, b, where="file"):
    """Equal trees, tensors bit for bit and laid out alike (strides, device); the save time aside."""
    assert_same_tree(a, b, where, ignore={"created_unix"}, strides=True)


@pytest.mark.versions  # torch.load of what every rank wrote, DDP, BatchNorm, the GradScaler
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_writes_its_share_into_one_file_equal_to_rank0s(tmp_path, world):
    results = run_ranks(_same_files, world, str(tmp_path))
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    for name in ("all.pt", "async.pt"):
        shared = torch.load(tmp_path / name, weights_only=True)
        _assert_same(rank0, shared, name)
        # A plain zip with every CRC-32 right, and ckptools' own check of it.
        with zipfile.ZipFile(tmp_path / name) as z:
            assert z.testzip() is None
        assert "every record's CRC-32 matches" in ck.verify(tmp_path / name)
        mapped = torch.load(tmp_path / name, weights_only=True, mmap=True)  # 64-byte aligned records
        _assert_same(rank0, mapped, name)
    # The rank-specific entries are rank 0's: its scaler, its BatchNorm statistics, every RNG.
    assert rank0["scaler"]["scale"] == 1.0 and rank0["rank"] == 0
    assert len(rank0[META_KEY]["rng"]) == world
    # Every rank wrote its share, the same for the sync and the async save: the replicated
    # tensors spread so that the ranks write about as much, within one tensor (64x64 float32)
    # of even, rank 0 starting with what only it holds (buffers, every rank's RNG); and each
    # rank's snapshot held its own share only.
    written = [r["written"][0] for r in results]
    assert all(r["written"] == [written[rank]] * 2 for rank, r in enumerate(results)), results
    largest = 64 * 64 * 4
    assert min(written) > 0 and max(written[1:]) - min(written[1:]) <= largest, written
    assert written[0] + largest >= max(written[1:]), written
    assert sum(written) >= results[0]["replicated"]
    for rank, r in enumerate(results):
        assert r["snapshot"] == written[rank], r
    # Nothing left behind but the three files.
    assert sorted(os.listdir(tmp_path)) == ["all.pt", "async.pt", "rank0.pt"]
    assert all(r["on_disk"] == ["all.pt", "rank0.pt"] for r in results)


def _node_local(rank: int, world: int, root: str) -> dict:
    # The same relative path names a different directory on each rank, as a node-local one
    # (/tmp, a local NVMe) does on each machine of a multi-node job.
    os.makedirs(f"{root}/node{rank}/ckpt", exist_ok=True)
    os.chdir(f"{root}/node{rank}")
    state = _state(rank)
    out = {}
    try:
        ck.save("ckpt/all.pt", state, writers="all")
        out["all"] = "saved"
    except ck.CheckpointError as err:
        out["all"] = str(err)
    out["auto"] = ck.save("ckpt/auto.pt", state)  # the default: "auto"
    handle = ck.async_save("ckpt/async.pt", state, writers="auto")
    out["async"] = handle.wait()
    return out


def test_ranks_that_do_not_share_the_directory_fall_back_to_rank0_or_refuse(tmp_path):
    results = run_ranks(_node_local, 2, str(tmp_path))
    for r in results:
        assert "rank 1 cannot see the temporary file" in r["all"] and "writers='auto'" in r["all"], r
        assert r["auto"] == "ckpt/auto.pt" and r["async"] == "ckpt/async.pt"
    # Rank 0 wrote both files whole in its own directory; rank 1's holds nothing, not even a
    # temporary file, and "all" wrote nothing anywhere.
    assert sorted(os.listdir(tmp_path / "node0/ckpt")) == ["async.pt", "auto.pt"]
    assert os.listdir(tmp_path / "node1/ckpt") == []
    reference = torch.load(tmp_path / "node0/ckpt/auto.pt", weights_only=True)
    assert reference["rank"] == 0 and "every record's CRC-32 matches" in ck.verify(tmp_path / "node0/ckpt/async.pt")


def _diverged(rank: int, world: int, directory: str) -> dict:
    state = _state(rank)
    ck.save(f"{directory}/good.pt", state, writers="all", replicas="all")
    if rank == 1:
        with torch.no_grad():
            state["model"].module[3].weight[0, 0] += 1.0  # one rank's copy changed behind DDP's back
    out = {}
    for name, call in (("sync", ck.save), ("async", lambda *a, **k: ck.async_save(*a, **k).wait())):
        try:
            call(f"{directory}/bad-{name}.pt", state, writers="all", replicas="all")
            out[name] = "saved"
        except ck.CheckpointError as err:
            out[name] = str(err)
    return out


def test_replicas_that_differ_are_refused_on_every_rank(tmp_path):
    results = run_ranks(_diverged, 2, str(tmp_path))
    for r in results:
        for name in ("sync", "async"):
            assert "model.3.weight" in r[name] and "rank(s) 1 disagree with rank 0" in r[name], r
    assert os.listdir(tmp_path) == ["good.pt"], "nothing written, the earlier file intact"
    assert "every record's CRC-32 matches" in ck.verify(tmp_path / "good.pt")


def _writer_trouble(rank: int, world: int, directory: str, victim: int, how: str) -> tuple[str, dict]:
    import ckptools.write.zip_writer as zip_writer

    state = _state(rank)
    ck.save(f"{directory}/ckpt.pt", state, writers="all")
    saved = {k: v.clone() for k, v in ck.unwrap_model(state["model"]).state_dict().items()}
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1.0)
    real = zip_writer.write_shares
    if rank == victim:
        zip_writer.write_shares = dies_midway(how)
    try:
        ck.save(f"{directory}/ckpt.pt", state, writers="all")
    except ck.CheckpointError as err:
        return str(err), saved
    finally:
        zip_writer.write_shares = real
    return "saved", saved


@pytest.mark.parametrize(
    ("victim", "how"),
    [(1, "kill"), (0, "kill"), (1, "fail"), (0, "fail")],
    ids=["kill-rank1", "kill-rank0", "fail-rank1", "fail-rank0"],
)
def test_a_writer_that_dies_or_fails_leaves_the_previous_checkpoint_and_every_rank_raises(tmp_path, victim, how):
    results = run_ranks(
        _writer_trouble,
        2,
        str(tmp_path),
        victim,
        how,
        may_die=frozenset({victim} if how == "kill" else ()),
        pg_timeout=20,
        fresh="a writer is killed or fails",
    )
    survivors = [r for rank, r in enumerate(results) if not (how == "kill" and rank == victim)]
    for message, _ in survivors:
        assert message.startswith("saving checkpoint") or "checkpoint collective" in message, message
        if how == "fail":
            assert f"failed on rank {victim}: OSError" in message and "No space left" in message, message
    # The previous checkpoint is intact: the state of the first save, not the failed one's.
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert "every record's CRC-32 matches" in ck.verify(tmp_path / "ckpt.pt")
    # (Parameters: those are what every rank holds alike; a surviving rank 1's buffers are its own.)
    params = {k: v for k, v in survivors[0][1].items() if "running" not in k and "batches" not in k}
    _assert_same(params, {k: loaded["model"][k] for k in params})
    # No temporary file stays behind while its writer lives; a killed rank 0's is left to the
    # manager (its writer is gone), which removes it at its next save.
    leftovers = [n for n in os.listdir(tmp_path) if TMP_MARKER in n]
    assert leftovers == [] or (victim == 0 and how == "kill"), leftovers


def _manager(rank: int, world: int, directory: str) -> list[str]:
    state = _state(rank)
    manager = ck.CheckpointManager(directory, keep_last=2)
    for step in range(1, 5):
        manager.save(state, step=step, blocking=step % 2 == 0, writers="all", replicas="all")
    manager.wait()
    fresh = _state(rank, seed_steps=0)
    manager.restore(fresh)
    same = all(torch.equal(a, b) for a, b in zip(fresh["model"].parameters(), state["model"].parameters()))
    return [*sorted(os.listdir(directory)), f"restored={same}"]


def test_manager_saves_with_every_rank_writing_and_prunes(tmp_path):
    results = run_ranks(_manager, 2, str(tmp_path))
    assert results[0] == results[1] == ["ckpt-0000000003.pt", "ckpt-0000000004.pt", "restored=True"]


def test_unknown_writers_value_is_refused():
    with pytest.raises(ValueError, match="writers must be one of 'rank0', 'all', 'auto', got 'rank1'"):
        ck.save("/tmp/never.pt", {"x": torch.ones(1)}, writers="rank1")
    assert not os.path.exists("/tmp/never.pt")


def _async_trouble(rank: int, world: int, directory: str, victim: int, how: str) -> tuple[str, dict]:
    import ckptools.write.zip_writer as zip_writer

    state = _state(rank)
    ck.async_save(f"{directory}/ckpt.pt", state, writers="all").wait()
    saved = {k: v.clone() for k, v in ck.unwrap_model(state["model"]).state_dict().items()}
    real = zip_writer.write_shares
    if rank == victim:
        zip_writer.write_shares = dies_midway(how)  # runs in the writer thread
    handle = ck.async_save(f"{directory}/ckpt.pt", state, writers="all")
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1.0)  # training goes on
    try:
        handle.wait()
    except ck.CheckpointError as err:
        return str(err), saved
    finally:
        zip_writer.write_shares = real
    return "saved", saved


@pytest.mark.parametrize(("victim", "how"), [(1, "kill"), (1, "fail"), (0, "fail")])
def test_an_async_writer_that_dies_or_fails_leaves_the_previous_checkpoint(tmp_path, victim, how):
    may_die = frozenset({victim} if how == "kill" else ())
    results = run_ranks(
        _async_trouble,
        2,
        str(tmp_path),
        victim,
        how,
        may_die=may_die,
        pg_timeout=20,
        fresh="a writer is killed or fails",
    )
    survivors = [r for rank, r in enumerate(results) if rank not in may_die]
    for message, _ in survivors:
        if how == "fail":  # every rank learns which rank failed, and why
            assert f"in the background failed on rank {victim}: OSError" in message and "No space" in message, message
        else:  # the dead peer: noticed at wait()'s check-in (same host), or breaking its exchange;
            # either way rank 0's writer gives up on its share
            assert ("AsyncSave.wait is collective, and rank(s) 1 died before every rank had come to it" in message
                    or "checkpoint collective with the other ranks failed" in message), message  # fmt: skip
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert "every record's CRC-32 matches" in ck.verify(tmp_path / "ckpt.pt")
    params = {k: v for k, v in survivors[0][1].items() if "running" not in k and "batches" not in k}
    _assert_same(params, {k: loaded["model"][k] for k in params})
    assert [n for n in os.listdir(tmp_path) if TMP_MARKER in n] == [], "rank 0 removed its temporary file"


def test_an_upload_plan_gives_each_rank_whole_parts_of_at_least_5_mib_in_file_order(monkeypatch):
    """S3's rules, for the plan of every rank uploading (ckptools.write.upload): a rank other than 0
    writes 5 MiB or nothing, each rank's records are one range, cut into parts numbered in file
    order, every part but the file's last at least 5 MiB (rank 0's range comes last)."""
    from ckptools.codecs.torchzip import ZipPlan
    from ckptools.write import upload
    from ckptools.write.plan import MIN_PART, PREFIX, Plan, Share, _for_upload

    mib = 1 << 20
    storages = {str(i): torch.empty(n, dtype=torch.uint8).untyped_storage() for i, n in enumerate(
        [40 * mib, 9 * mib, 6 * mib, 3 * mib, 1 * mib])}  # fmt: skip
    where = {s._cdata: ("model", k) for k, s in storages.items()}
    writer = _for_upload(storages, where, [0, 1, 2, 3])
    load = {r: sum(storages[k].nbytes() for k, w in writer.items() if w == r) for r in range(4)}
    assert all(load[r] == 0 or load[r] >= MIN_PART for r in (1, 2, 3)), load
    assert sum(1 for r in (1, 2, 3) if load[r]) == 2, load  # 59 MiB over 4 ranks: one had too little and left
    order = sorted(storages, key=lambda k: (writer[k] == 0, writer[k]))
    records = [(f"{PREFIX}data/{k}", storages[k].nbytes()) for k in order] + [(f"{PREFIX}version", 2)]
    zplan = ZipPlan(records)
    shares = [Share(k, storages[k].nbytes(), 0, writer[k], None) for k in storages]
    plan = Plan("", b"", records, shares, size=zplan.size)
    monkeypatch.setattr(upload, "PART_BYTES", 8 * mib)
    parts = upload.part_ranges(plan, zplan, 4)
    assert [p[0] for p in parts] == list(range(1, len(parts) + 1))  # numbered in file order
    assert parts[0][1] == 0 and parts[-1][2] == zplan.size and parts[-1][3] == 0
    assert all(a[2] == b[1] for a, b in zip(parts, parts[1:]))  # no gap, no overlap
    assert all(end - start >= MIN_PART for _, start, end, _ in parts[:-1]), parts
    ranks = [p[3] for p in parts]
    assert ranks == sorted(ranks, key=lambda r: (r == 0, r)), ranks  # each rank's parts together
