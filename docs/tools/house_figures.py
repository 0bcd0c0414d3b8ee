"""The house's figures (issue 45): the largest modules, lines of prose per line of code, and how
often a load and a verify open the checkpoint file.

    python docs/tools/house_figures.py            # the package beside this folder
    python docs/tools/house_figures.py --opens    # and the opens (imports torch, writes a small file)

Prose: docstring lines and lines that are only a comment; code: every other non-blank line.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import pathlib
import tempfile
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[2]


def lines(package: pathlib.Path) -> tuple[list[tuple[int, str]], int, int]:
    sizes, prose, code = [], 0, 0
    for path in sorted(package.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        rows = source.splitlines()
        sizes.append((len(rows), str(path.relative_to(package.parent))))
        docstring = set()
        for node in ast.walk(ast.parse(source)):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
                first = body[0]
                value = getattr(first, "value", None)
                if isinstance(first, ast.Expr) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    docstring.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
        comment = {
            t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT
        }
        for number, row in enumerate(rows, 1):
            if not row.strip():
                continue
            if number in docstring or (number in comment and row.strip().startswith("#")):
                prose += 1
            else:
                code += 1
    return sorted(sizes, reverse=True), prose, code


def opens() -> dict[str, int]:
    """How often each call opens the file (builtins.open by ckptools, and torch.load's own)."""
    import builtins

    import torch

    import ckptools as ck

    path = os.path.join(tempfile.mkdtemp(), "c.pt")
    ck.save(path, {"model": torch.nn.Linear(4, 4), "step": 3})
    counted: dict[str, int] = {}
    real_open, real_load = builtins.open, torch.load
    current = [""]  # the call being counted

    def counting_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) == path:
            counted[current[0]] = counted.get(current[0], 0) + 1
        return real_open(file, *args, **kwargs)

    def counting_load(f, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(f, (str, os.PathLike)) and os.fspath(f) == path:
            counted[current[0]] = counted.get(current[0], 0) + 1
            builtins.open = real_open  # torch's own open is torch.load's, counted once
            try:
                return real_load(f, *args, **kwargs)
            finally:
                builtins.open = counting_open
        return real_load(f, *args, **kwargs)

    builtins.open, torch.load = counting_open, counting_load
    try:
        for what, call in [
            ("ck.load", lambda: ck.load(path, {"model": torch.nn.Linear(4, 4)})),
            ("ck.load(verify=True)", lambda: ck.load(path, {"model": torch.nn.Linear(4, 4)}, verify=True)),
            ("ck.verify", lambda: ck.verify(path)),
        ]:
            current[0] = what
            call()
    finally:
        builtins.open, torch.load = real_open, real_load
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default=str(ROOT / "ckptools"))
    parser.add_argument("--opens", action="store_true", help="also count the opens of a load and a verify")
    args = parser.parse_args()
    sizes, prose, code = lines(pathlib.Path(args.package))
    print("largest modules:", ", ".join(f"{name} {n}" for n, name in sizes[:5]))
    print(f"prose {prose} lines, code {code} lines: {prose / code:.2f} lines of prose per line of code")
    if args.opens:
        for call, n in opens().items():
            print(f"{call}: opens the file {n} times")


if __name__ == "__main__":
    main()
