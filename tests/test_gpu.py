"""The CUDA paths: pinned copies of async saves, node-memory snapshots of CUDA state, the gloo side group
beside nccl, ZeRO partitions on the GPU, every rank writing CUDA tensors, the reference loop on a GPU
(fp16 and bf16 autocast with a GradScaler; two processes sharing one GPU, killed with kill -9), ExactResume
with dropout on the GPU, memory-mapped loads landing on the GPU, broadcast buckets on the GPU.

Skipped without CUDA (CI has none). ``make gpu`` runs them on a GPU machine and writes the report
(benchmarks/gpu_proof.py). ``CKPTOOLS_GPU_DRY_RUN=1`` runs the tests that have a CPU form on the CPU,
to check their logic before a GPU is lent (``GPU_DRY_RUN=1 make gpu``): it proves nothing about CUDA.

Two ranks on one GPU: nccl refuses two ranks on one device, so where one GPU is lent the multi-rank
tests run their ranks on ``cuda:0`` over gloo, which moves CUDA tensors through host memory
(``ck.init_distributed`` makes the same choice when a node has more ranks than GPUs).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import threading
import warnings

import pytest
import torch
from _dist import free_port, run_ranks
from _torchrun import kill_job, ok, torchrun, torchrun_signalled

import ckptools as ck
from ckptools.saving import async_save_with_hooks as _async_save
from ckptools.write import async_save as background

CUDA = torch.cuda.is_available()
DRY = not CUDA and os.environ.get("CKPTOOLS_GPU_DRY_RUN") == "1"
DEVICE = "cuda" if CUDA else "cpu"
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")
cuda_or_dry = pytest.mark.skipif(not (CUDA or DRY), reason="needs CUDA (CKPTOOLS_GPU_DRY_RUN=1: its logic on the CPU)")


@cuda_only
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
        pinned = sum(s.nbytes() for s in background.SAVES.stager._storages if s.is_pinned())
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
    assert ck.release_staging_buffers() > 0


@cuda_only
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


@cuda_only
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


@cuda_only
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


@cuda_only
def test_broadcast_buckets_on_the_gpu():
    # nccl refuses two ranks on one GPU, so this runs the CUDA side of broadcast_tree (GPU buckets,
    # GPU storages, the final synchronize) over gloo, which takes CUDA tensors too.
    assert run_ranks(_broadcast_on_one_gpu, 2) == [True, True]


def _read_once_onto_one_gpu(rank: int, world: int, path: str) -> bool:
    import ckptools as ck

    tree = {"w": torch.arange(1 << 16, dtype=torch.float32), "h": torch.ones(77).half()}
    tree["v"] = tree["w"][3:9]
    if rank == 0:
        ck.save(path, tree)
    ck.barrier()
    got = ck.load(path, read="once", verify=True, map_location="cuda:0")
    same = all(got[k].device.type == "cuda" and torch.equal(got[k].cpu(), tree[k]) for k in tree)
    return same and got["v"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()


@cuda_only
def test_read_once_lands_each_storage_on_the_gpu(tmp_path):
    # Issue 46: each rank reads its share, the rest arrives into storages allocated on the GPU (over
    # gloo here: nccl refuses two ranks on one GPU); views come out sharing their storage.
    assert run_ranks(_read_once_onto_one_gpu, 2, str(tmp_path / "c.pt")) == [True, True]


# --- node-memory snapshots of CUDA state -------------------------------------------------------------


def _cuda_model_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.LayerNorm(1024), torch.nn.Dropout(0.3), torch.nn.Linear(1024, 8)
    ).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(DEVICE)
    for _ in range(2):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(torch.randn(32, 256, device=DEVICE)).float().square().mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return {"model": model, "optimizer": opt, "scaler": scaler}


def _plain(tree):
    """Every tensor of a state dict tree copied to the CPU (what to compare bit for bit)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone()
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_plain(v) for v in tree)
    return tree


def _assert_equal_trees(a, b, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert a.cpu().reshape(-1).view(torch.uint8).equal(b.cpu().reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_equal_trees(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal_trees(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@cuda_or_dry
def test_a_node_memory_snapshot_of_cuda_state_restores_bit_exact_onto_the_gpu(tmp_path, request):
    """manager.snapshot of a model, AdamW and a GradScaler on the GPU (a mixed-precision step), then
    training moves on and draws from the CUDA stream; restore() puts back the snapshot's tensors on the
    GPU and the CUDA stream as of the snapshot, bit for bit. The slot was registered with CUDA (pinned)."""
    state = _cuda_model_state()
    # In node memory (/dev/shm), where snapshots go: CUDA registers a mapping of tmpfs pages; a mapping
    # of an ext4 file it refuses (cudaErrorInvalidValue, seen on an H200), and the copy runs unpinned.
    memory = tempfile.mkdtemp(prefix="ckptools-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    request.addfinalizer(lambda: shutil.rmtree(memory, ignore_errors=True))
    manager = ck.CheckpointManager(tmp_path / "run", snapshot_dir=memory)
    expected = {name: _plain(obj.state_dict()) for name, obj in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ck.CheckpointWarning)  # "could not register the slot" would fail here
        manager.snapshot({**state, "step": 7}, 7, blocking=True)
    if CUDA:
        assert any(m.registered for m in manager._node.slots.mapped.values()), "the slot was never pinned"
    drawn = torch.rand(4, device=DEVICE)  # the stream moves on
    with torch.no_grad():
        for p in state["model"].parameters():
            p.mul_(-2.0)
    state["optimizer"].step()
    assert manager.checkpoints() == []  # nothing durable: the restore below can only come from memory
    ckpt = manager.restore(state)
    assert ckpt is not None and ckpt["step"] == 7
    for name, obj in state.items():
        _assert_equal_trees(expected[name], _plain(obj.state_dict()), name)
    assert all(p.device.type == DEVICE for p in state["model"].parameters())
    moments = [t for s in state["optimizer"].state.values() for t in s.values() if t.dim()]
    assert moments and all(t.device.type == DEVICE for t in moments)
    assert torch.equal(torch.rand(4, device=DEVICE), drawn), "the random stream was not put back as of the snapshot"
    manager.close()


def _launch_args(ckpt_dir, nproc: int, *args: str) -> list[str]:
    from test_train_ddp_e2e import SCRIPT

    return ["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", SCRIPT, "--ckpt-dir", str(ckpt_dir),
            *args]  # fmt: skip


@cuda_or_dry
def test_two_processes_sharing_one_gpu_killed_with_kill_9_resume_from_node_memory_bit_exact(tmp_path):
    """torchrun --nproc-per-node=2 on one GPU: init_distributed puts both ranks on cuda:0 over gloo.
    The loop snapshots every step into node memory; kill -9 of every process of the job right after a
    logged step; the same command resumes at most one step behind, and ends bit-identical to an
    uninterrupted run of the same two processes."""
    from test_train_ddp_e2e import ROOT, assert_bit_identical

    args = ["--save-every-steps", "1000", "--snapshot-every", "1", "--log-every", "1", "--amp"]
    reference = ok(torchrun(_launch_args(tmp_path / "ref", 2, *args), cwd=ROOT, timeout=240))
    assert f"backend gloo, device {DEVICE}" in reference, reference[-3000:]
    if CUDA and torch.cuda.device_count() == 1:
        assert "processes on this node share 1 GPU(s)" in reference
    run = tmp_path / "run"
    launch = _launch_args(run, 2, *args, "--step-seconds", "0.05")
    kill = kill_job
    first, _ = torchrun_signalled(launch, cwd=ROOT, when="step 23 loss", send=kill, timeout=240)
    assert first.returncode != 0 and "done after" not in first.stdout, first.stdout[-3000:]
    last = max(int(n) for n in re.findall(r"step (\d+) loss", first.stdout))
    again = ok(torchrun(_launch_args(run, 2, *args), cwd=ROOT, timeout=240))
    resumed = int(re.search(r"resumed from step (\d+) ", again).group(1))
    assert resumed in (last - 1, last), (last, again[-3000:])
    assert_bit_identical(tmp_path / "ref", run)


@cuda_or_dry
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_amp_with_a_gradscaler_crashed_and_restarted_by_torchrun_is_bit_exact(tmp_path, dtype):
    """The reference loop under autocast (fp16 or bf16) with a GradScaler on one GPU: one rank dies after
    step 17, torchrun restarts the job, which resumes from step 15; the scaler's scale and growth
    tracker come back with it, and the end is bit-identical to an uninterrupted run."""
    from test_train_ddp_e2e import ROOT, assert_bit_identical

    args = ["--amp", "--amp-dtype", dtype, "--log-every", "1"]
    ok(torchrun(_launch_args(tmp_path / "ref", 1, *args), cwd=ROOT, timeout=240))
    crashed = _launch_args(tmp_path / "run", 1, *args, "--fail-at-step", "17")
    crashed[2] = "--max-restarts=1"
    out = ok(torchrun(crashed, cwd=ROOT, timeout=240))
    assert "simulated crash right after step 17" in out and "resumed from step 15 " in out, out[-3000:]
    assert_bit_identical(tmp_path / "ref", tmp_path / "run")
    saved = torch.load(ck.CheckpointManager(tmp_path / "run").latest(), weights_only=True, map_location="cpu")
    assert saved["scaler"]["scale"] > 0 and "_growth_tracker" in saved["scaler"]


# --- several ranks on one GPU (gloo) ----------------------------------------------------------------


def _rank_device() -> torch.device:
    """This rank's device: cuda:0 for every rank where one GPU is lent, deterministic kernels."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if CUDA:
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _zero_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))  # fmt: skip


def _zero_step(model, zero, device, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    zero.zero_grad()
    model(torch.randn(16, 64, generator=g).to(device)).square().mean().backward()
    zero.step()


def _zero_on_gpu(rank: int, world: int, directory: str, phase: str) -> dict:
    """ZeRO (AdamW) over DDP on this rank's GPU. straight: 6 steps; save: 3 steps, then ck.save (no
    consolidation); resume: load the file (saved on 2 ranks) and, on 2 ranks, train steps 3-5."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    device = _rank_device()
    model = DistributedDataParallel(_zero_net().to(device), device_ids=[device.index] if CUDA else None)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    path = os.path.join(directory, "zero.pt")
    own = 0
    if phase in ("straight", "save"):
        for step in range(3):
            _zero_step(model, zero, device, rank, step)
    if phase == "save":

        def refuse(*args, **kwargs):
            raise AssertionError("consolidate_state_dict was called")

        zero.consolidate_state_dict = refuse
        ck.save(path, {"model": model, "optimizer": zero, "step": 3})
        return {}
    if phase == "resume":
        ck.load(path, {"model": model, "optimizer": zero})
        saved = torch.load(path, weights_only=True, map_location="cpu")["optimizer"]["state"]
        for param, values in zero.optim.state.items():
            index = zero._param_to_index[param]
            for key, value in values.items():
                if value.dim():  # the moments live with their parameter (AdamW's step counter on the CPU)
                    assert value.device == param.device, (index, key, value.device)
                assert torch.equal(value.cpu(), saved[index][key]), (index, key)
                own += 1
    if world == 2:
        for step in range(3, 6):
            _zero_step(model, zero, device, rank, step)
    weights = {k: v.cpu().numpy().tobytes() for k, v in model.module.state_dict().items()}
    return {"own": own, "weights": weights, "device": str(next(model.parameters()).device)}


@cuda_or_dry
def test_zero_with_cuda_partitions_saved_by_their_owners_resumes_bit_exact_and_on_other_world_sizes(tmp_path):
    straight = run_ranks(_zero_on_gpu, 2, str(tmp_path), "straight", timeout=180)
    run_ranks(_zero_on_gpu, 2, str(tmp_path), "save", timeout=180)
    resumed = run_ranks(_zero_on_gpu, 2, str(tmp_path), "resume", timeout=180)
    assert straight[0]["device"].startswith(DEVICE)
    assert resumed[0]["weights"] == straight[0]["weights"], "resumed on 2 ranks, not bit-identical"
    entries = sum(len(v) for v in torch.load(tmp_path / "zero.pt", weights_only=True)["optimizer"]["state"].values())
    assert sum(r["own"] for r in resumed) == entries
    for world in (1, 3):  # every entry lands in exactly one rank's new partition, equal to what was saved
        got = run_ranks(_zero_on_gpu, world, str(tmp_path), "resume", timeout=180)
        assert sum(r["own"] for r in got) == entries, (world, [r["own"] for r in got])


def _writers_all_on_gpu(rank: int, world: int, directory: str) -> dict:
    from test_writers import _count_writes
    from torch.nn.parallel import DistributedDataParallel

    device = _rank_device()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 64))
    model = DistributedDataParallel(net.to(device), device_ids=[device.index] if CUDA else None)
    opt = torch.optim.Adam(model.parameters())
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(8, 512, generator=g).to(device)).square().mean().backward()
    opt.step()
    state = {"model": model, "optimizer": opt, "step": 1}
    ck.save(f"{directory}/rank0.pt", state, writers="rank0")
    counted = _count_writes()
    ck.save(f"{directory}/all.pt", state, writers="all")
    handle = ck.async_save(f"{directory}/async.pt", state, writers="all")
    with torch.no_grad():  # training moves on: the file holds the state as of the call
        for p in model.parameters():
            p.add_(1.0)
    handle.wait()
    ck.release_staging_buffers()
    return {"written": counted["bytes"]}


@cuda_or_dry
def test_every_rank_writes_its_share_of_cuda_tensors_into_one_file_equal_to_rank0s(tmp_path):
    from test_writers import _assert_same

    results = run_ranks(_writers_all_on_gpu, 2, str(tmp_path), timeout=180)
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True, map_location="cpu")
    for name in ("all.pt", "async.pt"):
        _assert_same(rank0, torch.load(tmp_path / name, weights_only=True, map_location="cpu"), name)
        assert "every record's CRC-32 matches" in ck.verify(tmp_path / name)
    # Both ranks wrote a share, in the sync and the async save alike.
    assert all(len(r["written"]) == 2 and min(r["written"]) > 0 for r in results), results


# --- ExactResume with dropout on the GPU (Lightning) --------------------------------------------------


@cuda_or_dry
@pytest.mark.timeout(600)
def test_exact_resume_in_lightning_with_dropout_on_the_gpu_is_bit_exact_after_kills(tmp_path, monkeypatch):
    """Lightning on one GPU with dropout (drawn from the CUDA stream): ExactResume + ck.ResumableDataLoader
    killed with SIGKILL at steps 6 and 19 resumes bit-identical to an uninterrupted run; the control,
    the same recipe with the CUDA stream left out of what is put back, does not."""
    pytest.importorskip("pytorch_lightning", reason="Lightning is not installed")
    from _lightning_fit import FIT, run_killed

    monkeypatch.setenv("FIT_ACCELERATOR", "gpu" if CUDA else "cpu")
    script = tmp_path / "fit.py"
    script.write_text(FIT)
    args = (3, 4, 0, 96, 1, 1, 1)  # epochs, every, workers, samples, dropout, shuffle, augment
    kills = [6, 19]  # resumed from steps 4 and 16, both mid-epoch (12 steps an epoch)

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)

    straight = run_killed(script, tmp_path / "straight", "exact", 1, args)  # on the CPU: Lightning's teardown
    resumed = run_killed(script, tmp_path / "resumed", "exact", 1, args, kills, require_checkpoint=True)
    assert same(straight, resumed), f"kills at steps {kills}"
    saved = torch.load(tmp_path / "resumed" / "last.ckpt", weights_only=True, map_location="cpu")
    streams = saved["callbacks"]["ckptools.ExactResume"]["rng"][0]
    assert ("cuda" in streams) == CUDA
    if CUDA:
        control = run_killed(script, tmp_path / "control", "exact-no-cuda-stream", 1, args, kills)
        assert not same(straight, control), "without the CUDA stream put back the resume was exact: no GPU dropout?"
