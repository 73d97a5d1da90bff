"""What hf_tpu's autoload adds to ``import torch``.

Runs ``python -X importtime -c "import torch"`` in fresh subprocesses with
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (torch alone) and ``=1`` (torch loads hf_tpu through its
``torch.backends`` entry point), alternating the two, and reads the cumulative import time of the
``torch`` package from each run. Prints the median of each and the difference in ms.

    python benchmarks/import_time.py [--runs 11]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from _report import report


def torch_import_microseconds(autoload: bool) -> int:
    """Cumulative import time of ``torch`` (µs) in a fresh interpreter, with autoload on or off."""
    environment = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="1" if autoload else "0")
    completed = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import torch"],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    # Lines read "import time: <self us> | <cumulative us> | <indented module name>".
    for line in completed.stderr.splitlines():
        fields = line.removeprefix("import time:").split("|")
        if len(fields) == 3 and fields[2].strip() == "torch" and not fields[2].startswith("  "):
            return int(fields[1])
    raise RuntimeError(f"no import-time line for torch in:\n{completed.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=11, help="subprocesses per setting (default 11)")
    args = parser.parse_args()

    samples: dict[bool, list[int]] = {False: [], True: []}
    torch_import_microseconds(autoload=True)  # warm the file-system cache
    for _ in range(args.runs):
        for autoload in (False, True):
            samples[autoload].append(torch_import_microseconds(autoload))

    without, with_autoload = (statistics.median(samples[setting]) / 1000 for setting in (False, True))
    print(f"import torch, median of {args.runs} runs (cumulative time of the torch package):")
    print(f"  TORCH_DEVICE_BACKEND_AUTOLOAD=0 (torch alone):   {without:8.1f} ms")
    print(f"  TORCH_DEVICE_BACKEND_AUTOLOAD=1 (loads hf_tpu):  {with_autoload:8.1f} ms")
    print(f"  added by hf_tpu's autoload:                      {with_autoload - without:8.1f} ms")
    report("import torch: added by hf_tpu's autoload", with_autoload - without, "ms",
           "import torch with TORCH_DEVICE_BACKEND_AUTOLOAD=0")
    report("import torch: autoload / torch alone", with_autoload / without, "x",
           "import torch with TORCH_DEVICE_BACKEND_AUTOLOAD=0")


if __name__ == "__main__":
    main()
