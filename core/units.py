"""Sizes and counts as people write them: ``40GiB``, ``1.03T``.

    parse_bytes("40GiB"), format_bytes(3 << 30), format_count(8_030_261_248)   # 42949672960, '3.00 GiB', '8.03B'
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, key: str = "value") -> int:
    """``"40GiB"`` -> ``42949672960``; also ``kB MB GB TB KiB MiB GiB TiB`` and plain numbers.

    Example:
        parse_bytes("1.5 GB")  # 1500000000
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{key}: cannot read {text!r} as a size; write e.g. 40GiB, 80GB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (``1.50 GiB``).

    Example:
        format_bytes(1536 << 20)  # '1.50 GiB'
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"


def format_count(n: float) -> str:
    """A count in the largest unit (K, M, B, T) that keeps it at least 1.

    Example:
        format_count(1_026_408_232_448)  # '1.03T'
    """
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))
