"""What Lightning and HF Trainer users tripped over outside the integrations (issue 33, items 2-8).

Lightning files here are the golden ones the real Lightning wrote (tests/interop/make_golden.py);
test_lightning.py repeats the plain-code load against a file a real `Trainer.fit` wrote.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import safetensors.torch
import torch
from _dist import free_port
from _same import tiny_net
from typer.testing import CliRunner

import ckptools as ck
from ckptools.cli import app

GOLDEN = os.path.join(os.path.dirname(__file__), "interop", "golden")
LIGHTNING = os.path.join(GOLDEN, "lightning.ckpt")  # a LightningModule holding self.model, SGD
HYDRA = os.path.join(GOLDEN, "lightning_hydra.ckpt")  # the same with Adam (its state has tensors)


def _run(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def _stored(path: str) -> dict:
    return torch.load(path, weights_only=False, map_location="cpu")


# --- 2. diff --key ---------------------------------------------------------------------------------


def _two_lightning_files(tmp_path):
    """Two checkpoints of one run, a step apart: weights, AdamW state and hyper-parameters differ."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    paths = []
    for step, lr in ((1, 0.1), (2, 0.2)):
        net(torch.ones(1, 3)).sum().backward()
        opt.step()
        ckpt = {
            "epoch": 0, "global_step": step, "pytorch-lightning_version": "2.6.6",
            "state_dict": {f"net.{k}": v.clone() for k, v in net.state_dict().items()},
            "optimizer_states": [opt.state_dict()], "lr_schedulers": [],
            "hyper_parameters": {"lr": lr, "root": "/data", "layers": [3, 2]}, "loops": {"fit_loop": {"epoch": 0}},
            "callbacks": {"ModelCheckpoint{}": {"best_model_score": None}},
        }  # fmt: skip
        paths.append(tmp_path / f"step{step}.ckpt")
        torch.save(ckpt, paths[-1])
    return paths


def test_diff_key_compares_the_entry_it_names_or_says_which_exist(tmp_path):
    a, b = _two_lightning_files(tmp_path)
    missing = _run("diff", a, b, "--key", "optimizer")  # both lack it: before, the weights were compared
    assert missing.exit_code == 2 and missing.stdout == "", missing.output
    assert "has no entry 'optimizer'" in missing.stderr and "optimizer_states" in missing.stderr
    assert "state_dict" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    deep = _run("diff", a, b, "--key", "optimizer_states.0.state", "--json")
    assert deep.exit_code == 1, deep.output
    result = json.loads(deep.stdout)
    assert set(result["max_abs_diff"]) == {f"{p}.{t}" for p in (0, 1) for t in ("exp_avg", "exp_avg_sq", "step")}
    assert result["changed"] == sorted(result["max_abs_diff"]) and not result["missing_in_b"]
    assert _run("diff", a, a, "--key", "optimizer_states.0.state").exit_code == 0
    for key, changed in (
        ("hyper_parameters", ["lr"]),
        ("callbacks", []),
        ("loops", []),
        ("global_step", ["global_step"]),
    ):
        out = _run("diff", a, b, "--key", key, "--json")
        assert out.exit_code == (1 if changed else 0) and "please report" not in out.output, (key, out.output)
        assert json.loads(out.stdout)["changed"] == changed, key
    said = _run("diff", a, b, "--key", "hyper_parameters")
    assert "changed lr: 0.1 vs 0.2" in said.stdout and "checkpoints differ" in said.stdout
    index = _run("diff", a, b, "--key", "optimizer_states.3")
    assert index.exit_code == 2 and "a list of 1 (indices 0 to 0)" in index.stderr
    # a file of bare weights has no entries: compared whole against the entry (a checkpoint and its export)
    ck.convert_to_safetensors(a, tmp_path / "export.safetensors")
    assert _run("diff", a, tmp_path / "export.safetensors", "--key", "state_dict").exit_code == 0


# --- 3. Lightning files into plain code ------------------------------------------------------------


def test_a_lightning_file_loads_into_the_plain_network_optimizer_and_scheduler():
    stored = _stored(HYDRA)
    weights = ck.load_state_dict(HYDRA)  # before: "model.0.weight", which the plain network does not have
    assert list(weights) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    net = tiny_net(1)
    net.load_state_dict(weights)
    assert all(torch.equal(net.state_dict()[k], stored["state_dict"][f"model.{k}"]) for k in weights)
    assert list(ck.load_state_dict(HYDRA, strip=None)) == [f"model.{k}" for k in weights]  # as stored
    # ck.load: the optimizer under any name takes optimizer_states[0], as configure_optimizers returned it
    for name in ("optimizer", "optimizer_states"):
        net = tiny_net(1)
        opt = torch.optim.Adam(net.parameters(), lr=1.0)
        ck.load(HYDRA, {"model": net, name: opt})
        saved = stored["optimizer_states"][0]
        assert opt.state_dict()["param_groups"][0]["lr"] == saved["param_groups"][0]["lr"] == 1e-3
        for index, state in saved["state"].items():
            got = opt.state_dict()["state"][index]
            assert all(torch.equal(got[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
    # a scheduler with the file's empty lr_schedulers list: said exactly
    net = tiny_net(1)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(ck.KeyMismatchError, match=r"0 scheduler state\(s\) in lr_schedulers.*pass as many"):
        ck.load(LIGHTNING, {"model": net, "optimizer": opt, "scheduler": scheduler})
    ck.load(LIGHTNING, {"model": net, "optimizer": opt})  # SGD: its lr comes back
    assert opt.param_groups[0]["lr"] == 0.1


def test_a_lightning_file_with_two_optimizers_takes_them_in_order_or_says_how(tmp_path):
    first, second = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.5), None
    second = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], lr=0.25)
    torch.save({"pytorch-lightning_version": "2.6.6", "state_dict": {"net.w": torch.ones(2)},
                "optimizer_states": [first.state_dict(), second.state_dict()], "lr_schedulers": []},
               tmp_path / "two.ckpt")  # fmt: skip
    a = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    b = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], lr=1.0)
    ck.load(tmp_path / "two.ckpt", {"generator_opt": a, "critic_opt": b})
    assert (a.param_groups[0]["lr"], b.param_groups[0]["lr"]) == (0.5, 0.25)
    with pytest.raises(ck.CheckpointFormatError, match="holds 2 optimizers' states; name each optimizer"):
        ck.load(tmp_path / "two.ckpt", {"optimizer_states": a})


def test_strip_module_that_removes_nothing_names_the_prefix_the_keys_share(tmp_path):
    result = _run("strip-module", LIGHTNING, "-o", tmp_path / "out.ckpt")
    assert result.exit_code == 0 and "removed from 0 keys" in result.stdout
    assert result.stderr.strip() == (
        "ckpt: note: no key starts with that prefix; every key starts with 'model.': to remove it, "
        f"ckpt strip-module {LIGHTNING} -o OUT --prefix model."
    )
    fixed = _run("strip-module", LIGHTNING, "-o", tmp_path / "plain.ckpt", "--prefix", "model.")
    assert fixed.exit_code == 0 and "removed from 4 keys" in fixed.stdout and fixed.stderr == ""
    tiny_net().load_state_dict(torch.load(tmp_path / "plain.ckpt", weights_only=False)["state_dict"])


# --- 5. an HF Trainer folder's export brings its config --------------------------------------------


def test_convert_of_a_trainer_folder_brings_its_config_and_tokenizer(tmp_path):
    folder = tmp_path / "checkpoint-4"
    shutil.copytree(os.path.join(GOLDEN, "hf_single"), folder)
    (folder / "tokenizer.json").write_text("{}")
    torch.save({"state": {}, "param_groups": []}, folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text("{}")
    result = _run("convert", folder, f"{tmp_path}/out/")
    assert result.exit_code == 0 and result.stderr == "", result.output  # no "has no config.json" note
    files = sorted(os.listdir(tmp_path / "out"))
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert (tmp_path / "out" / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    # an existing config in the output is left alone (replaced with --force)
    (tmp_path / "out" / "config.json").write_text('{"mine": 1}')
    assert _run("convert", folder, f"{tmp_path}/out/", "--force").exit_code == 0
    assert (tmp_path / "out" / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    (tmp_path / "out2").mkdir()
    (tmp_path / "out2" / "config.json").write_text('{"mine": 1}')
    assert _run("convert", folder, f"{tmp_path}/out2/").exit_code == 0
    assert (tmp_path / "out2" / "config.json").read_text() == '{"mine": 1}'
    # a plain file has no folder to bring: the note stays
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    bare = _run("convert", tmp_path / "w.pt", f"{tmp_path}/bare/")
    assert bare.exit_code == 0 and "has no config.json" in bare.stderr
    safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")


# --- 6. a script without a __main__ guard ----------------------------------------------------------

_NO_GUARD = """
import torch
import ckptools as ck

ck.init_distributed()
data = torch.utils.data.TensorDataset(torch.arange(8.0))
loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=1, multiprocessing_context="spawn")
for (batch,) in loader:
    print("batch", batch.tolist(), flush=True)
ck.exit_process(0)
"""


def test_init_distributed_in_a_spawned_worker_importing_the_script_names_the_guard(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_NO_GUARD)
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert "ckptools.init_distributed() was called while a process started by multiprocessing" in proc.stderr
    assert f"was importing {script}" in proc.stderr and 'if __name__ == "__main__":' in proc.stderr
    # (a guarded script's spawned workers, which init_distributed must let be, run in
    # test_train_ddp_e2e.py's launch with persistent spawned workers)


# --- 7. warnings: through warnings and the log, once each -----------------------------------------


def test_a_checkpoint_warning_is_a_warning_and_one_log_record(tmp_path, caplog):
    manager = ck.CheckpointManager(tmp_path, keep_last=3)
    net = torch.nn.Linear(2, 2)
    manager.save({"model": net}, step=1)
    newest = manager.save({"model": net}, step=2)
    with open(newest, "r+b") as f:  # damaged: skipped, with a warning
        f.seek(os.path.getsize(newest) // 2)
        f.write(b"\x00" * 64)
    with caplog.at_level(logging.WARNING, logger="ckptools"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert manager.latest().endswith("ckpt-0000000001.pt")
    ours = [w for w in caught if issubclass(w.category, ck.CheckpointWarning)]
    records = [r for r in caplog.records if r.name == "ckptools" and r.levelno == logging.WARNING]
    assert len(ours) == 1 and "skipping damaged checkpoint" in str(ours[0].message)
    assert len(records) == 1 and records[0].getMessage() == str(ours[0].message)
    with warnings.catch_warnings():  # -W error turns it into an error, and the log still has it
        warnings.simplefilter("error", ck.CheckpointWarning)
        with pytest.raises(ck.CheckpointWarning):
            manager.latest()
    # logging.captureWarnings(True) makes the record itself: one, on "py.warnings", none of ours beside it
    caplog.clear()
    logging.captureWarnings(True)
    try:
        with caplog.at_level(logging.WARNING), warnings.catch_warnings():
            warnings.simplefilter("always")
            manager.latest()
    finally:
        logging.captureWarnings(False)
    said = [r.name for r in caplog.records if "skipping damaged checkpoint" in r.getMessage()]
    assert said == ["py.warnings"], said
    # without a logging set-up, nothing is printed twice: the warning alone reaches stderr
    code = "import warnings, ckptools as ck\nfrom ckptools import log\nlog.warn('one message')\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr.count("one message") == 1, proc.stderr
