"""A write announced in flight makes every ckptools look-up of its path wait, except its own writer's."""

from __future__ import annotations

import threading
import time

import torch

import ckptools as ck
from ckptools.storage import paths as in_flight
from ckptools.storage import resolve


def test_a_reader_of_a_path_in_flight_waits_for_its_write(tmp_path):
    path = str(tmp_path / "bg.pt")
    write = in_flight.announce(path)
    seen: list[object] = []

    def writer() -> None:
        write.doing()
        resolve(path)  # the writer's own look-up never waits for itself
        time.sleep(0.3)
        torch.save({"w": torch.ones(2)}, path)
        write.done()

    def reader() -> None:
        seen.append(ck.load(path)["w"])  # through resolve: after the write, never before it

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(seen) == 1 and torch.equal(seen[0], torch.ones(2))
    assert time.monotonic() - started >= 0.3
    in_flight.wait_for(path)  # done: returns at once
    relative = in_flight.announce(str(tmp_path / "x" / ".." / "bg.pt"))  # one key for one file
    assert in_flight._WRITES[in_flight._key(path)] is relative
    relative.done()
    assert in_flight._WRITES == {}
