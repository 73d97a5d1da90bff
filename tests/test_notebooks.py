"""The marimo notebooks in notebooks/ are documentation that runs: each is executed headless, as a
script (marimo raises a failing cell's exception, so the process fails)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = [FOLDER / "quickstart.py", FOLDER / "offloading.py", FOLDER / "pallas_kernels.py", FOLDER / "sharding.py",
             FOLDER / "tensor_parallel.py", FOLDER / "serving.py"]


def test_every_notebook_is_run():
    assert sorted(FOLDER.glob("*.py")) == sorted(NOTEBOOKS), "list a new notebook in NOTEBOOKS"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.name for n in NOTEBOOKS])
def test_notebook_runs_headless(notebook):
    done = subprocess.run([sys.executable, str(notebook)], capture_output=True, text=True, timeout=600,
                          cwd=notebook.parent)
    assert done.returncode == 0, done.stderr[-3000:]
