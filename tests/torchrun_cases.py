"""Tests that need several processes: one torchrun launch runs a test module's ``case_*`` functions in every
rank (the module is also the workers' script), and each (rank, case) is reported as a test of its own. A module
using it ends with::

    reports = torchrun_cases.report_fixture(__file__, world=2)

    @pytest.mark.parametrize("case", torchrun_cases.cases(globals()))
    @pytest.mark.parametrize("rank", range(2))
    def test_ranks(reports, rank, case):
        assert reports[rank][case] == "ok", reports[rank][case]

    if __name__ == "__main__":
        torchrun_cases.main(globals())

Cases run in name order, after ``dist.init_process_group()`` (no backend argument: tpu's default, ``tpu_dist``).
A case may return a JSON value (``reports[rank][f"{case}:value"]``) for the test to compare with one process.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import traceback
from typing import Any, Callable

import pytest


def cases(namespace: dict[str, Any]) -> list[str]:
    return sorted(name for name in namespace if name.startswith("case_"))


def main(namespace: dict[str, Any], worker_timeout: float = 100, init: bool = True) -> None:
    """A worker's entry point: runs every case and writes ``{case: "ok" or its traceback}`` for its rank. A hung
    worker prints where it hangs and exits after ``worker_timeout`` seconds."""
    import torch.distributed as dist

    faulthandler.dump_traceback_later(worker_timeout, exit=True)
    if init:
        dist.init_process_group()
    report = {}
    only = os.environ.get("TORCHRUN_CASES_ONLY")
    for name in only.split(",") if only else cases(namespace):
        print(f"rank {os.environ['RANK']}: {name}", flush=True)
        try:
            value = namespace[name]()
            report[name] = "ok"
            if value is not None:  # what the test compares with one process (JSON)
                report[f"{name}:value"] = value
        except (Exception, pytest.fail.Exception):  # pytest.raises and pytest.fail raise outcomes, not Exceptions
            report[name] = traceback.format_exc()
    if dist.is_initialized():
        dist.destroy_process_group()
    with open(os.path.join(os.environ["TORCHRUN_CASES_REPORTS"], f"rank{os.environ['RANK']}.json"), "w") as file:
        json.dump(report, file)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(path: str, folder: str, world: int = 2, timeout: float = 120, env: dict[str, str] | None = None) -> list:
    """Runs ``path`` under torchrun with ``world`` processes; returns each rank's report. torchrun starts each
    worker in a session of its own: past ``timeout`` torchrun is asked to stop them, then killed."""
    environment = {**os.environ, "HF_TPU_PLATFORM": "cpu", "HF_HUB_OFFLINE": "1", "TORCHRUN_CASES_REPORTS": folder}
    environment.pop("HF_TPU_NUM_DEVICES", None)
    environment.update(env or {})
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-port", str(_free_port()), path]
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, cwd=os.path.dirname(path))
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()  # torchrun stops its workers on SIGTERM
        try:
            output, _ = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        pytest.fail(f"the {world}-process launch ran over {timeout} s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    return [json.loads(open(os.path.join(folder, f"rank{rank}.json")).read()) for rank in range(world)]


def report_fixture(path: str, world: int = 2, timeout: float = 120, env: dict[str, str] | None = None,
                   only: list[str] | None = None) -> Callable:
    """A module-scoped fixture: one launch of the module at ``path`` (see :func:`launch`), running every case or
    the ones named in ``only``."""
    env = {**(env or {}), **({"TORCHRUN_CASES_ONLY": ",".join(only)} if only else {})}

    @pytest.fixture(scope="module")
    def reports(tmp_path_factory: Any) -> list:
        return launch(path, str(tmp_path_factory.mktemp("torchrun")), world, timeout, env)

    return reports
