"""The package as users install it: one version, the development install, the typed public API."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
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
    assert module == "ckptools.collective.launch"
    assert os.path.samefile(path, os.path.join(ROOT, "ckptools", "__init__.py"))


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


def _dev_torch() -> str:
    """The torch the dev set-up pins (the Makefile's TORCH_PIN): the one mypy's --strict run is held to."""
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        return re.search(r"^TORCH_PIN := torch==(\S+)$", f.read(), re.M).group(1)


@pytest.mark.skipif(
    torch.__version__.split("+")[0] != _dev_torch(), reason="mypy checks against the dev pin's torch stubs"
)
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


def _imports() -> dict[str, set[tuple[str, str]]]:
    """Every module of the package -> the (module, name) pairs it imports from the package, at any depth."""
    import ast
    import pathlib

    package = pathlib.Path(ROOT) / "ckptools"
    graph: dict[str, set[tuple[str, str]]] = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_init else parts)
        found: set[tuple[str, str]] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {(a.name, "") for a in node.names if a.name.split(".")[0] == "ckptools"}
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "ckptools"):
                base = module.split(".") if is_init else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if (package.parent / (sub.replace(".", "/") + ".py")).exists() or (
                        package.parent / sub.replace(".", "/") / "__init__.py"
                    ).exists():
                        found.add((sub, ""))  # `from . import log`: the module itself
                    else:
                        found.add((target, alias.name))
        graph[module] = found
    return graph


def test_the_package_imports_point_one_way():
    """No import cycle (imports inside functions count), no private name taken from another module,
    codecs/ never imports a layout or torch-side module, and nothing but __main__ imports the CLI:
    the shape docs/development.md draws."""
    graph = _imports()
    edges = {m: {t for t, _ in found if t in graph and t != m} for m, found in graph.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*trail[trail.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    private = sorted(f"{m} takes {t}.{n}" for m, found in graph.items() for t, n in found
                     if n.startswith("_") and n != "__version__" and t != m)  # fmt: skip
    assert private == [], private
    allowed = ("ckptools.codecs", "ckptools.errors", "ckptools.storage")
    codecs_out = sorted(f"{m} -> {t}" for m in graph if m.startswith("ckptools.codecs") for t in edges[m]
                        if not t.startswith(allowed))  # fmt: skip
    assert codecs_out == [], codecs_out
    cli_users = sorted(
        m for m in graph for t in edges[m] if t.startswith("ckptools.cli") and not m.startswith("ckptools.cli")
    )
    assert cli_users == ["ckptools.__main__"], cli_users


# The wings of docs/development.md's package map, and who may import what across them.
OPERATIONS = ("ckptools.saving", "ckptools.read.loading", "ckptools.manager", "ckptools.converting",
              "ckptools.inspection", "ckptools.read.restoring", "ckptools.cli",
              "ckptools.training", "ckptools.integrations", "ckptools.__init__")  # fmt: skip
TORCH_ADAPTER = "ckptools.layouts.torch_io"


def _crossings(graph: dict, sources: tuple[str, ...], targets: tuple[str, ...]) -> list[str]:
    def within(module: str, prefixes: tuple[str, ...]) -> bool:
        return any(module == p or module.startswith(p + ".") for p in prefixes)

    return sorted(f"{m} -> {t}" for m, found in graph.items() if within(m, sources) or (m == "ckptools" and
                  "ckptools.__init__" in sources) for t, _ in found if within(t, targets))  # fmt: skip


def test_the_wings_keep_their_import_rules():
    """The rules docs/development.md states: the operations reach bytes only through a layout or
    the write wing (never a codec or the torch adapter); the integrations use the write wing's
    public face, never its modules; layouts import no collective code and nothing of the write
    wing; the collective wing imports no layout, operation or writer; node/ uses write/'s face and
    is used through its own."""
    graph = _imports()
    assert _crossings(graph, OPERATIONS, ("ckptools.codecs", TORCH_ADAPTER)) == []
    integration_imports = _crossings(graph, ("ckptools.integrations",), ("ckptools.write",))
    assert [c for c in integration_imports if not c.endswith(" -> ckptools.write")] == [], integration_imports
    assert _crossings(graph, ("ckptools.layouts",), ("ckptools.collective", "ckptools.write")) == []
    assert _crossings(graph, ("ckptools.codecs",), ("ckptools.layouts", "ckptools.collective", "ckptools.write")) == []
    below = ("ckptools.layouts", "ckptools.write", "ckptools.node", "ckptools.training", "ckptools.saving",
             "ckptools.read")  # fmt: skip
    assert _crossings(graph, ("ckptools.collective",), below) == []
    assert _crossings(graph, ("ckptools.write",), (*OPERATIONS, "ckptools.node")) == []
    # node/ writes through write/'s face; everyone else uses node/'s face.
    node_writes = _crossings(graph, ("ckptools.node",), ("ckptools.write",))
    assert [c for c in node_writes if not c.endswith(" -> ckptools.write")] == [], node_writes
    assert _crossings(graph, ("ckptools.node",), OPERATIONS) == []
    # Outside the write wing, only its face: no read-side module reaches into a writer.
    into_write = [
        c for c in _crossings(graph, ("ckptools",), ("ckptools.write",)) if not c.startswith("ckptools.write")
    ]
    assert [c for c in into_write if not c.endswith(" -> ckptools.write")] == [], into_write
    # ZeroRedundancyOptimizer is known (by its class name, or imported) to ckptools/owned/zero.py alone.
    knows = ('"ZeroRedundancyOptimizer"', "import ZeroRedundancyOptimizer")
    named = [str(p) for p in pathlib.Path(ROOT, "ckptools").rglob("*.py")
             if p.name != "zero.py" and any(k in p.read_text() for k in knows)]  # fmt: skip
    assert named == [], named
    into_node = [c for c in _crossings(graph, ("ckptools",), ("ckptools.node",)) if not c.startswith("ckptools.node")]
    assert [c for c in into_node if not c.endswith(" -> ckptools.node")] == [], into_node
    # layouts/ too is used through its face; the write wing alone also takes the torch adapter (torch.save's bytes).
    into_layouts = [c for c in _crossings(graph, ("ckptools",), ("ckptools.layouts",))
                    if not c.startswith("ckptools.layouts") and not c.endswith(" -> ckptools.layouts")]  # fmt: skip
    assert [c for c in into_layouts if not (c.startswith("ckptools.write") and c.endswith(TORCH_ADAPTER))] == []
    into_storage = [c for c in _crossings(graph, ("ckptools",), ("ckptools.storage",))
                    if not c.startswith("ckptools.storage") and not c.endswith(" -> ckptools.storage")]  # fmt: skip
    assert into_storage == [], into_storage
    # Restoring works on a loaded tree (ckptools.read.loaded), never on a file; the training loop's side
    # imports neither writing wing; the save in flight and the node memory end in ckptools.lifecycle alone.
    assert _crossings(graph, ("ckptools.read.restoring",), ("ckptools.layouts",)) == []
    assert _crossings(graph, ("ckptools.training",), ("ckptools.write", "ckptools.node")) == []
    ends = sorted(f"{m} takes {n}" for m, found in graph.items() for t, n in found
                  if (t, n) in {("ckptools.write", "finish_pending"), ("ckptools.node", "release")}
                  and m != "ckptools.lifecycle")  # fmt: skip
    assert ends == [], ends


def test_reading_a_file_and_every_codec_need_no_torch(tmp_path):
    """The byte formats, the layouts and the commands that only read a file import no torch (over a
    second); a file refused as damaged is refused without it too."""
    (tmp_path / "garbage.pt").write_bytes(os.urandom(64))
    code = (
        "import sys, pkgutil, importlib, ckptools.codecs as c, ckptools.layouts, ckptools.inspection\n"
        "for m in pkgutil.iter_modules(c.__path__): importlib.import_module(f'ckptools.codecs.{m.name}')\n"
        "try:\n"
        f"    ckptools.inspection.verify({str(tmp_path / 'garbage.pt')!r})\n"
        "except ckptools.errors.CheckpointFormatError:\n"
        "    pass\n"
        "print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stdout + proc.stderr


def test_the_wheel_lists_every_subpackage():
    # setuptools puts into the wheel only the packages pyproject names: a subpackage missing from
    # the list is missing from every install but an editable one (`ckpt` then fails at start with
    # "No module named 'ckptools.cli'"; `make dist` caught it, the editable test venv could not).
    from pathlib import Path

    import pytest

    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml itself")
    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(init.parent.relative_to(root).parts) for init in (root / "ckptools").rglob("__init__.py")}
    assert listed == on_disk, (sorted(on_disk - listed), sorted(listed - on_disk))


def test_the_package_map_names_every_module():
    """docs/development.md's package map stays true: every module and subpackage is named in it,
    and every name in it is one."""
    import pathlib
    import re

    root = pathlib.Path(ROOT)
    text = (root / "docs" / "development.md").read_text(encoding="utf-8")
    block = text.split("## The package map", 1)[1].split("```", 2)[1]
    named = set(re.findall(r"\b([a-z_]+\.py)\b", block)) | set(re.findall(r"\b([a-z_]+)/", block))
    modules = {p.name for p in (root / "ckptools").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    packages = {p.name for p in (root / "ckptools").iterdir() if (p / "__init__.py").exists()}
    assert modules | packages <= named | {"py.typed"}, sorted((modules | packages) - named)
    assert named - {"__init__.py"} <= modules | packages, sorted(named - modules - packages - {"__init__.py"})


def test_nothing_imports_upward():
    """docs/development.md's package map is the order of the floors: a module imports only what is on its
    own line or below it (the command line's entry point, __main__, aside)."""
    text = pathlib.Path(ROOT, "docs", "development.md").read_text(encoding="utf-8")
    block = text.split("## The package map", 1)[1].split("```", 2)[1]
    floor: dict[str, int] = {}
    for number, line in enumerate(block.splitlines()):  # a line's leading names (several on the ground floor)
        lead = re.match(r"(?:[a-z_]+(?:\.py|/)\s+)+", line + " ")
        if lead and not line.startswith(("tests/", "examples/", "benchmarks/", "docs/", "third_party/")):
            floor.update(dict.fromkeys(re.findall(r"([a-z_]+)(?:\.py|/)", lead.group(0)), number))
    graph = _imports()

    def unit(module: str) -> str:
        return module.split(".")[1] if "." in module else "__init__"

    upward = sorted(f"{m} -> {t}" for m, found in graph.items() for t, _ in found
                    if m != "ckptools.__main__" and (t in graph or t.rsplit(".", 1)[0] in graph)
                    and unit(m) != unit(t) and floor[unit(t)] < floor[unit(m)])  # fmt: skip
    assert upward == [], upward
    modules = {unit(m) for m in graph} - {"__main__"}
    assert modules <= set(floor), sorted(modules - set(floor))


def test_no_module_is_over_450_lines():
    """Issue 45's bound: a module over 450 lines holds more than one job (`python docs/tools/house_figures.py`)."""
    import pathlib

    long = {str(p.relative_to(ROOT)): n for p in pathlib.Path(ROOT, "ckptools").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 450}  # fmt: skip
    assert long == {}, long


def test_no_function_is_over_80_lines_and_the_top_level_holds_at_most_14_modules():
    """Issue 66's bounds: a function's code (its docstring aside: prose, not steps) over 80 lines does more
    than one step; more than 14 modules beside the packages at the top level (the entry points and the
    version aside) is a wing not yet drawn."""
    import ast

    long = []
    for p in pathlib.Path(ROOT, "ckptools").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = node.body[0]
                doc = (
                    isinstance(first, ast.Expr)
                    and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)
                )
                code = node.end_lineno - node.lineno + 1 - ((first.end_lineno - first.lineno + 1) if doc else 0)
                if code > 80:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({code} lines)")
    assert long == [], long
    top = sorted(p.name for p in pathlib.Path(ROOT, "ckptools").glob("*.py")
                 if p.name not in ("__init__.py", "__main__.py", "_version.py"))  # fmt: skip
    assert len(top) <= 14, top


def test_ci_gives_each_target_the_share_docs_development_states_and_the_shares_fit_its_budget():
    """.ci/run times each target against its share and warns past it; docs/development.md ("CI's budget") states the
    same shares, and they add up to no more than the budget."""
    run = pathlib.Path(ROOT, ".ci", "run").read_text(encoding="utf-8")
    budget = int(re.search(r"^BUDGET=(\d+)$", run, re.M).group(1))
    shares = {t: int(s) for t, s in re.findall(r"(\w+):(\d+)", re.search(r"^TARGETS=\((.*)\)$", run, re.M).group(1))}
    text = pathlib.Path(ROOT, "docs", "development.md").read_text(encoding="utf-8")
    table = text.split("## CI's budget", 1)[1].split("\n## ", 1)[0]
    stated = {t: int(s.replace(",", "")) for t, s in re.findall(r"^\| `make (\w[\w-]*)` \| ([\d,]+) s \|", table, re.M)}
    assert stated == shares, (stated, shares)
    assert f"{budget:,} s" in table and sum(shares.values()) <= budget, (budget, shares)
    assert list(shares) == ["test", "gpu", "dist", "interop", "compat"]  # what the README says CI runs, in order


@pytest.mark.slow
def test_the_three_walks_stay_within_issue_66s_bounds():
    """`python docs/tools/house_figures.py --walks`: on the calling thread (how issue 66 took its bounds) a save
    (writers="all", a group of one) enters at most 22 of the package's modules, a snapshot then a kill then the
    relaunch's restore 46 together, `ckpt verify RUN_DIR` 23; with the threads a call starts, 23 / 47 / 23 (a
    sync save's watched write thread reports its progress to storage/processes.py; the snapshot's commit
    thread publishes through storage/writes.py; 9efd968 measured 22 / 47 / 23 that way). Over them, a call
    crosses a room it need not."""
    sys.path.insert(0, os.path.join(ROOT, "docs", "tools"))
    try:
        import house_figures
    finally:
        sys.path.pop(0)
    for threads, bounds in ((False, (22, 46, 23)), (True, (23, 47, 23))):
        found = house_figures.walks(pathlib.Path(ROOT, "ckptools"), threads=threads)
        modules = {name: walk["modules"] for name, walk in found.items()}
        entered = (len(modules["save"]), len(set(modules["snapshot"]) | set(modules["restore"])),
                   len(modules["verify"]))  # fmt: skip
        assert all(n <= bound for n, bound in zip(entered, bounds)), (threads, entered, bounds, modules)
