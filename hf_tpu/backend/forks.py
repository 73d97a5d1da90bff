"""The device after ``fork()``.

JAX's runtime does not survive ``os.fork()``: its threads are gone in the child, and the child's first
device computation waits for them forever. Once the parent has started the runtime, a forked child
that touches the device gets an immediate RuntimeError saying to use the "spawn" start method, as
CUDA does. A child that never touches the device (DataLoader workers producing CPU tensors) is fine,
and so is seeding (``torch.manual_seed`` in a worker), which only records numbers.
"""

from __future__ import annotations

import os

FORK_MESSAGE = (
    "Cannot use the tpu device in a forked subprocess: the parent process had already started it, and JAX's "
    "runtime does not survive fork(). To use tpu with multiprocessing, use the 'spawn' start method "
    "(torch.multiprocessing.set_start_method('spawn'), or multiprocessing.get_context('spawn')); DataLoader "
    "workers that only produce CPU tensors work with fork."
)

forked = False  # in a child forked after the runtime started
_watching = False


def _mark_forked() -> None:
    global forked
    forked = True


def watch_forks() -> None:
    """Called once the JAX runtime is up: children forked from now on may not use the device."""
    global _watching
    if not _watching:
        os.register_at_fork(after_in_child=_mark_forked)
        _watching = True


def in_bad_fork() -> bool:
    return forked


def check_not_forked() -> None:
    if forked:
        raise RuntimeError(FORK_MESSAGE)
