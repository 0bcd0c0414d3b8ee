"""What a newcomer tripped over (issue 22): the export's config, cut names and lists, diff's
summary, what a file that is no checkpoint looks like, the package's own surface."""

from __future__ import annotations

import json
import os
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
