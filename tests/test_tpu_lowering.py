"""HF_TPU_CHECK_TPU_LOWERING: programs the device builds are also lowered for TPU chips.

The survey test runs the transformers and diffusers model tests with every program exported for
TPU and compares what does not lower with the list in docs/tpu_lowering.md, so that list stays true. Those tests
pass there or the survey fails; a run of the whole suite runs them there only (conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import torch

from conftest import ROOT, SURVEYED_FOR_TPU_LOWERING
from hf_tpu.backend import dtypes, runtime, tpu_lowering

runtime.jax_module()  # JAX configured as the device uses it (64-bit types on)


def _run(code: str, setting: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HF_TPU_CHECK_TPU_LOWERING": setting}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=environment, cwd=ROOT)


def test_what_a_tpu_cannot_run_is_named():
    assert tpu_lowering.problem(jax.jit(lambda x: jnp.sin(x) * 2), (jnp.ones(3, jnp.float32),)) is None
    assert "64-bit floating point" in tpu_lowering.problem(jax.jit(lambda x: x * 2), (jnp.ones(3, jnp.float64),))
    eig = tpu_lowering.problem(jax.jit(lambda x: jnp.linalg.eig(x)[0]), (jnp.eye(3, dtype=jnp.float32),))
    assert "'eig' not found for platform tpu" in eig


def test_python_numbers_add_no_float64():
    """``x * 0.5`` passes 0.5 as a weakly-typed float32 unless the op computes in float64."""
    scalar = dtypes.scalar_operand(0.5, wide=False)
    assert scalar.dtype == jnp.float32 and scalar.weak_type
    assert dtypes.scalar_operand(0.5, wide=True).dtype == jnp.float64
    assert dtypes.needs_wide_scalars([jnp.ones(2, jnp.float64)])
    assert not dtypes.needs_wide_scalars([jnp.ones(2, jnp.float32)])
    x = torch.arange(4, device="tpu")
    assert (x * 0.5).dtype == torch.float32 and (x * 0.5).tolist() == [0.0, 0.5, 1.0, 1.5]
    wide = torch.ones(2, dtype=torch.float64, device="tpu") * (1 + 2**-40)
    assert wide.cpu().tolist() == [1 + 2**-40] * 2  # a float64 op keeps the number's full precision


def test_raise_mode_passes_float32_models_and_stops_float64_and_cpu_only_ops():
    done = _run(
        "import torch\n"
        "from hf_tpu.backend.tpu_lowering import TPULoweringError\n"
        "layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8)).to('tpu')\n"
        "x = torch.randn(2, 8, device='tpu')\n"
        "print('eager', layer(x * 0.5).sum().item() is not None)\n"
        "print('compiled', torch.compile(layer, backend='tpu')(x).shape)\n"
        "for name, fn in [('float64', lambda: torch.ones(2, dtype=torch.float64, device='tpu') + 1),\n"
        "                 ('eig', lambda: torch.linalg.eigvals(torch.eye(3, device='tpu')))]:\n"
        "    try:\n"
        "        fn()\n"
        "        print(name, 'ran')\n"
        "    except TPULoweringError as error:\n"
        "        print(name, 'refused:', error)\n",
        "1",
    )
    assert done.returncode == 0, done.stderr
    assert "eager True" in done.stdout and "compiled torch.Size([2, 8])" in done.stdout
    assert "float64 refused: aten::ones: this program does not lower for TPU chips: uses 64-bit floating point" \
        in done.stdout
    assert "eig refused: aten::_linalg_eigvals: this program does not lower for TPU chips" in done.stdout


def test_the_survey_list_is_the_documented_one():
    text = (ROOT / "docs" / "tpu_lowering.md").read_text()
    assert all(f"`{module}`" in text for module in SURVEYED_FOR_TPU_LOWERING)


def _documented() -> set[tuple[str, str]]:
    """(program, reason) rows of the table in docs/tpu_lowering.md."""
    rows = set()
    for line in (ROOT / "docs" / "tpu_lowering.md").read_text().splitlines():
        match = re.match(r"\| `([^`]+)` \| (.+?) \|", line)
        if match:
            rows.add((match.group(1), match.group(2).strip()))
    return rows


def test_model_tests_lower_for_tpu_except_what_docs_list(tmp_path):
    record = tmp_path / "not_lowering.jsonl"
    record.touch()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SURVEYED_FOR_TPU_LOWERING],
        capture_output=True, text=True, timeout=1500, cwd=ROOT,
        env={**os.environ, "HF_TPU_CHECK_TPU_LOWERING": f"record:{record}"},
    )
    assert done.returncode == 0, done.stdout[-3000:]
    found = set()
    for line in record.read_text().splitlines():
        entry = json.loads(line)
        program = re.sub(r"^compiled graph \d+$", "compiled graph", entry["program"])
        found.add((program, entry["reason"]))
    assert found == _documented(), f"update docs/tpu_lowering.md: found {sorted(found)}"
