"""The tutorials' own launcher, ``torch.multiprocessing.spawn`` (issue 59): PyTorch's ``multigpu.py`` ported
(examples/train_spawn.py: MASTER_ADDR/PORT by hand, ``init_process_group(rank=, world_size=)``,
no torchrun), launched as a container's first process (tests/_spawn_launch.py reaps the orphaned workers).

- SIGTERM to the parent (what Kubernetes and ``kill PID`` send): torch hands each worker SIGINT as the
  parent dies, `ck.Preemption` takes it as the launcher's SIGTERM, every rank saves the step reached and
  leaves with 143, no traceback; the relaunch ends bit-identical to an uninterrupted run.
- The parent alone killed (SIGKILL), no Preemption in the script: the workers die, and the keeper (which
  watches the parent as it watches torchrun's agent) persists the newest snapshot; the relaunch resumes
  at most one step behind, bit-identical.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _dist import free_port

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, os.pardir, "examples", "train_spawn.py")
LAUNCH = os.path.join(HERE, "_spawn_launch.py")


def _launch(run_dir: str, signum: int = 0, after: str = "", *extra: str, grace: str = "600") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CKPTOOLS_KEEPER_GRACE=grace)
    if signum:
        env["STEP_PAUSE"] = "0.1"  # a signal lands mid-epoch, not between the epochs' saves
    cmd = [sys.executable, LAUNCH, str(signum), after, "--", sys.executable, SCRIPT, run_dir, str(free_port()), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _same_weights(a: str, b: str) -> bool:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _steps(run_dir: str) -> list[int]:
    return sorted(int(m[1]) for m in (re.fullmatch(r"ckpt-(\d+)\.pt", n) for n in os.listdir(run_dir)) if m)


@pytest.mark.compat  # mp.spawn's signals
@pytest.mark.slow  # make interop: three launches (make test stays within its time)
def test_sigterm_to_the_spawn_parent_saves_the_step_reached_and_every_rank_leaves_with_143(tmp_path):
    reference = _launch(str(tmp_path / "reference"))
    assert reference["parent"] == 0, reference["stderr"][-3000:]  # its workers reaped by the parent itself
    run = str(tmp_path / "run")
    stopped = _launch(run, 15, "step 5")
    assert stopped["parent"] == -15 and stopped["workers"] == [143, 143], stopped["stderr"][-3000:]
    assert "Traceback" not in stopped["stderr"] and "KeyboardInterrupt" not in stopped["stderr"], stopped["stderr"]
    reached = int(re.findall(r"^step (\d+)$", stopped["stdout"], re.M)[-1])
    assert _steps(run) == [reached], (_steps(run), reached)  # the preemption's save of the step reached
    resumed = _launch(run)
    assert f"resumed at step {reached}" in resumed["stdout"], resumed["stdout"][-2000:]
    assert _same_weights(str(tmp_path / "reference" / "final.pt"), os.path.join(run, "final.pt"))


@pytest.mark.slow  # make interop: the keeper's grace and a relaunch
def test_the_keeper_persists_when_only_the_spawn_parent_is_killed(tmp_path):
    assert _launch(str(tmp_path / "reference"))["parent"] == 0
    run = str(tmp_path / "run")
    killed = _launch(run, 9, "step 5", "--no-preemption", grace="1")
    assert killed["parent"] == -9 and "Traceback" not in killed["stderr"], killed["stderr"][-3000:]
    import time

    deadline = time.monotonic() + 60
    while not _steps(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _steps(run) and _steps(run)[-1] >= 5, _steps(run)  # the keeper's copy: at most one step lost
    resumed = _launch(run)
    assert re.search(r"resumed at step (\d+)", resumed["stdout"]), resumed["stdout"][-2000:]
    assert _same_weights(str(tmp_path / "reference" / "final.pt"), os.path.join(run, "final.pt"))


def _two_nodes(run_dir: str, memory: str, kill_after: str = "") -> list[str]:
    """Nodes 0 and 1 of a 4-rank job, each an ``mp.spawn`` launch of 2 workers with a node memory of its
    own (two machines, simulated); with ``kill_after``, both parents are killed (SIGKILL) once rank 0
    printed that line, and their workers die of their SIGINT. Each launch's output, once its workers ended."""
    import signal

    port = str(free_port())
    procs = []
    for node in (0, 1):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CKPTOOLS_KEEPER_GRACE="600", NODE=str(node),
                   NNODES="2", CKPTOOLS_NODE_MEMORY=os.path.join(memory, f"node{node}"))  # fmt: skip
        os.makedirs(env["CKPTOOLS_NODE_MEMORY"], exist_ok=True)
        extra = []
        if kill_after:
            env["STEP_PAUSE"], extra = "0.1", ["--no-preemption"]
        procs.append(subprocess.Popen([sys.executable, SCRIPT, run_dir, port, *extra], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env))  # fmt: skip
    out = [""]
    if kill_after:
        for line in procs[0].stdout:
            out[0] += line
            if line.startswith(kill_after):
                for proc in procs:
                    os.kill(proc.pid, signal.SIGKILL)
                break
    texts = []
    for proc, before in zip(procs, [out[0], ""]):
        text, _ = proc.communicate(timeout=240)  # EOF: every worker of that launch is gone
        texts.append(before + text)
    return texts


@pytest.mark.slow  # make interop: three 4-rank jobs
def test_two_simulated_nodes_under_spawn_snapshot_and_restore_from_each_nodes_memory(tmp_path):
    reference = _two_nodes(str(tmp_path / "reference"), str(tmp_path / "memory-reference"))
    assert "Traceback" not in "".join(reference), reference
    run, memory = str(tmp_path / "run"), str(tmp_path / "memory")
    _two_nodes(run, memory, kill_after="step 5")
    durable = max(_steps(run), default=0)  # the first epoch's save (4 steps of 4 ranks): older than the kill
    assert durable < 5, _steps(run)
    resumed = _two_nodes(run, memory)
    steps = {int(s) for text in resumed for s in re.findall(r"resumed at step (\d+)", text)}
    assert len(steps) == 1 and steps.pop() >= 5, resumed  # every rank the same step, from node memory
    assert _same_weights(str(tmp_path / "reference" / "final.pt"), os.path.join(run, "final.pt"))
    assert os.listdir(os.path.join(memory, "node0")) == [] and os.listdir(os.path.join(memory, "node1")) == []


IMAGENET = os.path.join(HERE, "user_scripts", "imagenet_spawn.py")


def _imagenet(out_dir: str, signum: int = 0, after: str = "", resume: bool = False) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CKPTOOLS_KEEPER_GRACE="600")
    if signum:
        env["STEP_PAUSE"] = "0.1"
    args = [out_dir, "--dist-url", f"tcp://127.0.0.1:{free_port()}"]
    if resume:
        args += ["--resume", os.path.join(out_dir, "checkpoint.pth.tar")]
    cmd = [sys.executable, LAUNCH, str(signum), after, "--", sys.executable, IMAGENET, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # make interop: five launches
def test_the_imagenet_main_worker_under_spawn_preempted_or_killed_resumes_bit_identical(tmp_path):
    """pytorch/examples' ImageNet shape (main_worker(gpu, ngpus_per_node, args), StepLR, GradScaler,
    --resume, a best copy): SIGTERM to the parent mid-epoch saves the step reached (143 on every rank); so
    does SIGKILL of the parent (its death reaches the workers as SIGINT all the same); both end bit-identical."""
    assert _imagenet(str(tmp_path / "reference"))["parent"] == 0
    reference = str(tmp_path / "reference" / "final.pt")
    preempted = str(tmp_path / "preempted")
    stopped = _imagenet(preempted, 15, "step 8")
    assert stopped["workers"] == [143, 143] and "Traceback" not in stopped["stderr"], stopped["stderr"][-3000:]
    resumed = _imagenet(preempted, resume=True)
    reached = int(re.findall(r"^step (\d+)$", stopped["stdout"], re.M)[-1])
    assert f"step {reached})" in resumed["stdout"], resumed["stdout"][-2000:]  # mid-epoch: the step it stopped at
    assert _same_weights(reference, os.path.join(preempted, "final.pt"))
    killed = str(tmp_path / "killed")
    assert _imagenet(killed, 9, "step 8")["workers"] == [143, 143]
    assert os.path.exists(os.path.join(killed, "checkpoint.pth.tar"))
    resumed = _imagenet(killed, resume=True)
    assert "=> loaded checkpoint" in resumed["stdout"], resumed["stdout"][-2000:]
    assert _same_weights(reference, os.path.join(killed, "final.pt"))
