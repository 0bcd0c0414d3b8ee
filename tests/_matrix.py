"""The guarantees matrix's cells (tests/test_guarantees.py holds the table, tests/_guarantee_payloads.py the
weights-only cells)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PROMISES = {
    "whole": "whole or absent after a kill",
    "checked": "every byte checked against a checksum on the way in",
    "fallback": "a damaged newest falls back to the newest good one, on every rank",
    "once": "read once between the ranks where read-once is the rule",
    "replicas": "DDP's replicas compared before a save writes",
    "weights_only": "torch's weights-only refusals refused, with no side effect",
    "named": "bad input is a named error, and nothing is changed",
    "valid": "a valid file torch reads is read: never called corrupt, never a hang",
    "exact": "a resume is bit-exact",
    "stalled": "a stuck storage is one named error on every rank within the bound, never a hang; behind a slow one "
    "an async save is skipped, not waited for",
}


@dataclass(frozen=True)
class Cell:
    promise: str
    storage: str
    writer: str
    entry: str
    world: int
    run: Callable[..., None] | None = None  # run here: run(tmp_path, request)
    held_by: str = ""  # a test elsewhere: "tests/file.py::test_name"
    na: str = ""  # why the cell does not apply
    marks: tuple[Any, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.promise}-{self.storage}-{self.writer}-{self.entry}-w{self.world}".replace(" ", "_")

    @property
    def how(self) -> str:
        if self.run is not None:
            return "here"
        return f"`{self.held_by.split('::')[-1]}`" if self.held_by else f"n/a: {self.na}"
