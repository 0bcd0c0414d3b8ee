"""A pytest plugin: every ``accelerate.Accelerator`` these tests make is attached to ckptools
(``ckptools.integrations.accelerate.attach``), so each ``save_state`` / ``load_state`` they call goes
through it. The session fails if no save was sealed by ckptools: the suite must have run through it."""

from __future__ import annotations

from typing import Any

import accelerate
import pytest

import ckptools.integrations.accelerate as integration

SEALED: list[str] = []
_own_init = accelerate.Accelerator.__init__
_own_seal = integration._seal


def _attached_init(self: Any, *args: Any, **kwargs: Any) -> None:
    _own_init(self, *args, **kwargs)
    integration.attach(self)


def _counted_seal(partial: str, final: str, total_limit: int | None) -> None:
    _own_seal(partial, final, total_limit)
    SEALED.append(final)


accelerate.Accelerator.__init__ = _attached_init  # type: ignore[method-assign]
integration._seal = _counted_seal


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == 0 and not SEALED:
        print("\nno save_state went through ckptools: the suite did not test the integration")
        session.exitstatus = 1
    else:
        print(f"\n{len(SEALED)} save_state folders sealed by ckptools")
