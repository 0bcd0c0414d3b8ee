"""ck.load(..., read="once"): each rank reads about 1/N of a file the ranks share, the rest arrives
over the process group; bytes read from storage 1.0x the file (issue 46)."""

from __future__ import annotations

import os

import pytest
import torch
from _dist import run_ranks
from _same import assert_same_tree, same_tree

import ckptools as ck
from ckptools.collective.tree import Skeleton
from ckptools.read import plan_reads

MIB = 1 << 20


def _state(rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))  # ~4 MiB of weights
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    optimizer.step()
    tied = torch.arange(12.0)
    views = {"conj": torch.tensor([1 + 2j, 3 - 4j]).conj(), "neg": torch.tensor([1.0, -2.0])._neg_view()}
    return {"model": model, "optimizer": optimizer, "tied": {"a": tied, "b": tied[2:5]}, "views": views, "step": 7}


def _io() -> dict[str, int]:
    """This process's reads: ``rchar`` (bytes its read calls returned: what it asked of files) and
    ``read_bytes`` (what it made the disk read; a page another rank read already is not read again)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def _evict(path: str) -> None:
    """Drop the file's pages from the page cache: what is read next comes from the disk (and counts)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _once(rank: int, world: int, root: str, saved_world: int) -> dict:
    path = os.path.join(root, "ckpt.pt")
    state = _state(rank)
    if world == saved_world:
        ck.save(path, state)
    ck.barrier()
    reference = ck.load(path, read="each", restore_rng=False)  # what every rank reads alone
    if rank == 0:
        _evict(path)
    ck.barrier()
    fresh = _state(rank)
    with torch.no_grad():
        for p in fresh["model"].parameters():
            p.zero_()  # the load must bring the weights
    before = _io()
    got = ck.load(path, {"model": fresh["model"], "optimizer": fresh["optimizer"]}, read="once", verify=True,
                  restore_rng=False)  # fmt: skip
    after = _io()
    a, b = got["tied"]["a"], got["tied"]["b"]
    return {
        "asked": after["rchar"] - before["rchar"],
        "disk": after["read_bytes"] - before["read_bytes"],
        "same_tree": same_tree(got, reference),
        "model": same_tree(fresh["model"].state_dict(), state["model"].state_dict()),
        "optimizer": same_tree(fresh["optimizer"].state_dict(), state["optimizer"].state_dict()),
        "tied": a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr(),
        "sizes": Skeleton(reference).sizes() if rank == 0 else None,
        "file": os.path.getsize(path),
        "direct": _direct_io(path),
    }  # fmt: skip


def _direct_io(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


def _check(results: list[dict], world: int) -> None:
    for r in results:
        assert r["same_tree"] and r["model"] and r["optimizer"] and r["tied"], r
    plan = plan_reads(results[0]["sizes"], world)
    size = results[0]["file"]
    asked = [r["asked"] for r in results]
    # Each rank asks the file for its planned share and the small records (data.pkl, the directory):
    # about 1/N, never the whole file; the plan splits the bytes evenly; and the disk read it once
    # between them (with the page cache dropped first; its readahead may take a little more).
    for got, share in zip(asked, plan):
        assert share <= got <= share + MIB, (asked, plan, size)
    assert max(plan) <= size / world + 2 * MIB, plan
    disk = [r["disk"] for r in results]
    assert sum(disk) <= size + 2 * MIB, (disk, size)
    if results[0]["direct"]:  # O_DIRECT reads: no readahead into another rank's share
        assert all(got <= share + MIB for got, share in zip(disk, plan)), (disk, plan)


# tmp_path must be on a disk, not a tmpfs: its pages can be dropped from the cache there, and
# /proc/self/io counts what is read again.


@pytest.mark.versions  # torch's storages, read in pieces
def test_two_ranks_read_a_shared_file_once_bit_exact(tmp_path):
    _check(run_ranks(_once, 2, str(tmp_path), 2), 2)


@pytest.mark.slow  # a third process: `make interop`
def test_saved_on_two_ranks_read_once_by_three(tmp_path):
    run_ranks(_once, 2, str(tmp_path), 2)
    _check(run_ranks(_once, 3, str(tmp_path), 2), 3)


def _damaged(rank: int, world: int, path: str) -> str:
    try:
        ck.load(path, read="once", verify=True)
    except ck.CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    return "loaded"


def test_a_flipped_byte_is_one_clear_error_on_every_rank(tmp_path):
    path = str(tmp_path / "c.pt")
    ck.save(path, {"w": torch.arange(1 << 18, dtype=torch.float32), "v": torch.ones(1 << 18)})
    with open(path, "r+b") as f:  # a byte inside the first tensor's record
        data = f.read()
        at = data.index(torch.arange(4, dtype=torch.float32).numpy().tobytes()) + 4096
        f.seek(at)
        f.write(bytes([data[at] ^ 0x40]))
    results = run_ranks(_damaged, 2, path)
    assert all("is damaged (CRC-32 mismatch" in r and "record" in r for r in results), results


def _legacy(rank: int, world: int, path: str) -> bool:
    return same_tree(ck.load(path, read="once"), torch.load(path, weights_only=True))


def test_a_file_that_cannot_be_mapped_is_read_by_rank0_and_sent(tmp_path):
    path = str(tmp_path / "legacy.pt")
    torch.save({"w": torch.arange(6.0), "step": 3}, path, _use_new_zipfile_serialization=False)
    assert run_ranks(_legacy, 2, path) == [True, True]


def test_who_reads_is_decided_alike_on_every_rank(monkeypatch):
    import ckptools.read.loading as loading
    from ckptools.read.loading import _who_reads  # the decision itself
    from ckptools.storage import resolve

    local, remote, cpu = resolve("/data/c.pt"), resolve("s3://b/c.pt"), torch.device("cpu")
    memory = resolve("memory://b/c.pt")  # remote, without ranged reads
    monkeypatch.setattr(loading, "get_world_size", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # two nodes
    assert _who_reads("auto", local, cpu) == "once"
    assert _who_reads("auto", remote, cpu) == "once"  # ranged GETs, each rank its share
    assert _who_reads("auto", memory, cpu) == "each"
    assert _who_reads("rank0", local, cpu) == "rank0"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # one node: its ranks share the page cache
    assert _who_reads("auto", local, cpu) == "each"
    assert _who_reads("auto", remote, cpu) == "once"  # but not an object store's bytes
    with pytest.raises(ValueError, match="contradicts"), pytest.warns(DeprecationWarning):  # the old switch
        ck.load("/data/c.pt", broadcast=True, read="once")
    with pytest.raises(ValueError, match="read must be one of"):
        _who_reads("twice", local, cpu)
    assert_same_tree(plan_reads([40, 10, 30, 20], 2), [50, 50])


def _node_local(rank: int, world: int, root: str) -> str:
    node = os.path.join(root, f"node{rank}")  # each rank's own disk; only node 0's holds the file
    os.makedirs(node, exist_ok=True)
    os.chdir(node)
    if rank == 0:
        torch.save({"w": torch.ones(4)}, "c.pt")
    ck.barrier()
    try:
        ck.load("c.pt", read="once")
    except ck.CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    return "loaded"


def test_a_file_only_one_node_has_says_how_to_send_it(tmp_path):
    results = run_ranks(_node_local, 2, str(tmp_path))
    assert results[1].startswith("CheckpointNotFoundError") and "but rank 0 read it: pass read='rank0'" in results[1]
    assert results[0].startswith("CheckpointError") and "failed on rank 1" in results[0], results


def _own_copies(rank: int, world: int, root: str) -> float:
    node = os.path.join(root, f"node{rank}")  # node-local copies of two different checkpoints, one layout
    os.makedirs(node, exist_ok=True)
    os.chdir(node)
    torch.save({"w": torch.full((1 << 16,), float(rank))}, "c.pt")
    ck.barrier()
    return float(ck.load("c.pt", read="once")["w"].sum())


def test_node_local_copies_that_differ_are_never_mixed(tmp_path):
    # Same records and sizes, other bytes (their CRC-32s differ): each rank reads its own file whole.
    assert run_ranks(_own_copies, 2, str(tmp_path)) == [0.0, float(1 << 16)]


def test_the_reader_reads_any_range_exactly(tmp_path, monkeypatch):
    """O_DIRECT reads whole blocks, in chunks: the bytes asked for come back, at any offset and length."""
    from ckptools.read import once as read_once

    data = os.urandom(50_000)
    path = tmp_path / "bytes"
    path.write_bytes(data)
    monkeypatch.setattr(read_once._Reader, "CHUNK", 8192)  # several chunks per range
    for direct in (True, False):  # O_DIRECT where the filesystem allows it, else plain reads
        with read_once._Reader(str(path)) as reader:
            if not direct and reader.direct >= 0:
                os.close(reader.direct)
                reader.direct = -1
            for offset, length in [(0, 1), (4095, 2), (123, 20_000), (49_000, 1000), (8192, 8192)]:
                out = bytearray(length)
                assert reader.read_into(memoryview(out), offset) and bytes(out) == data[offset : offset + length]
            assert not reader.read_into(memoryview(bytearray(10)), 49_995)  # the file ends first


def test_pieces_cover_every_byte_once_and_split_few_large_storages_evenly():
    from ckptools.collective.tree import pieces_of

    for sizes, world in (([3 << 20] * 3, 2), ([3 << 20, 0, 3 << 20, 3 << 20], 2), ([100 << 20, 1 << 20, 5], 4)):
        pieces = pieces_of(sizes, world)
        for index, size in enumerate(sizes):  # each storage's pieces tile it, in order
            mine = sorted((start, length) for i, start, length, _ in pieces if i == index)
            assert sum(length for _, length in mine) == size and all(
                a + n == b for (a, n), (b, _) in zip(mine, mine[1:])
            ), (sizes, index, mine)
        load = [sum(p[2] for p in pieces if p[3] == rank) for rank in range(world)]
        assert max(load) <= sum(sizes) / world + 4096, (sizes, load)
