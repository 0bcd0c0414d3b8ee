"""The ``ckpt`` application and what its commands share: one-line errors (exit 2), the progress
bar, the options several commands take. The commands themselves: `reading`, `writing`."""

from __future__ import annotations

import os
import sys
import unicodedata
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from .render import err, out, start_call

__all__ = ["FORCE", "KEY_HELP", "TRUST", "Fail", "about", "app", "check_output", "one_line", "progress", "run"]

# click's exception classes: from click itself, or from the copy newer typer versions carry.
_click_errors = sys.modules[typer.BadParameter.__module__]


class _Group(TyperGroup):
    """Usage errors (unknown option, missing argument) as one ``ckpt: ...`` line and exit 2.

    click would draw a box of several lines; every other ckpt error is one line on stderr, and
    scripts that read stderr should not have to tell the two apart. click's own hints ("Possible
    options: --json", "Try 'ckpt info --help'") are kept in the line.
    """

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        start_call()  # in-process calls (CliRunner, a notebook) each start clean
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


class Fail(Exception):
    """A clean failure: message for stderr and the exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@contextmanager
def about(*paths: str) -> Iterator[None]:
    """Name the input(s) in a plain ValueError from a key transform (two keys renamed to one)."""
    try:
        yield
    except ValueError as error:
        if type(error) is not ValueError:
            raise
        raise Fail(f"{' / '.join(paths)}: {error}") from None


def one_line(message: str) -> str:
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


def run(body: Callable[[], int | None]) -> None:
    from ..errors import CheckpointError

    try:
        with warnings.catch_warnings():
            # torch.load warns about odd files (e.g. "Detected pickle protocol 153") on stderr,
            # where the contract is one line: the error line already says what is wrong.
            warnings.simplefilter("ignore")
            code = body() or 0
    except Fail as failure:
        err.print(one_line(f"ckpt: {failure}"), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(failure.code) from None
    except (CheckpointError, OSError, ValueError, TypeError) as error:
        message = str(error) or type(error).__name__
        err.print(one_line(f"ckpt: {message}"), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except Exception as error:  # noqa: BLE001 - the CLI boundary: one line, never a traceback
        first = (str(error).strip().splitlines() or [""])[0][:300]
        message = f"ckpt: unexpected {type(error).__name__}: {first} (please report this)"
        err.print(one_line(message), markup=False, highlight=False)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@contextmanager
def progress(description: str, path: str) -> Iterator[None]:
    """A progress bar on stderr, sized by the input file, only when stderr is a terminal."""
    total = os.path.getsize(path) if "://" not in path and os.path.isfile(path) else None
    if not err.is_terminal or not total:
        yield
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from ..storage import progress_hook

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=err.console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        with progress_hook(lambda n: bar.advance(task, n)):
            yield


# The opt-in, the library's weights_only=False, named for what it does; --trust-pickled-code is the name
# ckptools 0.2 gave it, still accepted.
TRUST = typer.Option(
    "--trust-code",
    "--trust-pickled-code",
    help="UNSAFE: let torch unpickle any class the file names, running its code. Only for files you trust; "
    "without it such entries are skipped and the weights are read without running anything.",
)

FORCE = typer.Option("--force", "-f", help="overwrite OUT if it exists")
KEY_HELP = "entry holding the weights, dotted for nesting (model_state, model.state_dict)"


def check_output(dst: str, force: bool, *, suggestion: str) -> None:
    """Refuse an OUT that is a directory, or that exists without --force (nothing is touched)."""
    from ..storage import get_filesystem, join

    fs, fpath = get_filesystem(dst)
    if fs.isdir(fpath):
        raise Fail(f"{dst} is a directory; name the output file inside it, e.g. {join(dst, suggestion)}")
    if fs.exists(fpath) and not force:
        raise Fail(f"{dst} already exists; pass --force to overwrite it")
