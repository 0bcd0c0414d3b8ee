"""The commands that read: ``ckpt info``, ``ckpt diff``, ``ckpt verify`` (registered in order by
`ckptools.cli`)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from ..text import plural
from .app import KEY_HELP, TRUST, about, one_line, progress, run
from .render import err, out, render_diff, render_info, render_run, run_kind

__all__ = ["diff", "info", "verify"]


# --- info ----------------------------------------------------------------------------------------


def info(
    path: Annotated[str, typer.Argument(help="checkpoint file, folder (Hugging Face, Accelerate, DCP) or URL")],
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    trust: Annotated[bool, TRUST] = False,
) -> None:
    """Show format, entries, tensors (name, shape, dtype, bytes, saved device), totals and metadata.

    A CheckpointManager's folder: its checkpoints and this node's snapshots in memory; an HF Trainer's
    output_dir or a Lightning dirpath: the snapshots ckptools keeps of that run in this node's memory."""

    def body() -> None:
        from .runs import run_folder

        run = run_folder(path)  # a folder of numbered checkpoints: the run, not one file (no torch needed)
        if run is not None:
            if as_json:
                out.print_json(json.dumps(run))
            else:
                render_run(run)
            return
        from ..inspection import inspect

        report = inspect(path, weights_only=not trust)
        if as_json:
            out.print_json(json.dumps(report, default=repr))
            return
        render_info(report)

    run(body)


# --- diff ----------------------------------------------------------------------------------------


def diff(
    a: Annotated[str, typer.Argument(help="first checkpoint (file or folder)")],
    b: Annotated[str, typer.Argument(help="second checkpoint (file or folder)")],
    atol: Annotated[float, typer.Option(help="largest absolute difference still counted as equal")] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="the table of every common tensor, also when all match")
    ] = False,
    trust: Annotated[bool, TRUST] = False,
    key: Annotated[Optional[str], typer.Option(help=KEY_HELP + "; a file without it is read as without --key")] = None,
    weights: Annotated[bool, typer.Option("--weights", help="compare the weights alone (the rest named)")] = False,
) -> None:
    """Compare two checkpoints, weights and every other entry; exit 1 if they differ.

    Weights are compared tensor by tensor ('module.' and '_orig_mod.' ignored), every other entry
    (optimizer, scheduler, step, the ranks' random streams) tensor by tensor and value by value. What
    was not compared is named (--weights, --key, a file of bare weights, the save times and versions),
    and "checkpoints match" is said only when every entry was compared. A tensor one side stores
    once under a name it is tied to (transformers' lm_head.weight and transformer.wte.weight) is
    reported as tied, not as a difference."""

    def body() -> int:
        from ..inspection import diff as compare

        with about(a, b):
            result = compare(a, b, atol=atol, trust_code=trust, key=key, weights=weights)
        if as_json:
            out.print_json(json.dumps(result))
        else:
            render_diff(result, verbose=verbose)
        return 1 if result["differ"] else 0

    run(body)


# --- verify --------------------------------------------------------------------------------------


def verify(
    paths: Annotated[list[str], typer.Argument(help="checkpoint files, folders or URLs; a CheckpointManager's folder")],
    strict: Annotated[
        bool, typer.Option("--strict", help="exit 1 also when some bytes carry no checksum (only structure checked)")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output (damage included)")] = False,
    trust: Annotated[bool, TRUST] = False,
) -> None:
    """Read everything and check integrity: exit 0 good, 1 damaged, 2 missing/unsafe/bad arguments.

    OK: every byte matched a stored checksum. STRUCTURE OK: nothing damaged was found, but the
    files named after 'data not checksummed' carry no checksum (safetensors from other tools,
    DCP, tokenizer files): only their structure was checked; --strict exits 1 for that. A folder
    is checked whole: every file in it, a ckptools manifest, the HF Trainer's expected files. A
    CheckpointManager's folder: each of its checkpoints and each snapshot in this node's memory (an HF
    Trainer's output_dir with snapshots: each checkpoint-N folder and each snapshot).
    Several paths: a line each, on stdout (DAMAGED too); the exit status is the worst of them
    (a path that cannot be judged: its line on stderr, exit 2)."""

    def body() -> int:
        from ..errors import CheckpointError, CheckpointLayoutError
        from ..inspection import judge as verdict
        from .runs import run_folder

        reports: list[dict[str, Any]] = []
        failures: list[str] = []
        shown: list[str | dict[str, Any]] = []  # what to print, in the order of the paths: headers and reports

        def judge(path: str, where: str = "") -> None:
            report = verdict(path, weights_only=not trust, strict=strict)[0]
            report = {**report, "line": report["line"] + where}
            reports.append(report)
            shown.append(report)

        for path in paths:
            run = run_folder(path)  # asked first: a run folder's checkpoints and snapshots, each judged
            if run is None:
                try:
                    with progress("verifying", path):
                        judge(path)
                except CheckpointLayoutError as refusal:
                    if len(paths) == 1:
                        raise
                    failures.append(f"{path}: {refusal}")
                except CheckpointError as error:
                    if len(paths) == 1:
                        raise
                    failures.append(str(error))
                continue
            files = [(c["path"], "") for r in run["runs"] for c in r["checkpoints"]]
            memory_note = " (a snapshot in this node's memory)"
            snapshots = [(c["path"], memory_note) for r in run["runs"] for c in r["snapshots"]]
            memory = ", ".join(r["snapshot_dir"] for r in run["runs"])
            shown.append(f"{path}: {run_kind(run)}, {plural(len(files), 'checkpoint')}; "
                         f"{plural(len(snapshots), 'snapshot')} in this node's memory ({memory})")  # fmt: skip
            for found, where in files + snapshots:
                try:
                    judge(found, where)
                except CheckpointError as error:  # gone meanwhile (pruned by a running job), or refused
                    failures.append(str(error))
        code = max([0 if r["passed"] else 1 for r in reports] + [2] * len(failures), default=2)
        if as_json:
            if len(paths) == 1 and len(reports) == 1 and not failures and reports[0]["path"] == paths[0]:
                out.print_json(json.dumps({**reports[0], "strict": strict, "exit_code": code}))
            else:
                result = {"reports": reports, "errors": failures, "strict": strict, "exit_code": code}
                out.print_json(json.dumps(result))
            return code
        for item in shown:
            out.print(item if isinstance(item, str) else _verdict(item), markup=False, highlight=False, soft_wrap=True)
        for failure in failures:
            err.print(one_line(f"ckpt: {failure}"), markup=False, highlight=False, soft_wrap=True)
        return code

    run(body)


def _verdict(report: dict[str, Any]) -> str:
    """One checkpoint's line: `verify_report`'s label, the path, what was found."""
    path, line = str(report["path"]), str(report["line"])
    return one_line(f"{report['label']} {path}: {line.removeprefix(path + ': ')}")
