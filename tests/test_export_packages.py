"""Ahead-of-time packages (``hf_tpu.export``): ``torch.export`` programs of tpu models saved as one file.

A tiny Llama, diffusers UNet2DConditionModel and Flux transformer (built from configs) are exported on tpu,
saved and loaded in this process and in a new one that imports neither transformers nor diffusers, and
their outputs compared with the eager tpu model's and the CPU's (float32, to 1e-5).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
import zipfile
from dataclasses import dataclass
from typing import Any, Callable

import jax
import pytest
import safetensors.torch
import torch

import hf_tpu.export
from conftest import tiny_llama, to_tpu
from hf_tpu.backend import runtime
from hf_tpu.integrations import inductor
from test_diffusers_pipelines import tiny_flux_transformer, tiny_unet
from test_training_models import flux_batch

TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _llama_inputs() -> tuple[dict, dict]:
    return {"input_ids": torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))}, {
        "use_cache": False}


def _unet_inputs() -> tuple[dict, dict]:
    generator = torch.Generator().manual_seed(1)
    return dict(sample=torch.randn(2, 4, 16, 16, generator=generator), timestep=torch.tensor([10, 500]),
                encoder_hidden_states=torch.randn(2, 16, 32, generator=generator)), {}


def _flux_inputs() -> tuple[dict, dict]:
    batch = flux_batch()
    del batch["target"]
    return batch, {}


# model builder, inputs (tensors and other keyword arguments), the output compared
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], tuple[dict, dict]], str]] = {
    "llama": (tiny_llama, _llama_inputs, "logits"),
    "unet": (tiny_unet, _unet_inputs, "sample"),
    "flux": (tiny_flux_transformer, _flux_inputs, "sample"),
}


@dataclass
class Package:
    path: str
    exported: torch.export.ExportedProgram
    tensors: dict[str, torch.Tensor]  # CPU inputs
    options: dict[str, Any]
    key: str
    cpu: Any  # the CPU model's outputs
    eager: Any  # the eager tpu model's outputs


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Package]:
    directory = tmp_path_factory.mktemp("packages")
    built = {}
    for name, (build, make_inputs, key) in MODELS.items():
        torch.manual_seed(0)
        cpu_model = build().eval()
        tpu_model = copy.deepcopy(cpu_model).to("tpu")
        tensors, options = make_inputs()
        with torch.no_grad():
            cpu, eager = cpu_model(**tensors, **options), tpu_model(**to_tpu(tensors), **options)
        exported = torch.export.export(tpu_model, (), {**to_tpu(tensors), **options})
        path = str(directory / f"{name}.hftpu")
        hf_tpu.export.save(exported, path)
        built[name] = Package(path, exported, tensors, options, key, cpu, eager)
    return built


@pytest.mark.parametrize("name", list(MODELS))
def test_package_matches_the_eager_tpu_model_and_the_cpu(packages, name):
    package = packages[name]
    program = hf_tpu.export.load(package.path)
    outputs = program(**to_tpu(package.tensors), **package.options)
    assert type(outputs) is type(package.eager)  # the output class, whose library this process imported
    result = outputs[package.key]
    assert result.device.type == "tpu"
    torch.testing.assert_close(result.cpu(), package.eager[package.key].cpu(), **TOLERANCE)
    torch.testing.assert_close(result.cpu(), package.cpu[package.key], **TOLERANCE)
    from_cpu = program(**package.tensors, **package.options)[package.key]  # CPU inputs are moved
    assert from_cpu.device.type == "tpu"
    torch.testing.assert_close(from_cpu.cpu(), result.cpu(), rtol=0, atol=0)


_CHILD = textwrap.dedent("""
    import json, sys
    import safetensors.torch, torch
    import hf_tpu.export

    cases, embedding = json.loads(sys.argv[1]), sys.argv[2]
    report = {}
    for name, (package, inputs, options, key, outputs) in cases.items():
        result = hf_tpu.export.load(package)(**safetensors.torch.load_file(inputs), **options)
        report[name] = type(result).__name__
        safetensors.torch.save_file({key: result[key].cpu()}, outputs)
    try:
        hf_tpu.export.load(embedding)(torch.tensor([1, 7])).cpu()
    except IndexError as error:
        report["index check"] = str(error)
    report["modules"] = sorted(name for name in ("transformers", "diffusers", "torch._dynamo") if name in sys.modules)
    print(json.dumps(report))
""")


def test_packages_run_in_a_new_process_without_the_models_code(packages, tmp_path):
    cases = {}
    for name, package in packages.items():
        inputs, outputs = str(tmp_path / f"{name}_inputs.safetensors"), str(tmp_path / f"{name}_outputs.safetensors")
        safetensors.torch.save_file(package.tensors, inputs)
        cases[name] = [package.path, inputs, package.options, package.key, outputs]
    embedding = str(tmp_path / "embedding.hftpu")  # its index check is numbered anew in the child
    hf_tpu.export.save(torch.export.export(torch.nn.Embedding(4, 2).to("tpu"), (torch.tensor([0, 1], device="tpu"),)),
                       embedding)
    completed = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cases), embedding], capture_output=True,
                               text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["modules"] == []
    assert report["index check"] == "index out of range in self"
    for name, package in packages.items():
        assert report[name] == "dict"  # the output class's library is not imported there
        result = safetensors.torch.load_file(cases[name][-1])[package.key]
        torch.testing.assert_close(result, package.eager[package.key].cpu(), **TOLERANCE)
        torch.testing.assert_close(result, package.cpu[package.key], **TOLERANCE)


def test_package_for_another_platform_is_written_on_this_host_and_refused_here(packages, tmp_path):
    platform = runtime.backing_platform()
    other = "cpu" if platform == "tpu" else "tpu"  # off TPU chips: a package for chips, written on this host
    path = tmp_path / f"llama_for_{other}.hftpu"
    hf_tpu.export.save(packages["llama"].exported, path, platforms=[other])
    with zipfile.ZipFile(path) as package:
        assert jax.export.deserialize(bytearray(package.read("program.jax"))).platforms == (other,)
    with pytest.raises(RuntimeError, match=f"exported for the {other} platform, but the tpu device runs on {platform} "
                                           f"here: export it again on a {platform} host"):
        hf_tpu.export.load(path)


def test_inputs_other_than_the_exported_ones_are_refused(packages):
    program = hf_tpu.export.load(packages["llama"].path)
    with pytest.raises(hf_tpu.export.PackageError, match=r"input 'input_ids' has shape \(2, 5\).*static shapes"):
        program(input_ids=torch.zeros(2, 5, dtype=torch.int64), use_cache=False)
    with pytest.raises(hf_tpu.export.PackageError, match="exported with use_cache=False, not True"):
        program(input_ids=packages["llama"].tensors["input_ids"], use_cache=True)
    with pytest.raises(hf_tpu.export.PackageError, match=r"takes the keyword arguments \['input_ids', 'use_cache'\]"):
        program(input_ids=packages["llama"].tensors["input_ids"])


class _Normalized(torch.nn.Module):
    """Batch norm in train mode (its statistics are buffers the program updates) and an in-place update of an input."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counter.add_(1)
        return self.norm(x), x.t()


def test_buffer_and_input_updates_and_output_strides_follow_eager_mode(tmp_path):
    torch.manual_seed(0)
    model = _Normalized().to("tpu").train()
    x, counter = torch.randn(3, 4, device="tpu"), torch.zeros(2, device="tpu")
    hf_tpu.export.save(torch.export.export(copy.deepcopy(model), (x, counter.clone())), tmp_path / "norm.hftpu")
    program = hf_tpu.export.load(tmp_path / "norm.hftpu")
    counts = torch.zeros(2)
    for _ in range(2):
        (normalized, transposed), (expected, expected_transposed) = program(x, counts), model(x, counter)
        torch.testing.assert_close(normalized.cpu(), expected.cpu(), **TOLERANCE)
        assert transposed.stride() == expected_transposed.stride() == (1, 4)
    assert counts.tolist() == counter.cpu().tolist() == [2.0, 2.0]
    names = program._manifest["weights"]
    torch.testing.assert_close(program._weights[names.index("norm.running_var")].cpu(), model.norm.running_var.cpu(),
                               **TOLERANCE)


def test_random_ops_and_symbolic_shapes_are_refused_at_save(tmp_path):
    dropout = torch.nn.Dropout(0.5).train()
    x = torch.randn(4, 4, device="tpu")
    with pytest.raises(NotImplementedError, match=r"random operators \(aten::native_dropout\).*model.eval\(\)"):
        hf_tpu.export.save(torch.export.export(dropout, (x,)), tmp_path / "dropout.hftpu")
    dynamic = torch.export.export(torch.nn.ReLU(), (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    with pytest.raises(ValueError, match=r"symbolic sizes .*export with static shapes \(no dynamic_shapes\)"):
        hf_tpu.export.save(dynamic, tmp_path / "dynamic.hftpu")


def test_missing_and_damaged_files_give_clear_errors(packages, tmp_path):
    with pytest.raises(FileNotFoundError, match="no package file at"):
        hf_tpu.export.load(tmp_path / "missing.hftpu")
    data = open(packages["flux"].path, "rb").read()
    (tmp_path / "garbage.hftpu").write_bytes(b"not a package")
    (tmp_path / "truncated.hftpu").write_bytes(data[: len(data) // 2])
    with zipfile.ZipFile(packages["flux"].path) as package, zipfile.ZipFile(tmp_path / "damaged.hftpu", "w") as copy_:
        for member in package.namelist():
            copy_.writestr(member, b"\x00" * 8 if member == "program.jax" else package.read(member))
    for name in ("garbage", "truncated", "damaged"):
        with pytest.raises(hf_tpu.export.PackageError, match="is not a readable package of hf_tpu.export.save"):
            hf_tpu.export.load(tmp_path / f"{name}.hftpu")
    with zipfile.ZipFile(tmp_path / "other.hftpu", "w") as other:
        other.writestr("manifest.json", json.dumps({"format": "something else"}))
    with pytest.raises(hf_tpu.export.PackageError, match="not a package of hf_tpu.export.save"):
        hf_tpu.export.load(tmp_path / "other.hftpu")


def test_inductor_ahead_of_time_compilation_of_a_tpu_program_names_hf_tpu_export():
    model, x = torch.nn.Linear(4, 4).to("tpu"), torch.randn(2, 4, device="tpu")
    exported = torch.export.export(model, (x,))
    with pytest.raises(RuntimeError, match=r"aoti_compile_and_package: .*on tpu.*hf_tpu.export.save\(exported_program, "
                                           r"path\).*hf_tpu.export.load\(path\)"):
        torch._inductor.aoti_compile_and_package(exported)
    with pytest.raises(RuntimeError, match=r"aot_compile: .*hf_tpu.export.save"):
        torch._inductor.aot_compile(exported.module(), (x,))


def test_inductor_entries_pass_programs_on_other_devices_through():
    on_cpu = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    entry = inductor._refusing_tpu(lambda *args, **kwargs: "compiled by Inductor", inductor._program_tensors)
    assert entry(on_cpu, package_path="model.pt2") == "compiled by Inductor"
