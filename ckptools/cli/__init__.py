"""``ckpt``: inspect, rename, convert, compare and verify checkpoint files.

The CLI is thin: it parses arguments, calls the library, and renders with rich. A
`CheckpointError` is turned into one line on stderr and exit code 2 (1 for a negative
answer: ``diff`` found differences, ``verify`` found damage). Heavy modules (torch) are imported
inside the commands, so ``ckpt --help`` stays fast.
"""

from __future__ import annotations

import sys

from .app import app
from .reading import diff, info, verify
from .writing import add_module, convert, strip_module

__all__ = ["app", "main"]

# The commands, in the order `ckpt --help` lists them.
app.command()(info)
app.command("strip-module")(strip_module)
app.command("add-module")(add_module)
app.command()(convert)
app.command()(diff)
app.command()(verify)


def main() -> None:
    """Entry point of the ``ckpt`` executable."""
    for stream in (sys.stdout, sys.stderr):
        # A tensor name can hold a lone surrogate (torch.save pickles any str): shown escaped,
        # never a UnicodeEncodeError in the middle of a table.
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    app(prog_name="ckpt")


if __name__ == "__main__":  # pragma: no cover
    main()
