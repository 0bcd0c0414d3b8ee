"""The commands that write: ``ckpt strip-module``, ``ckpt add-module``, ``ckpt convert``
(registered in order by `ckptools.cli`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Optional

import typer

from .app import FORCE, KEY_HELP, TRUST, Fail, about, check_output, progress, run
from .render import err, out

__all__ = ["add_module", "convert", "strip_module"]


# --- strip-module / add-module -------------------------------------------------------------------


def _target(path: str, output: Optional[str], in_place: bool, force: bool) -> str:
    if in_place and output:
        raise Fail("give either -o OUT or --in-place, not both")
    if not in_place and not output:
        raise Fail("give -o OUT to write a new file, or --in-place to rewrite the input")
    if in_place:
        return path
    if _writes_folder(path):
        _check_folder_output(str(output), force)
    else:
        check_output(str(output), force, suggestion=os.path.basename(path))
    return str(output)


def _writes_folder(path: str) -> bool:
    """Whether renaming ``path`` writes a folder (a Hugging Face folder, a sharded index), as its layout says."""
    from ..layouts import detect
    from ..storage import resolve

    return detect(resolve(path)).folder


def _check_folder_output(dst: str, force: bool) -> None:
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise Fail(f"{dst} is a file; the input is a folder, so name a folder to write")
    if os.path.isdir(dst) and os.listdir(dst) and not force:
        raise Fail(f"{dst} already exists and is not empty; pass --force to write into it")


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

        with progress("renaming", path), about(path):
            from ..converting import rename_checkpoint

            changed = rename_checkpoint(path, dst, transform, key=key)
        verb = "added to" if add else "removed from"
        said = " / ".join(repr(p) for p in prefixes)
        out.print(f"{dst}: prefix {said} {verb} {changed} keys")
        if not changed and not add:
            _say_shared_prefix(path, key, names)

    run(body)


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


def strip_module(
    path: Annotated[str, typer.Argument(help="input checkpoint: a file, a sharded index or a Hugging Face folder")],
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="write the result here")] = None,
    in_place: Annotated[bool, typer.Option("--in-place", help="rewrite the input (atomically)")] = False,
    prefix: Annotated[str, typer.Option(help="the prefix to remove")] = "module.",
    compile_prefix: Annotated[
        bool, typer.Option("--compile", help="also remove torch.compile's '_orig_mod.' (alone or after 'module.')")
    ] = False,
    force: Annotated[bool, FORCE] = False,
    key: Annotated[Optional[str], typer.Option(help=KEY_HELP)] = None,
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


def add_module(
    path: Annotated[str, typer.Argument(help="input checkpoint")],
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="write the result here")] = None,
    in_place: Annotated[bool, typer.Option("--in-place", help="rewrite the input (atomically)")] = False,
    prefix: Annotated[str, typer.Option(help="the prefix to add")] = "module.",
    force: Annotated[bool, FORCE] = False,
    key: Annotated[Optional[str], typer.Option(help=KEY_HELP)] = None,
) -> None:
    """Add the 'module.' prefix to the weights' keys (keys that have it are left alone)."""
    _rename_command(path, output, in_place, [prefix], add=True, force=force, key=key)


# --- convert -------------------------------------------------------------------------------------


def convert(
    src: Annotated[str, typer.Argument(help="input: a torch file, .safetensors, sharded index, or a folder")],
    dst: Annotated[str, typer.Argument(help="output: .safetensors, .pt/.pth/.bin, or a folder OUT_DIR/")],
    key: Annotated[Optional[str], typer.Option(help=KEY_HELP)] = None,
    no_strip: Annotated[bool, typer.Option("--no-strip", help="keep the 'module.' prefix")] = False,
    max_shard_size: Annotated[
        Optional[str], typer.Option("--max-shard-size", help="write a Hugging Face folder with shards up to this size")
    ] = None,
    force: Annotated[bool, FORCE] = False,
    trust: Annotated[bool, TRUST] = False,
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
            check_output(dst, force, suggestion=f"{stem}.safetensors")
        with about(src), progress("converting", src):
            written = run_convert(src, dst, key=key, strip=None if no_strip else "module.", config=config,
                                  max_shard_size=max_shard_size, force=force, weights_only=not trust)  # fmt: skip
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

    run(body)
