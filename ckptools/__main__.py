"""``python -m ckptools`` runs the ``ckpt`` CLI."""

from ckptools.cli import main

main()
