"""Files written by the real libraries: transformers, Accelerate, Lightning, DCP, torch.compile.

The golden files under tests/interop/golden were written by tests/interop/make_golden.py with
the versions in VERSIONS.json; beside each, reference/*.safetensors holds the weights the
library held in memory, written by the official safetensors library. `make interop` writes them
afresh with the installed libraries and runs this file against those (CKPTOOLS_GOLDEN), where
the from_pretrained tests run too.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from _same import assert_same_tree
from typer.testing import CliRunner

import ckptools as ck
from ckptools.cli import app

pytestmark = [
    pytest.mark.versions,
    pytest.mark.interop,
]  # files the frameworks wrote (DCP, transformers, Accelerate, Lightning)

HERE = os.path.dirname(__file__)
# Absolute: some tests run the CLI from another working directory.
GOLDEN = os.path.abspath(os.environ.get("CKPTOOLS_GOLDEN") or os.path.join(HERE, "interop", "golden"))
CKPT = os.path.join(os.path.dirname(sys.executable), "ckpt")


def _g(*parts: str) -> str:
    return os.path.join(GOLDEN, *parts)


def _reference(name: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(_g("reference", f"{name}.safetensors"))


def _run(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


# artifact, reference, how reference names read in the file, format, names the file leaves out
HF_TIED = {"lm_head.weight"}  # transformers stores the tied output embedding once, under wte
CASES = {
    "hf_single": ("hf", "", "Hugging Face folder, safetensors", HF_TIED),
    "hf_single/model.safetensors": ("hf", "", "safetensors", HF_TIED),
    "hf_sharded": ("hf", "", "Hugging Face folder, sharded safetensors (2 shards)", HF_TIED),
    "hf_sharded/model.safetensors.index.json": ("hf", "", "sharded safetensors (2 shards)", HF_TIED),
    "hf_bin_sharded": ("hf_bin", "", "Hugging Face folder, sharded torch (2 shards)", set()),
    "hf_bin_sharded/pytorch_model.bin.index.json": ("hf_bin", "", "sharded torch (2 shards)", set()),
    "accelerate_state": ("accelerate", "", "Accelerate save_state folder, safetensors", set()),
    "lightning.ckpt": ("lightning", "model.", "torch zip", set()),
    "dcp": ("dcp", "", "DCP folder", set()),
    "compiled.pt": ("compiled", "", "torch zip", set()),
    "ddp_compiled.pt": ("compiled", "", "torch zip", set()),
}


def _expected(artifact: str) -> dict[str, torch.Tensor]:
    ref, prefix, _, left_out = CASES[artifact]
    return {prefix + k: v for k, v in _reference(ref).items() if k not in left_out}


def _same(got: dict, want: dict) -> None:
    assert_same_tree(got, want, key_order=False)


def test_golden_files_record_their_versions():
    versions = json.loads(pathlib.Path(_g("VERSIONS.json")).read_text())
    assert set(versions) >= {"torch", "transformers", "accelerate", "pytorch-lightning"}
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(GOLDEN) for f in fs)
    assert size < 2 * 2**20


@pytest.mark.parametrize("artifact", sorted(CASES))
def test_library_reads_every_layout_bit_exactly(artifact):
    ref, _, fmt, left_out = CASES[artifact]
    with pytest.warns(ck.CheckpointWarning) if artifact == "lightning.ckpt" else _no_warning():
        weights = ck.load_state_dict(_g(artifact))
    if artifact == "lightning.ckpt":  # the LightningModule's attribute ("model.") goes: the plain network's names
        _same(weights, _reference(CASES[artifact][0]))
        weights = ck.load_state_dict(_g(artifact), strip=None)  # as stored (warned once per file, above)
    _same(weights, _expected(artifact))
    if left_out:  # tied in memory: the name left out holds the same values as the one stored
        reference = _reference(ref)
        assert torch.equal(reference["lm_head.weight"], reference["transformer.wte.weight"])
    report = ck.inspect(_g(artifact))
    assert report["format"].startswith(fmt), report["format"]
    names = [t["name"] for t in report["tensors"]]  # as stored: entry and wrapper prefixes kept
    assert all(any(n == k or n.endswith("." + k) for n in names) for k in _expected(artifact))
    assert ck.verify(_g(artifact))  # reads every byte; raises on damage


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", ck.CheckpointWarning)

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)


@pytest.mark.parametrize("artifact", sorted(CASES))
def test_cli_info_verify_and_convert_every_layout(artifact, tmp_path):
    path = _g(artifact)
    # In this process (the CLI's own code, without a torch import per call); the installed `ckpt`
    # in a process of its own is tested on every command by test_cli.py.
    info = _run("info", path, "--json")
    assert info.exit_code == 0, info.output
    assert json.loads(info.stdout)["totals"]["tensors"] >= len(_expected(artifact)) - 1
    verify = _run("verify", path)
    # OK only where every byte carries a checksum (torch zips); elsewhere what was not is named
    checksummed = artifact.endswith((".pt", ".ckpt", ".bin.index.json"))
    assert verify.exit_code == 0 and verify.stdout.startswith("OK " if checksummed else "STRUCTURE OK "), verify.output
    assert checksummed == ("data not checksummed" not in verify.stdout)
    strict = _run("verify", "--strict", path)
    assert strict.exit_code == (0 if checksummed else 1), strict.output
    out = tmp_path / "out.safetensors"
    assert _run("convert", path, out).exit_code == 0
    official = safetensors.torch.load_file(str(out))  # the bytes, read by the official library
    with safetensors.safe_open(str(out), "pt") as f:
        aliases = json.loads(f.metadata().get("ckptools.aliases", "{}"))
    assert set(aliases) <= {"lm_head.weight"}  # a tie keeps the embedding, as transformers expects
    _same({**official, **{a: official[t] for a, t in aliases.items()}}, _expected(artifact))
    folder = tmp_path / "hf"
    result = _run("convert", path, f"{folder}/", "--max-shard-size", "4KB")
    assert result.exit_code == 0, result.output
    _same(ck.load_state_dict(folder), _expected(artifact))
    assert _run("verify", folder).exit_code == 0
    if not CASES[artifact][1]:  # same names: diff against the reference itself
        assert _run("diff", path, _g("reference", CASES[artifact][0] + ".safetensors")).exit_code == (
            1 if CASES[artifact][3] else 0  # hf: lm_head.weight is only in the reference
        )
        assert _run("diff", path, folder).exit_code == 0


def test_models_load_through_ck_load_whatever_the_layout():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for artifact, ref in (("dcp", "dcp"), ("ddp_compiled.pt", "compiled"), ("accelerate_state", "accelerate")):
        ck.load(_g(artifact), {"model": net})
        _same(net.state_dict(), _reference(ref))
    # Lightning: the inner network loads from "model.0.weight" without strip=; the Path and the
    # Namespace in hyper_parameters come back as inert placeholders, with a warning ...
    with pytest.warns(ck.CheckpointWarning, match=r"pathlib\.PosixPath.*nothing was executed"):
        ckpt = ck.load(_g("lightning.ckpt"), {"model": net})
    _same(net.state_dict(), _reference("lightning"))
    assert repr(ckpt["hyper_parameters"]["root"]) == "<pathlib.PosixPath, not loaded>"
    torch.nn.init.zeros_(net[0].weight)
    ckpt = ck.load(_g("lightning.ckpt"), {"model": net}, weights_only=False)  # ... or real ones, trusted
    _same(net.state_dict(), _reference("lightning"))
    assert ckpt["hyper_parameters"]["root"] == pathlib.PurePosixPath("/data/runs")


def test_a_distcp_shard_is_not_a_checkpoint_and_never_damaged():
    for command in ("info", "verify", "convert"):
        args = [CKPT, command, _g("dcp", "__0_0.distcp")] + (["/tmp/never.safetensors"] if command == "convert" else [])
        proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (command, proc.stdout)
        assert (
            "one shard of a torch.distributed.checkpoint (DCP) folder" in proc.stderr
            and "pass the folder" in proc.stderr
        )
    assert not os.path.exists("/tmp/never.safetensors")


def test_verify_finds_every_disagreement_between_index_and_shards(tmp_path):
    def copy() -> str:
        folder = tmp_path / f"c{len(os.listdir(tmp_path))}"
        shutil.copytree(_g("hf_sharded"), folder)
        return str(folder)

    missing = copy()
    os.remove(os.path.join(missing, "model-00002-of-00002.safetensors"))
    stray = copy()
    shutil.copy(
        os.path.join(stray, "model-00001-of-00002.safetensors"), os.path.join(stray, "model-00003-of-00003.safetensors")
    )
    unlisted = copy()
    index_path = os.path.join(unlisted, "model.safetensors.index.json")
    index = json.loads(pathlib.Path(index_path).read_text())
    index["weight_map"].pop("transformer.wte.weight")
    pathlib.Path(index_path).write_text(json.dumps(index))
    for folder, words in ((missing, "is missing"), (stray, "stray shard files"), (unlisted, "the index does not list")):
        proc = subprocess.run([CKPT, "verify", folder], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and proc.stdout.startswith(f"DAMAGED {folder}: "), proc.stdout
        assert words in proc.stdout, proc.stdout
    # Every other command refuses the incomplete folder too, naming the file to fetch again.
    proc = subprocess.run([CKPT, "info", missing], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "names shard model-00002-of-00002.safetensors, which is missing" in proc.stderr


def test_strip_module_and_add_module_on_a_sharded_folder(tmp_path):
    added, stripped = tmp_path / "added", tmp_path / "stripped"
    assert _run("add-module", _g("hf_sharded"), "-o", added).exit_code == 0
    assert all(n.startswith("module.") for n in ck.load_state_dict(added, strip=None))
    assert sorted(os.listdir(added)) == sorted(os.listdir(_g("hf_sharded")))  # config files copied
    assert _run("verify", added).exit_code == 0
    result = _run("strip-module", added, "-o", stripped)
    assert result.exit_code == 0, result.output
    _same(ck.load_state_dict(stripped, strip=None), _expected("hf_sharded"))
    assert (stripped / "config.json").read_bytes() == pathlib.Path(_g("hf_sharded", "config.json")).read_bytes()


def test_strip_module_compile_prefixes(tmp_path):
    out = tmp_path / "plain.pt"
    assert _run("strip-module", _g("ddp_compiled.pt"), "-o", out).exit_code == 0
    assert all(k.startswith("_orig_mod.") for k in torch.load(out, weights_only=True)["model"])
    assert _run("strip-module", _g("ddp_compiled.pt"), "-o", out, "--compile", "--force").exit_code == 0
    saved = torch.load(out, weights_only=True)
    _same(saved["model"], _reference("compiled"))
    assert saved["step"] == 7


def test_lightning_checkpoint_with_a_path_in_hyper_parameters(tmp_path):
    path = _g("lightning.ckpt")
    info = subprocess.run([CKPT, "info", path], capture_output=True, text=True, timeout=120)
    assert info.returncode == 0 and "pathlib.PosixPath" in info.stdout and "argparse.Namespace" in info.stdout
    # strip-module keeps the entries it could not load, byte for byte as torch reads them back
    out = tmp_path / "renamed.ckpt"
    assert _run("strip-module", path, "-o", out, "--prefix", "model.").exit_code == 0
    before = torch.load(path, weights_only=False)
    after = torch.load(out, weights_only=False)
    assert after["hyper_parameters"] == before["hyper_parameters"]
    assert set(after) == set(before)
    _same(after["state_dict"], _reference("lightning"))
    # the opt-in for trusted files: everything loads, nothing is skipped
    trusted = subprocess.run([CKPT, "info", path, "--json", "--trust-pickled-code"], capture_output=True, text=True)
    assert trusted.returncode == 0 and "skipped_globals" not in json.loads(trusted.stdout)


def test_export_for_transformers_is_what_from_pretrained_reads(tmp_path):
    transformers = pytest.importorskip("transformers")
    reference = transformers.GPT2LMHeadModel.from_pretrained(_g("hf_single")).state_dict()
    # What a DDP training script saves: "module." names, optimizer-free here, a step counter.
    torch.save({"model": {"module." + k: v for k, v in reference.items()}, "step": 5}, tmp_path / "train.pt")
    out = tmp_path / "out"
    # --config brings the config.json from_pretrained needs (and the generation config beside it)
    result = _run("convert", tmp_path / "train.pt", f"{out}/", "--max-shard-size", "20KB", "--config", _g("hf_single"))
    assert result.exit_code == 0, result.output
    assert {"config.json", "generation_config.json"} <= set(os.listdir(out))
    assert "model.safetensors.index.json" in os.listdir(out)
    model = transformers.GPT2LMHeadModel.from_pretrained(out)
    _same(model.state_dict(), reference)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # tied again


def test_verify_checks_an_accelerate_folders_optimizer_state_too(tmp_path):
    from ckptools.codecs.torchzip import TorchZip

    folder = tmp_path / "state"
    shutil.copytree(_g("accelerate_state"), folder)
    assert "optimizer.bin, scheduler.bin: every record's CRC-32 matches" in ck.verify(folder)
    archive = TorchZip(str(folder / "optimizer.bin"))
    info, start = next((i, s) for i, s in zip(archive.infos, archive.starts) if "/data/" in i.filename)
    data = bytearray((folder / "optimizer.bin").read_bytes())
    data[start + info.file_size // 2] ^= 1  # inside a tensor record (records are 64-byte aligned)
    (folder / "optimizer.bin").write_bytes(bytes(data))
    proc = subprocess.run([CKPT, "verify", str(folder)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "optimizer.bin: record optimizer/data/" in proc.stdout, proc.stdout


@pytest.mark.slow  # ~700 commands, ~20 s: make interop runs it, over the golden files it writes afresh
def test_every_documented_option_of_every_command_over_the_golden_files_says_what_it_did(tmp_path):
    """No "please report this" and no traceback from any option the help documents."""
    import typer

    typer_main = typer.main.get_command(app)  # click's group (typer may carry its own copy of click)
    artifacts = sorted(n for n in os.listdir(GOLDEN) if n not in ("reference", "VERSIONS.json"))
    keys = ["state_dict", "optimizer_states", "optimizer_states.0.state", "hyper_parameters", "callbacks", "loops",
            "epoch", "nope", "model.0"]  # fmt: skip
    values = {"--atol": ["0.5"], "--prefix": ["model."], "--max-shard-size": ["1KB"], "--key": keys,
              "--config": [os.path.join(GOLDEN, "hf_single")]}  # fmt: skip
    runs = 0
    for name, command in typer_main.commands.items():
        options = [p for p in command.params if p.param_type_name == "option" and p.name not in ("output", "help")]
        for artifact in artifacts:
            path = os.path.join(GOLDEN, artifact)
            for option in [None, *options]:
                variants = [[]] if option is None else (
                    [[option.opts[0]]] if option.is_flag else [[option.opts[0], v] for v in values[option.opts[0]]]
                )  # fmt: skip
                for extra in variants:
                    work = tmp_path / f"r{runs}"
                    work.mkdir()
                    if name in ("strip-module", "add-module"):
                        argv = [name, path, *extra] + ([] if "--in-place" in extra else ["-o", work / "out"])
                        if "--in-place" in extra:  # on a copy: the golden files stay as they are
                            copy = work / artifact.replace("/", "_")
                            (shutil.copytree if os.path.isdir(path) else shutil.copy)(path, copy)
                            argv[1] = copy
                    elif name == "convert":
                        argv = [name, path, f"{work}/out/" if "--config" in extra else work / "out.safetensors", *extra]
                    elif name == "diff":
                        argv = [name, path, os.path.join(GOLDEN, "lightning.ckpt"), *extra]
                    else:
                        argv = [name, path, *extra]
                    result = _run(*argv)
                    runs += 1
                    said = result.output + (result.stderr if result.stderr_bytes is not None else "")
                    assert "please report" not in said and "Traceback" not in said, (argv, said)
                    assert result.exit_code in (0, 1, 2), (argv, result.exit_code, said)
                    assert result.exception is None or isinstance(result.exception, SystemExit), (argv, said)
    assert runs > 500
