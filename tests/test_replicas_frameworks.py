"""DDP's replicas compared on the frameworks' own paths (issue 58): Lightning's ModelCheckpoint saves (through
ExactResume's exchange) and NodeSnapshots, Fabric's ``fabric.save``, the HF Trainer's saves and snapshots
(CkptoolsCallback), Accelerate's ``save_state`` (attach) and Snapshots. Rank 1 changes its copy alone after
step 3: every rank raises `ReplicaMismatchError` at the next save or snapshot, nothing of it is written, and
what the keeper persists afterwards is the last good step. Healthy jobs raise nothing. 2 processes under
torchrun (tests/_replicas_frameworks_job.py). Needs the frameworks: `make interop`.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

pytest.importorskip("pytorch_lightning")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

sys.path.insert(0, os.path.dirname(__file__))

from _torchrun import keepers_left, ok, torchrun

# versions: the frameworks' save paths; slow: 14 whole torchrun launches (`make interop`)
pytestmark = [pytest.mark.versions, pytest.mark.interop, pytest.mark.slow]

JOB = os.path.join(os.path.dirname(__file__), "_replicas_frameworks_job.py")

# What each job leaves in its folder once the keeper is done: the save of step 2 (every 2 steps; step 4's was
# refused), or the snapshot of step 2 persisted (step 3's was refused, so step 2's is the newest).
LEFT = {
    "lightning": ("ckpts", ["epoch=0-step=2.ckpt"]),
    "lightning-snapshots": ("ckpts", ["last-snapshot-0000000002.ckpt"]),
    "fabric": (".", ["step-2.ckpt"]),
    "hf": (".", ["checkpoint-2"]),
    "hf-snapshots": (".", ["checkpoint-2"]),
    "accelerate": (".", ["step_2"]),
    "accelerate-snapshots": (".", ["step_2"]),
}


def _run(framework: str, root: str, mode: str, memory: str):  # type: ignore[no-untyped-def]
    env = {"CKPTOOLS_NODE_MEMORY": memory, "CKPTOOLS_KEEPER_GRACE": "1"}
    return torchrun(["--standalone", "--nproc-per-node=2", "--max-restarts=0", JOB, framework, root, mode],
                    cwd=os.path.dirname(JOB), env=env, timeout=240)  # fmt: skip


# compat: the model each framework's save path is found by (its internals), for Lightning, the Trainer, Accelerate.
_COMPAT = {"lightning", "hf", "accelerate"}


@pytest.mark.parametrize(
    "framework", [pytest.param(f, marks=[pytest.mark.compat] if f in _COMPAT else []) for f in LEFT]
)
def test_a_copy_changed_on_one_rank_is_refused_on_every_rank_and_the_last_good_step_kept(tmp_path, framework):
    root, memory = str(tmp_path / "run"), str(tmp_path / "shm")
    proc = _run(framework, root, "corrupt", memory)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said[-3000:]
    found = re.findall(r"^rank (\d) caught at step (\d+): (\S+)$", proc.stdout, re.M)
    caught, steps = {rank: where for rank, _, where in found}, {step for _, step, _ in found}
    assert sorted(caught) == ["0", "1"], said[-3000:]  # every rank, not only the one whose copy changed
    assert all(where.startswith("model") for where in caught.values()), caught
    assert steps == {"3" if framework.endswith("snapshots") else "4"}, said[-3000:]  # the first call after it
    assert keepers_left(memory, within=60) == []
    folder, names = LEFT[framework]
    assert sorted(os.listdir(os.path.join(root, folder))) == names


# A repeat of the refused jobs' first steps (their saves and snapshots of steps 1-2 are compared on every rank,
# raise nothing and are kept) run to the end: `make stress`.
@pytest.mark.stress
@pytest.mark.parametrize("framework", list(LEFT))
def test_a_healthy_job_on_each_framework_is_compared_and_raises_nothing(tmp_path, framework):
    said = ok(_run(framework, str(tmp_path / "run"), "healthy", str(tmp_path / "shm")))
    assert len(re.findall(r"^rank \d finished$", said, re.M)) == 2 and "Replica" not in said, said[-3000:]


def test_each_integration_takes_the_one_switch_and_its_old_spelling_with_a_warning(tmp_path):
    from ckptools.integrations.lightning import ExactResume, NodeSnapshots
    from ckptools.integrations.transformers import CkptoolsCallback

    makers = {
        "ExactResume": lambda **kw: ExactResume(**kw),
        "NodeSnapshots": lambda **kw: NodeSnapshots(tmp_path / "run", **kw),
        "CkptoolsCallback": lambda **kw: CkptoolsCallback(**kw),
    }
    for name, make in makers.items():
        assert make().replicas == "auto" and make(replicas="sample").replicas == "sample", name
        old = rf"{name}\(check_replicas=\.\.\.\) is deprecated .* replicas='off'"
        with pytest.warns(DeprecationWarning, match=old):
            assert make(check_replicas=False).replicas == "off", name
        with pytest.raises(ValueError, match=f"{name}: replicas must be one of"):
            make(replicas="every")
