"""The CUDA paths: pinned snapshots of async saves, the gloo side group beside nccl, the reference
loop preempted on a GPU, memory-mapped loads landing on the GPU, broadcast buckets on the GPU.
Skipped without CUDA (CI has none); run on a GPU machine with ``python -m pytest -q tests/test_gpu.py``."""

from __future__ import annotations

import os
import re
import signal
import threading

import pytest
import torch
from _dist import free_port, run_ranks
from _torchrun import ok, torchrun, torchrun_signalled

import ckptools as ck
from ckptools.saving import async_save_with_hooks as _async_save
from ckptools.write import async_save as background

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_state_is_snapshotted_into_pinned_memory_as_of_the_call(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 8)).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(32, 256, device="cuda")).square().mean().backward()
    opt.step()
    state = {"model": model, "optimizer": opt}
    ck.save(tmp_path / "sync.pt", state)
    gate = threading.Event()
    handle = _async_save(tmp_path / "async.pt", state, before_write=gate.wait)
    try:
        # Every CUDA storage (weights, Adam's moments) went to pinned memory; CPU ones (the
        # RNG states, Adam's step counters) to plain memory.
        pinned = sum(s.nbytes() for s in background._BUFFERS._storages if s.is_pinned())
        assert pinned == 3 * sum(p.numel() * p.element_size() for p in model.parameters())
        # Training moves on at once, on the GPU's stream: the snapshot must already be complete.
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-3.0).add_(1.0)
        opt.step()
        torch.cuda.synchronize()
    finally:
        gate.set()
    handle.wait()
    sync = torch.load(tmp_path / "sync.pt", map_location="cpu")
    other = torch.load(tmp_path / "async.pt", map_location="cpu")
    for key, value in sync["model"].items():
        assert torch.equal(value, other["model"][key]), key
        assert other["model"][key].device.type == "cpu"
    for index, entry in sync["optimizer"]["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, other["optimizer"]["state"][index][name]), (index, name)
    # Loads back onto the GPU like any checkpoint.
    restored = ck.load(tmp_path / "async.pt", {"model": model, "optimizer": opt})
    assert restored["model"]["0.weight"].device.type == "cuda"
    assert ck.release_snapshot_buffers() > 0


def test_nccl_training_gets_a_gloo_side_group_for_ckptools_exchanges():
    import torch.distributed as dist

    from ckptools.collective import group as ckdist

    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, device_id=torch.device("cuda:0")
    )
    try:
        side = ckdist._object_group()
        assert side is not None and dist.get_backend(side) == "gloo"
        assert ckdist._object_group() is side  # made once
        box = torch.tensor([7], dtype=torch.uint8)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=side)  # a CPU tensor: no GPU involved
        out = [None]
        dist.all_gather_object(out, {"x": 1}, group=side)
        assert out == [{"x": 1}] and box.item() == 7
    finally:
        dist.destroy_process_group()
        ckdist._SIDE = None


def test_reference_loop_on_gpu_preempted_with_async_save_resumes_bit_exact(tmp_path):
    from test_train_ddp_e2e import ROOT, SCRIPT, assert_bit_identical

    common = ["--amp", "--async-save", "--save-every-steps", "1", "--hidden", "2048", "--depth", "4"]
    ref = tmp_path / "ref"
    out = ok(torchrun(["--standalone", "--nproc-per-node=1", SCRIPT, "--ckpt-dir", str(ref), *common], cwd=ROOT))
    assert "backend nccl, device cuda" in out, out[-2000:]
    run = tmp_path / "run"
    args = ["--standalone", "--nproc-per-node=1", SCRIPT, "--ckpt-dir", str(run), *common,
            "--log-every", "1", "--step-seconds", "0.05"]  # fmt: skip
    first, seconds = torchrun_signalled(
        args, cwd=ROOT, when="epoch 1 step 40 ", send=lambda pid: os.kill(pid, signal.SIGTERM)
    )
    step = int(re.findall(r"preempted at step (\d+) \(SIGTERM\)", first.stdout)[0])
    assert "every rank leaves with exit code 143" in first.stdout
    again = ok(torchrun(["--standalone", "--nproc-per-node=1", SCRIPT, "--ckpt-dir", str(run), *common], cwd=ROOT))
    assert f"resumed from step {step} " in again
    assert_bit_identical(ref, run)
    print(f"\nGPU preemption: stopped at step {step}, torchrun exited {seconds:.2f} s after SIGTERM, 0 steps lost")


def test_load_maps_the_file_and_lands_on_the_gpu(tmp_path):
    # ck.load memory-maps local files; with "auto" (this rank's GPU) every tensor must end on it.
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    ck.save(tmp_path / "c.pt", {"model": model, "optimizer": opt})
    fresh = torch.nn.Linear(64, 64).cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    ckpt = ck.load(tmp_path / "c.pt", {"model": fresh, "optimizer": fresh_opt})
    assert ckpt["model"]["weight"].device.type == "cuda"
    assert torch.equal(fresh.weight, model.weight)
    state = fresh_opt.state_dict()["state"][0]
    assert state["exp_avg"].device.type == "cuda" and torch.equal(
        state["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )


def _broadcast_on_one_gpu(rank: int, world: int) -> bool:
    from ckptools.collective.tree import broadcast_tree

    g = torch.Generator().manual_seed(1)
    base = torch.randn(1000, 37, generator=g)
    tree = {"w": base.cuda(), "h": torch.randn(77, generator=g).half().cuda()}
    tree["v"] = tree["w"][3:9]  # a view: must come out sharing w's storage
    got = broadcast_tree(tree if rank == 0 else None, device=torch.device("cuda", 0),
                         comm_device=torch.device("cuda", 0), bucket_bytes=4096)  # fmt: skip
    same = all(got[k].device.type == "cuda" and torch.equal(got[k].cpu(), tree[k].cpu()) for k in tree)
    return same and got["v"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()


def test_broadcast_buckets_on_the_gpu():
    # nccl refuses two ranks on one GPU, so this runs the CUDA side of broadcast_tree (GPU buckets,
    # GPU storages, the final synchronize) over gloo, which takes CUDA tensors too.
    assert run_ranks(_broadcast_on_one_gpu, 2) == [True, True]
