"""A Hugging Face ``save_pretrained`` folder, or an Accelerate ``save_state`` folder.

The folder holds one model file (``model.safetensors[.index.json]`` or
``pytorch_model.bin[.index.json]``), opened by that file's own layout; Accelerate adds
``optimizer.bin``, ``scheduler.bin``, ``random_states_*.pkl`` and the like beside it, which are
listed as extras and, for the torch files among them, checked by `HuggingFaceFolder.verify` too.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointLayoutError
from ..serialization import verify_torch_file
from ..storage import Location, resolve
from ..view import CheckpointView
from .base import Layout, Transform
from .safetensors_file import SAFETENSORS_FILE
from .sharded import SHARDED_INDEX, rename_in_folder
from .torch_file import TORCH_FILE

# What Accelerator.save_state writes beside the model (accelerate/utils/constants.py).
_ACCELERATE_EXTRAS = {
    "optimizer*.bin": "optimizer state",
    "scheduler*.bin": "LR scheduler state",
    "sampler*.bin": "sampler state",
    "dl_state_dict*.bin": "DataLoader state",
    "scaler.pt": "GradScaler state",
    "random_states_*.pkl": "RNG states (a pickle; not read)",
    "custom_checkpoint_*.pkl": "custom object state (a pickle; not read)",
}
MODEL_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


@dataclass
class _Opened:
    inner: CheckpointView
    checked: list[str]


def model_file(folder: str, names: set[str] | list[str]) -> str:
    """The model file of a Hugging Face or Accelerate folder, or `CheckpointLayoutError` saying none is there."""
    model = next((n for n in MODEL_FILES if n in names), None)
    if model is None:
        found = ", ".join(sorted(names)[:12]) or "nothing"
        raise CheckpointLayoutError(
            f"{folder} is a folder but not a checkpoint layout ckptools reads: it holds no .metadata (DCP) and none "
            f"of {', '.join(MODEL_FILES)} (it holds {found}); pass the checkpoint file inside it"
        )
    return model


class HuggingFaceFolder(Layout):
    """A local folder holding a model file (and, for Accelerate, the training state beside it)."""

    name = "Hugging Face folder"
    folder = True

    def open(self, location: Location, *, trust_code: bool) -> CheckpointView:
        folder = location.path.rstrip("/") or "/"
        names = set(os.listdir(folder))
        model = model_file(folder, names)
        extras = {n: what for n in sorted(names) for pat, what in _ACCELERATE_EXTRAS.items() if fnmatch.fnmatch(n, pat)}
        inner_loc = resolve(os.path.join(folder, model))
        if model.endswith(".json"):
            view = SHARDED_INDEX.open(inner_loc, trust_code=trust_code)
        elif model.endswith(".safetensors"):
            view = SAFETENSORS_FILE.open(inner_loc, trust_code=trust_code)
        else:
            view = TORCH_FILE.open(inner_loc, trust_code=trust_code)
        kind = "Accelerate save_state folder" if extras else "Hugging Face folder"
        for other in (n for n in MODEL_FILES if n in names and n != model):  # say which one was read
            extras[other] = f"also a model file; {model} was read"
        for n in sorted(names):  # Accelerate's further models: model_1.safetensors, pytorch_model_1.bin
            if re.fullmatch(r"(model|pytorch_model)_\d+\.(safetensors|bin)", n):
                extras[n] = "another model's weights (read it by passing the file)"
        # Accelerate's optimizer/scheduler/scaler states are torch zips: their CRC-32s are checked too.
        checked = [os.path.join(folder, n) for n in extras if n.endswith((".bin", ".pt")) and "model" not in n]
        return CheckpointView(
            path=folder, format=f"{kind}, {view.format}", tensors=view.tensors, entries=view.entries,
            metadata=view.metadata, files=view.files, extras=extras, skipped=view.skipped, file_bytes=view.file_bytes,
            layout=self, location=location, trust_code=trust_code, state=_Opened(view, checked),
        )  # fmt: skip

    def weights(self, view: CheckpointView, key: str | None, map_location: Any) -> Mapping[str, Any]:
        return view.state.inner.weights(key, map_location=map_location)  # type: ignore[no-any-return]

    def verify(self, view: CheckpointView) -> str:
        opened: _Opened = view.state
        said = opened.inner.verify()
        if not opened.checked:
            return said
        for path in opened.checked:
            verify_torch_file(path)
        return f"{said}; {', '.join(os.path.basename(p) for p in opened.checked)}: every record's CRC-32 matches"

    def rename(self, location: Location, dst: str, transform: Transform, *, key: str | None) -> int:
        """Each weight file renamed, the index rewritten, the other files copied (`rename_in_folder`)."""
        folder = location.path.rstrip("/") or "/"
        if key is not None:
            raise CheckpointLayoutError(
                f"{location.url} is a folder of bare weights: it has no entries, so key= does not apply"
            )
        return rename_in_folder(folder, model_file(folder, os.listdir(folder)), dst, transform)


HUGGING_FACE_FOLDER = HuggingFaceFolder()
