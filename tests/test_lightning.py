"""ckptools inside Lightning: the CheckpointIO plugins with the real pytorch-lightning (interop extra)."""

from __future__ import annotations

import contextlib
import inspect
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile

import pytest
import torch

pytestmark = [pytest.mark.versions, pytest.mark.interop]  # Lightning's CheckpointIO and strategies

pl = pytest.importorskip("pytorch_lightning", reason="the interop extra (pytorch-lightning) is not installed")

from _s3 import BUCKET  # noqa: E402  # the bucket of the s3_env fixture (a moto S3 server)

import ckptools as ck  # noqa: E402
from ckptools.integrations.lightning import AsyncCkptoolsCheckpointIO, CkptoolsCheckpointIO  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        # No dropout and a fixed batch order: Lightning restores no RNG state on resume, so only
        # a run that draws none resumes bit-exactly (whatever writes the files).
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 8, generator=g)
        data = torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())
        return torch.utils.data.DataLoader(data, batch_size=8)


def _trainer(root, plugin, epochs: int) -> pl.Trainer:
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=str(root), save_last=True, every_n_epochs=1, save_top_k=1)
    return pl.Trainer(
        default_root_dir=str(root), max_epochs=epochs, accelerator="cpu", devices=1, plugins=[plugin],
        callbacks=[checkpoint], logger=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True,
    )  # fmt: skip


@pytest.mark.parametrize("plugin", [CkptoolsCheckpointIO, AsyncCkptoolsCheckpointIO])
def test_fit_saves_through_the_plugin_and_resumes_from_last_bit_exact(tmp_path, plugin):
    pl.seed_everything(3)
    straight = Tiny()
    _trainer(tmp_path / "straight", plugin(), 4).fit(straight)
    pl.seed_everything(3)
    _trainer(tmp_path / "run", plugin(), 2).fit(Tiny())  # stops after epoch 2 ...
    last = tmp_path / "run" / "last.ckpt"
    assert zipfile.is_zipfile(last) and "CRC-32" in ck.verify(last)  # an ordinary torch zip, every CRC-32 right
    assert torch.load(last, weights_only=True)["epoch"] == 1  # Lightning's own loader reads it
    assert not [p for p in os.listdir(tmp_path / "run") if p.startswith(".")], "no temporary files left"
    pl.seed_everything(3)
    resumed = Tiny()
    _trainer(tmp_path / "run", plugin(), 4).fit(resumed, ckpt_path="last")  # ... and goes on to 4
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert a.numpy().tobytes() == b.numpy().tobytes(), name


class Shuffled(Tiny):
    def train_dataloader(self):
        loader = super().train_dataloader()
        return torch.utils.data.DataLoader(loader.dataset, batch_size=8, shuffle=True)


def test_a_single_process_fit_that_shuffles_does_not_resume_exactly_whoever_writes_the_files(tmp_path):
    """The guide's rule, measured: on one process a shuffling DataLoader draws its order from the
    global torch RNG, which Lightning does not restore, so the resumed run differs (under DDP the
    DistributedSampler draws it from (seed, epoch): the DDP kill test shuffles and ends bit-identical)."""
    pl.seed_everything(3)
    straight = Shuffled()
    _trainer(tmp_path / "straight", CkptoolsCheckpointIO(), 4).fit(straight)
    pl.seed_everything(3)
    _trainer(tmp_path / "run", CkptoolsCheckpointIO(), 2).fit(Shuffled())
    pl.seed_everything(3)
    resumed = Shuffled()
    _trainer(tmp_path / "run", CkptoolsCheckpointIO(), 4).fit(resumed, ckpt_path="last")
    a, b = straight.state_dict(), resumed.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("plugin", [CkptoolsCheckpointIO, AsyncCkptoolsCheckpointIO])
def test_fabric_saves_and_loads_through_the_plugin(tmp_path, plugin):
    """Fabric(plugins=[...]): fabric.save and fabric.load go through the plugin."""
    from lightning_fabric import Fabric

    io, calls = plugin(), []
    save, load = io.save_checkpoint, io.load_checkpoint
    io.save_checkpoint = lambda *args, **kwargs: (calls.append("save"), save(*args, **kwargs))[1]  # type: ignore[method-assign]
    io.load_checkpoint = lambda *args, **kwargs: (calls.append("load"), load(*args, **kwargs))[1]  # type: ignore[method-assign]
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": optimizer, "step": 7})
    with torch.no_grad():
        model.weight.add_(1)  # training goes on after the save
    remainder = fabric.load(tmp_path / "f.ckpt", {"model": model, "optimizer": optimizer})
    assert calls == ["save", "load"] and remainder == {"step": 7}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert "CRC-32" in ck.verify(tmp_path / "f.ckpt")


class Wide(Tiny):
    """16 MB of weights (48 MB of checkpoint with momentum) and one batch per epoch: the next
    epoch's checkpoint is due while the previous one is still being written."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2))
        self.big = torch.nn.Parameter(torch.zeros(4_000_000))

    def training_step(self, batch, _):
        loss = super().training_step(batch, _) + 1e-3 * self.big.square().mean()
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self):
        loader = super().train_dataloader()
        return torch.utils.data.DataLoader(torch.utils.data.Subset(loader.dataset, range(8)), batch_size=8)


@pytest.mark.parametrize("plugin", [CkptoolsCheckpointIO, AsyncCkptoolsCheckpointIO])
def test_a_fixed_filename_keeps_every_epochs_checkpoint_with_either_plugin(tmp_path, plugin, monkeypatch):
    """Issue 33: ModelCheckpoint names a new file name-vN when name exists; with the async plugin
    the previous save was still in flight, read as absent, and was overwritten (2 of 4 lost)."""
    import ckptools.integrations.lightning as integration

    write = integration._write

    def slow_disk(location, checkpoint):  # each write outlasts an epoch: the next name is picked meanwhile
        time.sleep(0.5)
        return write(location, checkpoint)

    monkeypatch.setattr(integration, "_write", slow_disk)
    checkpoint = pl.callbacks.ModelCheckpoint(
        dirpath=str(tmp_path), filename="test", save_top_k=-1, monitor="train_loss"
    )
    trainer = pl.Trainer(default_root_dir=str(tmp_path), max_epochs=4, accelerator="cpu", devices=1,
                         plugins=[plugin()], callbacks=[checkpoint], logger=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    trainer.fit(Wide())
    files = sorted(n for n in os.listdir(tmp_path) if n.endswith(".ckpt"))
    assert files == ["test-v1.ckpt", "test-v2.ckpt", "test-v3.ckpt", "test.ckpt"], files
    epochs = {n: torch.load(tmp_path / n, weights_only=False)["epoch"] for n in files}
    assert epochs == {"test.ckpt": 0, "test-v1.ckpt": 1, "test-v2.ckpt": 2, "test-v3.ckpt": 3}


def test_the_async_plugin_hooks_its_own_trainers_run_alone_and_nothing_of_lightnings_classes(tmp_path):
    """Issue 55: nothing on Lightning's classes is replaced for the process; the ModelCheckpoint of the
    trainer that saves through the plugin waits for the save in flight during its run (a hook on that
    instance), and the hook is gone after the run. Another trainer's callback is never hooked."""
    classes = (pl.callbacks.ModelCheckpoint.file_exists, pl.Trainer.save_checkpoint)
    seen = []

    class Look(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            seen.append([("file_exists" in vars(c)) for c in trainer.checkpoint_callbacks])

    def fit(plugins):
        checkpoint = pl.callbacks.ModelCheckpoint(
            dirpath=str(tmp_path), filename="t", save_top_k=-1, monitor="train_loss"
        )
        trainer = pl.Trainer(default_root_dir=str(tmp_path), max_epochs=2, accelerator="cpu", devices=1, logger=False,
                             plugins=plugins, callbacks=[checkpoint, Look()], enable_progress_bar=False,
                             enable_model_summary=False)  # fmt: skip
        trainer.fit(Wide())
        return checkpoint

    plain = fit([])
    ours = fit([AsyncCkptoolsCheckpointIO()])
    assert seen == [[False], [False], [False], [True]], seen  # hooked from the run's first save, ours alone
    assert "file_exists" not in vars(ours) and "file_exists" not in vars(plain)  # undone at the run's end
    assert (pl.callbacks.ModelCheckpoint.file_exists, pl.Trainer.save_checkpoint) == classes
    for method in classes:  # Lightning's own functions, not a wrapper
        assert method.__module__.startswith(("pytorch_lightning", "lightning")) and not hasattr(method, "__wrapped__")


def test_a_save_after_fit_is_there_for_whatever_reads_it_at_once(tmp_path):
    """Issue 33: trainer.save_checkpoint after fit returned before the file existed."""
    trainer = pl.Trainer(default_root_dir=str(tmp_path), max_epochs=1, accelerator="cpu", devices=1,
                         plugins=[AsyncCkptoolsCheckpointIO()], enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    model = Wide()
    trainer.fit(model)
    path = tmp_path / "after.ckpt"
    trainer.save_checkpoint(path)
    assert "after.ckpt" in os.listdir(tmp_path)  # a listing
    assert torch.equal(torch.load(path, weights_only=False)["state_dict"]["big"], model.big.detach())
    assert torch.equal(Wide.load_from_checkpoint(path).big, model.big)
    # during fit a save stays in the background; another instance's load of it waits for it
    first, second = AsyncCkptoolsCheckpointIO(), AsyncCkptoolsCheckpointIO()
    first.save_checkpoint({"state_dict": {"w": torch.arange(8_000_000.0)}, "epoch": 7}, tmp_path / "bg.ckpt")
    assert second.load_checkpoint(tmp_path / "bg.ckpt")["epoch"] == 7
    assert ck.load(tmp_path / "bg.ckpt")["epoch"] == 7
    first.teardown()
    # another Trainer with its own plugin resumes from a file saved the moment before
    first.save_checkpoint(torch.load(path, weights_only=False), tmp_path / "again.ckpt")
    resumed = Wide()
    again = pl.Trainer(default_root_dir=str(tmp_path), max_epochs=2, accelerator="cpu", devices=1,
                       plugins=[AsyncCkptoolsCheckpointIO()], enable_checkpointing=False, logger=False,
                       enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    again.fit(resumed, ckpt_path=str(tmp_path / "again.ckpt"))
    assert resumed.current_epoch == 2
    first.teardown()


_DDP_SAVE_AFTER_FIT = """
import os, sys, torch, pytorch_lightning as pl
from ckptools.integrations.lightning import AsyncCkptoolsCheckpointIO

class Wide(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Parameter(torch.zeros(8_000_000))  # 32 MB: its write takes a while

    def training_step(self, batch, _):
        return (self.big[:8] * batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 8)), batch_size=2)

trainer = pl.Trainer(default_root_dir=sys.argv[1], max_epochs=1, accelerator="cpu", devices=2, strategy="ddp",
                     plugins=[AsyncCkptoolsCheckpointIO()], enable_checkpointing=False, logger=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Wide())
path = os.path.join(sys.argv[1], "after.ckpt")
trainer.save_checkpoint(path)
step = torch.load(path, weights_only=False)["global_step"]
sys.stdout.write(f"rank {trainer.global_rank} reads {step}\\n")  # one write: print's pieces interleave between ranks
sys.stdout.flush()
"""


@pytest.mark.slow  # a 2-process DDP fit: `make interop` runs it
def test_a_save_after_a_ddp_fit_is_there_for_every_rank_when_the_call_returns(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(_DDP_SAVE_AFTER_FIT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The two ranks write to one pipe: each line is one write, but unbuffered (PYTHONUNBUFFERED) a line's
    # pieces were written apart ("rank 1 readsrank 0 reads 1", seen in make compat): matched anywhere.
    reads = sorted(re.findall(r"rank (\d) reads (\d+)", proc.stdout))
    assert reads == [("0", "1"), ("1", "1")], proc.stdout


def test_async_file_holds_the_state_at_the_call(tmp_path):
    io = AsyncCkptoolsCheckpointIO()
    weights = torch.arange(1_000_000, dtype=torch.float32)
    io.save_checkpoint({"state_dict": {"w": weights}, "epoch": 1}, tmp_path / "a.ckpt")
    weights.add_(1)  # training goes on while the file is written
    io.save_checkpoint({"state_dict": {"w": weights}, "epoch": 2}, tmp_path / "b.ckpt")  # reuses the buffers
    weights.add_(1)
    io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"], torch.arange(1_000_000.0))
    assert torch.equal(io.load_checkpoint(tmp_path / "b.ckpt")["state_dict"]["w"], torch.arange(1_000_000.0) + 1)


def test_a_failed_background_write_is_raised_and_removes_nothing(tmp_path):
    io = AsyncCkptoolsCheckpointIO()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "old.ckpt")
    (tmp_path / "blocked").mkdir()  # a directory where the new file should go: its rename fails
    io.save_checkpoint({"w": torch.zeros(3)}, tmp_path / "blocked")
    with pytest.raises(ck.CheckpointError, match="background checkpoint save failed"):
        io.remove_checkpoint(tmp_path / "old.ckpt")  # Lightning removes the old one after saving the new
    assert torch.equal(io.load_checkpoint(tmp_path / "old.ckpt")["w"], torch.ones(3))


def test_remove_keeps_the_newest_checkpoint_of_its_folder(tmp_path, caplog):
    io = CkptoolsCheckpointIO()
    io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "epoch=0.ckpt")
    time.sleep(0.01)
    io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "epoch=1.ckpt")
    io.remove_checkpoint(tmp_path / "epoch=1.ckpt")  # nothing newer: kept
    assert (tmp_path / "epoch=1.ckpt").exists() and "newest checkpoint" in caplog.text
    io.remove_checkpoint(tmp_path / "epoch=0.ckpt")
    assert not (tmp_path / "epoch=0.ckpt").exists()
    io.remove_checkpoint(tmp_path / "missing.ckpt")  # as Lightning's: nothing there, nothing to do


def test_load_checks_crcs_and_refuses_code_unless_trusted(tmp_path):
    io = CkptoolsCheckpointIO()
    io.save_checkpoint({"w": torch.arange(4096.0), "hparams": {"lr": 0.1}}, tmp_path / "c.ckpt")
    data = bytearray((tmp_path / "c.ckpt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor's record
    (tmp_path / "bad.ckpt").write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match="CRC"):
        io.load_checkpoint(tmp_path / "bad.ckpt")
    io.save_checkpoint({"when": pathlib_path()}, tmp_path / "code.ckpt")
    with pytest.raises(ck.UnsafeCheckpointError):
        io.load_checkpoint(tmp_path / "code.ckpt")
    assert io.load_checkpoint(tmp_path / "code.ckpt", weights_only=False)["when"] == pathlib_path()
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})


class WithScheduler(Tiny):
    """Tiny with AdamW and a StepLR, and hyper-parameters holding a Path and a Namespace (as
    ``save_hyperparameters()`` of a script's arguments does): what issue 33's user trained."""

    def __init__(self, root=None, args=None) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)]


@pytest.mark.parametrize("plugin", [CkptoolsCheckpointIO, AsyncCkptoolsCheckpointIO])
def test_a_fit_with_path_hyper_parameters_resumes_once_told_and_loads_into_plain_code(tmp_path, plugin):
    import argparse
    import pathlib

    hparams = {"root": pathlib.Path("/data/runs"), "args": argparse.Namespace(lr=0.01, depth=2)}
    module = WithScheduler(**hparams)
    _trainer(tmp_path, plugin(), 2).fit(module)
    last = tmp_path / "last.ckpt"
    # resuming refuses the Path and the Namespace by default (as Lightning's own loader does) and says how,
    # in the words of the Lightning installed: fit(weights_only=False) from 2.6, the plugin's weights_only before
    per_call = "weights_only" in inspect.signature(pl.Trainer.fit).parameters
    how = r"trainer\.fit\(model, ckpt_path=\.\.\., weights_only=False\)" if per_call else r"\(weights_only=False\)\]\)"
    with pytest.raises(ck.UnsafeCheckpointError, match=how):
        _trainer(tmp_path, plugin(), 3).fit(WithScheduler(**hparams), ckpt_path=str(last))
    resumed = WithScheduler(**hparams)
    if per_call:
        _trainer(tmp_path, plugin(), 3).fit(resumed, ckpt_path=str(last), weights_only=False)
    else:
        _trainer(tmp_path, plugin(weights_only=False), 3).fit(resumed, ckpt_path=str(last))
    assert torch.load(last, weights_only=False)["epoch"] == 2
    # into plain code: the network, AdamW and StepLR a script without Lightning builds
    stored = torch.load(last, weights_only=False)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    with pytest.warns(ck.CheckpointWarning, match="pathlib"):
        net.load_state_dict(ck.load_state_dict(last))  # "net." is the LightningModule's, not the network's
    optimizer = torch.optim.AdamW(net.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    ck.load(last, {"model": net, "optimizer": optimizer, "scheduler": scheduler})  # (warned once per file, above)
    assert all(torch.equal(v, stored["state_dict"][f"net.{k}"]) for k, v in net.state_dict().items())
    saved = stored["optimizer_states"][0]
    assert optimizer.state_dict()["param_groups"] == saved["param_groups"]
    for index, state in saved["state"].items():
        assert all(torch.equal(optimizer.state_dict()["state"][index][k], v) for k, v in state.items())
    assert scheduler.state_dict() == stored["lr_schedulers"][0]
    assert scheduler.last_epoch == resumed.lr_schedulers().last_epoch


def pathlib_path():
    import pathlib

    return pathlib.PurePosixPath("/data/runs")


_SAVER = """
import sys, torch
from ckptools.integrations.lightning import CkptoolsCheckpointIO
from pytorch_lightning.plugins.io import TorchCheckpointIO
io = CkptoolsCheckpointIO() if sys.argv[2] == "ckptools" else TorchCheckpointIO()
step = 0
while True:  # Lightning's last.ckpt, saved again and again, until killed
    step += 1
    io.save_checkpoint({"state_dict": {"w": torch.full((4_000_000,), float(step))}, "global_step": step}, sys.argv[1])
    print(step, flush=True)
"""


@pytest.mark.slow  # each kill starts a process that imports Lightning (~4 s): `make interop` runs it
@pytest.mark.timeout(900)  # ~35 s on a quiet machine (4 kills each); `make stress` runs 20 each
def test_kill_minus_9_mid_save_never_tears_last_ckpt_lightnings_own_does(tmp_path, tmpdir_elsewhere):
    """SIGKILL a process that saves a 16 MB last.ckpt over and over, at random moments: through the
    plugin last.ckpt always loads whole; Lightning's TorchCheckpointIO is run the same way beside it,
    and the test reports how often it was left torn. The temporary directory is on another
    filesystem than the checkpoints where this machine has one (/dev/shm), as on a cluster:
    Lightning's fsspec transaction writes its temporary there, then moves it (a copy, across
    filesystems)."""
    kills = int(os.environ.get("CKPTOOLS_LIGHTNING_SAVER_KILLS", "4"))
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    env, other_fs, _ = tmpdir_elsewhere
    torn = {"ckptools": 0, "lightning": 0}
    rng = random.Random(0)
    for kind in torn:
        target = tmp_path / kind / "last.ckpt"
        target.parent.mkdir()
        for _ in range(kills):
            proc = subprocess.Popen([sys.executable, str(script), str(target), kind], stdout=subprocess.PIPE,
                                    text=True, env=env)  # fmt: skip
            assert proc.stdout is not None
            proc.stdout.readline()  # one save done: there is a previous file from here on
            time.sleep(rng.uniform(0.0, 0.3))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            try:
                loaded = torch.load(target, weights_only=True)
                w = loaded["state_dict"]["w"]
                assert torch.equal(w, torch.full((4_000_000,), float(loaded["global_step"])))
            except Exception:  # noqa: BLE001 - counted: a torn file, what a resume would trip over
                torn[kind] += 1
    where = "another" if other_fs else "the same"
    print(f"\nkill -9 mid-save, {kills} kills each (TMPDIR on {where} filesystem): torn last.ckpt with "
          f"ckptools {torn['ckptools']}, with Lightning's TorchCheckpointIO {torn['lightning']}")  # fmt: skip
    assert torn["ckptools"] == 0
    # What a kill left behind, the next save removed: only the newest write's temporary can remain.
    assert len([p for p in os.listdir(tmp_path / "ckptools") if p.startswith(".")]) <= 1


@pytest.fixture
def tmpdir_elsewhere(tmp_path):
    """(environment, whether it is elsewhere, the folder): TMPDIR on another filesystem than
    ``tmp_path`` where one exists (/dev/shm), as on a cluster (node-local /tmp, checkpoints on
    shared storage); removed afterwards, with whatever was left in it."""
    shm = "/dev/shm"
    other_fs = os.path.isdir(shm) and os.stat(shm).st_dev != os.stat(tmp_path).st_dev
    tmpdir = tempfile.mkdtemp(dir=shm if other_fs else tmp_path)
    yield dict(os.environ, TMPDIR=tmpdir), other_fs, tmpdir
    shutil.rmtree(tmpdir, ignore_errors=True)


_DDP_FIT = """
import os, sys, torch, pytorch_lightning as pl
from ckptools.integrations.lightning import AsyncCkptoolsCheckpointIO, CkptoolsCheckpointIO

class Wide(pl.LightningModule):  # 4M parameters: a 48 MB checkpoint with momentum, so saves take a while
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                       torch.nn.ReLU(), torch.nn.Linear(2048, 2))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
        # shuffled: under DDP Lightning's DistributedSampler draws the order from (seed, epoch), no RNG state
        data = torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)

    def on_save_checkpoint(self, checkpoint):  # called as the checkpoint is made, before it is written
        if self.global_rank == 0:
            print("saving", checkpoint["epoch"], flush=True)

root, epochs, kind, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "resume"
plugins = {"sync": [CkptoolsCheckpointIO()], "async": [AsyncCkptoolsCheckpointIO()], "lightning": []}[kind]
pl.seed_everything(3)
model = Wide()
trainer = pl.Trainer(
    default_root_dir=root, max_epochs=epochs, accelerator="cpu", devices=2, strategy="ddp", plugins=plugins,
    callbacks=[pl.callbacks.ModelCheckpoint(dirpath=root, save_last=True, every_n_epochs=1, save_top_k=1)],
    logger=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(model, ckpt_path="last" if resume and os.path.exists(os.path.join(root, "last.ckpt")) else None)
if trainer.global_rank == 0:
    torch.save(model.state_dict(), os.path.join(root, "final.pt"))
"""


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """The launch's stdout, line by line, read by a thread (None at its end)."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


@pytest.mark.slow  # ~10 2-process Lightning launches: `make interop` runs it
@pytest.mark.timeout(1200)  # ~150 s on a quiet machine; over the default 300 s on a loaded one
def test_ddp_fit_killed_mid_save_again_and_again_always_leaves_a_loadable_last_ckpt(tmp_path, tmpdir_elsewhere):
    """A 2-process DDP `Trainer.fit` on CPU (8 epochs, a 48 MB checkpoint each) is SIGKILLed, both
    ranks, at a random moment of its first epoch-end save: 0-0.15 s after Lightning made the
    checkpoint dict (rank 0's `on_save_checkpoint` says when), then relaunched with ckpt_path="last",
    again and again (2 kills; CKPTOOLS_LIGHTNING_KILLS: `make stress` runs 5). With either plugin, last.ckpt
    always loads whole, its epoch never goes back (no completed epoch lost), and the run ends bit-identical to one
    never killed. In `make stress` Lightning's own TorchCheckpointIO is run the same way beside them, and what it
    left is reported (nothing is asserted of it: test_kill_minus_9_mid_save_never_tears_last_ckpt_lightnings_own_does
    shows it tears)."""
    script = tmp_path / "fit.py"
    script.write_text(_DDP_FIT)
    epochs, kills = 8, int(os.environ.get("CKPTOOLS_LIGHTNING_KILLS", "2"))
    # Lightning's fsspec transaction writes its temporary in TMPDIR: on another filesystem here.
    env, other_fs, tmpdir = tmpdir_elsewhere

    def launch(root, kind: str, resume: bool) -> subprocess.Popen:
        root.mkdir(exist_ok=True)
        with open(root / "stderr.txt", "a") as err:
            return subprocess.Popen([sys.executable, str(script), str(root), str(epochs), kind,
                                     "resume" if resume else "fresh"], stdout=subprocess.PIPE, stderr=err, text=True,
                                    env=env, start_new_session=True)  # fmt: skip

    def stderr(root) -> str:
        return (root / "stderr.txt").read_text()[-3000:]

    straight = launch(tmp_path / "straight", "sync", resume=False)
    _lines(straight)  # drained
    assert straight.wait(timeout=600) == 0, stderr(tmp_path / "straight")
    expected = torch.load(tmp_path / "straight" / "final.pt", weights_only=True)
    rng = random.Random(1)
    report = {}
    kinds = ("sync", "async", "lightning") if "CKPTOOLS_LIGHTNING_KILLS" in os.environ else ("sync", "async")
    for kind in kinds:
        before = len(os.listdir(tmpdir))
        report[kind] = _kill_mid_save(launch, stderr, tmp_path / kind, kind, kills, rng, expected)
        report[kind]["temporaries left in TMPDIR"] = len(os.listdir(tmpdir)) - before
    print(f"\nLightning DDP, kill -9 in the first save of each launch, 0-0.15 s after it began (TMPDIR on "
          f"{'another' if other_fs else 'the same'} filesystem): {report}")  # fmt: skip
    for kind in ("sync", "async"):
        result = report[kind]
        assert result["torn"] == result["went back"] == result["lost"] == 0, result
        assert result["bit-identical"] and not result["failed"], result


def _kill_mid_save(launch, stderr, root, kind: str, kills: int, rng: random.Random, expected) -> dict:
    """Launches of ``kind`` killed in their first save, each resuming one epoch further at most,
    then one that finishes; what each kill left."""
    last = root / "last.ckpt"
    seen, killed, torn, went_back, lost, mid_write, failed = -1, 0, 0, 0, 0, 0, ""
    while True:
        proc = launch(root, kind, resume=last.exists())
        lines = _lines(proc)
        if killed < kills:
            while (line := lines.get(timeout=300)) is not None and not line.startswith("saving "):
                pass
            if line is not None:  # (else the launch ended first)
                time.sleep(rng.uniform(0.0, 0.15))  # the two writes of an epoch end take ~0.02-0.12 s each
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                killed += 1
        code = proc.wait(timeout=600)
        if code not in (0, -signal.SIGKILL):  # a resume that failed (on a torn file, counted already)
            failed = stderr(root)
            break
        mid_write += bool([p for p in os.listdir(root) if p.startswith(".")])  # a ckptools temporary
        epoch = seen
        if not last.exists():  # before its first save was written, nothing to lose
            lost += seen >= 0
        else:
            try:
                epoch = torch.load(last, weights_only=True)["epoch"]  # whole, whatever the moment
            except Exception:  # noqa: BLE001 - counted: a torn last.ckpt, what a resume trips over
                torn += 1
        went_back += epoch < seen
        seen = max(seen, epoch)
        if code == 0 and killed == kills:
            break
    final = root / "final.pt"
    loaded = torch.load(final, weights_only=True) if final.exists() and not failed else None
    same = loaded is not None and all(loaded[k].numpy().tobytes() == expected[k].numpy().tobytes() for k in expected)
    return {"kills": killed, "torn": torn, "went back": went_back, "lost": lost, "ckptools temporary left": mid_write,
            "bit-identical": same, "failed": failed[-300:]}  # fmt: skip


@pytest.mark.parametrize("plugin", [CkptoolsCheckpointIO, AsyncCkptoolsCheckpointIO])
def test_s3_urls_save_load_and_remove_through_the_plugin(s3_env, plugin):
    """An s3:// dirpath (a moto server): saved as one multipart upload, loaded verified; the
    removal Lightning asks for after a newer save goes through, the newest file is never removed."""
    import s3fs

    io, folder = plugin(), f"s3://{BUCKET}/lightning-{plugin.__name__}"
    io.save_checkpoint({"state_dict": {"w": torch.arange(100_000.0)}, "epoch": 0}, f"{folder}/epoch=0.ckpt")
    time.sleep(1.1)  # S3 keeps modification times to the second
    io.save_checkpoint({"state_dict": {"w": torch.arange(100_000.0) + 1}, "epoch": 1}, f"{folder}/epoch=1.ckpt")
    loaded = io.load_checkpoint(f"{folder}/epoch=1.ckpt")
    assert loaded["epoch"] == 1 and torch.equal(loaded["state_dict"]["w"], torch.arange(100_000.0) + 1)
    assert "CRC-32" in ck.verify(f"{folder}/epoch=1.ckpt")
    io.remove_checkpoint(f"{folder}/epoch=1.ckpt")  # the newest: kept
    io.remove_checkpoint(f"{folder}/epoch=0.ckpt")
    io.teardown()
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    assert [p.rsplit("/", 1)[1] for p in fs.ls(folder)] == ["epoch=1.ckpt"]


def _plugin_loads(rank: int, world: int, path: str, read: str) -> dict:
    def asked() -> int:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar")).split(":")[1])

    io = CkptoolsCheckpointIO(read=read)
    before = asked()
    got = io.load_checkpoint(path)
    read_bytes = asked() - before
    reference = torch.load(path, weights_only=True)
    same = got.keys() == reference.keys() and got["epoch"] == reference["epoch"]
    same = same and all(torch.equal(got["state_dict"][k], v) for k, v in reference["state_dict"].items())
    return {"asked": read_bytes, "same": same}


def test_the_plugin_reads_a_checkpoint_every_rank_loads_once_between_them(tmp_path):
    """Lightning loads a resume's checkpoint on every rank: with read="once" (what "auto" is on several
    nodes sharing a filesystem, or for an object in S3) each rank reads about half of it."""
    from _dist import run_ranks

    weights = {f"layer{i}.weight": torch.full((512, 1024), float(i)) for i in range(4)}  # 2 MiB each
    path = str(tmp_path / "last.ckpt")
    CkptoolsCheckpointIO().save_checkpoint({"state_dict": weights, "epoch": 3, "global_step": 30}, path)
    size = os.path.getsize(path)
    once = run_ranks(_plugin_loads, 2, path, "once")
    assert all(r["same"] for r in once), once
    assert all(r["asked"] <= size / 2 + (1 << 20) for r in once) and sum(r["asked"] for r in once) >= size, once
    # One node, a local file: every rank reads all of it through its own mapping of the file (the page cache),
    # by page faults, not read calls: what it asks with read calls is the zip's headers and pickle alone, where
    # read="once" asked half the file each (ranged reads, the other half from the other rank).
    each = run_ranks(_plugin_loads, 2, path, "auto")
    assert all(r["same"] and r["asked"] < size / 4 for r in each), (each, size)


def test_node_snapshots_offer_a_copy_whose_commit_a_kill_cut_short(tmp_path, monkeypatch):
    """A snapshot every rank copied whole, its commit cut short (here: failed in its CRC-32s; a kill -9
    at that moment leaves the same): ckpt_path="last" is that step, sealed, and torch reads it."""
    from ckptools.integrations.lightning import NodeSnapshots
    from ckptools.node import finish_snapshot, settle
    from ckptools.node import snapshot as node_snapshot

    snapshots = NodeSnapshots(tmp_path / "run", budget=None)
    memory = snapshots.manager.snapshot_dir
    try:
        snapshots.manager.snapshot({"state_dict": {"w": torch.full((4,), 3.0)}, "global_step": 3}, 3, blocking=True)

        def fails(*_):
            raise OSError("killed during the CRC-32s")

        monkeypatch.setattr(node_snapshot, "crc32s", fails)
        snapshots.manager.snapshot({"state_dict": {"w": torch.full((4,), 4.0)}, "global_step": 4}, 4)
        settle(memory)
        monkeypatch.undo()
        with pytest.raises(ck.CheckpointError, match="killed during the CRC-32s"):
            finish_snapshot(memory)
        assert os.path.basename(snapshots.ckpt_path) == "last-snapshot-0000000004.ckpt"
        assert torch.load(snapshots.ckpt_path, weights_only=True)["global_step"] == 4
        assert "every record" in ck.verify(snapshots.ckpt_path)
    finally:
        snapshots.manager.close()
        shutil.rmtree(memory, ignore_errors=True)
