"""Sizes and durations as operators write them ("8GiB", "512MiB", "1.5GB", "15s", "1m").

Shared by the agent's flags and config file and by the CLI, so `--pool-memory 2GiB` and
`kvctl pool resize --size 2GiB` mean the same number of bytes.
"""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in `text` ("8GiB", "512MiB", "1.5GB", "4096"); ValueError says what is accepted."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    match = _NUMBER_UNIT.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size; write a number with an optional unit such as "
            "4096, 512MiB, 8GiB or 1.5GB"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_duration(text: str | float) -> float:
    """Seconds in `text` ("15s", "1m", "500ms", "2h", "30"); ValueError says what is accepted."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a duration cannot be negative: {text}")
        return float(text)
    match = _NUMBER_UNIT.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _DURATION_UNITS:
        raise ValueError(
            f"cannot read {text!r} as a duration; write a number with a unit such as "
            "500ms, 15s, 1m or 2h"
        )
    return float(match.group(1)) * _DURATION_UNITS[unit]


def format_bytes(count: float) -> str:
    """Bytes in binary units with three significant digits: 1536 -> "1.50 KiB"."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            whole = unit == "B" or abs(value) >= 1000  # `.3g` would print 1000 as 1e+03
            return f"{value:.0f} {unit}" if whole else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
