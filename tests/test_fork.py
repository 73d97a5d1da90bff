"""The device and fork(): a forked child that touches the device gets a clear error (never a hang);
DataLoader workers forked for CPU data work; spawned processes use the device normally."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PARENT_USES_THE_DEVICE_FROM_THREADS = """
import os, threading, time, torch
x = torch.ones(3, device="tpu")
threads = [threading.Thread(target=lambda: (x * 2).cpu()) for _ in range(3)]
[t.start() for t in threads]
[t.join() for t in threads]
"""  # a spawned child runs this too, as the import of its __main__


def _run(code: str, directory) -> subprocess.CompletedProcess:
    """Runs the script from a file (spawned children import it again as their __main__)."""
    script = directory / "script.py"
    script.write_text(textwrap.dedent(PARENT_USES_THE_DEVICE_FROM_THREADS) + textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("use", ["new tensor", "parent's tensor to cpu", "synchronize", "compiled call"])
def test_forked_child_touching_the_device_raises_at_once(use, tmp_path):
    action = {
        "new tensor": "torch.ones(2, device='tpu')",
        "parent's tensor to cpu": "x.cpu()",
        "synchronize": "torch.tpu.synchronize()",
        "compiled call": "compiled(x)",
    }[use]
    done = _run(f"""
        compiled = torch.compile(lambda t: t + 1, backend="tpu")
        compiled(x)
        pid = os.fork()
        if pid == 0:
            torch.manual_seed(0)  # seeding only records numbers: allowed, as DataLoader workers do it
            try:
                {action}
                print("no error", flush=True)
            except RuntimeError as error:
                print("error:", error, flush=True)
            os._exit(0)
        deadline = time.time() + 60
        while time.time() < deadline:
            finished, status = os.waitpid(pid, os.WNOHANG)
            if finished:
                print("child exited", status)
                break
            time.sleep(0.1)
        else:
            os.kill(pid, 9)
            print("child hung")
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "error: Cannot use the tpu device in a forked subprocess" in done.stdout
    assert "'spawn' start method" in done.stdout
    assert "child exited 0" in done.stdout


def test_dataloader_with_forked_workers_producing_cpu_tensors(tmp_path):
    done = _run("""
        from torch.utils.data import DataLoader, TensorDataset
        data = TensorDataset(torch.arange(32, dtype=torch.float32).reshape(16, 2))
        loader = DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context="fork", timeout=60)
        total = sum((batch.to("tpu") * 2).sum().item() for (batch,) in loader)
        print("total", total)
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "total 992.0" in done.stdout


def test_spawned_processes_use_the_device(tmp_path):
    done = _run("""
        import torch.multiprocessing as mp

        def work(rank, results):
            results[rank] = (torch.full((2,), float(rank), device="tpu") + 1).sum().item()

        if __name__ == "__main__":
            with mp.Manager() as manager:
                results = manager.dict()
                mp.spawn(work, args=(results,), nprocs=2, join=True)
                print("results", sorted(results.items()))
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "results [(0, 2.0), (1, 4.0)]" in done.stdout
