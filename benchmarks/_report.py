"""Headline figures of a benchmark, machine-readable: what ``benchmarks/run_all.py`` collects.

A benchmark prints its tables as it always has and, for each figure worth tracking, also calls
``report(name, value, unit, compared_with)``. Without ``HF_TPU_BENCH_REPORT`` in the environment (a
benchmark run by hand) that does nothing; with it set to a file path (``run_all.py`` sets it), it appends
one JSON line ``{"name", "value", "unit", "compared_with"}`` to that file. Name the figure so that it
says which way a ratio is taken (``"tpu / jax.jit time per op"``: below 1 = tpu faster; ``"tokens/s, tpu
/ pure jax"``: above 1 = tpu faster).
"""

from __future__ import annotations

import json
import math
import os

ENVIRONMENT_VARIABLE = "HF_TPU_BENCH_REPORT"


def report(name: str, value: float, unit: str = "x", compared_with: str = "") -> None:
    """Records one headline figure (``unit`` ``"x"`` for a ratio) when ``HF_TPU_BENCH_REPORT`` names a file."""
    path = os.environ.get(ENVIRONMENT_VARIABLE)
    if not path:
        return
    value = float(value)
    line = {"name": name, "value": value if math.isfinite(value) else None, "unit": unit,
            "compared_with": compared_with}
    with open(path, "a") as file:  # one short write per line: lines from several processes do not interleave
        file.write(json.dumps(line) + "\n")
