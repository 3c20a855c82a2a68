"""Byte rates written with their unit in the estate files: ``"200 MB/s"``, ``"1.5 Gbit/s"``.

A bare number is refused: whether 200 means MB/s or Mbit/s is an eightfold question, and a cap set
eight times too high protects nothing.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator

_UNITS = {
    "B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9,
    "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3,
    "kbit": 1e3 / 8, "Mbit": 1e6 / 8, "Gbit": 1e9 / 8,
}
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]+)\s*/\s*s\s*$")
_EXAMPLE = "e.g. '200 MB/s' (units: " + ", ".join(f"{u}/s" for u in _UNITS) + ")"


def parse_rate(value: object) -> float:
    """Bytes per second of a rate with its unit; ValueError saying what to write otherwise."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f"{value!r} has no unit; write the rate with one, {_EXAMPLE}")
    match = _RATE.match(value)
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"{value!r} is not a byte rate; write {_EXAMPLE}")
    rate = float(match.group(1)) * _UNITS[match.group(2)]
    if rate <= 0:
        raise ValueError(f"{value!r}: a cap of 0 would stop every upload; give a rate above 0, or remove the key "
                         "for no cap")
    return rate


# A byte rate from the estate files, in bytes per second.
Rate = Annotated[float, BeforeValidator(parse_rate)]
