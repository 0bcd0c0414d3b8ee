"""The package as users install it: one version, the development install, the typed public API."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

from typer.testing import CliRunner

import ckptools as ck
from ckptools.cli import app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_version_has_one_source():
    assert importlib.metadata.version("ckptools") == ck.__version__  # pyproject reads it from the package
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"ckpt (ckptools) {ck.__version__}"
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        assert f"## [{ck.__version__}]" in f.read(), "CHANGELOG.md has no section for this version"


def test_a_script_beside_the_clone_folder_imports_the_package(tmp_path):
    # `git clone` names the checkout ckptools/; a script next to it has that folder on sys.path
    # first. With setuptools' import-hook editable install the empty folder won as a namespace
    # package ("module 'ckptools' has no attribute 'init_distributed'"); the development install
    # (`make` runs `pip install -e .`) must be a plain path entry, which a namespace cannot shadow.
    (tmp_path / "ckptools").mkdir()
    (tmp_path / "ckptools" / "README.md").write_text("a clone's root, as git names it\n")
    (tmp_path / "train.py").write_text("import ckptools as ck\nprint(ck.init_distributed.__module__, ck.__file__)\n")
    proc = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    module, path = proc.stdout.split()
    assert module == "ckptools.dist" and os.path.samefile(path, os.path.join(ROOT, "ckptools", "__init__.py"))
