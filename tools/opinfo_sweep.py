"""Op coverage against PyTorch's OpInfo database: every OpInfo, float32 and bfloat16, CPU vs tpu.

For each OpInfo in ``torch.testing._internal.common_methods_invocations.op_db`` and each dtype it
supports on CPU (of float32 and bfloat16), the sweep runs the OpInfo's sample inputs on CPU and on
tpu copies of them, and compares the results with ``torch.testing.assert_close``. An OpInfo passes
for a dtype when every sample it ran matches; it fails with the first sample's reason otherwise.

- Tolerances: the largest ``toleranceOverride`` the OpInfo declares for the dtype, at least the
  defaults below (float32: atol 1e-5, rtol 1.3e-5; bfloat16: atol 1e-2, rtol 1.6e-2).
- Samples whose CPU reference raises are not run on tpu; an OpInfo all of whose samples raise on
  CPU (or that has none) is reported as ``cpu-error`` and left out of the pass rate.
- Random ops (their CPU results differ between two seeds) and ``empty``-like ops (uninitialised
  results) are compared by shape and dtype only.
- The tpu call runs under a recording dispatch mode: aten ops that reached the device without a
  lowering in hf_tpu's table nor a backend-agnostic kernel were served by the PrivateUse1
  fallback (decompositions, once the fallback has them); passing OpInfos that needed such ops are
  listed in the report. Run with ``HF_TPU_CPU_FALLBACK`` unset: CPU fallback would hide failures.

Usage::

    python tools/opinfo_sweep.py                       # CI mode: first 6 samples per OpInfo and dtype
    python tools/opinfo_sweep.py --all-samples         # every sample
    python tools/opinfo_sweep.py --ops cumsum,median   # a few OpInfos (merged into --results)

Results go to a JSON-lines file (``--results``, one line per OpInfo and dtype); the report
``docs/op_coverage.md`` is generated from it (``--markdown``; ``--report-only`` regenerates it).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("float32", "bfloat16")
DEFAULT_TOLERANCES = {"float32": (1e-5, 1.3e-5), "bfloat16": (1e-2, 1.6e-2)}
# Ops whose results are uninitialised memory: only shapes and dtypes are meaningful.
UNINITIALISED = ("empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted")


class Mismatch(AssertionError):
    pass


class SampleTimeout(Exception):
    pass


def _load_op_db():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return op_db


def op_key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def tolerances(op, dtype) -> tuple[float, float]:
    """The largest ``toleranceOverride`` the OpInfo declares for ``dtype``, at least the defaults."""
    from torch.testing._internal.common_device_type import toleranceOverride

    atol, rtol = DEFAULT_TOLERANCES[str(dtype).removeprefix("torch.")]
    for info in op.decorators:
        for decorator in getattr(info, "decorators", [info]):
            if isinstance(decorator, toleranceOverride) and dtype in decorator.d:
                atol = max(atol, decorator.d[dtype].atol)
                rtol = max(rtol, decorator.d[dtype].rtol)
    return atol, rtol


# OpInfos whose lowering uses an XLA feature that TPU chips lack: they pass on the CPU (and GPU)
# platform, which is where the sweep runs, and raise NotImplementedError on TPU chips.
NOT_ON_TPU_CHIPS = {
    "linalg.eig": "non-symmetric eigendecomposition (XLA has it on CPU and GPU only)",
    "linalg.eigvals": "non-symmetric eigendecomposition (XLA has it on CPU and GPU only)",
}

# Why the gradients that still differ from CPU's do (shown in the coverage table, strict xfails in CI).
_TIES = "bfloat16 ties: CPU's order among equal keys differs, so gradients go to other positions"
_GRID = "the grid's gradient jumps at pixel boundaries and bfloat16 coordinates land on either side of them"
_SPARSE = "sparse layouts are not supported on tpu"
GRADIENT_REASONS = {
    ("matrix_exp", "float32"): "the backward is a matrix_exp of a block matrix: the forward's known difference "
                               "(CPU's float32 result is itself 2.4e-3 off the exact one)",
    ("nn.functional.ctc_loss", "float32"): "CPU's formula subtracts exp(alpha + beta + nll - log_probs) from "
                                           "exp(log_probs) with nll ~ 1e2: one element of 16000 is 2.8e-5 off",
    ("sort", "bfloat16"): _TIES,
    ("msort", "bfloat16"): _TIES,
    ("topk", "bfloat16"): _TIES,
    ("nn.functional.normalize", "bfloat16"): "one gradient element of 40 whose two terms cancel to 0 on CPU is "
                                             "0.0625 on tpu (one bfloat16 rounding step of those terms); not traced",
    ("grid_sampler_2d", "bfloat16"): _GRID + " (CPU's own is 113 off its float32 gradient on one sample)",
    ("nn.functional.grid_sample", "bfloat16"): _GRID,
    ("sparse.mm.reduce", "float32"): _SPARSE,
    ("sparse.mm.reduce", "bfloat16"): _SPARSE,
    ("sparse.sampled_addmm", "float32"): _SPARSE,
    ("to_sparse", "float32"): _SPARSE,
}

# Tensor arguments that the op requires on the CPU (as on CUDA), by position in (input, *args).
CPU_ARGUMENTS = {"tensor_split": (1,)}


def to_tpu(value: Any, leaves: dict | None = None) -> Any:
    """tpu copies of the tensors in a sample; ``device`` values naming the CPU name the tpu instead.

    With ``leaves`` (gradient mode), tensors that require grad become tpu leaves that require grad, one
    per CPU tensor (a tensor passed twice is one leaf, as on CPU), recorded as ``{id(cpu): (cpu, tpu)}``.
    """
    import torch

    if isinstance(value, torch.Tensor):
        if leaves is None or not value.requires_grad:
            return _copy_keeping_layout(value, "tpu")
        if id(value) not in leaves:
            leaves[id(value)] = (value, _copy_keeping_layout(value, "tpu").requires_grad_())
        return leaves[id(value)][1]
    if (isinstance(value, torch.device) and value.type == "cpu") or value == "cpu":
        return torch.device("tpu")
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_tpu(v, leaves) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_tpu(v, leaves) for v in value)
    if isinstance(value, dict):
        return {k: ("tpu" if k == "device" and v is not None else to_tpu(v, leaves)) for k, v in value.items()}
    return value


def _copy_keeping_layout(tensor, device: str):
    """A detached copy of a tensor on ``device``; a view keeps its place in a copy of its whole storage
    (ops like ``as_strided`` address the storage, not the view)."""
    import torch

    if tensor._base is None or tensor.layout != torch.strided:
        return tensor.detach().to(device, copy=True)
    whole = torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage())
    return whole.detach().to(device, copy=True).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def clone(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return _copy_keeping_layout(value, "cpu")
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(clone(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(clone(v) for v in value)
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    return value


def compare(actual: Any, expected: Any, atol: float, rtol: float, values: bool = True) -> None:
    """Raises ``Mismatch`` unless ``actual`` (tpu) matches ``expected`` (CPU)."""
    import torch

    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise Mismatch(f"expected a tensor, got {type(actual).__name__}")
        if expected.device.type == "cpu" and actual.device.type != "tpu":
            raise Mismatch(f"result on {actual.device}, expected tpu")
        if actual.dtype != expected.dtype:
            raise Mismatch(f"dtype {actual.dtype} != {expected.dtype}")
        if actual.shape != expected.shape:
            raise Mismatch(f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
        if values and expected.layout == torch.strided:
            try:
                torch.testing.assert_close(actual.cpu(), expected, atol=atol, rtol=rtol, equal_nan=True,
                                           check_device=False, check_stride=False)
            except AssertionError as error:
                raise Mismatch(_summary(str(error))) from None
    elif isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise Mismatch(f"expected a sequence of {len(expected)}, got {type(actual).__name__}")
        for a, e in zip(actual, expected):
            compare(a, e, atol, rtol, values)
    elif isinstance(expected, dict):
        compare([actual[k] for k in expected], list(expected.values()), atol, rtol, values)
    elif isinstance(expected, float) and isinstance(actual, float):
        both_nan = actual != actual and expected != expected
        if values and not (abs(actual - expected) <= atol + rtol * abs(expected) or both_nan):
            raise Mismatch(f"scalar {actual} != {expected}")
    elif values and actual != expected:
        raise Mismatch(f"{actual!r} != {expected!r}")


def _summary(message: str) -> str:
    """``assert_close``'s message in one line: mismatched elements and the greatest differences."""
    parts = [line.strip().rstrip(".") for line in message.splitlines()
             if line.strip().startswith(("Mismatched elements", "Greatest absolute", "Greatest relative"))]
    parts = [p.replace("Mismatched elements: ", "").replace("Greatest absolute difference: ", "abs ")
             .replace("Greatest relative difference: ", "rel ") for p in parts]
    return "values " + "; ".join(parts) if parts else message.strip().splitlines()[0]


def reason_of(error: BaseException) -> str:
    if isinstance(error, Mismatch):
        return f"mismatch: {error}"[:400]
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    if isinstance(error, NotImplementedError) and "has no lowering" in first:
        return f"no lowering: {first.split(chr(39))[1] if chr(39) in first else first}"
    return f"{type(error).__name__}: {first}"[:200]


@contextlib.contextmanager
def time_limit(seconds: float):
    def expire(signum, frame):
        raise SampleTimeout(f"sample took over {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Recorder:
    """A dispatch mode that records the aten ops the tpu call reaches (after composite decomposition)."""

    def __init__(self):
        import torch
        from torch.utils._pytree import tree_leaves
        from torch.utils._python_dispatch import TorchDispatchMode

        names = set()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(t.device.type == "tpu" for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
                    names.add(func.name())
                return func(*args, **(kwargs or {}))

        self.names = names
        self.mode = Mode


def fallback_served(names) -> list[str]:
    """The recorded ops that have neither a tpu kernel nor a backend-agnostic one: the fallback ran them."""
    import torch
    from hf_tpu.backend.dispatch import TABLE

    served = []
    for name in sorted(names):
        if name in TABLE.installed or not name.startswith("aten::"):
            continue
        if any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
               for key in ("PrivateUse1", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")):
            continue
        served.append(name)
    return served


def is_random(op, sample) -> bool:
    """Whether the op samples random numbers: it reseeds (``wrapper_set_seed``, which would make the
    CPU results look deterministic) or its CPU results differ between two seeds."""
    import torch

    code = getattr(op.op, "__code__", None)
    if code is not None and "wrapper_set_seed" in code.co_names:
        return True

    results = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        results.append(op(*clone((sample.input,) + tuple(sample.args)), **clone(sample.kwargs)))
    try:
        compare_cpu(results[0], results[1])
        return False
    except Exception:
        return True


def compare_cpu(a, b):
    import torch

    if isinstance(a, torch.Tensor):
        if not torch.equal(a, b) and not (a.is_floating_point() and torch.equal(a.nan_to_num(), b.nan_to_num())):
            raise Mismatch("random")
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b):
            compare_cpu(x, y)


def differentiable_outputs(result: Any) -> list:
    """The tensors of an op's result (flattened) that gradients flow back through, by position."""
    import torch
    from torch.utils._pytree import tree_leaves

    return [(i, t) for i, t in enumerate(tree_leaves(result))
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]


def cotangents(outputs: list, seed: int = 0) -> list:
    """Random cotangents (CPU, float32 draws cast to each output's dtype), reproducible per sample."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=generator).to(t.dtype) for _, t in outputs]


def gradients(result: Any, inputs: list, grads_out: list) -> tuple:
    """``autograd.grad`` of the differentiable outputs with ``grads_out``; ``None`` for unused inputs."""
    import torch

    outputs = [t for _, t in differentiable_outputs(result)]
    grads = torch.autograd.grad(outputs, inputs, grads_out, allow_unused=True)
    # CPU's formulas return storage-less zero tensors for some ops (sgn of real inputs); CPU kernels
    # read them as null pointers under a dispatch mode (the recorder), so they are made real here.
    return tuple(torch.zeros_like(g) if g is not None and g._is_zerotensor() else g for g in grads)


def _compare_gradients(actual_grads, expected, atol, rtol, values) -> None:
    for index, (a, e) in enumerate(zip(actual_grads, expected)):
        if (a is None) != (e is None):
            raise Mismatch(f"gradient of input {index}: {'None' if a is None else 'a tensor'} on tpu, "
                           f"{'None' if e is None else 'a tensor'} on CPU")
        if e is not None:
            try:
                compare(a, e, atol, rtol, values=values)
            except Mismatch as error:
                raise Mismatch(f"gradient of input {index}: {error}") from None


def float32_gradients(op, sample, leaves: dict, grads_out: list) -> tuple:
    """The CPU's gradients of a bfloat16 sample recomputed in float32 from the same values."""
    import torch
    from torch.utils._pytree import tree_map

    wide = {key: cpu.detach().float().requires_grad_() for key, (cpu, _) in leaves.items()}

    def widen(value):
        if isinstance(value, torch.Tensor):
            return wide[id(value)] if id(value) in wide else value.float() if value.is_floating_point() else value
        return value

    args, kwargs = tree_map(widen, ((sample.input,) + tuple(sample.args), sample.kwargs))
    result = sample.output_process_fn_grad(op(*args, **kwargs))
    grads = gradients(result, list(wide.values()), [g.float() for g in grads_out])
    return tuple(None if g is None else g.to(torch.bfloat16) for g in grads)


def _run_sample(op, sample, tpu_args, tpu_kwargs, expected, atol, rtol, values, grad_inputs=None) -> str:
    """Runs one sample on tpu and compares with the CPU's ``expected`` (results, or gradients).

    A bfloat16 gradient that differs from the CPU's also passes when it matches the CPU's float32
    gradient of the same values within the bfloat16 tolerances (CPU's bfloat16 backward formulas
    round every intermediate; tpu keeps float32 where its kernels accumulate): returns how it passed.
    """
    import torch

    actual = op(*tpu_args, **tpu_kwargs)
    actual = sample.output_process_fn_grad(actual)
    if grad_inputs is None:
        compare(actual, expected, atol, rtol, values=values)
        return "cpu"
    leaves, cpu_outputs, grads_out = grad_inputs
    tpu_outputs = dict(differentiable_outputs(actual))
    missing = [i for i, _ in cpu_outputs if i not in tpu_outputs]
    if missing:
        raise Mismatch(f"outputs {missing} do not require grad on tpu")
    actual_grads = gradients(actual, [t for _, t in leaves.values()], [g.to("tpu") for g in grads_out])
    try:
        _compare_gradients(actual_grads, expected, atol, rtol, values)
        return "cpu"
    except Mismatch as against_cpu:
        if not values or grads_out[0].dtype != torch.bfloat16:
            raise
        try:
            _compare_gradients(actual_grads, float32_gradients(op, sample, leaves, grads_out), atol, rtol, values)
        except Mismatch as against_float32:
            raise Mismatch(f"{against_cpu}; against CPU's float32 gradient: {against_float32}") from None
        return "float32"


def run_one(op, dtype, max_samples: int | None, timeout: float, record: bool, grad: bool = False) -> dict:
    """One OpInfo at one dtype: its results (or, with ``grad``, its gradients) on tpu against the CPU's.

    Gradient mode differentiates every output that requires grad with respect to every sample tensor
    that requires grad, with random cotangents (``autograd.grad``), on CPU and on tpu copies.
    """
    import torch

    atol, rtol = tolerances(op, dtype)
    entry = {"op": op_key(op), "dtype": str(dtype).removeprefix("torch."), "samples": 0, "cpu_errors": 0,
             "status": None, "reason": "", "fallback_ops": [], "compare": "values"}
    start = time.perf_counter()
    recorder = Recorder() if record else None
    try:
        samples = op.sample_inputs("cpu", dtype, requires_grad=grad)
        samples = itertools.islice(samples, max_samples) if max_samples else samples
        samples = list(samples)
    except Exception as error:  # noqa: BLE001
        entry.update(status="cpu-error", reason=f"sample_inputs: {reason_of(error)}")
        return entry
    uninitialised = op.name in UNINITIALISED
    for number, sample in enumerate(samples):
        entry["samples"] += 1
        leaves = {} if grad else None
        try:
            tpu_args = tuple(clone(v) if i in CPU_ARGUMENTS.get(op.name, ()) else to_tpu(v, leaves)
                             for i, v in enumerate((sample.input,) + tuple(sample.args)))
            tpu_kwargs = to_tpu(sample.kwargs, leaves)
        except Exception as error:  # noqa: BLE001
            entry.update(status="fail", reason=f"moving inputs: {reason_of(error)}")
            break
        grad_inputs = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                if grad:
                    expected = op(sample.input, *sample.args, **sample.kwargs)
                    expected = sample.output_process_fn_grad(expected)
                    outputs = differentiable_outputs(expected)
                    if not outputs or not leaves:
                        raise Mismatch("nothing to differentiate")
                    cpu_inputs = [cpu for cpu, _ in leaves.values()]
                    grads_out = cotangents(outputs, seed=number)
                    expected = gradients(expected, cpu_inputs, grads_out)
                    grad_inputs = (leaves, outputs, grads_out)
                else:
                    expected = op(*clone((sample.input,) + tuple(sample.args)), **clone(sample.kwargs))
                    expected = sample.output_process_fn_grad(expected)
                random = not uninitialised and is_random(op, sample)
        except Exception:  # noqa: BLE001
            entry["cpu_errors"] += 1
            continue
        if random or uninitialised:
            entry["compare"] = "shape/dtype (random)" if random else "shape/dtype (uninitialised)"
        try:
            with warnings.catch_warnings(), time_limit(timeout):
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                with (recorder.mode() if recorder is not None else contextlib.nullcontext()):
                    matched = _run_sample(op, sample, tpu_args, tpu_kwargs, expected, atol, rtol,
                                          not (random or uninitialised), grad_inputs)
                if matched == "float32":
                    entry["compare"] = "float32 reference"
        except Exception as error:  # noqa: BLE001
            entry.update(status="fail", reason=reason_of(error))
            break
    if entry["status"] is None:
        if entry["samples"] == 0:
            entry.update(status="cpu-error", reason="no sample inputs")
        elif entry["cpu_errors"] == entry["samples"]:
            entry.update(status="cpu-error", reason="every sample raises on CPU" +
                         (" or has nothing to differentiate" if grad else ""))
        else:
            entry["status"] = "pass"
    if recorder is not None:
        entry["fallback_ops"] = fallback_served(recorder.names)
    entry["seconds"] = round(time.perf_counter() - start, 3)
    return entry


def load_results(path: Path) -> dict:
    results = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                results[(entry["op"], entry["dtype"])] = entry
    return results


def rates(results: dict) -> dict:
    summary = {}
    for dtype in DTYPES:
        entries = [e for (_, d), e in results.items() if d == dtype]
        counted = [e for e in entries if e["status"] != "cpu-error"]
        passed = [e for e in counted if e["status"] == "pass"]
        summary[dtype] = {
            "passed": len(passed), "counted": len(counted), "cpu_errors": len(entries) - len(counted),
            "rate": 100.0 * len(passed) / len(counted) if counted else 0.0,
            "fallback": sum(1 for e in passed if e.get("fallback_ops")),
        }
    return summary


FORWARD_INTRO = (
    "Generated by `tools/opinfo_sweep.py`; do not edit by hand. Each OpInfo of "
    "`torch.testing._internal.common_methods_invocations.op_db` runs its sample inputs on CPU and on "
    "tpu copies, and the results are compared with `torch.testing.assert_close` (the OpInfo's "
    "tolerance overrides where it declares them; at least atol 1e-5 / rtol 1.3e-5 for float32 and "
    "atol 1e-2 / rtol 1.6e-2 for bfloat16). OpInfos whose CPU reference raises on every sample are "
    "`cpu-error` and left out of the rates. Random ops are compared by shape and dtype only."
)
GRADIENT_INTRO = (
    "Generated by `tools/opinfo_sweep.py --grad`; do not edit by hand. Every OpInfo that supports "
    "autograd, in each dtype it supports backward for on CPU: its samples' inputs require grad, and "
    "`torch.autograd.grad` of every floating-point output that requires grad, with random cotangents "
    "(the same on both devices), gives the gradient of every input that requires grad, on CPU and on tpu "
    "copies; they are compared with the forward sweep's tolerances. A sample whose CPU run raises or "
    "has no differentiable output is not counted; an OpInfo with no such sample is `cpu-error`."
)
# Each sweep owns one part of docs/op_coverage.md, from its heading to the next part's.
HEADINGS = {False: "# Op coverage against PyTorch's OpInfo database",
            True: "# Gradient coverage against PyTorch's OpInfo database"}


def write_markdown(path: Path, section: str, grad: bool) -> None:
    """Replaces this sweep's part of the coverage document, keeping the other sweep's part."""
    parts = {False: "", True: ""}
    if path.exists():
        text = path.read_text()
        at = text.find(HEADINGS[True])
        parts = {False: text[:at] if at >= 0 else text, True: text[at:] if at >= 0 else ""}
    parts[grad] = section
    path.write_text(parts[False].rstrip("\n") + "\n\n" + parts[True] if parts[True] else parts[False])


def markdown(results: dict, command: str, seconds: float | None, grad: bool = False) -> str:
    summary = rates(results)
    lines = [
        HEADINGS[grad],
        "",
        GRADIENT_INTRO if grad else FORWARD_INTRO,
        "",
        f"Command: `{command}`" + (f" ({seconds / 60:.0f} min)" if seconds else ""),
        "",
        "| dtype | pass | of | rate | cpu-error (excluded) | passes needing fallback-served ops |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for dtype, s in summary.items():
        lines.append(f"| {dtype} | {s['passed']} | {s['counted']} | {s['rate']:.1f}% | {s['cpu_errors']} | "
                     f"{s['fallback']} |")
    reasons = collections.Counter()
    for entry in results.values():
        if entry["status"] == "fail":
            reason = entry["reason"]
            reasons["no lowering" if reason.startswith("no lowering") else
                    "mismatch" if reason.startswith("mismatch") else reason.split(":")[0]] += 1
    lines += ["", "Failures by kind: " + ", ".join(f"{k} {v}" for k, v in reasons.most_common()) + ".", ""]
    explained = GRADIENT_REASONS if grad else {}
    lines += ["## Failing OpInfos", "", "| OpInfo | dtype | reason |" + (" why |" if grad else ""),
              "| --- | --- | --- |" + (" --- |" if grad else "")]
    for (name, dtype), entry in sorted(results.items()):
        if entry["status"] == "fail":
            reason = entry["reason"].replace("|", "\\|").replace("\n", " ")
            why = f" {explained.get((name, dtype), 'not yet known')} |" if grad else ""
            lines.append(f"| `{name}` | {dtype} | {reason} |{why}")
    served = [(k, e) for k, e in sorted(results.items()) if e["status"] == "pass" and e.get("fallback_ops")]
    lines += ["", "## Passes that went through the PrivateUse1 fallback", "",
              "These OpInfos passed, but some aten op they reached has no lowering in hf_tpu's table: the "
              "fallback served it (by decomposition).", ""]
    if served:
        lines += ["| OpInfo | dtype | fallback-served ops |", "| --- | --- | --- |"]
        lines += [f"| `{name}` | {dtype} | {', '.join(e['fallback_ops'])} |" for (name, dtype), e in served]
    else:
        lines.append("None.")
    platform_bound = sorted((name, dtype) for (name, dtype), e in results.items()
                            if e["status"] == "pass" and name in NOT_ON_TPU_CHIPS)
    lines += ["", "## Passes that need the CPU or GPU platform", "",
              "These pass here (JAX's CPU platform) but raise NotImplementedError on TPU chips.", ""]
    lines += [f"- `{name}` ({dtype}): {NOT_ON_TPU_CHIPS[name]}" for name, dtype in platform_bound] or ["None."]
    cpu_errors = [(k, e) for k, e in sorted(results.items()) if e["status"] == "cpu-error"]
    lines += ["", "## Excluded: CPU reference raises", ""]
    lines += [f"- `{name}` ({dtype}): {e['reason']}" for (name, dtype), e in cpu_errors] or ["None."]
    shape_only = sorted({name for (name, _), e in results.items() if e.get("compare", "").startswith("shape")})
    lines += ["", "## Compared by shape and dtype only", "", ", ".join(f"`{n}`" for n in shape_only) or "None.", ""]
    if grad:
        wide = sorted(name for (name, _), e in results.items()
                      if e["status"] == "pass" and e.get("compare") == "float32 reference")
        lines += ["## bfloat16 passes against CPU's float32 gradient", "",
                  "These bfloat16 gradients differ from CPU's bfloat16 ones beyond the tolerances but match CPU's "
                  "gradient of the same values computed in float32 (CPU's bfloat16 backward formulas round "
                  "every intermediate to bfloat16; tpu accumulates in float32 where its kernels do).", "",
                  ", ".join(f"`{n}`" for n in wide) or "None.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grad", action="store_true", help="compare gradients instead of results")
    parser.add_argument("--all-samples", action="store_true", help="run every sample (default: the first 6)")
    parser.add_argument("--samples", type=int, default=6, help="samples per OpInfo and dtype in CI mode")
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (name or name.variant)")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per sample")
    parser.add_argument("--results", default=None,
                        help="JSON-lines results (default: build/opinfo_sweep.jsonl, with --grad "
                             "build/opinfo_grad_sweep.jsonl)")
    parser.add_argument("--markdown", default=str(ROOT / "docs" / "op_coverage.md"))
    parser.add_argument("--no-markdown", action="store_true")
    parser.add_argument("--report-only", action="store_true", help="regenerate the markdown from --results")
    parser.add_argument("--no-record", action="store_true", help="don't record fallback-served ops")
    args = parser.parse_args(argv)

    if os.environ.get("HF_TPU_CPU_FALLBACK", "0") not in ("", "0"):
        print("HF_TPU_CPU_FALLBACK is set: CPU fallback would count host-run ops as passes", file=sys.stderr)
        return 2
    results_path = Path(args.results or ROOT / "build" / ("opinfo_grad_sweep.jsonl" if args.grad
                                                          else "opinfo_sweep.jsonl"))
    command = "python tools/opinfo_sweep.py" + (" --grad" if args.grad else "") + (
        " --all-samples" if args.all_samples else "")
    results = load_results(results_path) if (args.ops or args.report_only) else {}
    seconds = None
    if not args.report_only:
        import torch

        import hf_tpu  # noqa: F401

        (torch.ones(2, device="tpu") + 1).cpu()  # installs the op table: fail here, not once per OpInfo
        op_db = _load_op_db()
        wanted = {name for name in args.ops.split(",") if name}
        ops = [op for op in op_db if not wanted or op.name in wanted or op_key(op) in wanted]
        if args.grad:
            ops = [op for op in ops if op.supports_autograd]
        dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
        results_path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        log = results_path.open("a" if args.ops else "w")
        for i, op in enumerate(ops):
            supported = op.supported_backward_dtypes("cpu") if args.grad else op.supported_dtypes("cpu")
            for dtype in dtypes:
                if dtype not in supported:
                    continue
                entry = run_one(op, dtype, None if args.all_samples else args.samples, args.timeout,
                                not args.no_record, grad=args.grad)
                results[(entry["op"], entry["dtype"])] = entry
                log.write(json.dumps(entry) + "\n")
                log.flush()
                mark = {"pass": ".", "fail": "F", "cpu-error": "c"}[entry["status"]]
                print(f"[{i + 1}/{len(ops)}] {mark} {entry['op']} {entry['dtype']} {entry['reason']}", flush=True)
        log.close()
        seconds = time.perf_counter() - start
        if args.ops:  # rewrite the merged results, one line per (OpInfo, dtype)
            results_path.write_text("".join(json.dumps(e) + "\n" for e in results.values()))
    for dtype, s in rates(results).items():
        print(f"{dtype}: {s['passed']}/{s['counted']} pass ({s['rate']:.1f}%), {s['cpu_errors']} cpu-error excluded, "
              f"{s['fallback']} passes via fallback-served ops")
    if not args.no_markdown and (args.report_only or not args.ops):
        write_markdown(Path(args.markdown), markdown(results, command, seconds, args.grad), args.grad)
    return 0


if __name__ == "__main__":
    sys.exit(main())
