"""The guarantees matrix's weights-only cells: files torch refuses or reads (tests/_payloads.py) through every
command and ``ck.load`` (issue 65, 5.). Run in-process (the CLI through typer's runner): milliseconds a cell."""

from __future__ import annotations

import hashlib
import pathlib
import time
from collections.abc import Callable
from typing import Any

import _payloads
import torch
from _matrix import Cell
from typer.testing import CliRunner

import ckptools as ck
from ckptools.cli import app

ENTRIES = ("ckpt info", "ckpt verify", "ckpt diff", "ckpt strip-module", "ckpt convert", "ck.load")


def _ckpt(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _refused(payload: str, entry: str) -> Callable[..., None]:
    """The file is refused with the tensor named: exit 2 and one line on stderr (verify: DAMAGED, exit 1),
    no output written, the input unchanged."""

    def run(tmp_path: pathlib.Path, request: Any) -> None:
        path = tmp_path / f"{payload}.pt"
        _payloads.REFUSED[payload](path)
        before = _digest(path)
        out = tmp_path / "out.safetensors" if entry == "ckpt convert" else tmp_path / "out.pt"
        if entry == "ck.load":
            try:
                ck.load(path)
            except ck.CheckpointFormatError as err:
                said = str(err)
            else:
                raise AssertionError(f"ck.load read {payload}")
        else:
            args = {"ckpt info": [str(path)], "ckpt verify": [str(path)], "ckpt diff": [str(path), str(path)],
                    "ckpt strip-module": [str(path), "-o", str(out)],
                    "ckpt convert": [str(path), str(out)]}[entry]  # fmt: skip
            result = _ckpt(entry.split()[1], *args)
            if entry == "ckpt verify":
                assert result.exit_code == 1 and result.stdout.startswith("DAMAGED"), result.stdout
                said = result.stdout
            else:
                assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
                said = result.stderr
        assert "'w'" in said and (payload == "numel_overflow" or "past its end" in said), said
        assert not out.exists() and _digest(path) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left either

    return run


def _read(payload: str, entry: str) -> Callable[..., None]:
    """A valid file torch writes is read by every command, at once: never called corrupt, never a hang."""

    def run(tmp_path: pathlib.Path, request: Any) -> None:
        path = tmp_path / f"{payload}.pt"
        {"shared_paths": _payloads.shared_paths, "protocol_4": _payloads.protocol_4,
         "meta_tensors": _payloads.meta_tensors}[payload](path)  # fmt: skip
        expected = torch.load(path, weights_only=False)  # the reference: torch's own reading of the file
        started = time.monotonic()
        if entry == "ck.load":
            got = ck.load(path)
            weights = got.get("state_dict", got)
            reference = expected.get("state_dict", expected)
            for name, value in reference.items():
                if isinstance(value, torch.Tensor) and not value.is_meta:
                    assert torch.equal(weights[name], value), name
                elif isinstance(value, torch.Tensor):
                    assert weights[name].is_meta and weights[name].shape == value.shape, name
        elif entry == "ckpt diff":
            other = tmp_path / "other.pt"
            {"shared_paths": _payloads.shared_paths, "protocol_4": _payloads.protocol_4,
             "meta_tensors": _payloads.meta_tensors}[payload](other)  # fmt: skip
            result = _ckpt("diff", str(path), str(other))
            assert result.exit_code == 0 and " match" in result.stdout, result.stdout + result.stderr
            if payload == "meta_tensors":  # named as not compared, never "equal"
                assert "not compared: the values of a (a meta tensor holds none" in result.stdout, result.stdout
        elif entry in ("ckpt strip-module", "ckpt convert"):
            out = tmp_path / ("out.safetensors" if entry == "ckpt convert" else "out.pt")
            result = _ckpt(entry.split()[1], str(path), *(["-o"] if entry == "ckpt strip-module" else []), str(out))
            if payload == "meta_tensors" and entry == "ckpt convert":  # no values to write: said, nothing written
                assert result.exit_code == 2 and "meta device" in result.stderr and not out.exists(), result.stderr
                return
            assert result.exit_code == 0, result.stdout + result.stderr
            written = ck.load_state_dict(out, strip=None)
            weights = expected.get("state_dict", expected)
            for name, value in weights.items():
                if isinstance(value, torch.Tensor) and not value.is_meta:
                    assert torch.equal(written[name.removeprefix("module.")], value), name
        else:
            result = _ckpt(entry.split()[1], str(path))
            assert result.exit_code == 0, result.stdout + result.stderr
            if entry == "ckpt verify":
                assert result.stdout.startswith("OK"), result.stdout
        assert time.monotonic() - started < 20, f"{entry} of {payload} took {time.monotonic() - started:.0f} s"

    return run


_WHAT = {
    "size_past_storage": "a tensor whose size reaches past its storage",
    "stride_past_storage": "a tensor whose stride reaches past its storage",
    "offset_past_storage": "a tensor whose offset reaches past its storage",
    "numel_overflow": "a tensor whose numel overflows int64",
    "build_set_out_of_range": "a tensor whose BUILD calls set_ past its storage",
}
_VALID = {
    "shared_paths": "torch.save of lists shared 2^60 ways",
    "protocol_4": "torch.save(pickle_protocol=4)",
    "meta_tensors": "torch.save of a meta tensor",
}

PAYLOAD_CELLS = [
    *(Cell("weights_only", "local", f"{what} (torch refuses it)", entry, 1, run=_refused(payload, entry))
      for payload, what in _WHAT.items() for entry in ENTRIES),
    *(Cell("valid", "local", what, entry, 1, run=_read(payload, entry))
      for payload, what in _VALID.items() for entry in ENTRIES),
]  # fmt: skip
