"""``hf-tpu launch`` (torchrun, one process per local chip) and ``hf-tpu info --chips``: real launches of a tiny
script whose ranks all-reduce a tpu tensor, the default process count, torchrun's exit status, and bad input."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import pytest
import torch

from hf_tpu.cli import main
from hf_tpu.cli import launch
from test_packaging import hf_tpu_command

LAUNCH_TIMEOUT_S = 120

ALL_REDUCE_SCRIPT = """
import sys
import torch
import torch.distributed as dist

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.full((3,), float(rank + 1), device="tpu") * float(sys.argv[1])
dist.all_reduce(value)
print(f"rank {rank} of {world} on {value.device} with {torch.tpu.device_count()} chip(s): {value.cpu().tolist()}")
dist.destroy_process_group()
"""


def _environment(**variables: str) -> dict[str, str]:
    environment = {**os.environ, "HF_TPU_PLATFORM": "cpu", "HF_HUB_OFFLINE": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "1",
                   **variables}
    if "HF_TPU_NUM_DEVICES" not in variables:
        environment.pop("HF_TPU_NUM_DEVICES", None)
    return environment


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _hf_tpu(*arguments: str, **variables: str) -> subprocess.CompletedProcess:
    """The installed ``hf-tpu`` console script, in a fresh process."""
    return subprocess.run([hf_tpu_command(), *arguments], env=_environment(**variables), capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "all_reduce.py"
    path.write_text(ALL_REDUCE_SCRIPT)
    return str(path)


def test_launch_runs_the_script_in_each_process_with_torchrun_options(script):
    done = _hf_tpu("launch", "--nproc-per-node", "2", "--master-port", str(_free_port()), script, "10")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(re.findall(r"^rank \d.*$", done.stdout, re.MULTILINE))
    expected = [10.0 * (1 + 2)] * 3  # each rank's (rank + 1) * 10, summed over the 2 ranks
    assert lines == [f"rank {rank} of 2 on tpu:0 with 1 chip(s): {expected}" for rank in range(2)], done.stdout


def test_launch_on_two_nodes_with_a_rendezvous_endpoint(script):
    """Two torchrun agents (nodes) on this host meet at a c10d rendezvous endpoint, as hosts of a pod do."""
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen([hf_tpu_command(), "launch", "--nnodes", "2", "--node-rank", str(node),
                               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                               "--rdzv-id", "test", script, "10"], env=_environment(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for node in range(2)]
    try:
        outputs = [node.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.communicate()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    lines = [re.findall(r"^rank \d.*$", output, re.MULTILINE) for output in outputs]
    assert lines == [[f"rank {rank} of 2 on tpu:0 with 1 chip(s): {[30.0] * 3}"] for rank in range(2)], outputs


def test_launch_defaults_to_one_process_per_chip_and_exits_with_torchruns_status(tmp_path):
    failing = tmp_path / "fails.py"
    failing.write_text("import sys\nsys.exit(3)\n")
    done = _hf_tpu("launch", "--master-port", str(_free_port()), str(failing), HF_TPU_NUM_DEVICES="2")
    assert done.returncode == 1, done.stderr  # torchrun's status when a worker fails
    assert re.search(r"exitcode\s*: 3", done.stderr), done.stderr  # torchrun's report of the worker's status
    workers = re.findall(r"rank\s*: (\d) \(local_rank: \d\)", done.stderr)  # the other may be stopped first
    assert sorted(workers) == ["0", "1"], done.stderr  # 2 chips counted: 2 workers


def test_launch_command_line(script, monkeypatch):
    monkeypatch.delenv("PET_NPROC_PER_NODE", raising=False)
    monkeypatch.setattr(launch, "local_chip_count", lambda: 3)  # counted for real in the test above
    command = launch.torchrun_command(["--nnodes", "1", script, "--nproc-per-node", "5"])  # the last is the script's
    assert command == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--nnodes", "1",
                       script, "--nproc-per-node", "5"]
    given = launch.torchrun_command(["--nproc_per_node", "2", script])
    assert given == [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script]
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")  # torchrun's own variable for the option
    assert launch.torchrun_command([script]) == [sys.executable, "-m", "torch.distributed.run", script]


def test_info_chips_prints_the_chip_count_alone(capsys):
    """In a process of its own (``python -m hf_tpu.cli info --chips``), with ``HF_TPU_NUM_DEVICES=2``, it is the
    count test_launch_defaults_to_one_process_per_chip_and_exits_with_torchruns_status launches."""
    assert main(["info", "--chips"]) == 0
    assert capsys.readouterr().out == f"{torch.tpu.device_count()}\n"


@pytest.mark.parametrize("arguments, message", [
    (["missing.py"], r"missing.py: no such script; pass the path of a Python file"),
    (["--nproc-per-node", "0", "{script}"], r"--nproc-per-node must be a positive number of processes, not '0'; "
                                            r"leave it out for one process per local chip"),
    (["--nproc-per-node", "auto", "{script}"], r"--nproc-per-node must be a positive number of processes, not "
                                               r"'auto'"),
])
def test_launch_bad_input_is_one_line_and_exit_2(arguments, message, script, capsys):
    assert main(["launch", *(a.format(script=script) for a in arguments)]) == 2
    error = capsys.readouterr().err
    assert re.fullmatch(r"hf-tpu launch: " + message + r".*\n", error), error


def test_launch_without_a_script_shows_usage(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["launch", "--nproc-per-node", "2"])
    assert stopped.value.code == 2
    assert re.search(r"usage: hf-tpu launch .*required: training_script", capsys.readouterr().err, re.DOTALL)
