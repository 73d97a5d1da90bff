"""Tests that need several chips, on a host without them: a test module's ``case_*`` functions run in one new
process with ``HF_TPU_NUM_DEVICES=4`` (the device count is fixed when JAX starts), and each case is reported
as a test of its own. A module using it ends with::

    four_chip_report = four_chips.report_fixture(__file__)

    @pytest.mark.parametrize("case", four_chips.cases(globals()))
    def test_on_four_chips(four_chip_report, case):
        assert four_chip_report[case] == "ok", four_chip_report[case]

    if __name__ == "__main__":
        four_chips.main(globals())
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from typing import Any, Callable

import pytest


def cases(namespace: dict[str, Any]) -> list[str]:
    return sorted(name for name in namespace if name.startswith("case_"))


def main(namespace: dict[str, Any]) -> None:
    """Runs every case; prints ``{case: "ok" or its traceback}`` as the last line."""
    report = {}
    for name in cases(namespace):
        try:
            namespace[name]()
            report[name] = "ok"
        except Exception:
            report[name] = traceback.format_exc()
    print(json.dumps(report))


def report_fixture(path: str, timeout: float = 600) -> Callable:
    """A module-scoped fixture running the module at ``path`` on four virtual chips (bounded by ``timeout``)."""

    @pytest.fixture(scope="module")
    def four_chip_report() -> dict[str, str]:
        environment = dict(os.environ, HF_TPU_NUM_DEVICES="4", HF_TPU_PLATFORM="cpu", HF_HUB_OFFLINE="1")
        result = subprocess.run([sys.executable, path], env=environment, capture_output=True, text=True,
                                timeout=timeout, cwd=os.path.dirname(path))
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    return four_chip_report
