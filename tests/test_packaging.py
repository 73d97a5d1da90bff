"""The installed package: torch's autoload, failing registration, the ``hf-tpu`` command, CI.

Each check runs in a fresh interpreter, because registration happens once per process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT = 300


def _environment(autoload: bool) -> dict[str, str]:
    environment = dict(os.environ, HF_HUB_OFFLINE="1")
    environment["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "1" if autoload else "0"
    return environment


def run_python(code: str, autoload: bool = True, **variables: str) -> subprocess.CompletedProcess:
    """Runs ``python -c code`` in a fresh interpreter (with environment ``variables`` added); fails the test if it
    exits non-zero."""
    completed = subprocess.run(
        [sys.executable, "-c", code],
        env={**_environment(autoload), **variables},
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        cwd=ROOT,
    )
    assert completed.returncode == 0, (
        f"exit {completed.returncode}\nstdout:\n{completed.stdout}\nstderr:\n{completed.stderr}"
    )
    return completed


def hf_tpu_command() -> str:
    """The installed ``hf-tpu`` console script (next to this interpreter, else on PATH)."""
    beside = Path(sys.executable).with_name("hf-tpu")
    found = str(beside) if beside.exists() else shutil.which("hf-tpu")
    assert found, "the hf-tpu console script is not installed: run `pip install -e .`"
    return found


def test_entry_points_are_declared():
    backends = {ep.name: ep.value for ep in metadata.entry_points(group="torch.backends")}
    assert backends.get("hf_tpu") == "hf_tpu._autoload:load"
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("hf-tpu") == "hf_tpu.cli:main"


def test_import_torch_registers_the_device_without_importing_hf_tpu():
    completed = run_python("import torch; print(torch.ones(2, device='tpu').device)")
    assert completed.stdout.strip() == "tpu:0"
    assert "not registered" not in completed.stderr


def test_autoload_does_not_import_jax():
    completed = run_python(
        "import sys, torch; print(torch.accelerator.current_accelerator(), 'jax' in sys.modules)"
    )
    assert completed.stdout.split() == ["tpu", "False"]


def test_autoload_off_leaves_the_device_unregistered():
    completed = run_python(
        "import sys, torch; "
        "print(torch._C._get_privateuse1_backend_name(), hasattr(torch, 'tpu'), 'hf_tpu' in sys.modules)",
        autoload=False,
    )
    assert completed.stdout.split() == ["privateuseone", "False", "False"]


def test_import_hf_tpu_registers_the_device_when_autoload_is_off():
    completed = run_python("import hf_tpu, torch; print(torch.ones(2, device='tpu').device)", autoload=False)
    assert completed.stdout.strip() == "tpu:0"


def test_import_hf_tpu_before_torch_registers_without_warning():
    # hf_tpu imports torch, whose autoload then imports hf_tpu again while it is half-initialised.
    completed = run_python("import hf_tpu, torch; print(torch.ones(2, device='tpu').device)")
    assert completed.stdout.strip() == "tpu:0"
    assert "not registered" not in completed.stderr


def test_failing_registration_only_warns():
    code = """
import warnings
import torch

torch.utils.rename_privateuse1_backend("other")  # another backend took PrivateUse1
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import hf_tpu._autoload
    hf_tpu._autoload.load()
messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
assert messages and all("not registered" in m for m in messages), messages
assert torch._C._get_privateuse1_backend_name() == "other"
print("warned", len(messages))
"""
    completed = run_python(code, autoload=False)
    assert completed.stdout.startswith("warned")


def run_hf_tpu(subcommand: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [hf_tpu_command(), subcommand],
        env=_environment(autoload=True),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
    )


def test_hf_tpu_info_runs():
    completed = run_hf_tpu("info")
    assert completed.returncode == 0, completed.stderr
    assert re.search(r"^device count\s+\d+$", completed.stdout, re.MULTILINE), completed.stdout
    assert re.search(r"^torch\s+2\.", completed.stdout, re.MULTILINE), completed.stdout


def test_readme_set_up_commands_install_cpu_torch_first():
    commands = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("pip install")]
    assert any(line.endswith("hf-tpu demo") for line in commands), commands
    assert any(line.endswith("python -m pytest -n auto --dist loadfile") for line in commands), commands
    for command in commands:  # otherwise pip resolves torch for hf-tpu's dependencies: a CUDA build
        assert command.startswith("pip install torch==2.13.0 && "), command


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("pip install") and "pytest" in line]
    assert len(commands) == 1, commands
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert any(line.startswith(commands[0]) for line in ci_lines), f"{commands[0]!r} is not in .ci/run"


_AS_IF_NVIDIA_GPUS = """
import sys, torch
torch.backends.cuda.is_built = lambda: True
torch.cuda._device_count_nvml = lambda: 1
torch._import_device_backends()  # what `import torch` runs at its end when autoload is on
print(torch._C._get_privateuse1_backend_name(), 'hf_tpu' in sys.modules)
"""


def test_autoload_leaves_a_machine_with_nvidia_gpus_to_cuda():
    """Registering PrivateUse1 makes torch's autograd engine fail every CUDA backward (pytorch#161129), so
    autoload does not; ``import hf_tpu`` then registers the device."""
    completed = run_python(_AS_IF_NVIDIA_GPUS + "import hf_tpu; print(torch.ones(2, device='tpu').device)",
                           autoload=False)
    assert completed.stdout.split() == ["privateuseone", "False", "tpu:0"]


def test_autoload_registers_beside_nvidia_gpus_when_a_platform_is_asked_for():
    completed = run_python(_AS_IF_NVIDIA_GPUS, autoload=False, HF_TPU_PLATFORM="cpu")
    assert completed.stdout.split() == ["tpu", "True"]
