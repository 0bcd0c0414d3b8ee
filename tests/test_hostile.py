"""Hostile and damaged files: the right error, nothing executed, modified, written or over-allocated.

The corpus (tests/_corpus.py) holds ~100 files: missing, empty, directories, random bytes,
truncations at many offsets, zips that are not torch files or lie about sizes, legacy garbage,
safetensors headers that are too long, absurd, invalid, overlapping, out of range or duplicated,
and pickles that call os.system / eval / exec / subprocess.Popen or import a module that would
write a canary file.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest
from _corpus import CANARY, build
from typer.testing import CliRunner

from ckptools.cli import app

HERE = os.path.dirname(__file__)
WANT = {
    "valid": "ok",
    "missing": "CheckpointNotFoundError",
    "format": "CheckpointFormatError",
    "unsafe": "UnsafeCheckpointError",
}


def _fingerprint(directory: str) -> dict[str, str]:
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, directory)] = (
                "dir" if os.path.isdir(path) else hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
            )
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("corpus"))
    expected = build(directory)
    return directory, expected


# Readers that open any layout (files and folders): a folder they cannot read is a layout error.
_LAYOUT_AWARE = ("load", "load(verify=True)", "load_state_dict", "load_state_dict(verify=True)",
                 "convert_to_safetensors", "inspect (ckpt info)")  # fmt: skip


def _expected(kind: str, name: str, reader: str) -> set[str]:
    if name.startswith("a_directory") and reader in _LAYOUT_AWARE:
        return {"CheckpointLayoutError"}  # a folder, of no layout ckptools reads: never "corrupt"
    want = {WANT[kind]}
    if kind == "unsafe" and reader == "verify_torch_file":
        # A CRC check reads no pickle: a well-formed zip passes, a legacy pickle is "not a zip".
        want = {"ok", "CheckpointFormatError"}
    legacy = "_legacy" in name or "_after_magic" in name
    if kind == "unsafe" and legacy and ("verify=True" in reader or reader.startswith("torchzip")):
        want = {"CheckpointFormatError"}  # verification needs the zip format; refused before any unpickling
    return want


def test_library_readers_refuse_hostile_files_in_bounded_memory(corpus, tmp_path):
    directory, expected = corpus
    before = _fingerprint(directory)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    # The corpus directory is importable in the child, so a pickle naming the canary module
    # *would* import it if any reader resolved the global.
    env = {**os.environ, "PYTHONPATH": directory, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "_bounded_readers.py"), directory, str(out_dir), "1024"],
        input=json.dumps(sorted(expected)),
        capture_output=True,
        text=True,
        env=env,
        cwd=directory,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    results = report["results"]
    assert report["untouched"], "a file changed a global of the reading process (a pickle BUILD onto it)"
    wrong = [
        (name, reader, outcome)
        for name, reader, outcome, _, _ in results
        if outcome not in _expected(expected[name], name, reader)
    ]
    assert wrong == []
    assert [r[:2] for r in results if r[4]] == [], "a reader allocated what a file claimed"
    slow = [(r[0], r[1], round(r[3], 2)) for r in results if r[3] > 5]
    assert slow == []
    assert not os.path.exists(os.path.join(directory, CANARY)), "a hostile pickle ran"
    assert _fingerprint(directory) == before, "a reader modified its input"
    assert os.listdir(out_dir) == [], "a failed conversion left output behind"
    print(f"\nhostile corpus: {len(expected)} files, {len(results)} library reader calls, all refused as expected")


@pytest.mark.parametrize("command", ["info", "verify", "convert", "strip-module", "add-module", "diff"])
def test_cli_refuses_hostile_files_one_line_exit_2(corpus, tmp_path, command, monkeypatch):
    directory, expected = corpus
    monkeypatch.syspath_prepend(directory)  # the canary module is importable here too
    before = _fingerprint(directory)
    runner = CliRunner()
    out = tmp_path / ("out.safetensors" if command == "convert" else "out.pt")
    valid = os.path.join(directory, "valid.pt")
    checked = 0
    for name, kind in sorted(expected.items()):
        if kind == "valid":
            continue
        src = os.path.join(directory, name)
        extra = {"convert": [str(out)], "strip-module": ["-o", str(out)], "add-module": ["-o", str(out)],
                 "diff": [valid]}.get(command, [])  # fmt: skip
        result = runner.invoke(app, [command, src, *extra])
        # verify answers "exists but damaged" with 1; missing, unsafe, not-a-file are bad input (2).
        damaged = command == "verify" and kind == "format" and not name.startswith("a_directory")
        assert result.exit_code == (1 if damaged else 2), (name, result.output)
        # DAMAGED is verify's answer, on stdout; what cannot be judged is one line on stderr.
        lines = (result.stdout if damaged else result.stderr).strip().splitlines()
        prefix = "DAMAGED " if damaged else "ckpt: "
        assert len(lines) == 1 and lines[0].startswith(prefix), (name, result.output)
        assert not damaged or result.stderr == "", (name, result.stderr)
        assert "please report this" not in lines[0], (name, lines[0])  # only the CLI's catch-all says that
        assert ("Traceback" not in result.output and result.exception is None) or isinstance(
            result.exception, SystemExit
        )
        assert not out.exists(), (name, "partial output")
        checked += 1
    assert not os.path.exists(os.path.join(directory, CANARY)), "a hostile pickle ran"
    assert _fingerprint(directory) == before
    assert os.listdir(tmp_path) == [], "temporary files left behind"
    print(f"\nckpt {command}: {checked} bad inputs refused")
