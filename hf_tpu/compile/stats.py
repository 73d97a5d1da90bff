"""Counters of graph-mode work (JAX-free), for tests and benchmarks."""

from __future__ import annotations

_STATS = {"graphs": 0, "traces": 0, "calls": 0}


def count(name: str) -> None:
    _STATS[name] += 1


def compile_stats() -> dict[str, int]:
    """``graphs``: ATen graphs lowered; ``traces``: times ``jax.jit`` traced one of them (once per
    graph and input shape); ``calls``: runs of a lowered graph, each one jitted XLA program."""
    return dict(_STATS)


def reset_compile_stats() -> None:
    """Sets every counter of :func:`compile_stats` back to zero."""
    for name in _STATS:
        _STATS[name] = 0
