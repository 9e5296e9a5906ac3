"""Sizes on ``matrixfsdp plan``'s command line: device memory (``80GiB``) and dtypes.

The planning itself (every layout searched and timed) is :mod:`matrixfsdp.advisor.search`.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20,
          "mb": 10**6, "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40,
          "tb": 10**12}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80 GB"`` (10^9), ``"80G"`` (GiB), ``"1024"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"expected a size such as 80GiB, 80GB or 85899345920, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
