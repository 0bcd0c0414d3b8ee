"""End-to-end: the reference loop under real torchrun, killed and resumed, must end bit-identical."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from _dist import free_port
from _torchrun import computed_once, job_processes, keepers_left, kill_job, ok, rank_processes, torchrun_signalled
from _torchrun import torchrun as _launch
from safetensors.torch import load_file
from torch.distributed.run import get_args_parser

import ckptools as ck

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "train_ddp.py")


def torchrun(ckpt_dir, *args: str, nproc: int = 2, max_restarts: int = 0, launch: tuple[str, ...] = ()):
    launch = launch or ("--standalone",)
    return _launch([*launch, f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", SCRIPT,
                    "--ckpt-dir", str(ckpt_dir), *args], cwd=ROOT)  # fmt: skip


def assert_bit_identical(a_dir, b_dir) -> None:
    a, b = load_file(str(Path(a_dir) / "final.safetensors")), load_file(str(Path(b_dir) / "final.safetensors"))
    assert sorted(a) == sorted(b) and not any(k.startswith("module.") for k in a)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        diff = (a[key].double() - b[key].double()).abs().max().item() if a[key].numel() else 0.0
        assert a[key].numpy().tobytes() == b[key].numpy().tobytes(), f"{key}: max |delta| {diff}"


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Uninterrupted runs, computed once per session (shared by xdist workers): a ckpt_dir per
    (nproc, amp, model args)."""

    def get(nproc: int = 2, amp: bool = False, model: tuple[str, ...] = ()) -> Path:
        # Saves never change the weights: a big model's reference saves at epoch ends only.
        saves = ("--save-every-steps", "1000") if model else ()

        def run(d: Path) -> None:
            out = ok(torchrun(d, *(["--amp"] if amp else []), *model, *saves, nproc=nproc))
            assert "fresh start" in out and "resumed" not in out

        name = f"ref{nproc}{'amp' if amp else ''}-" + hashlib.sha1(" ".join(model).encode()).hexdigest()[:8]
        return computed_once(tmp_path_factory, name, run)

    return get


@pytest.mark.slow  # a whole-run scenario: make interop (make test stays within its 5 minutes)
def test_killed_and_restarted_by_torchrun_again_and_again_is_bit_exact(tmp_path, reference):
    """One launch, four crashes: torchrun's attempt k loses a rank right after the k-th step of
    17 (right after the epoch-end save), 23 (between two saves), 24 (right before one) and 26
    (right after one), and restarts the job each time. The loop trains with autocast (bfloat16) and
    a GradScaler, and its dataset augments every sample with torch, python and numpy draws in 2
    DataLoader workers; it ends as the uninterrupted autocast run with 0 workers did (SeededDataset:
    each sample's draws depend on (seed, epoch, index) alone)."""
    kills = [(17, 16), (23, 20), (24, 20), (26, 25)]
    out = ok(torchrun(tmp_path, "--amp", "--num-workers", "2", "--fail-at-step", *(str(k) for k, _ in kills),
                      max_restarts=len(kills)))  # fmt: skip
    for attempt, (fail_at, resumed_from) in enumerate(kills, start=1):
        assert f"simulated crash right after step {fail_at}" in out, out[-3000:]
        this_attempt = out.split(f"attempt {attempt},", 1)[1].split(f"attempt {attempt + 1},", 1)[0]
        assert f"resumed from step {resumed_from} " in this_attempt, (attempt, out[-3000:])
    assert "resumed from step 20 (epoch 1: 128 of its 512 samples consumed, 192 left for each rank)" in out
    assert f"attempt {len(kills) + 1}," not in out
    assert_bit_identical(reference(amp=True), tmp_path)
    with pytest.raises(AssertionError):  # autocast really changed the numerics
        assert_bit_identical(reference(), tmp_path)
    ckpts = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-"))
    assert ckpts == ["ckpt-0000000040.pt", "ckpt-0000000045.pt", "ckpt-0000000048.pt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temp leftovers"
    assert "CheckpointWarning" not in out


@pytest.mark.slow  # ~17 s: make interop runs it (make test stays within 5 minutes)
def test_unseeded_augmentation_in_workers_differs_after_a_resume_and_warns(tmp_path):
    """The control: the same dataset unwrapped (--no-seeded-dataset), killed and resumed with 2
    workers, ends with other weights than its own uninterrupted run, and the loop says why. On one
    rank (a job of one process): what goes wrong is in each rank's DataLoader workers, whatever the
    world size, and each launch costs a rank less (batches of 16: step 20 is in epoch 0)."""
    plain = ("--num-workers", "2", "--no-seeded-dataset")
    uninterrupted = tmp_path / "uninterrupted"
    ok(torchrun(uninterrupted, *plain, nproc=1))
    out = ok(torchrun(tmp_path / "resumed", *plain, "--fail-at-step", "23", nproc=1, max_restarts=1))
    assert "resumed from step 20 " in out
    assert len(re.findall(r"CheckpointWarning: epoch 0 resumes mid-way with 2 DataLoader workers", out)) == 1, out
    assert "ck.SeededDataset(dataset, sampler)" in out
    with pytest.raises(AssertionError):
        assert_bit_identical(uninterrupted, tmp_path / "resumed")


@pytest.mark.slow  # a whole-run scenario: make interop (make test stays within its 5 minutes)
def test_failed_launch_then_same_command_or_another_worker_count_resumes(tmp_path, reference):
    """A launch whose 2 DataLoader workers are spawned and persistent (alive across epochs) dies
    after step 23 and is not restarted. Run again as it was, it resumes from step 20; so does a
    launch with 3 forked workers from the same folder (a copy); both end bit-identical to the
    uninterrupted run with 0 workers, without a warning."""
    same, more = tmp_path / "same", tmp_path / "more"
    workers = ("--num-workers", "2", "--persistent-workers", "--worker-start", "spawn")
    failed = torchrun(same, *workers, "--fail-at-step", "23")
    assert failed.returncode != 0 and "simulated crash right after step 23" in failed.stdout + failed.stderr
    shutil.copytree(same, more)
    again = ok(torchrun(same, *workers, "--fail-at-step", "23"))
    assert "resumed from step 20" in again
    assert_bit_identical(reference(), same)
    out = ok(torchrun(more, "--num-workers", "3"))
    assert "resumed from step 20 " in out
    assert_bit_identical(reference(), more)
    assert "CheckpointWarning" not in again + out


def _records(directory: Path, world: int) -> list[tuple[int, int, list[int]]]:
    """(step, epoch, sample indices) of every step every rank of that world size trained."""
    rows = []
    for path in sorted(directory.glob(f"samples-rank*-of-{world}.txt")):
        for line in path.read_text().splitlines():
            step, epoch, *indices = map(int, line.split())
            rows.append((step, epoch, indices))
    return rows


@pytest.mark.slow  # four 3-rank launches (~30 s): `make interop` runs it, with the other whole-job scenarios
def test_three_processes_resumed_on_three_or_on_two_cover_the_data_exactly_once(tmp_path, reference):
    """3 ranks train with batches of 15 and a save every 3 steps; one dies after step 14, so the
    last checkpoint is step 12, one step into epoch 1 (45 samples consumed: not a multiple of 2).
    Relaunched on 3 ranks (a copy of the folder) it ends bit-identical to the uninterrupted 3-rank
    run; the job comes back on 2 ranks. Counted from what each rank trained on: in the interrupted
    epoch no sample is seen twice and only the sampler's remainder and each rank's incomplete last
    batch are left out; the next epoch is a plain 2-rank epoch. What differs from an uninterrupted
    3-rank run: the global batch (45 -> 30), so the step count and the weights; and each new
    rank's RNG stream (left as it is, with a warning)."""
    ckpt, seen = tmp_path / "ckpt", tmp_path / "seen"
    args = ("--batch-size", "15", "--save-every-steps", "3", "--record-samples", str(seen))
    first = torchrun(ckpt, *args, "--fail-at-step", "14", nproc=3)
    assert first.returncode != 0 and "simulated crash right after step 14" in first.stdout + first.stderr
    # The same job relaunched on 3 ranks (a copy of the folder) ends bit-identical to the
    # uninterrupted 3-rank run: ring all-reduce over 3 ranks keeps its order across the resume.
    same = tmp_path / "same"
    shutil.copytree(ckpt, same)
    again = ok(torchrun(same, *args[:4], nproc=3))
    assert "world size 3" in again and "resumed from step 12 " in again
    assert_bit_identical(reference(nproc=3, model=args[:2]), same)
    out = ok(torchrun(ckpt, *args, nproc=2))
    assert "world size 2" in out and "sampler saved with 3 replicas, restored with 2" in out
    assert "resumed from step 12 (epoch 1: 45 of its 512 samples consumed, 233 left for each rank)" in out
    before = [r for r in _records(seen, 3) if r[0] <= 12]  # steps 13-14 died with the crash: retrained
    after = _records(seen, 2)
    epoch1 = [i for _, epoch, indices in before + after if epoch == 1 for i in indices]
    assert len(epoch1) == 45 + 2 * 15 * 15  # 45 before; the other 467 dealt out as 2 x 233, 15 batches each
    assert len(set(epoch1)) == len(epoch1), "a sample of the interrupted epoch was trained on twice"
    assert 512 - len(epoch1) == 1 + 2 * (233 - 15 * 15)  # the sampler's remainder, each rank's last batch
    epoch2 = [i for _, epoch, indices in after if epoch == 2 for i in indices]
    assert len(epoch2) == len(set(epoch2)) == 2 * 17 * 15  # a plain 2-rank epoch: 256 per rank, 17 batches
    assert max(step for step, _, _ in after) == 12 + 15 + 17
    # Every sample, on 3 ranks or on 2, before or after the resume, was augmented exactly as any
    # run of this seed augments it (SeededDataset): the hash of its features per (epoch, index).
    hashes = {}
    for path in seen.glob("augmented-rank*-of-*.txt"):
        for line in path.read_text().splitlines():
            epoch, index, digest = line.split()
            hashes.setdefault((int(epoch), int(index)), set()).add(digest)
    assert len(hashes) == len({(e, i) for _, e, indices in _records(seen, 3) + after for i in indices})
    retrained = [(1, i) for step, epoch, indices in _records(seen, 3) if step > 12 for i in indices]
    assert retrained and all(len(hashes[key]) == 1 for key in retrained)  # trained on 3 ranks, then on 2
    assert {key: digests.pop() for key, digests in hashes.items()} == _augmented_hashes(hashes)
    with pytest.raises(AssertionError):  # not the 3-rank run: another global batch, other steps
        assert_bit_identical(reference(nproc=3, model=args[:2]), ckpt)


def _augmented_hashes(keys) -> dict[tuple[int, int], str]:
    """What any run of the reference loop (seed 0) feeds for each (epoch, index), computed here."""
    spec = importlib.util.spec_from_file_location("train_ddp", SCRIPT)
    assert spec is not None and spec.loader is not None
    loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop)
    data = loop.SyntheticData(512, 0)
    sampler = ck.ResumableDistributedSampler(data, num_replicas=1, rank=0, seed=0)
    seeded = ck.SeededDataset(data, sampler)
    out = {}
    for epoch, index in keys:
        sampler.set_epoch(epoch)
        out[epoch, index] = hashlib.sha256(seeded[index][0].numpy().tobytes()).hexdigest()[:16]
    return out


def _two_nodes(ckpt_dir, *args: str) -> list[subprocess.CompletedProcess]:
    port = free_port()
    results: list = [None, None]

    def launch(node: int) -> None:
        results[node] = torchrun(
            ckpt_dir,
            *args,
            nproc=1,
            launch=("--nnodes=2", f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}"),
        )

    threads = [threading.Thread(target=launch, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.slow  # ~14 s: make interop runs it (make test stays within 5 minutes)
def test_two_simulated_nodes(tmp_path, reference):
    first = _two_nodes(tmp_path, "--fail-at-step", "23")
    assert all(p.returncode != 0 for p in first), "the crash of node 1's rank fails both launches"
    node0, node1 = (ok(p) for p in _two_nodes(tmp_path, "--fail-at-step", "23"))
    assert "[rank0] local rank 0, writes checkpoints: True" in node0
    assert "[rank1] local rank 0, writes checkpoints: False" in node1
    assert "resumed from step 20" in node0
    assert_bit_identical(reference(), tmp_path)


def _signal(targets, signum: int):
    def send(torchrun_pid: int) -> None:
        for pid in targets(torchrun_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    return send


# Who gets the signal: torchrun (Kubernetes, or `kill` of the launcher; it forwards SIGTERM to
# every rank's process group), every process of the job (SLURM signals a whole job step), or
# one rank alone (the others learn it at the next step boundary).
_TORCHRUN = (lambda pid: [pid], signal.SIGTERM)
_EVERY_PROCESS = (job_processes, signal.SIGTERM)
_ONE_RANK_USR1 = (lambda pid: rank_processes(pid)[-1:], signal.SIGUSR1)
# SLURM's `--signal=USR1@90` reaches every process of the step; torchrun forwards SIGUSR1 too
# when told to handle it (by default SIGUSR1 would kill torchrun itself on the spot).
_EVERY_PROCESS_USR1 = (job_processes, signal.SIGUSR1)
_SLURM_TORCHRUN = ("--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",)


@pytest.mark.parametrize(
    ("chain", "extra", "model"),
    [
        # Without DataLoader workers: SIGUSR1 to one rank (SIGTERM to torchrun: the async chain).
        # ~18 s: make interop runs it (make test stays within 5 minutes)
        pytest.param((_ONE_RANK_USR1,), (), (), id="sigusr1-to-one-rank", marks=pytest.mark.slow),
        # One job preempted again and again, each launch resuming where the last stopped: the
        # signals of one chain share its processes (a launch each), not their paths.
        pytest.param(
            (_TORCHRUN, _EVERY_PROCESS, _EVERY_PROCESS_USR1),
            ("--num-workers", "2"),
            (),
            id="workers2-sigterm-to-torchrun-then-to-every-process-then-sigusr1-to-every-process-slurm",
            marks=pytest.mark.slow,  # ~40 s: make interop runs it (make test stays within 5 minutes)
        ),
        # Async saves every step of a ~55 MB state: the stop finds that step's save being
        # written, and must finish it before every rank exits.
        pytest.param(
            (_TORCHRUN,),
            ("--async-save", "--save-every-steps", "1"),
            ("--hidden", "1536", "--depth", "4", "--batch-size", "2", "--dataset-size", "64", "--epochs", "1"),
            id="sigterm-async-save-in-flight",
            marks=pytest.mark.slow,  # ~23 s: make interop runs it (make test stays within 5 minutes)
        ),
    ],
)
def test_preempted_mid_epoch_saves_that_step_and_resumes_bit_exact(tmp_path, reference, chain, extra, model):
    """Each launch of ``chain`` gets its signal 4 steps into an epoch (of 16 steps: the run's
    last epoch, or each of the three for a chain of three), must stop mid-epoch at one step on every rank,
    save it and exit with 128 + the signal; the next launch (the same command) resumes from that
    very step, and the last one ends bit-identical to the uninterrupted run."""
    asynchronous = "--async-save" in extra
    # Periodic saves off (only the epoch-end ones): only the preemption save can explain resuming
    # at the step the signal stopped. With async saves every step is saved, in the background;
    # the stop's task is to make sure that save completes.
    periodic = () if asynchronous else ("--save-every-steps", "1000")
    # SLURM's signal: torchrun must be told to forward SIGUSR1 (to every launch of that chain).
    launcher = _SLURM_TORCHRUN if _EVERY_PROCESS_USR1 in chain else ()
    if launcher and "--signals-to-handle" not in get_args_parser()._option_string_actions:
        pytest.skip(f"torchrun of torch {torch.__version__} has no --signals-to-handle (SIGUSR1 kills it)")
    step = None
    epochs = int(model[model.index("--epochs") + 1]) if "--epochs" in model else 3
    for epoch, (targets, signum) in zip(range(epochs - len(chain), epochs), chain):
        args = ["--standalone", "--nproc-per-node=2", "--max-restarts=0", *launcher, SCRIPT, "--ckpt-dir",
                str(tmp_path), "--step-seconds", "0.01" if asynchronous else "0.1", "--log-every", "1", *periodic,
                *extra, *model]  # fmt: skip
        when = f"epoch {epoch} step {16 * epoch + 4} "
        run, exit_seconds = torchrun_signalled(args, cwd=ROOT, when=when, send=_signal(targets, signum))
        out = run.stdout
        name = signal.Signals(signum).name
        # A launch killed as hung carries every process's stack: all of them, or the ranks' are cut.
        assert exit_seconds >= 0, (name, out[-60000:] if "launch killed" in out else out[-3000:])
        assert step is None or f"resumed from step {step} " in out, (name, out[-3000:])  # 0 steps lost
        # Async: that step's save is in the background, or was skipped behind the one before it (a disk slower
        # than a save a step: ckptools warns) and the stop saves it, blocking.
        how = "(?:finishing its background save|saving it)" if asynchronous else "saving it"
        stopped = re.findall(rf"preempted at step (\d+) \({name}\): {how}", out)
        assert len(stopped) == 1, (name, out[-4000:])  # rank 0 logs it once; every rank stopped at that step
        step = int(stopped[0])
        assert 16 * epoch + 4 <= step < 16 * (epoch + 1), (name, out[-3000:])  # mid-epoch, not its end
        assert f"every rank leaves with exit code {128 + signum}" in out, (name, out[-3000:])
        # No rank died of it (a dead DataLoader worker, a broken collective): only torchrun's own
        # SignalException traceback, or its report that the ranks exited 138, may be there.
        assert set(re.findall(r"\w+Error\b|DataLoader worker", out)) <= {"ChildFailedError"}, (name, out[-4000:])
        assert exit_seconds < 20, f"{name}: {exit_seconds:.1f} s from the signal to torchrun's exit"
        if asynchronous and "finishing its background save" in out:
            # The save of that step had just begun: exiting without finishing it would lose it.
            assert "finishing its background save (still being written)" in out, out[-3000:]
        elif asynchronous:
            assert "was skipped, as is every save while the one before it is still being written" in out, out[-3000:]
    # The last launch's saves are not under test: the async chain's saves at epoch ends only
    # (every step of a 55 MB state doubled this test's time).
    # (argparse keeps an option's last value: this one replaces the chain's own.)
    again = ok(torchrun(tmp_path, "--log-every", "1", *extra, "--save-every-steps", "1000", *model))
    assert f"resumed from step {step} " in again, again[-3000:]  # 0 steps lost
    assert_bit_identical(reference(model=model), tmp_path)


@pytest.mark.compat  # torchrun, DataLoader workers and node memory
@pytest.mark.slow
def test_kill_9_of_the_whole_job_resumes_from_node_memory_at_most_one_step_behind(tmp_path, reference):
    """kill -9 of torchrun, both ranks and their DataLoader workers at once, right after step 23 is
    logged; the durable checkpoint is at step 16 (the epoch end), the loop snapshots every step into
    node memory. The same command relaunched resumes at step 22 or 23 from memory (the kill may land
    before or after step 23's snapshot, never inside a torn one), ends bit-identical to the
    uninterrupted run, and leaves no node memory behind."""
    args = ["--num-workers", "2", "--save-every-steps", "1000", "--snapshot-every", "1", "--log-every", "1",
            "--step-seconds", "0.05"]  # fmt: skip
    launch = ["--standalone", "--nproc-per-node=2", "--max-restarts=0", SCRIPT, "--ckpt-dir", str(tmp_path), *args]
    first, _ = torchrun_signalled(launch, cwd=ROOT, when="step 23 loss", send=kill_job)
    assert first.returncode != 0 and "step 23 loss" in first.stdout, first.stdout[-3000:]
    assert "done after" not in first.stdout
    memory = ck.CheckpointManager(tmp_path).snapshot_dir
    assert os.path.isdir(memory), "the snapshots outlive every process of the job"
    last = max(int(n) for n in re.findall(r"step (\d+) loss", first.stdout))  # the last step the job logged
    out = ok(torchrun(tmp_path, *args))
    resumed = int(re.search(r"resumed from step (\d+) ", out).group(1))
    # The durable checkpoint is step 16: 22 or 23 came from node memory (or, had the relaunch been
    # slower than the keeper's grace, from the keeper's copy of it in the folder).
    assert resumed in (last - 1, last), (last, out[-3000:])
    assert_bit_identical(reference(), tmp_path)
    assert not os.path.exists(memory), "a job that ends normally releases its node memory"


@pytest.mark.slow
# The kill matrix's "the whole tree, nobody relaunches" case (tests/test_kill_matrix.py) is this job killed the
# same way and judged the same: `make stress`.
@pytest.mark.stress
def test_kill_9_of_the_whole_job_not_relaunched_leaves_the_newest_step_in_the_folder(tmp_path, monkeypatch):
    """Nobody relaunches: the keeper copies the newest snapshot into the run folder as the ordinary
    checkpoint of its step within 30 s, releases the node memory and exits; nothing of ours remains."""
    monkeypatch.setenv("CKPTOOLS_KEEPER_GRACE", "2")
    args = ["--save-every-steps", "1000", "--snapshot-every", "1", "--log-every", "1", "--step-seconds", "0.05"]
    launch = ["--standalone", "--nproc-per-node=2", "--max-restarts=0", SCRIPT, "--ckpt-dir", str(tmp_path), *args]
    first, _ = torchrun_signalled(launch, cwd=ROOT, when="step 23 loss", send=kill_job)
    killed = time.monotonic()
    last = max(int(n) for n in re.findall(r"step (\d+) loss", first.stdout))
    memory = ck.CheckpointManager(tmp_path).snapshot_dir
    while os.path.exists(memory) and time.monotonic() - killed < 30:
        time.sleep(0.2)
    assert not os.path.exists(memory), "the keeper released the node memory within 30 s"
    steps = [s for s, _ in ck.CheckpointManager(tmp_path).checkpoints()]
    assert steps[-1] in (last - 1, last) and steps[:-1] == [16], (last, steps)
    persisted = torch.load(ck.CheckpointManager(tmp_path).latest(), weights_only=True)
    assert persisted["step"] == steps[-1]
    assert keepers_left(memory) == [], "the keeper exits once it released node memory"


def _whole(path: Path) -> bool:
    """Whether a checkpoint file is whole: every record's CRC-32 matches and torch's safe loader reads it."""
    from ckptools.layouts.torch_io import verify_torch_file

    try:
        verify_torch_file(str(path))
        torch.load(path, weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - any failure is the finding
        return False
    return True


@pytest.mark.slow  # 4 kills in CI (a few launches, ~1 min); `make stress` runs 50
def test_kill_9_at_random_moments_never_tears_a_snapshot_and_every_relaunch_is_bit_exact(tmp_path, reference):
    """kill -9 of the whole job at random moments (also inside a snapshot's copy; CKPTOOLS_SNAPSHOT_KILLS,
    default 4, `make stress` runs 50), then the same command again, over and over: after every kill each
    snapshot and checkpoint on disk is whole (0 unloadable, 0 torn), every relaunch resumes from the
    newest step it left (a snapshot every rank had copied, its commit cut short, included), and each
    run that ends does so bit-identical to the uninterrupted one."""
    import random

    from ckptools.node import checkpoint_names, sealable

    kills_wanted = int(os.environ.get("CKPTOOLS_SNAPSHOT_KILLS", "4"))
    rng = random.Random(35)
    args = ["--save-every-steps", "1000", "--snapshot-every", "1", "--log-every", "1", "--step-seconds", "0.01"]
    kills = runs = 0
    while kills < kills_wanted:
        run_dir = tmp_path / f"run{runs}"
        runs += 1
        memory = ck.CheckpointManager(run_dir).snapshot_dir
        newest: int | None = None  # the newest whole step on disk or in memory after the last kill
        while True:
            launch = ["--standalone", "--nproc-per-node=2", "--max-restarts=0", SCRIPT, "--ckpt-dir", str(run_dir),
                      *args]  # fmt: skip
            timer: list[threading.Timer] = []

            def arm(pid: int, delay: float = rng.uniform(0.0, 0.6), timer: list = timer) -> None:
                timer.append(threading.Timer(delay, kill_job, [pid]))
                timer[0].start()

            # Armed at the first training step, so the kill lands among steps and snapshot copies.
            out, _ = torchrun_signalled(launch, cwd=ROOT, when=" loss ", send=arm)
            for t in timer:
                t.join()
            if newest is not None:  # this launch resumed from the newest step the last one left
                assert f"resumed from step {newest} " in out.stdout, (newest, out.stdout[-2000:])
            if out.returncode == 0:
                break
            kills += 1
            files = [*sorted(Path(memory).glob("ckpt-*.pt")), *sorted(run_dir.glob("ckpt-*.pt"))]
            torn = [f for f in files if not _whole(f)]
            assert torn == [], torn
            # A snapshot every rank had copied when the kill came counts too: the relaunch seals it.
            sealed = [step for step, _, _ in sealable(str(memory), checkpoint_names("ckpt"))]
            newest = max([*(int(f.stem.split("-")[1]) for f in files), *sealed], default=None)
        assert_bit_identical(reference(), run_dir)
        assert not os.path.exists(memory)
    print(f"{kills} kills over {runs} runs: every file whole, every run bit-identical")
