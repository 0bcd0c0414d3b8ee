"""One torch file: ``torch.save``'s zip (since 1.6: .pt/.pth/.bin/.ckpt) or its legacy format.

A local zip is opened from its ``data.pkl`` alone by ckptools' torch-free reader (no tensor is
read, nothing imported); a legacy or remote file is loaded by torch's safe loader. A file whose
*other* entries need classes outside the allowlist (a Lightning checkpoint's ``pathlib.Path``)
still gives up its weights, read with inert placeholders for those classes
(``layouts.placeholders``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..codecs.pickle_writer import dumps
from ..codecs.pickles import hostile, loads, loads_lenient
from ..codecs.torchzip import is_local_zip, open_local_zip, read_local_zip
from ..codecs.trees import LIGHTNING_VERSION_KEY, entry_at, is_tensor, locate_weights, tensor_info
from ..errors import CheckpointFormatError, CheckpointLayoutError, KeyMismatchError, UnsafeCheckpointError
from ..storage import Location, atomic_write, file_size
from ..text import plural
from ..view import CheckpointView, Verification
from .base import Layout, Transform, walk_tree
from .placeholders import load_without_code, refuse_whole_object, weights_without_code
from .torch_io import load_file, save_file, verify_torch_file


@dataclass
class _Opened:
    zipped: bool


class TorchFile(Layout):
    """A torch file (zip or legacy). Holds whole training checkpoints: `training_state` is true."""

    name = "torch file"
    training_state = True

    def open(self, location: Location, *, trust_code: bool) -> CheckpointView:
        # Remote files are taken as zip (the legacy format predates object stores), without a download.
        # One open: the directory and data.pkl (no torch import, no tensor read); a remote file is
        # taken as zip (the legacy format predates object stores), without a download.
        opened = read_local_zip(location) if location.local else None
        zipped = opened is not None or not location.local
        skipped: list[str] = []
        parsed = None
        if opened is not None:
            archive, data = opened
            try:
                parsed = loads(data, location.url, archive)
            except UnsafeCheckpointError as refusal:
                if not trust_code:  # else torch loads it below, running what it names
                    parsed, skipped = lenient_tree(data, location.url, refusal, archive)
        if parsed is not None:
            tensors, entries, metadata = walk_tree(parsed, lambda n: tensor_info(n) if is_tensor(n) else None)
        else:
            devices: dict[int, str] = {}

            def remember(storage: Any, where: str) -> Any:
                devices[storage.data_ptr()] = where  # the device each storage was saved from
                return storage

            tree = load_whole(location, trust_code, mmap=False, map_location=remember)
            tensors, entries, metadata = walk_tree(tree, loaded_tensor_info(devices))
        return CheckpointView(
            path=location.url, format="torch zip" if zipped else "torch legacy", tensors=tensors, entries=entries,
            metadata=metadata, files=[location.url], skipped=skipped, file_bytes=file_size(location), layout=self,
            location=location, trust_code=trust_code, state=_Opened(zipped),
        )  # fmt: skip

    def weights(self, view: CheckpointView, key: str | None, map_location: Any) -> Mapping[str, Any]:
        assert view.location is not None  # every view a layout opens has one
        return torch_weights(view.location, key, map_location, view.trust_code)

    def entry(self, view: CheckpointView, key: str, map_location: Any) -> Any:
        """The node at ``key`` (``""``: the whole tree); a file that is itself a bare state dict has no
        entries but its tensors' names (`CheckpointLayoutError`, as a safetensors file). Refused classes
        are inert placeholders unless the view trusts the file's code."""
        import torch

        location = view.location
        assert location is not None
        try:
            tree = load_whole(location, view.trust_code, mmap=False, map_location=map_location)
        except UnsafeCheckpointError as refusal:
            tree = load_without_code(location, map_location, refusal)[0]
        if key == "":  # the whole tree (what `ckptools.diff` compares, read once)
            return tree
        try:
            return entry_at(tree, key, path=location.url)
        except KeyMismatchError:
            if isinstance(tree, Mapping) and tree and all(isinstance(v, torch.Tensor) for v in tree.values()):
                raise CheckpointLayoutError(f"{location.url} is a bare state dict: it has no entries") from None
            raise

    def verify(self, view: CheckpointView) -> Verification:
        location, zipped = view.location, view.state.zipped
        assert location is not None
        if view.skipped:  # the strict load would refuse: read what can be read without code
            if zipped:
                verify_torch_file(location)
            n = len(torch_weights(location, None, "cpu", view.trust_code))
            return Verification(
                f"torch zip, every record's CRC-32 matches, {plural(n, 'weight tensor')} read "
                f"({plural(len(view.skipped), 'global')} skipped)"
            )
        # Every CRC-32 in the pass that checks the file for torch (one open), then torch's load.
        loaded = load_whole(location, view.trust_code, mmap=zipped and location.local, crc=zipped)
        n = len(walk_tree(loaded, loaded_tensor_info())[0])
        if zipped:
            return Verification(f"torch zip, every record's CRC-32 matches, {plural(n, 'tensor')} loaded")
        return Verification(
            f"torch legacy format, {plural(n, 'tensor')} loaded",
            {location.name: "loads; the legacy format has no checksums"},
        )

    def read_weights(
        self, location: Location, *, key: str | None, map_location: Any, verify: bool, trust_code: bool = False
    ) -> Mapping[str, Any]:
        # No view is built: a remote file is fetched once.
        if verify:
            verify_torch_file(location)
        return torch_weights(location, key, map_location, trust_code)

    def read_tree(
        self,
        location: Location,
        *,
        map_location: Any,
        trust_code: bool = False,
        verify: bool = False,
        placeholders: bool = False,
        mmap: bool = True,
    ) -> Any:
        """The whole file as torch loads it: what `ckptools.load` restores from.

        ``verify`` checks every record's CRC-32 first. A local zip is memory-mapped (``mmap``):
        tensors are read from the page cache when they are copied into the model and optimizer,
        so resuming needs no second copy of the checkpoint in anonymous memory; the mapping is
        private (copy-on-write): writing to a returned tensor never touches the file, and
        replacing or deleting the file later is safe. With ``placeholders`` entries torch's safe
        loader refuses (a Lightning checkpoint's ``pathlib.Path`` hyper-parameters) come back as
        inert placeholders, with a warning; otherwise they raise `UnsafeCheckpointError`.
        """
        try:
            if mmap and location.local:
                try:  # one open for the checks (and CRC-32s), then torch's
                    return load_file(location, map_location=map_location, weights_only=not trust_code, mmap=True,
                                     crc=verify)  # fmt: skip
                except CheckpointFormatError:
                    if verify:
                        verify_torch_file(location)  # damage: raised as such, not read again without a map
                    verify = False  # a filesystem that cannot map files (some FUSE mounts): read it as usual
            return load_file(location, map_location=map_location, weights_only=not trust_code, crc=verify)
        except UnsafeCheckpointError as refusal:
            if trust_code or not placeholders:
                raise
            return load_without_code(location, map_location, refusal, mmap=mmap)[0]

    def check(self, location: Location, *, records: bool = True) -> None:
        """Check every record's CRC-32 (`CheckpointFormatError` if one differs; a legacy file has none).

        ``records=False`` checks a local zip's container only (its central directory, every record
        inside the file), reading no record: for files whose CRC-32s were just written from what was
        copied into memory (a node-memory snapshot's).
        """
        opened = None if records else open_local_zip(location)  # the container read: the check
        if opened is None:
            verify_torch_file(location)
        else:
            opened[1].close()

    def is_lightning(self, location: Location) -> bool:
        """Whether a local zip is a Lightning checkpoint (its top level holds Lightning's version);
        False for remote and legacy files, whose entries would cost a download or a load."""
        if not is_local_zip(location):
            return False
        return LIGHTNING_VERSION_KEY in self.open(location, trust_code=False).entries

    def write_weights(self, location: Location, tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> None:
        """``torch.save`` of the bare weights, atomically (``metadata`` has nowhere to go)."""
        save_file(location, dict(tensors))

    def rename(self, location: Location, dst: str, transform: Transform, *, key: str | None) -> int:
        """A local zip: only ``data.pkl`` is rewritten and every tensor record copied byte for byte;
        entries that need classes torch's safe loader refuses are kept as they were, never loaded
        (nothing runs). A legacy or remote file goes through torch's safe loader."""
        path = location.url
        opened = open_local_zip(location)
        if opened is not None:  # one open: the pickle and the records copied come from the same file
            archive, src = opened
            with src:
                data = archive.read_pickle(src)
                try:
                    tree = loads(data, path, archive)
                except UnsafeCheckpointError as refusal:
                    tree, _ = lenient_tree(data, path, refusal, archive)  # other entries are written back as read
                tree, weights, renamed = _rename_in_tree(tree, locate_weights(tree, key=key, path=path), transform)
                payload = dumps(tree)
                atomic_write(dst, lambda f: archive.write_with_pickle(src, f, payload))
        else:  # legacy (pre-1.6) format or a remote URL: through torch
            ckpt = load_torch(location)
            import torch  # loaded by now (a file refused above is refused without it)

            located = locate_weights(ckpt, key=key, path=path, is_leaf=lambda v: isinstance(v, torch.Tensor))
            ckpt, weights, renamed = _rename_in_tree(ckpt, located, transform)
            save_file(dst, ckpt)
        return sum(1 for a, b in zip(weights, renamed) if a != b)


TORCH_FILE = TorchFile()


def _rename_in_tree(tree: Any, located: tuple[Any, Any, Any], transform: Transform) -> tuple[Any, Any, Any]:
    """Put the renamed weights where ``located`` (parent, key, weights) found them; return the
    tree (the renamed weights themselves when the tree was a bare state dict), old and new."""
    parent, key, weights = located
    renamed = transform(weights)
    if parent is None:
        return renamed, weights, renamed
    parent[key] = renamed
    return tree, weights, renamed


def lenient_tree(data: bytes, path: str, refusal: UnsafeCheckpointError, archive: Any = None) -> tuple[Any, list[str]]:
    """The tree of a ``data.pkl`` whose other entries need refused classes, with placeholders for
    them. The refusal stands when there are no weights beside them, or when a refused global
    runs code (``os.system``: a file made to attack, not a checkpoint with a ``Path`` in it)."""
    tree, skipped = loads_lenient(data, path, archive)
    if hostile(skipped):
        raise refusal
    refuse_whole_object(tree, path)
    try:
        locate_weights(tree, path=path)
    except Exception:  # noqa: BLE001 - no weights to give: nothing here is worth a lenient read
        raise refusal from None
    return tree, skipped


def load_torch(location: Location) -> Any:
    """torch.load safely, memory-mapping local zip files (tensors are read only when touched)."""
    return load_file(location, map_location="cpu", mmap=is_local_zip(location))


def load_whole(
    location: Location, trust_code: bool, *, mmap: bool, map_location: Any = "cpu", crc: bool = False
) -> Any:
    """The whole file through torch (``crc``: every record's CRC-32 checked first, in the same open);
    a trusted whole pickled module (``torch.save(model)``) as its ``state_dict()``, which is what a
    checkpoint of it would hold (never "0 tensors")."""
    try:
        return load_file(location, map_location=map_location, weights_only=True, mmap=mmap, crc=crc)
    except UnsafeCheckpointError:
        if not trust_code:
            raise
        tree = load_file(location, map_location=map_location, weights_only=False, mmap=mmap)
    import torch  # loaded by now

    return dict(tree.state_dict()) if isinstance(tree, torch.nn.Module) else tree


def torch_weights(location: Location, key: str | None, map_location: Any, trust_code: bool) -> dict[str, Any]:
    """The weights of a torch file, found under the usual names or ``key``."""
    import torch

    try:
        tree = load_whole(location, False, mmap=False, map_location=map_location)
    except UnsafeCheckpointError as refusal:
        if trust_code:
            tree = load_whole(location, True, mmap=False, map_location=map_location)
        else:
            # The weights never need the other entries' classes: read them without running code.
            return weights_without_code(location, key, map_location, refusal)
    return dict(locate_weights(tree, key=key, path=location.url, is_leaf=lambda v: isinstance(v, torch.Tensor))[2])


def loaded_tensor_info(devices: Mapping[int, str] | None = None) -> Callable[[Any], dict[str, Any] | None]:
    """A `walk_tree` describer for a tree torch loaded (``devices``: storage pointer -> saved device)."""
    import torch

    def describe(node: Any) -> dict[str, Any] | None:
        if not isinstance(node, torch.Tensor):
            return None
        if node.is_nested:  # no sizes of its own: how many tensors it holds, and their bytes
            parts = list(node.unbind())
            nbytes = sum(p.numel() * p.element_size() for p in parts)
            dtype = str(node.dtype).removeprefix("torch.")
            return {"shape": [len(parts)], "dtype": dtype, "bytes": nbytes, "device": "cpu", "storage": id(node)}
        if node.layout != torch.strided:  # sparse: its parts' bytes; no storage of its own
            parts = _sparse_parts(node)
            ptr = parts[-1].untyped_storage().data_ptr()
            nbytes = sum(p.numel() * p.element_size() for p in parts)
        else:
            ptr, nbytes = node.untyped_storage().data_ptr(), node.numel() * node.element_size()
        return {
            "shape": list(node.shape),
            "dtype": str(node.dtype).removeprefix("torch."),
            "bytes": nbytes,
            "device": (devices or {}).get(ptr, "cpu"),
            "storage": ptr,
        }

    return describe


def _sparse_parts(tensor: Any) -> list[Any]:
    """The dense tensors a sparse tensor is made of (indices first, values last)."""
    import torch

    if tensor.layout == torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]  # csc, bsc


def zip_records(location: Location) -> dict[int, tuple[str, int, int]] | None:
    """A local torch zip's records by where their data starts: ``(name, bytes, CRC-32)``, from its
    directory and data.pkl (one open, no other record read); None for a remote or legacy file."""
    opened = read_local_zip(location) if location.local else None
    if opened is None:
        return None
    archive = opened[0]
    return {start: (info.filename, info.file_size, info.CRC) for info, start in zip(archive.infos, archive.starts)}
