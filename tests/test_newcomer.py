"""What a newcomer tripped over (issue 22): the export's config, cut names and lists, diff's
summary, what a file that is no checkpoint looks like, the package's own surface."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

import ckptools as ck
from ckptools.cli import app

CKPT = os.path.join(os.path.dirname(sys.executable), "ckpt")


def _run(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def _cli(*args: object, columns: int = 80) -> subprocess.CompletedProcess[str]:
    """The real executable at a terminal width of ``columns``."""
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([CKPT, *map(str, args)], capture_output=True, text=True, timeout=120, env=env)


# --- 1. a Hugging Face export needs its config ----------------------------------------------------


def test_a_folder_export_brings_the_config_or_says_it_is_missing(tmp_path):
    torch.save({"model": {"module.w": torch.ones(2, 2)}, "step": 1}, tmp_path / "train.pt")
    model_dir = tmp_path / "model"  # what the model came from: config and tokenizer files
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 2}))
    (model_dir / "tokenizer.json").write_text("{}")
    (model_dir / "notes.txt").write_text("not copied")
    bare = _cli("convert", tmp_path / "train.pt", f"{tmp_path}/bare/")
    assert bare.returncode == 0 and "no config.json, which from_pretrained needs" in bare.stderr
    assert "--config" in bare.stderr
    done = _cli("convert", tmp_path / "train.pt", f"{tmp_path}/out/", "--config", model_dir)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (tmp_path / "out" / "config.json").read_text() == (model_dir / "config.json").read_text()
    # a config.json file alone; an existing one is replaced only with --force
    again = _run("convert", tmp_path / "train.pt", f"{tmp_path}/out/", "--config", model_dir / "config.json")
    assert again.exit_code == 2 and "--force" in again.output
    for bad, words in ((tmp_path / "nope.json", "does not exist"), (tmp_path / "train.pt", "config.json"),
                       (tmp_path / "bare", "no config.json")):  # fmt: skip
        result = _run("convert", tmp_path / "train.pt", f"{tmp_path}/x/", "--config", bad)
        assert result.exit_code == 2 and words in result.output, result.output
        assert not (tmp_path / "x").exists() or not os.listdir(tmp_path / "x")  # nothing written
    with pytest.warns(ck.CheckpointWarning, match="no config.json"):
        ck.export_huggingface(tmp_path / "train.pt", tmp_path / "lib")
    written = ck.export_huggingface(tmp_path / "train.pt", tmp_path / "lib2", config=model_dir)
    assert [os.path.basename(w) for w in written] == ["model.safetensors", "config.json", "tokenizer.json"]
    single = _run("convert", tmp_path / "train.pt", tmp_path / "w.safetensors", "--config", model_dir)
    assert single.exit_code == 2 and "folder output" in single.output
    _ = safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")


# --- 3. names are what people read ------------------------------------------------------------------


GOLDEN = os.path.join(os.path.dirname(__file__), "interop", "golden")


def test_info_at_80_columns_shows_every_name_whole_and_says_when_a_list_is_cut(tmp_path):
    folder = os.path.join(GOLDEN, "hf_sharded")  # transformers' own shards of a tiny GPT-2
    names = json.loads(pathlib.Path(folder, "model.safetensors.index.json").read_text())["weight_map"]
    shown = _cli("info", folder, columns=80)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in shown.stdout
    for name in names:  # each on one line, whole
        assert any(f"│ {name} " in line for line in lines), name
    assert "3 files: model.safetensors.index.json, model-00001-of-00002.safetensors, " in shown.stdout
    # 26 files (the index and 25 shards): 20 named, and the rest counted
    torch.save({f"layer{i}.w": torch.ones(64) for i in range(25)}, tmp_path / "m.pt")
    ck.export_huggingface(tmp_path / "m.pt", tmp_path / "hf", max_shard_size=256, config=folder)
    listed = _cli("info", tmp_path / "hf", columns=200).stdout
    assert "26 files: " in listed and ", and 6 more" in listed, listed[:400]
    one = _cli("info", tmp_path / "hf" / "model-00001-of-00025.safetensors").stdout
    assert "1 tensor, 256 B" in one and "1 tensors" not in one


def test_diff_says_one_line_when_all_match_and_shows_the_table_when_not(tmp_path):
    weights = {f"block{i}.weight": torch.full((2,), float(i)) for i in range(5)}
    torch.save(weights, tmp_path / "a.pt")
    # The CLI in this process (the installed command's output is test_cli.py's): no torch import per diff.
    safetensors.torch.save_file(weights, tmp_path / "b.safetensors")
    same = _run("diff", tmp_path / "a.pt", tmp_path / "b.safetensors")
    assert same.exit_code == 0
    assert "5 common tensors equal bit for bit" in same.stdout and "block0.weight" not in same.stdout
    verbose = _run("diff", "--verbose", tmp_path / "a.pt", tmp_path / "b.safetensors")
    assert verbose.exit_code == 0 and all(name in verbose.stdout for name in weights)
    weights["block3.weight"] = weights["block3.weight"] + 1
    torch.save(weights, tmp_path / "c.pt")
    differ = _run("diff", tmp_path / "a.pt", tmp_path / "c.pt")
    assert differ.exit_code == 1 and all(name in differ.stdout for name in weights)
    close = _run("diff", "--atol", "2", tmp_path / "a.pt", tmp_path / "c.pt")
    assert close.exit_code == 0 and "within atol=2 (largest |a-b| 1)" in close.stdout


# --- 4. a file that is no checkpoint is said to be what it is --------------------------------------


def test_a_file_of_another_kind_is_named_not_called_corrupt(tmp_path):
    import gzip

    import numpy

    torch.save({"w": torch.ones(2)}, tmp_path / "real.pt")
    safetensors.torch.save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    numpy.save(tmp_path / "a.npy", numpy.ones(3))
    files = {
        "notes.pt": (b"hello world, these are my notes\n", "a text file (it starts 'hello world"),
        "page.pt": (b"<!DOCTYPE html>\n<html><body>403 Forbidden</body></html>", "an HTML or XML page"),
        "lfs.bin": (b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 9\n", "git lfs pull"),
        "index.pt": (b'{"weight_map": {}}', "JSON text"),
        "real.pt.gz": (gzip.compress((tmp_path / "real.pt").read_bytes()), "gzip-compressed"),
        "renamed.pt": ((tmp_path / "model.safetensors").read_bytes(), "rename it to .safetensors"),
        "array.pt": ((tmp_path / "a.npy").read_bytes(), "numpy array file"),
    }
    for name, (data, words) in files.items():
        (tmp_path / name).write_bytes(data)
        for command in ("info", "verify"):
            result = _run(command, tmp_path / name)
            assert result.exit_code == 2, (name, command, result.output)  # not "DAMAGED" (exit 1)
            assert result.output.count("\n") == 1 and "not a torch checkpoint: it is" in result.output, result.output
            assert words in result.output, (name, result.output)
        with pytest.raises(ck.CheckpointLayoutError, match="not a torch checkpoint"):
            ck.load_state_dict(tmp_path / name)
    (tmp_path / "random.pt").write_bytes(bytes(range(200, 256)) * 4)
    (tmp_path / "empty.pt").write_bytes(b"")
    for name, words in (("random.pt", "starts with bytes c8 c9 ca"), ("empty.pt", "is empty (0 bytes)")):
        result = _run("verify", tmp_path / name)
        assert result.exit_code == 1 and words in result.output, result.output  # damaged or cut short
    shown = _cli("info", tmp_path / "notes.pt")  # the real executable: one line on stderr, exit 2
    assert shown.returncode == 2 and shown.stderr.startswith("ckpt: ") and shown.stderr.count("\n") == 1


# --- 7. the README's install check works as written -------------------------------------------------


def test_the_readme_install_check_runs_as_written():
    import re
    import shlex

    readme = pathlib.Path(__file__).parent.parent.joinpath("README.md").read_text()
    block = readme.split("Check an install", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [line for line in block.strip().splitlines() if line.strip()]
    assert lines[0] == "ckpt --version"
    version = subprocess.run([CKPT, "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and re.fullmatch(r"ckpt \(ckptools\) [0-9.]+\n", version.stdout)
    argv = shlex.split(lines[1])
    assert argv[0] == "python"
    smoke = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=120)
    assert smoke.returncode == 0 and smoke.stdout == "tensor([1., 1.])\n", smoke.stderr
    assert "prints `tensor([1., 1.])`" in readme
