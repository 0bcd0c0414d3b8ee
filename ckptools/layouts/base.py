"""The layout protocol: what every checkpoint layout module implements, and the view it returns.

A *layout* is one way a checkpoint sits on disk (one torch file, one safetensors file, a
sharded index and its shards, a Hugging Face or Accelerate folder, a DCP folder). Each is one
module of this package holding one `Layout` subclass; `ckptools.layouts.detect` decides which
one a path is, once, and every reader and command goes through what it returns.

The order of calls, as DCP's ``StorageReader`` documents its own:

1. ``detect(location)`` (the registry) picks the layout from the `Location` alone.
2. `Layout.open` builds a `CheckpointView` from headers and pickles only: names, dtypes,
   shapes, entries, metadata. No tensor data is read; nothing from the file is run unless
   ``trust_code`` is set.
3. `Layout.weights` (through `CheckpointView.weights`) reads the model weights, lazily: a
   sharded layout reads one shard at a time, when a tensor is asked for.
   `Layout.entry` (through `CheckpointView.entry`) reads one entry of a layout that has entries
   (a torch file: ``optimizer``, ``hyper_parameters``); the others hold bare weights and refuse.
4. `Layout.verify` (through `CheckpointView.verify`) reads everything and checks every checksum
   the layout stores; it may be called without calling `Layout.weights` first.
5. `Layout.rename`, only where the layout allows it (the names of a DCP folder live in a pickled
   ``.metadata``: no rename), writes a copy with the weights renamed, never decoding a tensor.

`Layout.read_weights` is steps 2 and 3 (and 4 when asked) in one call, for a caller that wants
only the weights; single files override it to read straight, without a view.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ..codecs.record import META_KEY
from ..errors import CheckpointLayoutError
from ..storage import Location
from ..text import plural
from ..view import CheckpointView, TensorInfo, Verification

# Renames the weights: a state dict in, the renamed state dict out (``ckptools.strip_prefix``).
Transform = Callable[[Mapping[str, Any]], Mapping[str, Any]]


class Layout:
    """One checkpoint layout. Subclasses implement `open`, `weights` and `verify`, and `rename`
    where the layout allows it; see the module docstring for the order of calls.

    Attributes:
        name: the layout in words, for messages.
        training_state: whether files of this layout can hold a whole training checkpoint (a
            torch file can; the others hold bare weights, which `ckptools.load` gives to a model
            entry).
        folder: whether the checkpoint is a folder of files, so that a renamed copy is a folder too.
    """

    name: ClassVar[str] = "checkpoint"
    training_state: ClassVar[bool] = False
    folder: ClassVar[bool] = False

    def open(self, location: Location, *, trust_code: bool) -> CheckpointView:
        """Read the headers; return the view. No tensor data is read."""
        raise NotImplementedError

    def weights(self, view: CheckpointView, key: str | None, map_location: Any) -> Mapping[str, Any]:
        """The model weights of an opened checkpoint (``key``: the entry that holds them)."""
        raise NotImplementedError

    def verify(self, view: CheckpointView) -> Verification:
        """Read everything, check every checksum; return what was checked and what no checksum covers."""
        raise NotImplementedError

    def entry(self, view: CheckpointView, key: str, map_location: Any) -> Any:
        """The node at ``key`` (dotted; `ckptools.codecs.trees.entry_at`) of a checkpoint that has
        entries. Layouts of bare weights have none: `CheckpointLayoutError`."""
        raise CheckpointLayoutError(f"{view.path} is a {self.name} of bare weights: it has no entries to look in")

    def read_weights(
        self, location: Location, *, key: str | None, map_location: Any, verify: bool, trust_code: bool = False
    ) -> Mapping[str, Any]:
        """The weights straight from ``location`` (``verify``: check it whole first)."""
        view = self.open(location, trust_code=trust_code)
        if verify:
            view.verify()
        return view.weights(key, map_location=map_location)

    def rename(self, location: Location, dst: str, transform: Transform, *, key: str | None) -> int:
        """Write the checkpoint to ``dst`` with its weights renamed; return how many names changed."""
        raise CheckpointLayoutError(f"{location.url} is a {self.name}, whose weights ckptools cannot rename")

    def write_weights(self, location: Location, tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> None:
        """Write bare weights (CPU tensors) as a file of this layout, atomically (see
        `ckptools.layouts.named.writer_for`); ``metadata`` goes where the layout keeps strings."""
        raise CheckpointLayoutError(f"ckptools writes no {self.name} of bare weights")


def walk_tree(
    tree: Any, describe: Callable[[Any], dict[str, Any] | None]
) -> tuple[list[TensorInfo], dict[str, str], dict[str, Any]]:
    """Tensors, entry lines and ckptools metadata of a checkpoint tree (loaded or parsed).

    ``describe(node)`` returns shape, dtype, bytes, device and a storage identity for a tensor
    (a repeated storage marks the tensor as shared), None for anything else.
    """
    tensors: list[TensorInfo] = []
    seen: set[Any] = set()
    # A container the pickle shares (memoized, written once) is walked once, under the first name
    # that reaches it: a file of a few KB can share lists so that its tree has 2^60 paths.
    walked: set[int] = set()

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, (Mapping, list, tuple)):
            if id(node) in walked:
                return
            walked.add(id(node))
        info = describe(node)
        if info is not None:
            storage = info.pop("storage")
            shared = storage is not None and storage in seen and info["bytes"] > 0
            seen.add(storage)
            tensors.append(TensorInfo(name=prefix, shared=shared, **info))
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
    return tensors, entries, metadata


def _describe(value: Any, tensors: list[TensorInfo]) -> str:
    """One line about a top-level entry, given the tensors found under it."""
    if tensors and not isinstance(value, (Mapping, list, tuple)):  # the entry is itself a tensor
        return f"tensor {tensors[0].shape} {tensors[0].dtype}"
    if isinstance(value, Mapping):
        return f"dict, {plural(len(value), 'key')}" + (f", {plural(len(tensors), 'tensor')}" if tensors else "")
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
