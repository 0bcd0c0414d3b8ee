"""Reading a torch zip whose other entries need refused classes, with inert placeholders for them.

torch's weights-only loader refuses a whole Lightning checkpoint for one ``pathlib.Path`` among
its hyper-parameters. ckptools reads such a file with `placeholders`, a ``pickle_module`` for
``torch.load`` that builds exactly torch's allowlist and stands an inert `Opaque` in for every
other global, after ckptools' own torch-free reader has vetted the pickle (structure, storage
sizes, globals that run code).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any, ClassVar

from .. import log
from ..codecs.parsed import Opaque
from ..codecs.pickles import LenientReader, PyUnpickler, canonical, hostile, loads_lenient
from ..codecs.torchzip import open_local_zip
from ..codecs.trees import locate_weights
from ..errors import CheckpointFormatError, UnsafeCheckpointError
from ..storage import Location
from .torch_io import load_open


def refuse_whole_object(tree: Any, path: str) -> None:
    """Refuse, saying so, a file that is one pickled object of a refused class (``torch.save(model)``)."""

    if isinstance(tree, Opaque) and tree.cls is not None:
        raise UnsafeCheckpointError(
            f"{path} is a whole pickled {tree.name} object (torch.save(model)), not a dict of weights: only "
            "that class's code can rebuild it, so it was refused and nothing was executed. For a file you trust, "
            "--trust-code (weights_only=False) reads its state_dict(); better, re-save it as "
            "torch.save(model.state_dict(), path)"
        )


def weights_without_code(
    location: Location, key: str | None, map_location: Any, refusal: UnsafeCheckpointError
) -> dict[str, Any]:
    """The weights of a local zip checkpoint whose *other* entries need refused classes.

    The file is read by `load_without_code` (those classes as inert placeholders, nothing is
    imported or run) and the weights found as usual. Raises ``refusal`` when that cannot be done
    (a remote or legacy file, the weights themselves needing such a class).
    """
    import torch

    tree, _ = load_without_code(location, map_location, refusal)
    try:
        weights = locate_weights(tree, key=key, path=location.url, is_leaf=lambda v: isinstance(v, torch.Tensor))[2]
    except CheckpointFormatError:
        if key is None and isinstance(tree, Opaque):
            raise refusal from None
        raise
    return dict(weights)


def load_without_code(
    location: Location, map_location: Any, refusal: UnsafeCheckpointError, *, mmap: bool = False
) -> tuple[Any, list[str]]:
    """The whole tree of a local zip checkpoint some of whose entries need refused classes.

    Tensors, dtypes, devices and containers load as ``torch.load(weights_only=True)`` loads them
    (torch's own allowlist, and whatever ``torch.serialization.add_safe_globals`` added); every
    other global is an inert `ckptools.codecs.pickles.Opaque` placeholder that holds what the pickle
    said about it: nothing is imported, constructed or called. Files naming code-running modules
    (`ckptools.codecs.pickles.hostile`) raise ``refusal``, as do remote and legacy files. Warns once,
    naming what was skipped. Returns the tree and the skipped globals.
    """

    path = location.url
    opened = open_local_zip(location)
    if opened is None:
        raise refusal
    archive, handle = opened
    with handle:  # one open: the pickle vetted here is the one unpickled below
        # Our own torch-free reader vets the pickle first (structure, storage sizes, hostile names).
        parsed, skipped = loads_lenient(archive.read_pickle(handle), path, archive)
        if hostile(skipped):
            raise refusal
        refuse_whole_object(parsed, path)
        if not isinstance(parsed, Mapping):
            raise refusal
        unpickler = placeholders(path)
        handle.seek(0)
        tree = load_open(handle, path, local=True, map_location=map_location, weights_only=False, mmap=mmap,
                         pickle_module=unpickler)  # fmt: skip
    log.warn(
        f"{path}: read without loading {', '.join(skipped)} (inert placeholders stand in for them; nothing was "
        "executed). To load the whole file, trust it and use torch.load(..., weights_only=False)",
        once=f"weights {path}",
    )
    return tree, skipped


def placeholders(path: str) -> Any:
    """A ``pickle_module`` for ``torch.load`` whose unpickler builds torch's allowlisted globals
    and stands an inert `Opaque` in for every other one.

    torch's own weights-only unpickler refuses a whole file for one ``pathlib.Path``; this one
    differs from it only there. It is the pure-Python unpickler (no memo table sized by a hostile
    index); ``BUILD`` sets state only where torch's safe loader does, or on a placeholder.
    """
    import types
    from collections import OrderedDict

    import torch
    import torch._weights_only_unpickler as safe

    allowed = {**safe._get_allowed_globals(), **safe._get_user_allowed_globals()}  # type: ignore[no-untyped-call]
    buildable = {torch.Tensor, torch.nn.Parameter, OrderedDict, *(t for t in allowed.values() if isinstance(t, type))}

    class Unpickler(PyUnpickler):  # type: ignore[misc]  # the pure-Python one (typed Any)
        dispatch: ClassVar[dict[int, Any]] = dict(PyUnpickler.dispatch)
        _path = path  # named in LenientReader's errors

        def find_class(self, module: str, name: str) -> Any:
            module, name = canonical(module, name)
            real = allowed.get(f"{module}.{name}")
            if real is not None:
                return real
            if hostile([f"{module}.{name}"]):  # vetted above; kept so this reader never resolves one alone
                raise UnsafeCheckpointError(f"refused {module}.{name}: it runs code")
            return Opaque(module, name)

        def load_build(self) -> None:
            state, inst = self.stack[-1], self.stack[-2]
            if state is None or (isinstance(state, (dict, tuple)) and not any(state)):
                self.stack.pop()  # an empty state (OmegaConf writes them): pickle sets nothing either
            elif isinstance(inst, Opaque) or type(inst) in buildable:  # where torch's safe loader sets state
                super().load_build()
            else:
                raise UnsafeCheckpointError(f"refused to set the state of a {type(inst).__name__}")

        dispatch[pickle.BUILD[0]] = load_build
        dispatch[pickle.NEWOBJ[0]] = LenientReader.load_newobj
        dispatch[pickle.NEWOBJ_EX[0]] = LenientReader.load_newobj_ex

    def load(*_: Any, **__: Any) -> Any:  # torch calls it for legacy files only, which never come here
        raise UnsafeCheckpointError(f"{path}: a legacy (pre-1.6) file cannot be read with placeholders")

    return types.SimpleNamespace(Unpickler=Unpickler, load=load, __name__="ckptools_placeholders")
