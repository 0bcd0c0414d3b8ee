"""The documentation cannot rot: every snippet runs, every example in a docstring runs, the site
builds with warnings as errors, and the references name every public name and CLI option.

The README's and the guides' Python snippets run as a user would run them: a file's blocks in
order, in one fresh process joined to a real one-rank gloo group (torchrun's environment), in an
empty folder, with the blanks a snippet leaves to the reader (``build_model()``, ``dataset``,
``epochs``, files it opens) filled in by ``PRELUDE``; ``s3://my-bucket/`` becomes ``memory://``.
The Getting started block is also run under torchrun, killed and relaunched, by
test_quickstart_e2e.py.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import free_port

import ckptools as ck

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

PRELUDE = """
import torch
from torch.utils.data import TensorDataset

def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

_g = torch.Generator().manual_seed(1)
dataset = TensorDataset(torch.randn(128, 8, generator=_g), torch.randint(0, 4, (128,), generator=_g))
epochs = 2
torch.save({"state_dict": {"module.w": torch.ones(2)}, "epoch": 1}, "lightning.ckpt")
"""


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M)


def test_pages_have_the_snippets_this_test_expects():
    # A guard against the extraction silently finding nothing (a changed fence, a moved page).
    counted = {page.relative_to(ROOT).as_posix(): len(_python_blocks(page)) for page in PAGES}
    assert counted["README.md"] >= 1 and counted["docs/getting-started.md"] >= 2, counted


# A page about an optional framework (an `interop` extra) runs where that framework is installed.
_FRAMEWORK_PAGES = {"lightning.md": "pytorch_lightning", "transformers.md": "transformers"}


@pytest.mark.versions  # the guides' snippets on each torch
@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, marks=[pytest.mark.interop] if p.name in _FRAMEWORK_PAGES else [])
        for p in PAGES
        if _python_blocks(p)
    ],
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_every_python_snippet_runs(tmp_path, page):
    framework = _FRAMEWORK_PAGES.get(page.name)
    if framework is not None and importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed (the interop extra)")
    code = "\n".join(_python_blocks(page))
    # A snippet may end the script (ck.exit_process); the file's later blocks still run, so that
    # call moves to the very end, where it leaves the one-rank group as a script would.
    code = re.sub(r"^ck\.exit_process\(0\).*$", "", code, flags=re.M)
    # Buckets become fsspec's in-memory filesystem: the same code path, no credentials or network.
    code = code.replace("s3://my-bucket/", "memory://my-bucket/")
    script = tmp_path / "snippets.py"
    ending = "print('SNIPPETS RAN', flush=True)\nimport ckptools\nckptools.exit_process(0)\n"
    script.write_text(f"{PRELUDE}\n{code}\n{ending}")
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0 and "SNIPPETS RAN" in proc.stdout, proc.stdout + proc.stderr


def _modules() -> list[str]:
    # __main__ is the CLI entry: importing it runs `ckpt`.
    # Every module, also inside the subpackages (codecs, layouts, cli).
    return ["ckptools"] + [
        m.name for m in pkgutil.walk_packages(ck.__path__, "ckptools.") if m.name != "ckptools.__main__"
    ]


# The framework each integration needs, an optional extra (`interop`): without it, its import says so.
_INTEGRATIONS = {
    "ckptools.integrations.accelerate": "torch",  # takes the Accelerator it is given: imports no accelerate
    "ckptools.integrations.accelerate_data": "accelerate",
    "ckptools.integrations.accelerate_snapshots": "torch",  # takes the Accelerator it is given
    "ckptools.integrations._memory_folders": "torch",
    "ckptools.integrations.lightning": "pytorch_lightning",
    "ckptools.integrations.lightning_resume": "pytorch_lightning",
    "ckptools.integrations.lightning_snapshots": "pytorch_lightning",
    "ckptools.integrations.transformers": "transformers",
    "ckptools.integrations.trainer_snapshots": "torch",  # needs no transformers (the keeper imports it)
}


@pytest.mark.versions  # the docstrings' examples on each torch
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(m, marks=[pytest.mark.interop] if _INTEGRATIONS.get(m, "torch") != "torch" else [])
        for m in _modules()
    ],
)
def test_every_docstring_example_runs(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    if name.startswith("ckptools.integrations."):
        framework = _INTEGRATIONS[name]
        if importlib.util.find_spec(framework) is None:
            with pytest.raises(ImportError, match="pip install"):
                importlib.import_module(name)
            pytest.skip(f"{framework} is not installed (the interop extra)")
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (printed above)"


def test_the_api_reference_reads_as_raw_markdown_too():
    """On a code host the mkdocstrings directives show nothing: each is preceded by the call and its
    docstring's first line, current with the code (`make docs` writes them)."""
    spec = importlib.util.spec_from_file_location("api_summaries", ROOT / "docs" / "tools" / "api_summaries.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = (ROOT / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
    assert module.render(text) == text, "docs/reference/api.md is stale: run make docs"
    assert text.count("**`ck.save(") == 1 and text.count("\n::: ") == text.count("**`")


def test_the_api_reference_documents_every_public_name():
    text = (ROOT / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^::: ckptools\.(?!integrations\.)(?:[a-z_]+\.)+(\w+)$", text, re.M))
    assert documented == set(ck.__all__), (set(ck.__all__) - documented, documented - set(ck.__all__))
    for name in ck.__all__:  # and under the module that really defines it
        assert f"::: {getattr(ck, name).__module__}.{name}\n" in text, name
    # The other public modules, the integrations: every name of their __all__ (read from the source,
    # so without their frameworks installed too), under the module users import it from.
    # lightning_resume's and lightning_snapshots' names are imported from lightning (which re-exports them),
    # trainer_snapshots' from transformers.
    integrations = sorted((ROOT / "ckptools" / "integrations").glob("[a-z]*.py"))
    assert [p.stem for p in integrations] == [
        "accelerate",
        "accelerate_data",
        "accelerate_snapshots",
        "lightning",
        "lightning_resume",
        "lightning_snapshots",
        "trainer_snapshots",
        "transformers",
    ]
    for source in integrations:
        tree = ast.parse(source.read_text(encoding="utf-8"))
        names = next(ast.literal_eval(node.value) for node in tree.body
                     if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__")  # fmt: skip
        assert names, source
        where = {"lightning_resume": "lightning", "lightning_snapshots": "lightning",
                 "trainer_snapshots": "transformers"}.get(source.stem, source.stem)  # fmt: skip
        for name in names:
            assert f"::: ckptools.integrations.{where}.{name}\n" in text, (source.stem, name)


def test_the_cli_reference_is_generated_from_the_current_cli(tmp_path):
    typer = shutil.which("typer") or os.path.join(os.path.dirname(sys.executable), "typer")
    out = tmp_path / "cli.md"
    subprocess.run(
        [typer, "ckptools.cli", "utils", "docs", "--name", "ckpt", "--title", "CLI reference", "--output", str(out)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    assert out.read_text() == (ROOT / "docs" / "reference" / "cli.md").read_text(), "run `make docs` and commit"


def test_the_readme_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links into the docs"
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    mkdocs = os.path.join(os.path.dirname(sys.executable), "mkdocs")
    proc = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = tmp_path / "site"
    api = (site / "reference" / "api.html").read_text(encoding="utf-8")
    assert all('id="ckptools.' in api and name in api for name in ck.__all__)
    # Browsable from disk (file://): every link and script names a file that is there (a link to a
    # folder opens a directory listing), nothing is fetched from the network, and search has its
    # index inlined as a script and the worker shim beside it.
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")  # 404: for servers only
    assert len(pages) > 15
    for page in pages:
        html = page.read_text(encoding="utf-8")
        for ref in re.findall(r'(?:href|src)="([^"#?]+)[^"]*"', html):
            if ref.startswith(("http://", "https://", "mailto:", "data:")):
                assert not re.search(rf'<(?:link|script)[^>]*"{re.escape(ref)}', html), (page.name, ref)
                continue
            target = (page.parent / ref).resolve()
            assert target.is_file(), (str(page.relative_to(site)), ref)
        assert "github.com/ckptools" not in html  # no link to a repository that does not exist
    assert (site / "search" / "search_index.js").is_file()
    assert (site / "javascripts" / "iframe-worker-shim.js").is_file()
