"""In-place updates give their old array to XLA when nothing else holds it (tests/donation_cases.py), checked in a
process of its own: after a failed ``torch.compile`` in a process, in-place updates there stop donating (a
reference to each input array is held somewhere; the cause is not found yet), and this file's worker may have run
a test whose compile fails on purpose."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_donation_cases_pass_in_a_process_of_their_own():
    environment = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/donation_cases.py"],
                          capture_output=True, text=True, timeout=600, env=environment, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = done.stdout.splitlines()[-1]
    assert " passed" in summary and " failed" not in summary and "skipped" not in summary, summary
