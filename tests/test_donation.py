"""In-place updates give their old array to XLA when nothing else holds it (tests/donation_cases.py), checked in a
process of its own, and in one where a ``torch.compile`` failed first (torch 2.13 then holds one more reference to
every argument of each Python call, which a count of an array's holders must not mistake for another owner)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("plugins", [[], ["-p", "failed_compile_first"]], ids=["fresh", "after_a_failed_compile"])
def test_donation_cases_pass_in_a_process_of_their_own(plugins):
    environment = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), environment.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins,
                           "tests/donation_cases.py"],
                          capture_output=True, text=True, timeout=600, env=environment, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = done.stdout.splitlines()[-1]
    assert " passed" in summary and " failed" not in summary and "skipped" not in summary, summary
