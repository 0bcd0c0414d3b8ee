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
        assert f"## {ck.__version__} - " in f.read(), "CHANGELOG.md has no section for this version"


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


USER_SCRIPT = """
from __future__ import annotations

import torch

import ckptools as ck


def resume(path: str, model: torch.nn.Module) -> int:
    opt = torch.optim.AdamW(model.parameters())
    ckpt: dict[str, object] = ck.load(path, {"model": model, "optimizer": opt}, map_location="cpu")
    step = ckpt.get("step", 0)
    return step if isinstance(step, int) else 0


def inspect_weights(path: str) -> list[str]:
    view: ck.CheckpointView = ck.open_checkpoint(path)
    infos: list[ck.TensorInfo] = view.tensors
    weights = ck.load_state_dict(path)
    return [t.name for t in infos] + sorted(ck.strip_prefix(dict(weights)))


def finish(manager: ck.CheckpointManager, handle: ck.AsyncSave, model: torch.nn.Module) -> str:
    path: str = handle.wait()
    ck.save_weights("final.safetensors", model)
    manager.close()
    return path
"""


def test_the_package_and_code_using_it_type_check_strictly(tmp_path):
    # The package itself (py.typed ships it to users' type checkers) and a user's script against
    # the public names, which are imported lazily at run time: mypy must still see each one.
    mypy = os.path.join(os.path.dirname(sys.executable), "mypy")
    (tmp_path / "user.py").write_text(USER_SCRIPT)
    proc = subprocess.run(  # one run for both: torch's stubs are analysed once
        [mypy, "--strict", "ckptools", str(tmp_path / "user.py")], cwd=ROOT, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
