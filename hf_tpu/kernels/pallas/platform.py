"""Where the Pallas kernels run: compiled by Mosaic on TPU chips, in TPU interpret mode elsewhere.

Pallas TPU kernels compile only for TPU chips. On any other platform (a CPU host, a GPU) the same
kernels run in JAX's TPU interpret mode, which simulates the chip's memories and DMAs with ordinary
XLA operations: slow, but numerically the kernel itself, so tests and CPU hosts exercise the code
that runs on chips.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import jax
from jax.experimental.pallas import tpu as pltpu

from ...backend import runtime


def use_by_default() -> bool:
    """Whether hf_tpu should prefer the Pallas kernels to the XLA-native lowerings.

    True when TPU chips back the ``tpu`` device; on every other platform the XLA-native lowerings
    stay (the kernels would only run in the slow interpret mode there), unless ``HF_TPU_PALLAS=1``
    asks for them everywhere (see :func:`hf_tpu.backend.runtime.pallas_kernels`).
    """
    return runtime.pallas_kernels()


def interpret_unless_on_tpu(fn: Callable[..., Any], interpret: bool | None = None) -> Callable[..., Any]:
    """``fn``, a function calling Pallas TPU kernels, made to run here: on TPU chips or interpreted.

    ``fn`` takes positional JAX arrays (or pytrees of them, ``None`` included) and returns arrays;
    bind static arguments with ``functools.partial`` first. ``interpret=None`` runs it in TPU
    interpret mode unless TPU chips back the device or it is lowered for them
    (``runtime.lowering_for_tpu_chips``); ``False`` forces the Mosaic path (for a
    ``jax.export`` to TPU from a CPU host), ``True`` forces interpret mode.

    ``fn`` is also traced with 64-bit mode off: JAX's TPU kernels are written for 32-bit JAX (their
    index maps mix int32 grid indices with Python ints, which x64 widens to int64) and hf_tpu turns
    x64 on. Both settings act at trace time, and a ``custom_vjp``'s backward is traced after the
    forward has returned, so the result carries its own ``custom_vjp`` that traces the backward of
    ``fn`` under the same settings. Differentiating it works exactly when differentiating ``fn`` does.
    """
    if interpret is None:
        interpret = runtime.pallas_interpreted()
    return functools.partial(_traced_for_tpu, interpret, fn)


@contextlib.contextmanager
def _kernel_tracing(interpret: bool) -> Iterator[None]:
    if interpret:
        runtime.interpreted_kernel_traces += 1  # its program must not be queued behind (runtime.waiting)
    with contextlib.ExitStack() as settings:
        settings.enter_context(jax.enable_x64(False))
        if interpret:
            settings.enter_context(pltpu.force_tpu_interpret_mode(params=pltpu.InterpretParams()))
            # the kernels' float32 dots in full float32 where a GPU would take them in TF32 (8e-4 off on the H200)
            settings.enter_context(jax.default_matmul_precision("highest"))
        yield


def _call_traced_for_tpu(interpret: bool, fn: Callable[..., Any], *args: Any) -> Any:
    with _kernel_tracing(interpret):
        return fn(*args)


_traced_for_tpu = jax.custom_vjp(_call_traced_for_tpu, nondiff_argnums=(0, 1))


def _traced_for_tpu_fwd(interpret: bool, fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    with _kernel_tracing(interpret):
        return jax.vjp(fn, *args)  # the pullback is a pytree of residual arrays


def _traced_for_tpu_bwd(interpret: bool, fn: Callable[..., Any], pullback: Any, cotangent: Any) -> Any:
    with _kernel_tracing(interpret):
        return pullback(cotangent)


_traced_for_tpu.defvjp(_traced_for_tpu_fwd, _traced_for_tpu_bwd)
