"""ck.load(..., read="rank0"): rank 0 reads, every rank ends with what it would have read itself."""

from __future__ import annotations

import os

import pytest
import torch
from _dist import run_ranks

import ckptools as ck

pytestmark = pytest.mark.versions  # torch's collectives over storages and DDP's buckets


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))


def _two_nodes(rank: int, world: int, root: str, read: str, deprecated: bool = False) -> dict:
    # Two simulated nodes: each rank works in its own directory (its node-local disk), and the
    # same relative path names the checkpoint, which only node 0's disk holds.
    node = os.path.join(root, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    os.chdir(node)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    tied = torch.arange(12.0)
    torch.manual_seed(100 + rank)  # each rank's own stream, saved per rank
    # conjugate and negative views: their bits travel with them (their bytes are not their values)
    views = {"conj": torch.tensor([1 + 2j, 3 - 4j]).conj(), "neg": torch.tensor([1.0, -2.0])._neg_view()}
    state = {"model": model, "optimizer": optimizer, "tied": {"a": tied, "b": tied[2:5]}, "views": views, "step": 7}
    if rank == 0:
        os.makedirs("ckpt", exist_ok=True)
    ck.barrier()
    # Saved by rank 0 into node 0's directory only (every rank takes part in the collective).
    ck.save("ckpt/latest.pt", state)
    expected_rng = torch.get_rng_state()
    torch.manual_seed(12345)  # moved on: restoring must bring this rank's own stream back
    fresh = _net()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    try:
        if deprecated:  # the old switch, read="rank0"'s former name
            with pytest.warns(DeprecationWarning, match="read='rank0'"):
                ckpt = ck.load("ckpt/latest.pt", {"model": fresh, "optimizer": fresh_opt}, broadcast=True)
        else:
            ckpt = ck.load("ckpt/latest.pt", {"model": fresh, "optimizer": fresh_opt}, read=read)
    except ck.CheckpointError as err:
        return {"error": type(err).__name__, "message": str(err)}
    same_model = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    sa, sb = fresh_opt.state_dict()["state"], optimizer.state_dict()["state"]
    same_opt = all(torch.equal(sa[i][k], sb[i][k]) for i in sb for k in sb[i])
    a, b = ckpt["tied"]["a"], ckpt["tied"]["b"]
    return {
        "exists_here": os.path.exists("ckpt/latest.pt"),
        "model": same_model,
        "optimizer": same_opt,
        "rng": torch.equal(torch.get_rng_state(), expected_rng),
        "step": ckpt["step"],
        "tied": a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and torch.equal(b, a[2:5]),
        "views": all(
            torch.equal(ckpt["views"][k].resolve_conj().resolve_neg(), v.resolve_conj().resolve_neg())
            for k, v in views.items()
        ),
    }


@pytest.mark.parametrize("deprecated", [False, True])
def test_only_node_0_has_the_file_and_rank0_reads_it_for_everyone(tmp_path, deprecated):
    results = run_ranks(_two_nodes, 2, str(tmp_path), "rank0", deprecated)
    assert [r["exists_here"] for r in results] == [True, False]
    for r in results:
        assert r["model"] and r["optimizer"] and r["rng"] and r["step"] == 7 and r["tied"] and r["views"], r


def test_each_rank_reading_the_rank_that_cannot_find_it_says_what_to_do(tmp_path):
    results = run_ranks(_two_nodes, 2, str(tmp_path), "each")
    assert results[1]["error"] == "CheckpointNotFoundError"
    assert "but rank 0 read it: pass read='rank0'" in results[1]["message"]
    assert results[0]["error"] == "CheckpointError" and "failed on rank 1" in results[0]["message"]


def _rank0_cannot_read(rank: int, world: int, root: str) -> str:
    os.chdir(root)
    try:
        ck.load("missing.pt", {}, read="rank0")
    except ck.CheckpointError as err:
        return type(err).__name__ + ": " + str(err)
    return "loaded"


def test_a_failure_on_rank_0_reaches_every_rank(tmp_path):
    results = run_ranks(_rank0_cannot_read, 2, str(tmp_path))
    assert results[0].startswith("CheckpointNotFoundError")
    assert results[1].startswith("CheckpointError") and "failed on rank 0" in results[1]


def test_buckets_split_and_join_storages_exactly():
    from ckptools.collective.tree import _windows

    sizes = [5, 0, 17, 3]
    windows = list(_windows(sizes, 8))
    assert all(sum(length for _, _, length, _ in w) <= 8 for w in windows)
    covered = {i: 0 for i in range(len(sizes))}
    for w in windows:
        for i, start, length, _ in w:
            assert start == covered[i]
            covered[i] += length
    assert [covered[i] for i in range(len(sizes))] == sizes


@pytest.mark.parametrize("bucket", [7, 1 << 20])
def test_many_tensors_through_small_buckets(tmp_path, bucket):
    run_ranks(_small_buckets, 2, str(tmp_path), bucket)


def _small_buckets(rank: int, world: int, root: str, bucket: int) -> None:
    from ckptools.collective.tree import broadcast_tree

    g = torch.Generator().manual_seed(3)
    tree = {"w": torch.randn(33, 5, generator=g), "h": torch.randn(9, generator=g).half(), "b": torch.tensor([True]),
            "e": torch.empty(0), "p": torch.nn.Parameter(torch.ones(2)), "n": [1, "x", None]}  # fmt: skip
    got = broadcast_tree(tree if rank == 0 else None, device=torch.device("cpu"),
                         comm_device=torch.device("cpu"), bucket_bytes=bucket)  # fmt: skip
    for k in ("w", "h", "b", "e", "p"):
        assert got[k].dtype == tree[k].dtype and torch.equal(got[k], tree[k]), k
    assert isinstance(got["p"], torch.nn.Parameter) and got["n"] == [1, "x", None]


def _manager_on_two_nodes(rank: int, world: int, root: str) -> dict:
    node = os.path.join(root, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    os.chdir(node)  # "ckpt" is each node's own local directory
    model = _net()
    manager = ck.CheckpointManager("ckpt", keep_last=2)
    manager.save({"model": model, "step": 3}, 3)  # rank 0 writes, into node 0's directory
    target = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    ckpt = manager.restore({"model": target}, read="rank0")
    return {
        "files_here": sorted(os.listdir("ckpt")) if os.path.isdir("ckpt") else [],
        "step": ckpt["step"],
        "same": all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), model.state_dict().values())),
    }


def test_manager_restores_from_node_0_only(tmp_path):
    results = run_ranks(_manager_on_two_nodes, 2, str(tmp_path))
    assert results[0]["files_here"] == ["ckpt-0000000003.pt"] and results[1]["files_here"] == []
    assert all(r["step"] == 3 and r["same"] for r in results), results


def _placeholders_everywhere(rank: int, world: int, path: str) -> dict:
    import warnings

    net = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ck.CheckpointWarning)  # rank 0 names the skipped class
        ckpt = ck.load(path, {"model": net}, read="rank0")
    return {"hparams": repr(ckpt["hyper_parameters"]), "weight": net.weight.detach().tolist()}


def test_a_broadcast_load_sends_inert_placeholders_too(tmp_path):
    import pathlib

    net = torch.nn.Linear(3, 2)
    path = tmp_path / "lightning.ckpt"  # a Path in hyper_parameters: read as a placeholder
    torch.save({"state_dict": net.state_dict(), "hyper_parameters": {"root": pathlib.Path("/d"), "lr": 0.1}}, path)
    for r in run_ranks(_placeholders_everywhere, 2, str(path)):
        assert r["hparams"] == "{'root': <pathlib.PosixPath, not loaded>, 'lr': 0.1}"
        assert r["weight"] == net.weight.detach().tolist()
