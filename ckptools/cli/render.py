"""How ``ckpt`` shows what the library returned: tables and lines on the terminal (rich)."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..text import human_size, plural


class _Escaping:
    """The stream ``sys.<name>`` is at each write (typer's CliRunner and notebooks swap it per call), with
    every character its encoding lacks written escaped: a tensor name may hold a lone surrogate (torch.save
    pickles any str), and one unwritable name must never fail the call, nor the calls after it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, text: str) -> int:
        stream = getattr(sys, self.name)
        encoding = getattr(stream, "encoding", None) or "utf-8"
        return int(stream.write(text.encode(encoding, "backslashreplace").decode(encoding, "replace")))

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding: the stream's own
        return getattr(getattr(sys, self.name), name)


def _stdout_console() -> Console:
    """The console for results: at a terminal, its width; in a pipe or a file, no wrapping.

    rich wraps at 80 columns when stdout is no terminal, which cuts a line a script greps
    ("25 \ntensors loaded"). There, unless ``COLUMNS`` asks for a width, lines and table rows are
    as long as their text.
    """
    console = Console(file=_Escaping("stdout"))  # type: ignore[arg-type]  # a text stream in all but name
    if console.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return console
    return Console(file=_Escaping("stdout"), width=_UNWRAPPED, soft_wrap=True)  # type: ignore[arg-type]


def _stderr_console() -> Console:
    return Console(file=_Escaping("stderr"), stderr=True)  # type: ignore[arg-type]


class _Current:
    """The console of the ``ckpt`` call in progress, made anew by `start` at each call (the executable's
    or an in-process one's), so that nothing a call left in it reaches the next."""

    def __init__(self, make: Callable[[], Console]) -> None:
        self._make = make
        self.console = make()

    def start(self) -> None:
        self.console = self._make()

    def __getattr__(self, name: str) -> Any:  # print, print_json, width, is_terminal: the console's
        return getattr(self.console, name)


_UNWRAPPED = 1 << 16  # wider than any line ckpt prints: tables are as wide as their cells, never padded to it
out = _Current(_stdout_console)
err = _Current(_stderr_console)


def start_call() -> None:
    """Fresh consoles over the streams as they are now: the first thing each ``ckpt`` call does."""
    out.start()
    err.start()


def listed(items: list[str], limit: int = 20) -> str:
    """The first ``limit`` of ``items``, and how many more there are (a cut list says so)."""
    shown = ", ".join(items[:limit])
    return shown + (f", and {len(items) - limit} more" if len(items) > limit else "")


def names_table(columns: list[str], rows: list[list[str]], *, title: str, styles: list[Any] | None = None) -> Table:
    """A table whose first column holds names. Names are what people read: that column is as wide
    as the longest name, or as the terminal leaves once the other columns have their widths, and
    then folds onto more lines; a name is never cut short with an ellipsis."""
    widths = [max([len(columns[i])] + [len(r[i]) for r in rows]) for i in range(len(columns))]
    room = max(12, out.width - sum(widths[1:]) - 3 * len(columns) - 1)
    table = Table(title=title, title_justify="left")
    table.add_column(columns[0], min_width=min(widths[0], room), max_width=room, overflow="fold")
    for column in columns[1:]:
        table.add_column(column, no_wrap=True)
    for i, row in enumerate(rows):
        table.add_row(*row, style=styles[i] if styles else None)
    return table


def render_info(report: dict[str, Any]) -> None:
    size = report["file_bytes"]
    out.print(f"[bold]{report['path']}[/]  {report['format']}" + (f", {human_size(size)}" if size is not None else ""))
    if len(report.get("files", [])) > 1:
        out.print(f"{plural(len(report['files']), 'file')}: " + listed([os.path.basename(f) for f in report["files"]]))
    if report["entries"]:
        rows = [[key, text] for key, text in report["entries"].items()]
        out.print(names_table(["entry", "content"], rows, title="entries"))
    sharded = any("file" in t for t in report["tensors"])
    devices = {t["device"] + (" (shared)" if t.get("shared") else "") for t in report["tensors"]}
    one_device = len(devices) == 1  # then said once, under the table: room for the names
    columns = (
        ["tensor", "shape", "dtype", "bytes"] + ([] if one_device else ["saved on"]) + (["file"] if sharded else [])
    )
    rows = [[t["name"], str(t["shape"]), t["dtype"], human_size(t["bytes"])]
            + ([] if one_device else [t["device"] + (" (shared)" if t.get("shared") else "")])
            for t in report["tensors"]]  # fmt: skip
    if sharded:
        files = [t.get("file") or "" for t in report["tensors"]]
        widest = max(len(r[0]) + sum(map(len, r[1:])) for r in rows) + max(map(len, files)) + 3 * len(columns) + 1
        if widest > out.width:  # no room for whole shard names beside whole tensor names: "2/5"
            files = [re.sub(r"^.*?0*(\d+)-of-0*(\d+)\..*$", r"\1/\2", f) for f in files]
        rows = [[*r, f] for r, f in zip(rows, files)]
    out.print(names_table(columns, rows, title="tensors"))
    totals = report["totals"]
    saved_on = f", all saved on {devices.pop()}" if one_device else ""
    out.print(f"{plural(totals['tensors'], 'tensor')}, {human_size(totals['bytes'])}{saved_on}")
    if report["metadata"]:
        out.print("metadata: " + json.dumps(report["metadata"], default=str))
    for name, what in report.get("extras", {}).items():
        out.print(f"also in the folder: {name} ({what})")
    if report.get("skipped_globals"):
        out.print(
            "[yellow]not loaded[/] (they need classes torch's safe loader refuses; nothing was run): "
            + ", ".join(report["skipped_globals"])
        )
    if totals["module_prefixed"]:
        out.print(
            f"[yellow]{totals['module_prefixed']} tensor names carry a wrapper's prefix (DDP's 'module.', "
            f"torch.compile's '_orig_mod.')[/]; remove it with: ckpt strip-module {report['path']} -o OUT"
        )


def render_diff(result: dict[str, Any], *, verbose: bool = False) -> None:
    for label, key in (("only in A", "missing_in_b"), ("only in B", "only_in_b")):
        if result[key]:
            out.print(f"[red]{label}[/] ({len(result[key])}): " + listed(result[key]))
    tied = list(result["tied"].items())
    for name, partner in tied[:20]:
        out.print(f"{name}: tied to {partner} (stored once on the other side; compared there)")
    if len(tied) > 20:
        out.print(f"and {len(tied) - 20} more tied names")
    for m in result["shape_or_dtype_mismatch"]:
        out.print(f"[red]mismatch[/] {m['name']}: {m['a']} vs {m['b']}", highlight=False)
    values = result.get("values", {})
    differing = [name for name in values if name in result["changed"]]
    for name in differing[:50]:
        a, b = values[name]
        out.print(f"[red]changed[/] {escape(name)}: {escape(a)} vs {escape(b)}", highlight=False)
    if len(differing) > 50:
        out.print(f"and {len(differing) - 50} more changed values")
    if values and (verbose or not differing):
        same = len(values) - len(differing)
        out.print(f"{plural(same, 'common value')} equal" + ("" if verbose else " (--json shows them)"))
    deltas = result["max_abs_diff"]
    if deltas and (verbose or result["differ"]):
        rows = [[name, f"{delta:.3g}"] for name, delta in deltas.items()]
        styles = ["red" if name in result["changed"] else None for name in deltas]
        out.print(names_table(["tensor", "max |a-b|"], rows, title="common tensors", styles=styles))
    elif deltas:  # all match: one line; --verbose shows the table
        largest = max(deltas.values())
        said = "equal bit for bit" if largest == 0 else f"within atol={result['atol']:g} (largest |a-b| {largest:.3g})"
        out.print(f"{plural(len(deltas), 'common tensor')} {said} (--verbose lists them)")
    not_compared = result.get("not_compared", {})
    for what, why in not_compared.items():
        out.print(f"[yellow]not compared[/]: {escape(what)} ({escape(why)})", highlight=False, soft_wrap=True)
    if result["differ"]:
        out.print("[red]checkpoints differ[/]")
    elif result.get("all_compared", True):  # every entry: only when and with what each was saved was not
        out.print("[green]checkpoints match[/]")
    else:  # never "match" about what was not compared
        compared = escape(" and ".join(result.get("compared", ["weights"])))
        out.print(f"[green]{compared} match[/]; the rest not compared", highlight=False, soft_wrap=True)


def run_kind(run: dict[str, Any]) -> str:
    """What a `ckptools.cli.runs.run_report` folder is, in words: a CheckpointManager's, or a framework's run."""
    frameworks = sorted({entry["of"] for entry in run["runs"] if entry.get("of")})
    return "a CheckpointManager's folder" if not frameworks else f"the folder of a run of {' and '.join(frameworks)}"


def render_run(run: dict[str, Any]) -> None:
    """A CheckpointManager's folder (or a framework's run folder): each prefix's checkpoints, and this
    node's snapshots."""
    from ..layouts import (
        MANAGER_RESUMES,
        framework_of,
    )  # here: `ckpt --help` imports nothing of the storage door

    out.print(f"[bold]{escape(run['path'])}[/]  {escape(run_kind(run))}")
    for entry in run["runs"]:
        steps = entry["checkpoints"]
        of = f" of {entry['of']}" if entry.get("of") else ""
        rows = [[os.path.basename(c["path"]), str(c["step"]), human_size(c["bytes"])] for c in steps]
        if steps or not of:  # Lightning's own files are not listed: only what NodeSnapshots persisted
            title = f"{plural(len(steps), 'checkpoint')}{of}"
            out.print(names_table(["checkpoint", "step", "size"], rows, title=title))
        snaps = entry["snapshots"]
        where = escape(entry["snapshot_dir"])
        if not snaps:
            out.print(f"no snapshot in this node's memory ({where})")
            continue
        rows = [[os.path.basename(s["path"]), str(s["step"]), human_size(s["bytes"])] for s in snaps]
        title = f"snapshots{of} in this node's memory ({where})" if of else f"in this node's memory ({where})"
        out.print(names_table(["snapshot", "step", "size"], rows, title=title))
        newest = max(s["step"] for s in snaps)
        if not steps or newest > max(c["step"] for c in steps):
            framework = framework_of(entry["prefix"])
            resumes = framework.resumes if framework is not None else MANAGER_RESUMES
            out.print(f"the snapshot of step {newest} {escape(resumes)}")
