"""``ckpt``: inspect, rename, convert, compare and verify checkpoint files.

The CLI is thin: it parses arguments, calls the library, and renders with rich. A
:class:`CheckpointError` is turned into one line on stderr and exit code 2 (1 for a negative
answer: ``diff`` found differences, ``verify`` found damage). Heavy modules (torch) are imported
inside the commands, so ``ckpt --help`` stays fast.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

out = Console()
err = Console(stderr=True)
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
            code = super().main(*args, standalone_mode=False, **kwargs)
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
        from . import __version__

        out.print(f"ckpt (ckptools) {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", help="show the version and exit", is_eager=True, callback=_show_version)
    ] = False,
) -> None:
    """Inspect, rename, convert, compare and verify PyTorch checkpoints (.pt/.pth/.bin/.ckpt/.safetensors)."""


TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


class _Fail(Exception):
    """A clean failure: message for stderr and the exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _run(body: Callable[[], int | None]) -> None:
    from .errors import CheckpointError

    try:
        with warnings.catch_warnings():
            # torch.load warns about odd files (e.g. "Detected pickle protocol 153") on stderr,
            # where the contract is one line: the error line already says what is wrong.
            warnings.simplefilter("ignore")
            code = body() or 0
    except _Fail as failure:
        err.print(f"ckpt: {failure}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(failure.code) from None
    except (CheckpointError, OSError, ValueError, TypeError) as error:
        message = str(error) or type(error).__name__
        err.print(f"ckpt: {message}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except Exception as error:  # noqa: BLE001 - the CLI boundary: one line, never a traceback
        first = (str(error).strip().splitlines() or [""])[0][:300]
        message = f"ckpt: unexpected {type(error).__name__}: {first} (please report this)"
        err.print(message, markup=False, highlight=False)
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

    from .storage import progress_hook

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(description, total=total)
        with progress_hook(lambda n: bar.advance(task, n)):
            yield


def _is_safetensors(path: str) -> bool:
    return path.endswith(".safetensors")


# --- reading -------------------------------------------------------------------------------------


def _load_torch_with_devices(path: str) -> tuple[Any, dict[int, str]]:
    """Load a torch file on CPU, remembering the device each storage was saved from."""
    from .serialization import load_file
    from .storage import open_for_read

    devices: dict[int, str] = {}

    def remember(storage: Any, location: str) -> Any:
        devices[storage.data_ptr()] = location
        return storage

    source, local = open_for_read(path)
    is_zip = False
    if local:
        with open(source, "rb") as f:
            is_zip = f.read(4) == b"PK\x03\x04"
    return load_file(path, map_location=remember, mmap=is_zip), devices


# --- info ----------------------------------------------------------------------------------------


@app.command()
def info(
    path: Annotated[str, typer.Argument(help="checkpoint file or URL")],
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Show format, entries, tensors (name, shape, dtype, bytes, saved device), totals and metadata."""

    def body() -> None:
        report = _info(path)
        if as_json:
            out.print_json(json.dumps(report, default=repr))
            return
        _render_info(report)

    _run(body)


def _info(path: str) -> dict[str, Any]:
    if _is_safetensors(path):
        from .convert import read_safetensors_header

        header, metadata, _, size = read_safetensors_header(path)
        tensors = [
            {"name": n, "shape": e["shape"], "dtype": e["dtype"], "bytes": e["data_offsets"][1] - e["data_offsets"][0]}
            for n, e in sorted(header.items())
        ]
        for t in tensors:
            t["device"] = "cpu"  # safetensors files carry no device
        return _report(path, "safetensors", size, entries={}, tensors=tensors, metadata=metadata)
    if _local_zip(path):
        # From data.pkl alone: no torch import, no tensor read.
        from .torchzip import TorchZip, is_tensor, loads, tensor_info

        archive = TorchZip(path)
        tree = loads(archive.read_pickle(), path)
        return _tree_report(path, "torch zip", archive.size, tree, lambda n: tensor_info(n) if is_tensor(n) else None)
    ckpt, devices = _load_torch_with_devices(path)
    return _loaded_report(path, ckpt, devices)


def _loaded_report(path: str, ckpt: Any, devices: Mapping[int, str]) -> dict[str, Any]:
    """The ``info`` report of a checkpoint loaded by torch (``devices``: storage -> saved device)."""
    import torch

    def describe(node: Any) -> dict[str, Any] | None:
        if not isinstance(node, torch.Tensor):
            return None
        ptr = node.untyped_storage().data_ptr()
        dtype = str(node.dtype).removeprefix("torch.")
        nbytes = node.numel() * node.element_size()
        return {
            "shape": list(node.shape),
            "dtype": dtype,
            "bytes": nbytes,
            "device": devices.get(ptr, "cpu"),
            "storage": ptr,
        }

    size = os.path.getsize(path) if "://" not in path else None
    return _tree_report(path, "torch zip" if _zip(path) else "torch legacy", size, ckpt, describe)


def _tree_report(
    path: str, fmt: str, size: int | None, tree: Any, describe: Callable[[Any], dict[str, Any] | None]
) -> dict[str, Any]:
    """The ``info`` report of a checkpoint tree, loaded by torch or parsed without it.

    ``describe(node)`` returns shape, dtype, bytes, device and a storage identity for a tensor
    (a repeated storage marks the tensor as shared), None for anything else.
    """
    from .torchzip import META_KEY

    tensors: list[dict[str, Any]] = []
    seen: set[Any] = set()

    def walk(node: Any, prefix: str) -> None:
        info = describe(node)
        if info is not None:
            storage = info.pop("storage")
            info["shared"] = storage is not None and storage in seen and info["bytes"] > 0
            seen.add(storage)
            tensors.append({"name": prefix, **info})
        elif isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, f"{prefix}.{i}" if prefix else str(i))

    entries: dict[str, str] = {}
    metadata: dict[str, Any] = {}
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            if key == META_KEY and isinstance(value, Mapping):
                metadata = {k: v for k, v in value.items() if k != "rng"}
                metadata["rng_ranks"] = len(value.get("rng", []))
                continue
            first = len(tensors)
            walk(value, str(key))
            entries[str(key)] = _describe(value, tensors[first:])
    else:
        walk(tree, "")
    return _report(path, fmt, size, entries=entries, tensors=tensors, metadata=metadata)


def _describe(value: Any, tensors: list[dict[str, Any]]) -> str:
    """One line about a top-level entry, given the tensors found under it."""
    if tensors and not isinstance(value, (Mapping, list, tuple)):  # the entry is itself a tensor
        return f"tensor {tensors[0]['shape']} {tensors[0]['dtype']}"
    if isinstance(value, Mapping):
        return f"dict, {len(value)} keys" + (f", {len(tensors)} tensors" if tensors else "")
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _zip(path: str) -> bool:
    # Remote files are taken as zip (the pre-1.6 format predates object-store checkpoints).
    return "://" in path or _local_zip(path)


def _report(path: str, fmt: str, size: int | None, **parts: Any) -> dict[str, Any]:
    tensors = parts["tensors"]
    total = sum(t["bytes"] for t in tensors if not t.get("shared"))
    prefixed = [t["name"] for t in tensors if _has_module_prefix(t["name"])]
    return {
        "path": path,
        "format": fmt,
        "file_bytes": size,
        "entries": parts["entries"],
        "tensors": tensors,
        "totals": {"tensors": len(tensors), "bytes": total, "module_prefixed": len(prefixed)},
        "metadata": parts["metadata"],
    }


def _has_module_prefix(name: str) -> bool:
    return name.startswith("module.") or ".module." in name


def _render_info(report: dict[str, Any]) -> None:
    from .storage import human_size

    size = report["file_bytes"]
    out.print(f"[bold]{report['path']}[/]  {report['format']}" + (f", {human_size(size)}" if size is not None else ""))
    if report["entries"]:
        table = Table("entry", "content", title="entries", title_justify="left")
        for key, text in report["entries"].items():
            table.add_row(key, text)
        out.print(table)
    table = Table("tensor", "shape", "dtype", "bytes", "saved on", title="tensors", title_justify="left")
    for t in report["tensors"]:
        table.add_row(
            t["name"],
            str(t["shape"]),
            t["dtype"],
            human_size(t["bytes"]),
            t["device"] + (" (shared)" if t.get("shared") else ""),
        )
    out.print(table)
    totals = report["totals"]
    out.print(f"{totals['tensors']} tensors, {human_size(totals['bytes'])}")
    if report["metadata"]:
        out.print("metadata: " + json.dumps(report["metadata"], default=str))
    if totals["module_prefixed"]:
        out.print(
            f"[yellow]{totals['module_prefixed']} tensor names carry the DDP 'module.' prefix[/]; remove it with: "
            f"ckpt strip-module {report['path']} -o OUT"
        )


# --- strip-module / add-module -------------------------------------------------------------------


def _target(path: str, output: Optional[str], in_place: bool, force: bool) -> str:
    if in_place and output:
        raise _Fail("give either -o OUT or --in-place, not both")
    if not in_place and not output:
        raise _Fail("give -o OUT to write a new file, or --in-place to rewrite the input")
    if in_place:
        return path
    _check_output(str(output), force, suggestion=os.path.basename(path))
    return str(output)


def _check_output(dst: str, force: bool, *, suggestion: str) -> None:
    """Refuse an OUT that is a directory, or that exists without --force (nothing is touched)."""
    from .storage import get_filesystem, join

    fs, fpath = get_filesystem(dst)
    if fs.isdir(fpath):
        raise _Fail(f"{dst} is a directory; name the output file inside it, e.g. {join(dst, suggestion)}")
    if fs.exists(fpath) and not force:
        raise _Fail(f"{dst} already exists; pass --force to overwrite it")


_FORCE = typer.Option("--force", "-f", help="overwrite OUT if it exists")


def _rename_command(path: str, output: Optional[str], in_place: bool, prefix: str, add: bool, force: bool) -> None:
    def body() -> None:
        from .state_dict import add_prefix, strip_prefix

        dst = _target(path, output, in_place, force)
        transform = (lambda sd: add_prefix(sd, prefix)) if add else (lambda sd: strip_prefix(sd, prefix))
        with _progress("renaming", path):
            if _is_safetensors(path):
                from .convert import rename_safetensors

                changed = rename_safetensors(path, dst, transform)
            else:
                changed = _rename_torch(path, dst, transform)
        verb = "added to" if add else "removed from"
        out.print(f"{dst}: prefix {prefix!r} {verb} {changed} keys")

    _run(body)


def _rename_torch(path: str, dst: str, transform: Callable[[Mapping[str, Any]], Mapping[str, Any]]) -> int:
    from .storage import atomic_write

    if _local_zip(path):
        # Only data.pkl names the keys: rewrite it, copy every tensor record byte for byte.
        from .torchzip import TorchZip, dumps, loads, locate_weights

        archive = TorchZip(path)
        tree = loads(archive.read_pickle(), path)
        parent, key, weights = locate_weights(tree, path=path)
        renamed = transform(weights)
        if parent is None:
            tree = renamed
        else:
            parent[key] = renamed
        payload = dumps(tree)
        atomic_write(dst, lambda f: archive.write_with_pickle(f, payload))
    else:  # legacy (pre-1.6) format or a remote URL: through torch
        from .checkpoint import locate_weights as locate_loaded
        from .convert import load_torch
        from .serialization import save_file

        ckpt = load_torch(path)
        parent, key, weights = locate_loaded(ckpt, path=path)
        renamed = transform(weights)
        if parent is None:
            ckpt = renamed
        else:
            parent[key] = renamed
        save_file(dst, ckpt)
    return sum(1 for a, b in zip(weights, renamed) if a != b)


def _local_zip(path: str) -> bool:
    from .convert import _local_zip as local_zip  # one definition; raises the clear not-found errors

    return local_zip(path)


@app.command("strip-module")
def strip_module(
    path: Annotated[str, typer.Argument(help="input checkpoint")],
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="write the result here")] = None,
    in_place: Annotated[bool, typer.Option("--in-place", help="rewrite the input (atomically)")] = False,
    prefix: Annotated[str, typer.Option(help="the prefix to remove")] = "module.",
    force: Annotated[bool, _FORCE] = False,
) -> None:
    """Remove the DDP 'module.' prefix from the weights' keys (other entries are kept).

    --prefix _orig_mod. (or module._orig_mod.) removes torch.compile's prefix instead.
    """
    _rename_command(path, output, in_place, prefix, add=False, force=force)


@app.command("add-module")
def add_module(
    path: Annotated[str, typer.Argument(help="input checkpoint")],
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="write the result here")] = None,
    in_place: Annotated[bool, typer.Option("--in-place", help="rewrite the input (atomically)")] = False,
    prefix: Annotated[str, typer.Option(help="the prefix to add")] = "module.",
    force: Annotated[bool, _FORCE] = False,
) -> None:
    """Add the 'module.' prefix to the weights' keys (keys that have it are left alone)."""
    _rename_command(path, output, in_place, prefix, add=True, force=force)


# --- convert -------------------------------------------------------------------------------------


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="input: .pt/.pth/.bin/.ckpt or .safetensors")],
    dst: Annotated[str, typer.Argument(help="output; its suffix picks the format")],
    key: Annotated[Optional[str], typer.Option(help="entry holding the weights (dotted for nesting)")] = None,
    no_strip: Annotated[bool, typer.Option("--no-strip", help="keep the 'module.' prefix")] = False,
    force: Annotated[bool, _FORCE] = False,
) -> None:
    """Convert .pt -> .safetensors (tied tensors once, scalars and checksums in metadata), or back."""

    def body() -> None:
        strip = None if no_strip else "module."
        stem = os.path.basename(src).rsplit(".", 1)[0] or "model"
        _check_output(dst, force, suggestion=f"{stem}.pt" if _is_safetensors(src) else f"{stem}.safetensors")
        if _is_safetensors(dst):
            from .convert import convert_to_safetensors

            with _progress("converting", src):
                convert_to_safetensors(src, dst, key=key, strip=strip)
        elif dst.endswith(TORCH_SUFFIXES) and _is_safetensors(src):
            from .convert import load_safetensors
            from .serialization import save_file
            from .state_dict import strip_prefix

            tensors = load_safetensors(src)
            save_file(dst, strip_prefix(tensors, strip) if strip else tensors)
        else:
            raise _Fail(f"cannot convert {src} to {dst}: use a .safetensors OUT, or a .safetensors IN with a .pt OUT")
        out.print(f"wrote {dst}")

    _run(body)


# --- diff ----------------------------------------------------------------------------------------


@app.command()
def diff(
    a: Annotated[str, typer.Argument(help="first checkpoint")],
    b: Annotated[str, typer.Argument(help="second checkpoint")],
    atol: Annotated[float, typer.Option(help="largest absolute difference still counted as equal")] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Compare the weights of two checkpoints ('module.' ignored); exit 1 if they differ."""

    def body() -> int:
        result = _diff(a, b, atol)
        if as_json:
            out.print_json(json.dumps(result))
        else:
            _render_diff(result)
        return 1 if result["differ"] else 0

    _run(body)


def _weights(path: str) -> Mapping[str, Any]:
    from .checkpoint import locate_weights
    from .convert import load_safetensors, load_torch
    from .state_dict import strip_wrappers

    # Compared without any wrapper's prefix: DDP's "module.", torch.compile's "_orig_mod.".
    if _is_safetensors(path):
        return strip_wrappers(load_safetensors(path))
    return strip_wrappers(locate_weights(load_torch(path), path=path)[2])


def _diff(a: str, b: str, atol: float) -> dict[str, Any]:
    import torch

    wa, wb = _weights(a), _weights(b)
    missing = sorted(set(wa) - set(wb))
    unexpected = sorted(set(wb) - set(wa))
    mismatched, changed, max_abs = [], [], {}
    for name in sorted(set(wa) & set(wb)):
        ta, tb = wa[name], wb[name]
        if ta.shape != tb.shape or ta.dtype != tb.dtype:
            mismatched.append(
                {"name": name, "a": [list(ta.shape), str(ta.dtype)], "b": [list(tb.shape), str(tb.dtype)]}
            )
            continue
        if ta.numel() == 0:
            continue
        if ta.dtype.is_floating_point or ta.dtype.is_complex:
            delta = (ta.double() - tb.double()).abs().max().item() if not torch.equal(ta, tb) else 0.0
        else:
            delta = float((ta.long() - tb.long()).abs().max().item()) if not torch.equal(ta, tb) else 0.0
        if delta != delta or delta > atol:  # NaN counts as different
            changed.append(name)
        max_abs[name] = delta
    differ = bool(missing or unexpected or mismatched or changed)
    return {"a": a, "b": b, "atol": atol, "differ": differ, "missing_in_b": missing, "only_in_b": unexpected,
            "shape_or_dtype_mismatch": mismatched, "changed": changed, "max_abs_diff": max_abs}  # fmt: skip


def _render_diff(result: dict[str, Any]) -> None:
    for label, key in (("only in A", "missing_in_b"), ("only in B", "only_in_b")):
        if result[key]:
            out.print(f"[red]{label}[/] ({len(result[key])}): " + ", ".join(result[key][:20]))
    for m in result["shape_or_dtype_mismatch"]:
        out.print(f"[red]mismatch[/] {m['name']}: {m['a']} vs {m['b']}")
    if result["max_abs_diff"]:
        table = Table("tensor", "max |a-b|", title="common tensors", title_justify="left")
        for name, delta in result["max_abs_diff"].items():
            style = "red" if name in result["changed"] else None
            table.add_row(name, f"{delta:.3g}", style=style)
        out.print(table)
    out.print("[red]checkpoints differ[/]" if result["differ"] else "[green]checkpoints match[/]")


# --- verify --------------------------------------------------------------------------------------


@app.command()
def verify(path: Annotated[str, typer.Argument(help="checkpoint file or URL")]) -> None:
    """Read everything and check integrity: exit 0 good, 1 damaged, 2 missing/unsafe/bad arguments."""

    def body() -> None:
        from .errors import CheckpointFormatError

        try:
            with _progress("verifying", path):
                what = _verify(path)
        except CheckpointFormatError as error:
            if "is a directory" in str(error):
                raise
            raise _Fail(f"DAMAGED: {error}", code=1) from error
        out.print(f"OK {path}: {what}")

    _run(body)


def _verify(path: str) -> str:
    # Tensors are counted as `info` counts them (its report, from what was just loaded), so the
    # two commands never disagree about one file.
    if _is_safetensors(path):
        from .convert import load_safetensors, read_safetensors_header, verify_safetensors

        checked = verify_safetensors(path)
        load_safetensors(path)
        n = len(read_safetensors_header(path)[0])
        return f"safetensors, {n} tensors" + (
            f", {checked} CRC-32s match" if checked else ", structure checked (no checksums stored)"
        )
    from .convert import load_torch
    from .serialization import verify_torch_file

    zipped = _zip(path)
    if zipped:
        verify_torch_file(path)
    n = _loaded_report(path, load_torch(path), {})["totals"]["tensors"]
    if zipped:
        return f"torch zip, every record's CRC-32 matches, {n} tensors load"
    return f"torch legacy format (no checksums), {n} tensors load"


def main() -> None:
    """Entry point of the ``ckpt`` executable."""
    app(prog_name="ckpt")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
