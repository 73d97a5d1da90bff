"""Counters of graph-mode work (JAX-free), for users, tests and benchmarks."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_STATS: dict[str, float] = {}


def reset_compile_stats() -> None:
    """Sets every counter of :func:`compile_stats` back to zero."""
    with _lock:
        _STATS.update(
            graphs=0, compilations=0, cache_hits=0, disk_cache_hits=0, calls=0, compile_seconds=0.0, fallbacks=0,
            warm_starts=0, fast_calls=0, decode_loops=0,
        )


reset_compile_stats()


def count(name: str, amount: float = 1) -> None:
    with _lock:
        _STATS[name] += amount


def compile_stats() -> dict[str, float]:
    """What graph mode has done since the start (or :func:`reset_compile_stats`).

    - ``graphs``: ATen graphs (forward or backward) lowered to a JAX function;
    - ``compilations``: XLA programs built, one per lowered graph and input signature (shapes, dtypes,
      static sizes) unless an identical program exists already (a graph Dynamo recompiled with
      symbolic sizes meeting a size seen before); a program loaded from the on-disk cache counts
      here and in ``disk_cache_hits``;
    - ``cache_hits``: runs of an already built program;
    - ``compile_seconds``: wall time spent tracing, lowering and compiling (or loading) programs;
    - ``calls``: runs of a lowered graph (``compilations + cache_hits``);
    - ``fast_calls``: those among ``cache_hits`` that found every input as the graph's previous call left it
      (the same weights and caches, new tensors of the same shapes: a decode step) and skipped working
      out placement and executable again (see :mod:`.fast_call`);
    - ``fallbacks``: graphs with an operator graph mode cannot lower, run eagerly op by op instead;
    - ``decode_loops``: runs of decoding's one program (see :mod:`.decode_loop`): one per ``generate``,
      one per 8 tokens with a streamer;
    - ``warm_starts``: ATen graphs loaded from the on-disk cache of AOTAutograd's results instead of
      traced (see :mod:`.warm_start`).
    """
    with _lock:
        return dict(_STATS)
