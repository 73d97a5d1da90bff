"""``hf-tpu launch [--nproc-per-node N] [torchrun options...] script.py [args...]``: torchrun, one process per chip.

The arguments are torchrun's (``python -m torch.distributed.run``), parsed by torchrun's own parser, so every
torchrun option passes through (``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--rdzv-backend``,
``--master-port``, ...). Without ``--nproc-per-node`` (or torchrun's ``PET_NPROC_PER_NODE``) it is the number
of local chips, which a subprocess counts (``hf-tpu info --chips``): on a TPU VM libtpu can be opened by one
process at a time, so the launcher itself never opens the chips its workers need. The launcher then becomes
torchrun (``exec``): torchrun's exit status is the command's, and signals reach torchrun directly.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import NoReturn, Sequence

from .models import CommandError

COUNT_TIMEOUT_S = 300
_TORCHRUN = ("-m", "torch.distributed.run")
_NPROC_ENV = "PET_NPROC_PER_NODE"  # torchrun reads each option from PET_<OPTION> too


def local_chip_count() -> int:
    """The number of chips this host has for the tpu device (``torch.tpu.device_count()``: TPU chips, else
    JAX's stand-in devices, ``HF_TPU_NUM_DEVICES`` virtual ones on a CPU host), counted in a subprocess that
    exits before anyone else needs the chips."""
    command = [sys.executable, "-m", "hf_tpu.cli", "info", "--chips"]
    try:
        counted = subprocess.run(command, capture_output=True, text=True, timeout=COUNT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CommandError(f"counting the local chips (hf-tpu info --chips) took over {COUNT_TIMEOUT_S} s; "
                           "pass --nproc-per-node N") from None
    lines = counted.stdout.split()
    if counted.returncode != 0 or not lines or not lines[-1].isdigit():
        reason = (counted.stderr.strip().splitlines() or ["no output"])[-1]
        raise CommandError(f"could not count the local chips (hf-tpu info --chips: {reason}); "
                           "pass --nproc-per-node N")
    return int(lines[-1])


def build_parser() -> argparse.ArgumentParser:
    """torchrun's argument parser, as ``hf-tpu launch``: ``--nproc-per-node`` defaults to one per local chip."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "hf-tpu launch"
    parser.description = ("Runs torchrun with one process per local chip (unless --nproc-per-node says otherwise); "
                          "every other option is torchrun's. Each process drives its chip as tpu:0; "
                          "torch.distributed.init_process_group() then uses the tpu_dist backend.")
    parser.set_defaults(nproc_per_node=os.environ.get(_NPROC_ENV))  # None: the user gave none
    return parser


def _check_processes(given: str) -> None:
    try:
        count = int(given)
    except ValueError:
        count = 0
    if count < 1:
        raise CommandError(f"--nproc-per-node must be a positive number of processes, not {given!r}; leave it out "
                           "for one process per local chip (hf-tpu info --chips counts them)")


def torchrun_command(argv: Sequence[str]) -> list[str]:
    """The torchrun command line for ``hf-tpu launch argv``: ``argv``, preceded by ``--nproc-per-node`` with the
    local chip count when it has none."""
    args = build_parser().parse_args(list(argv))
    script = args.training_script
    if not (args.module or args.no_python) and not os.path.isfile(script):
        raise CommandError(f"{script}: no such script; pass the path of a Python file (or -m MODULE for a module)")
    if args.nproc_per_node is not None:
        _check_processes(args.nproc_per_node)
        return [sys.executable, *_TORCHRUN, *argv]
    return [sys.executable, *_TORCHRUN, "--nproc-per-node", str(local_chip_count()), *argv]


def run_launch(argv: Sequence[str]) -> NoReturn:
    """Replaces this process with torchrun (bad arguments raise :class:`CommandError` first)."""
    command = torchrun_command(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)
