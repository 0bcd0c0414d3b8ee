"""``ckpt``: inspect, rename, convert, compare and verify checkpoint files.

The CLI is thin: it parses arguments, calls the library, and renders with rich. A
`CheckpointError` is turned into one line on stderr and exit code 2 (1 for a negative
answer: ``diff`` found differences, ``verify`` found damage). Heavy modules (torch) are imported
inside the commands, so ``ckpt --help`` stays fast.
"""

from __future__ import annotations

import json
import os
import sys
import unicodedata
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperGroup

from ..text import plural
from .render import err, out, render_diff, render_info, render_run

# click's exception classes: from click itself, or from the copy newer typer versions carry.
_click_errors = sys.modules[typer.BadParameter.__module__]


class _Group(TyperGroup):
    """Usage errors (unknown option, missing argument) as one ``ckpt: ...`` line and exit 2.

    click would draw a box of several lines; every other ckpt error is one line on stderr, and
    scripts that read stderr should not have to tell the two apart. click's own hints ("Possible
    options: --json", "Try 'ckpt info --help'") are kept in the line.
    """

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)  # type: ignore[misc]  # ours decides
        except _click_errors.UsageError as usage:
            if type(usage).__name__ == "NoArgsIsHelpError" and usage.ctx is not None:
                out.print(usage.ctx.get_help(), markup=False, highlight=False)  # bare `ckpt`: the help
            else:
                hint = f" Try '{usage.ctx.command_path} --help' for help." if usage.ctx else ""
                message = " ".join(usage.format_message().split()).rstrip(".")
                err.print(f"ckpt: {message}.{hint}", markup=False, highlight=False, soft_wrap=True)
            code = usage.exit_code
        except typer.Abort:
            err.print("ckpt: aborted", markup=False, highlight=False)
            code = 1
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    name="ckpt",
    cls=_Group,
    help="Inspect, rename, convert, compare and verify PyTorch checkpoints (.pt/.pth/.bin/.ckpt/.safetensors).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _show_version(value: bool) -> None:
    if value:
        from .._version import __version__

        out.print(f"ckpt (ckptools) {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", help="show the version and exit", is_eager=True, callback=_show_version)
    ] = False,
) -> None:
    """Inspect, rename, convert, compare and verify PyTorch checkpoints (.pt/.pth/.bin/.ckpt/.safetensors)."""


class _Fail(Exception):
    """A clean failure: message for stderr and the exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@contextmanager
def _about(*paths: str) -> Iterator[None]:
    """Name the input(s) in a plain ValueError from a key transform (two keys renamed to one)."""
    try:
        yield
    except ValueError as error:
        if type(error) is not ValueError:
            raise
        raise _Fail(f"{' / '.join(paths)}: {error}") from None


def _one_line(message: str) -> str:
    """``message`` as one printable line: line breaks become spaces, other control characters (a name read
    from a damaged file may hold any byte; str.splitlines breaks at \\x1c..\\x1e and \\x85 too) escapes."""
    out = []
    for char in message.strip():
        if char in "\r\n":
            out.append(" ")
        elif unicodedata.category(char) in ("Cc", "Zl", "Zp") and char != "\t":
            out.append(char.encode("unicode_escape").decode("ascii"))
        else:
            out.append(char)
    return "".join(out)


def _run(body: Callable[[], int | None]) -> None:
    from ..errors import CheckpointError

    try:
        with warnings.catch_warnings():
            # torch.load warns about odd files (e.g. "Detected pickle protocol 153") on stderr,
            # where the contract is one line: the error line already says what is wrong.
            warnings.simplefilter("ignore")
            code = body() or 0
    except _Fail as failure:
        err.print(_one_line(f"ckpt: {failure}"), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(failure.code) from None
    except (CheckpointError, OSError, ValueError, TypeError) as error:
        message = str(error) or type(error).__name__
        err.print(_one_line(f"ckpt: {message}"), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except Exception as error:  # noqa: BLE001 - the CLI boundary: one line, never a traceback
        first = (str(error).strip().splitlines() or [""])[0][:300]
        message = f"ckpt: unexpected {type(error).__name__}: {first} (please report this)"
        err.print(_one_line(message), markup=False, highlight=False)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@contextmanager
def _progress(description: str, path: str) -> Iterator[None]:
    """A progress bar on stderr, sized by the input file, only when stderr is a terminal."""
    total = os.path.getsize(path) if "://" not in path and os.path.isfile(path) else None
    if not err.is_terminal or not total:
        yield
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from ..storage import progress_hook

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(description, total=total)
        with progress_hook(lambda n: bar.advance(task, n)):
            yield


# One spelling of the opt-in, as the library's trust_code=True; --trust-pickled-code is the name
# ckptools 0.2 gave it, still accepted.
_TRUST = typer.Option(
    "--trust-code",
    "--trust-pickled-code",
    help="UNSAFE: let torch unpickle any class the file names, running its code. Only for files you trust; "
    "without it such entries are skipped and the weights are read without running anything.",
)


# --- info ----------------------------------------------------------------------------------------


@app.command()
def info(
    path: Annotated[str, typer.Argument(help="checkpoint file, folder (Hugging Face, Accelerate, DCP) or URL")],
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    trust: Annotated[bool, _TRUST] = False,
) -> None:
    """Show format, entries, tensors (name, shape, dtype, bytes, saved device), totals and metadata.

    A CheckpointManager's folder: its checkpoints and this node's snapshots in memory."""

    def body() -> None:
        from ..errors import CheckpointLayoutError
        from ..inspection import inspect

        try:
            report = inspect(path, trust_code=trust)
        except CheckpointLayoutError:
            from ..runs import run_report

            run = run_report(path)  # a folder of numbered checkpoints: the run, not one file
            if run is None:
                raise
            if as_json:
                out.print_json(json.dumps(run))
            else:
                render_run(run)
            return
        if as_json:
            out.print_json(json.dumps(report, default=repr))
            return
        render_info(report)

    _run(body)


# --- strip-module / add-module -------------------------------------------------------------------


def _target(path: str, output: Optional[str], in_place: bool, force: bool) -> str:
    if in_place and output:
        raise _Fail("give either -o OUT or --in-place, not both")
    if not in_place and not output:
        raise _Fail("give -o OUT to write a new file, or --in-place to rewrite the input")
    if in_place:
        return path
    if _writes_folder(path):
        _check_folder_output(str(output), force)
    else:
        _check_output(str(output), force, suggestion=os.path.basename(path))
    return str(output)


def _writes_folder(path: str) -> bool:
    """Whether renaming ``path`` writes a folder (a Hugging Face folder, a sharded index), as its layout says."""
    from ..layouts import detect
    from ..storage import resolve

    return detect(resolve(path)).folder


def _check_output(dst: str, force: bool, *, suggestion: str) -> None:
    """Refuse an OUT that is a directory, or that exists without --force (nothing is touched)."""
    from ..storage import get_filesystem, join

    fs, fpath = get_filesystem(dst)
    if fs.isdir(fpath):
        raise _Fail(f"{dst} is a directory; name the output file inside it, e.g. {join(dst, suggestion)}")
    if fs.exists(fpath) and not force:
        raise _Fail(f"{dst} already exists; pass --force to overwrite it")


def _check_folder_output(dst: str, force: bool) -> None:
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise _Fail(f"{dst} is a file; the input is a folder, so name a folder to write")
    if os.path.isdir(dst) and os.listdir(dst) and not force:
        raise _Fail(f"{dst} already exists and is not empty; pass --force to write into it")


_FORCE = typer.Option("--force", "-f", help="overwrite OUT if it exists")
_KEY_HELP = "entry holding the weights, dotted for nesting (model_state, model.state_dict)"


def _rename_command(
    path: str, output: Optional[str], in_place: bool, prefixes: list[str], add: bool, force: bool, key: Optional[str]
) -> None:
    def body() -> None:
        from ..state_dict import add_prefix, strip_prefix

        dst = _target(path, output, in_place, force)

        names: list[str] = []  # the weights' names as the rename saw them (per shard, for a sharded checkpoint)

        def transform(sd: Mapping[str, Any]) -> Mapping[str, Any]:
            names.extend(sd)
            for prefix in prefixes:
                sd = add_prefix(sd, prefix) if add else strip_prefix(sd, prefix)
            return sd

        with _progress("renaming", path), _about(path):
            from ..rewrite import rename_checkpoint

            changed = rename_checkpoint(path, dst, transform, key=key)
        verb = "added to" if add else "removed from"
        said = " / ".join(repr(p) for p in prefixes)
        out.print(f"{dst}: prefix {said} {verb} {changed} keys")
        if not changed and not add:
            _say_shared_prefix(path, key, names)

    _run(body)


def _say_shared_prefix(path: str, key: Optional[str], names: list[str]) -> None:
    """After a strip that removed nothing: the prefix the ``names`` (the weights', as the rename read
    them: no second read, no tensor, no torch) do share (a LightningModule's ``net.``), and how to remove it."""
    from ..state_dict import shared_prefix

    head = shared_prefix(names)
    if head is not None:
        where = f" --key {key}" if key else ""
        err.print(
            f"ckpt: note: no key starts with that prefix; every key starts with {head!r}: to remove it, "
            f"ckpt strip-module {path} -o OUT --prefix {head}{where}",
            markup=False, highlight=False, soft_wrap=True,
        )  # fmt: skip


@app.command("strip-module")
def strip_module(
    path: Annotated[str, typer.Argument(help="input checkpoint: a file, a sharded index or a Hugging Face folder")],
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="write the result here")] = None,
    in_place: Annotated[bool, typer.Option("--in-place", help="rewrite the input (atomically)")] = False,
    prefix: Annotated[str, typer.Option(help="the prefix to remove")] = "module.",
    compile_prefix: Annotated[
        bool, typer.Option("--compile", help="also remove torch.compile's '_orig_mod.' (alone or after 'module.')")
    ] = False,
    force: Annotated[bool, _FORCE] = False,
    key: Annotated[Optional[str], typer.Option(help=_KEY_HELP)] = None,
) -> None:
    """Remove the DDP 'module.' prefix from the weights' keys (other entries are kept).

    --compile removes torch.compile's '_orig_mod.' too (module._orig_mod.x, _orig_mod.module.x and
    _orig_mod.x all become x); --prefix P removes another prefix instead. A folder (sharded or
    not) is written as a folder: shards renamed without decoding, the index rewritten, config and
    tokenizer files copied.
    """
    from ..state_dict import WRAPPER_PREFIXES

    prefixes = list(WRAPPER_PREFIXES[::-1]) if compile_prefix else [prefix]
    _rename_command(path, output, in_place, prefixes, add=False, force=force, key=key)


@app.command("add-module")
def add_module(
    path: Annotated[str, typer.Argument(help="input checkpoint")],
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="write the result here")] = None,
    in_place: Annotated[bool, typer.Option("--in-place", help="rewrite the input (atomically)")] = False,
    prefix: Annotated[str, typer.Option(help="the prefix to add")] = "module.",
    force: Annotated[bool, _FORCE] = False,
    key: Annotated[Optional[str], typer.Option(help=_KEY_HELP)] = None,
) -> None:
    """Add the 'module.' prefix to the weights' keys (keys that have it are left alone)."""
    _rename_command(path, output, in_place, [prefix], add=True, force=force, key=key)


# --- convert -------------------------------------------------------------------------------------


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="input: a torch file, .safetensors, sharded index, or a folder")],
    dst: Annotated[str, typer.Argument(help="output: .safetensors, .pt/.pth/.bin, or a folder OUT_DIR/")],
    key: Annotated[Optional[str], typer.Option(help=_KEY_HELP)] = None,
    no_strip: Annotated[bool, typer.Option("--no-strip", help="keep the 'module.' prefix")] = False,
    max_shard_size: Annotated[
        Optional[str], typer.Option("--max-shard-size", help="write a Hugging Face folder with shards up to this size")
    ] = None,
    force: Annotated[bool, _FORCE] = False,
    trust: Annotated[bool, _TRUST] = False,
    config: Annotated[
        Optional[str],
        typer.Option(help="for a folder: the model's config.json, or its folder (tokenizer files come along)"),
    ] = None,
) -> None:
    """Convert the weights: to .safetensors (tied tensors once, scalars and checksums in metadata),
    to a Hugging Face folder (OUT_DIR/ or --max-shard-size: model.safetensors or shards and
    model.safetensors.index.json, which from_pretrained reads, with the config.json it also needs
    from --config), or to a torch file."""

    def body() -> None:
        from ..converting import convert as run_convert
        from ..converting import writes_folder

        to_folder = writes_folder(dst, max_shard_size)
        if not to_folder:
            stem = os.path.basename(src.rstrip("/")).rsplit(".", 1)[0] or "model"
            _check_output(dst, force, suggestion=f"{stem}.safetensors")
        with _about(src), _progress("converting", src):
            written = run_convert(src, dst, key=key, strip=None if no_strip else "module.", config=config,
                                  max_shard_size=max_shard_size, force=force, trust_code=trust)  # fmt: skip
        if not to_folder:
            out.print(f"wrote {dst}")
            return
        out.print(f"wrote {dst.rstrip('/')}/: " + ", ".join(os.path.basename(w) for w in written))
        if not os.path.isfile(os.path.join(dst, "config.json")):
            err.print(
                f"ckpt: note: {dst.rstrip('/')}/ has no config.json, which from_pretrained needs: pass "
                "--config MODEL/config.json (or the folder the model came from), or copy it in",
                markup=False, highlight=False, soft_wrap=True,
            )  # fmt: skip

    _run(body)


# --- diff ----------------------------------------------------------------------------------------


@app.command()
def diff(
    a: Annotated[str, typer.Argument(help="first checkpoint (file or folder)")],
    b: Annotated[str, typer.Argument(help="second checkpoint (file or folder)")],
    atol: Annotated[float, typer.Option(help="largest absolute difference still counted as equal")] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="the table of every common tensor, also when all match")
    ] = False,
    trust: Annotated[bool, _TRUST] = False,
    key: Annotated[Optional[str], typer.Option(help=_KEY_HELP + "; a file without it is read as without --key")] = None,
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

        with _about(a, b):
            result = compare(a, b, atol=atol, trust_code=trust, key=key, weights_only=weights)
        if as_json:
            out.print_json(json.dumps(result))
        else:
            render_diff(result, verbose=verbose)
        return 1 if result["differ"] else 0

    _run(body)


# --- verify --------------------------------------------------------------------------------------


@app.command()
def verify(
    paths: Annotated[list[str], typer.Argument(help="checkpoint files, folders or URLs; a CheckpointManager's folder")],
    strict: Annotated[
        bool, typer.Option("--strict", help="exit 1 also when some bytes carry no checksum (only structure checked)")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output (damage included)")] = False,
    trust: Annotated[bool, _TRUST] = False,
) -> None:
    """Read everything and check integrity: exit 0 good, 1 damaged, 2 missing/unsafe/bad arguments.

    OK: every byte matched a stored checksum. STRUCTURE OK: nothing damaged was found, but the
    files named after 'data not checksummed' carry no checksum (safetensors from other tools,
    DCP, tokenizer files): only their structure was checked; --strict exits 1 for that. A folder
    is checked whole: every file in it, a ckptools manifest, the HF Trainer's expected files. A
    CheckpointManager's folder: each of its checkpoints and each snapshot in this node's memory.
    Several paths: a line each, on stdout (DAMAGED too); the exit status is the worst of them
    (a path that cannot be judged: its line on stderr, exit 2)."""

    def body() -> int:
        from ..errors import CheckpointError, CheckpointLayoutError
        from ..inspection import verify_report

        reports: list[dict[str, Any]] = []
        failures: list[str] = []
        shown: list[str | dict[str, Any]] = []  # what to print, in the order of the paths: headers and reports

        def judge(path: str, where: str = "") -> None:
            report = verify_report(path, trust_code=trust, strict=strict)
            report = {**report, "line": report["line"] + where}
            reports.append(report)
            shown.append(report)

        for path in paths:
            run: dict[str, Any] | None = None
            try:
                with _progress("verifying", path):
                    judge(path)
            except CheckpointLayoutError as refusal:
                from ..runs import run_report

                run = run_report(path) if "://" not in path else None
                if run is None:
                    if len(paths) == 1:
                        raise
                    failures.append(f"{path}: {refusal}")
            except CheckpointError as error:
                if len(paths) == 1:
                    raise
                failures.append(str(error))
            if run is None:
                continue
            files = [(c["path"], "") for r in run["runs"] for c in r["checkpoints"]]
            memory_note = " (a snapshot in this node's memory)"
            snapshots = [(c["path"], memory_note) for r in run["runs"] for c in r["snapshots"]]
            memory = ", ".join(r["snapshot_dir"] for r in run["runs"])
            shown.append(f"{path}: a CheckpointManager's folder, {plural(len(files), 'checkpoint')}; "
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
            err.print(_one_line(f"ckpt: {failure}"), markup=False, highlight=False, soft_wrap=True)
        return code

    _run(body)


def _verdict(report: dict[str, Any]) -> str:
    """One checkpoint's line: `verify_report`'s label, the path, what was found."""
    path, line = str(report["path"]), str(report["line"])
    return _one_line(f"{report['label']} {path}: {line.removeprefix(path + ': ')}")


def main() -> None:
    """Entry point of the ``ckpt`` executable."""
    for stream in (sys.stdout, sys.stderr):
        # A tensor name can hold a lone surrogate (torch.save pickles any str): shown escaped,
        # never a UnicodeEncodeError in the middle of a table.
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    app(prog_name="ckpt")


if __name__ == "__main__":  # pragma: no cover
    main()
