"""How ckptools words counts and sizes in what it prints."""

from __future__ import annotations


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: what every count ckptools prints says.

    Examples:
        >>> plural(1, "tensor"), plural(3, "shard")
        ('1 tensor', '3 shards')
    """
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def human_size(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ``3.2 GiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
