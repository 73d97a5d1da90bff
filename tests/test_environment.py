"""Every HF_TPU_* variable with a bad value fails at the first device use with one error naming it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FIRST_USE = "import torch\nprint((torch.ones(2, device='tpu') + 1).tolist())"

BAD_VALUES = {
    "HF_TPU_PLATFORM": ("tpux", "ValueError: HF_TPU_PLATFORM='tpux' is not one of auto, tpu, gpu, cpu"),
    "HF_TPU_NUM_DEVICES": ("two", "ValueError: HF_TPU_NUM_DEVICES='two' must be a positive integer"),
    "HF_TPU_CPU_FALLBACK": ("maybe", "ValueError: HF_TPU_CPU_FALLBACK='maybe' is not a yes/no value"),
    "HF_TPU_LOG_RECOMPILES": ("loud", "ValueError: HF_TPU_LOG_RECOMPILES='loud' is not a yes/no value"),
    "HF_TPU_STRICT_COMPILE": ("sure", "ValueError: HF_TPU_STRICT_COMPILE='sure' is not a yes/no value"),
    "HF_TPU_CHECKS": ("sometimes", "ValueError: HF_TPU_CHECKS='sometimes' is not one of 1, immediate, 0"),
    "HF_TPU_PALLAS": ("always", "ValueError: HF_TPU_PALLAS='always' is not one of auto, 1, 0"),
    "HF_TPU_CACHE_DIR": ("/proc/no-such-dir", "ValueError: HF_TPU_CACHE_DIR='/proc/no-such-dir': cannot create"),
}


def _first_use(**variables: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_TPU_")}
    return subprocess.run([sys.executable, "-c", FIRST_USE], capture_output=True, text=True, timeout=240,
                          env={**environment, **variables})


@pytest.mark.parametrize("name", BAD_VALUES)
def test_a_bad_value_is_one_clear_error(name):
    value, message = BAD_VALUES[name]
    done = _first_use(**{name: value})
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(message), done.stderr[-2000:]


def test_a_platform_jax_does_not_have_says_what_to_install():
    done = _first_use(HF_TPU_PLATFORM="gpu")
    assert done.returncode == 1
    assert "HF_TPU_PLATFORM=gpu but JAX has no gpu platform here (it has: cpu)" in done.stderr


def test_a_misspelt_variable_is_named_in_a_warning():
    done = _first_use(HF_TPU_CHEKS="0", HF_TPU_CHECKS="1")
    assert done.returncode == 0 and done.stdout.strip() == "[2.0, 2.0]"
    assert "ignoring HF_TPU_CHEKS: not a variable hf_tpu reads" in done.stderr
    assert "HF_TPU_CHECKS" in done.stderr  # the list of the real names
