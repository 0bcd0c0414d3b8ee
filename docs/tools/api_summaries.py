"""Write, before each mkdocstrings directive of docs/reference/api.md, the line a reader of the raw
Markdown needs (on a code host the directives render as nothing): the call and its docstring's first
line, read from the source (no import: the integrations need frameworks `make test` does not have).
`make docs` runs it; tests/test_docs.py checks that the page is current.

    python docs/tools/api_summaries.py [--check]
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "api.md"
DIRECTIVE = re.compile(r"^::: (ckptools(?:\.\w+)+)$", re.M)
SUMMARY = re.compile(r"^\*\*`[^\n]*\n\n(?=::: )", re.M)  # a line this script wrote, before a directive


def _find(module: str, name: str) -> tuple[ast.AST, str]:
    """The definition of ``name`` in ``module``'s source (following a relative ``from . import``)."""
    parts = module.split(".")
    path = ROOT.joinpath(*parts).with_suffix(".py")
    if not path.exists():
        path = ROOT.joinpath(*parts, "__init__.py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node, module
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node, module
        if isinstance(node, ast.ImportFrom) and node.level and any(a.name == name for a in node.names):
            base = parts if path.name == "__init__.py" else parts[:-1]
            source = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            return _find(source, name)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            lazy = ast.literal_eval(node.value)  # a package whose names are imported on first use (PEP 562)
            if name in lazy:
                return _find(module + lazy[name], name)
    raise LookupError(f"{name} is not defined in {module}")


def summary(target: str) -> str:
    """``**`ck.name(signature)`**: first docstring line`` for ``ckptools.module.name``."""
    module, _, name = target.rpartition(".")
    node, _ = _find(module, name)
    public = target if target.startswith("ckptools.integrations.") else f"ck.{name}"
    call, doc = public, ""
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        doc = ast.get_docstring(node) or ""
        init = node
        if isinstance(node, ast.ClassDef):
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is not None:
            args = init.args
            if isinstance(node, ast.ClassDef) and args.args:
                args.args = args.args[1:]  # self
            call = f"{public}({ast.unparse(args)})"
    else:
        value = getattr(node, "value", None)
        call = f"{public} = {ast.unparse(value)}" if value is not None else public
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    return f"**`{call}`**" + (f": {first}" if first else "")


def render(text: str) -> str:
    text = SUMMARY.sub("", text)
    return DIRECTIVE.sub(lambda m: f"{summary(m.group(1))}\n\n{m.group(0)}", text)


def main() -> int:
    current = PAGE.read_text(encoding="utf-8")
    wanted = render(current)
    if "--check" in sys.argv:
        return 0 if wanted == current else 1
    PAGE.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
