"""Which JAX devices back the ``tpu`` device, chosen once and lazily.

``HF_TPU_PLATFORM`` picks the JAX platform: ``auto`` (default: TPU chips when libtpu finds
them, otherwise JAX's default platform, GPU or CPU, as a stand-in), ``tpu``, ``gpu`` or ``cpu``.
``HF_TPU_NUM_DEVICES=N`` gives N virtual chips on a CPU host (``tpu:0`` .. ``tpu:N-1``).
``HF_TPU_CACHE_DIR`` is where compiled XLA programs persist across processes (see
:func:`compilation_cache_dir`).

Nothing here imports JAX until a device is first needed, so ``import torch`` stays fast.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from typing import Any, Callable, Iterator

logger = logging.getLogger("hf_tpu")

_PLATFORMS = ("auto", "tpu", "gpu", "cpu")
_YES = ("1", "true", "yes", "on")
_NO = ("", "0", "false", "no", "off")
_CHECKS = {"1": "deferred", "on": "deferred", "deferred": "deferred", "immediate": "immediate", "0": "off",
           "off": "off"}

# Every variable hf_tpu reads; another HF_TPU_* name in the environment is most likely a typo.
VARIABLES = ("HF_TPU_PLATFORM", "HF_TPU_NUM_DEVICES", "HF_TPU_CACHE_DIR", "HF_TPU_CPU_FALLBACK", "HF_TPU_CHECKS",
             "HF_TPU_LOG_RECOMPILES", "HF_TPU_STRICT_COMPILE", "HF_TPU_CHECK_TPU_LOWERING", "HF_TPU_PALLAS",
             "HF_TPU_EAGER_MODE", "HF_TPU_STEPWISE_DECODE")
EAGER_MODES = ("strict", "fused", "debug")
# Per-geometry programs are bounded (least recently used evicted): a long run with ever new shapes
# must not grow memory without end.
PROGRAMS_PER_CACHE = 1024


def flag(name: str) -> bool:
    """A yes/no variable: 1/true/yes/on or 0/false/no/off (unset: no); anything else is an error."""
    value = os.environ.get(name, "").strip().lower()
    if value in _YES:
        return True
    if value in _NO:
        return False
    raise ValueError(f"{name}={value!r} is not a yes/no value: set it to 1 (on) or 0 (off), or unset it.")


def checks_mode() -> str:
    """``HF_TPU_CHECKS``: ``deferred`` (1, the default), ``immediate`` or ``off`` (0)."""
    value = os.environ.get("HF_TPU_CHECKS", "1").strip().lower() or "1"
    if value not in _CHECKS:
        raise ValueError(
            f"HF_TPU_CHECKS={value!r} is not one of 1, immediate, 0: use 1 (checks raised at the next sync), "
            "immediate (raised by the failing op) or 0 (no index or division checks)."
        )
    return _CHECKS[value]


def check_environment() -> None:
    """Reads every HF_TPU_* variable once, so that a bad value fails at the first device use, naming
    the variable, rather than wherever it is first read; warns about names hf_tpu does not read."""
    requested_platform()
    requested_device_count()
    checks_mode()
    eager_mode()
    pallas_mode()
    for name in ("HF_TPU_CPU_FALLBACK", "HF_TPU_LOG_RECOMPILES", "HF_TPU_STRICT_COMPILE", "HF_TPU_STEPWISE_DECODE"):
        flag(name)
    if not os.environ.get("HF_TPU_CHECK_TPU_LOWERING", "").strip().lower().startswith("record:"):
        flag("HF_TPU_CHECK_TPU_LOWERING")
    unknown = sorted(name for name in os.environ if name.startswith("HF_TPU_") and name not in VARIABLES)
    if unknown:
        logger.warning("hf_tpu: ignoring %s: not a variable hf_tpu reads (those are %s).",
                       ", ".join(unknown), ", ".join(VARIABLES))


def eager_mode() -> str:
    """``HF_TPU_EAGER_MODE``: ``strict`` (the default), ``fused`` or ``debug`` (see :mod:`hf_tpu.backend.fused`)."""
    value = os.environ.get("HF_TPU_EAGER_MODE", "strict").strip().lower() or "strict"
    if value not in EAGER_MODES:
        raise ValueError(f"HF_TPU_EAGER_MODE={value!r} is not one of strict, fused, debug: use strict (each op runs at "
                         "once), fused (ops recorded and run as one program at a sync) or debug (each op waits for its "
                         "result and checks it).")
    return value


def pallas_mode() -> str:
    """``HF_TPU_PALLAS``: ``auto`` (the default), ``1`` or ``0``; see :func:`pallas_kernels`."""
    value = os.environ.get("HF_TPU_PALLAS", "auto").strip().lower() or "auto"
    if value in _YES:
        return "1"
    if value in _NO:
        return "0"
    if value != "auto":
        raise ValueError(f"HF_TPU_PALLAS={value!r} is not one of auto, 1, 0: use auto (the Pallas kernels on TPU "
                         "chips only), 1 (on every platform, interpreted off TPU chips) or 0 (never).")
    return value


def pallas_kernels() -> bool:
    """Whether operator lowerings use hf_tpu's Pallas kernels (:mod:`hf_tpu.kernels.pallas`) where those
    beat the XLA-native lowering: on TPU chips by default (``HF_TPU_PALLAS=auto``), on every platform
    with ``HF_TPU_PALLAS=1`` (off TPU chips in TPU interpret mode: slow, to test the chips' code path on
    a laptop), never with ``0``. Read when an operator is traced, so set it before the first call."""
    mode = pallas_mode()
    return backing_platform() == "tpu" if mode == "auto" else mode == "1"


def requested_platform() -> str:
    value = os.environ.get("HF_TPU_PLATFORM", "auto").strip().lower() or "auto"
    if value == "cuda":
        value = "gpu"
    if value not in _PLATFORMS:
        raise ValueError(f"HF_TPU_PLATFORM={value!r} is not one of {', '.join(_PLATFORMS)}; set it to one of those.")
    return value


def tpu_chips() -> int:
    """This host's TPU chips where JAX is to use them (PCI devices, counted as JAX counts them, before it starts)."""
    if requested_platform() not in ("tpu", "auto"):
        return 0
    from jax._src import hardware_utils  # no public API counts the chips without starting libtpu

    return hardware_utils.num_available_tpu_chips_and_device_id()[0]


def backends_started() -> bool:
    """Whether JAX has made its backends (its devices are fixed then); imports no JAX that is not imported yet."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def requested_device_count() -> int | None:
    value = os.environ.get("HF_TPU_NUM_DEVICES")
    if not value:
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"HF_TPU_NUM_DEVICES={value!r} must be a positive integer number of devices.")
    return count


def compilation_cache_dir() -> str | None:
    """The persistent XLA compilation cache: ``HF_TPU_CACHE_DIR``, by default ``hf_tpu/xla`` in the
    user's cache directory (``$XDG_CACHE_HOME`` or ``~/.cache``); ``off`` (or empty) turns it off."""
    value = os.environ.get("HF_TPU_CACHE_DIR")
    if value is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "hf_tpu", "xla")
    return None if value.strip().lower() in ("", "0", "off", "none", "false") else os.path.expanduser(value)


def _enable_compilation_cache(jax: Any) -> None:
    """Every program (eager operators and compiled graphs) goes to the on-disk cache, however quick
    its compilation: a second process then skips XLA compilation. The cache is not size-limited:
    JAX's limit scans the cache on every write, which doubled the test suite's time; delete the
    directory to reclaim space. A cache directory the user set for JAX itself is kept. A directory
    that cannot be written is an error when ``HF_TPU_CACHE_DIR`` names it, and skipped with a warning
    when it is the default."""
    directory = compilation_cache_dir()
    if directory is None or jax.config.jax_compilation_cache_dir:
        return
    try:
        os.makedirs(directory, exist_ok=True)
        writable = os.access(directory, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        if "HF_TPU_CACHE_DIR" in os.environ:
            raise ValueError(
                f"HF_TPU_CACHE_DIR={os.environ['HF_TPU_CACHE_DIR']!r}: cannot create or write {directory}; set it "
                "to a writable directory, or to 'off' to keep compiled programs in memory only."
            )
        logger.warning("hf_tpu: cannot write the XLA program cache at %s; compiled programs stay in memory "
                       "(set HF_TPU_CACHE_DIR to a writable directory).", directory)
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@functools.cache
def jax_module() -> Any:
    """Imports and configures JAX for hf_tpu (64-bit types on, virtual CPU devices if asked)."""
    check_environment()
    count = requested_device_count()
    if count is not None and requested_platform() in ("auto", "cpu"):
        os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(count))
    import jax

    # int64 and float64 tensors must keep their width; every lowering passes dtypes explicitly.
    jax.config.update("jax_enable_x64", True)
    _enable_compilation_cache(jax)
    if count is not None:
        try:
            jax.config.update("jax_num_cpu_devices", count)
        except Exception:  # backends already initialised by the user's own JAX code
            pass
    return jax


@functools.cache
def devices() -> tuple[Any, ...]:
    """The JAX devices that are ``tpu:0`` .. ``tpu:N-1``, in index order: this process's own (local) devices, also
    under JAX's multi-process runtime (:mod:`hf_tpu.distributed`)."""
    jax = jax_module()
    platform = requested_platform()
    if platform == "auto":
        try:
            found = jax.local_devices(backend="tpu")
        except RuntimeError:
            found = jax.local_devices()
            logger.warning(
                "hf_tpu: no TPU found; the 'tpu' device runs on JAX's %s platform (%d device%s).",
                found[0].platform, len(found), "" if len(found) == 1 else "s",
            )
    else:
        try:
            found = jax.local_devices(backend=platform)
        except RuntimeError as error:
            available = sorted({d.platform for d in jax.devices()})
            raise RuntimeError(
                f"HF_TPU_PLATFORM={platform} but JAX has no {platform} platform here (it has: "
                f"{', '.join(available)}). Install JAX for it (jax[tpu] on a TPU VM, jax[cuda12] for NVIDIA GPUs) "
                "or set HF_TPU_PLATFORM=auto."
            ) from error
    count = requested_device_count()
    if count is not None:
        if count > len(found):
            raise RuntimeError(
                f"HF_TPU_NUM_DEVICES={count} but the {found[0].platform} platform has only {len(found)} devices."
            )
        found = found[:count]
    from .forks import watch_forks

    watch_forks()
    for callback in _FIRST_USE:
        callback()
    return tuple(found)


_FIRST_USE: list[Callable[[], None]] = []


def when_first_used(callback: Callable[[], None]) -> None:
    """Calls ``callback()`` when this process first uses the device (at once if it has)."""
    if devices.cache_info().currsize:
        callback()
    else:
        _FIRST_USE.append(callback)


def device(index: int) -> Any:
    return devices()[index]


@functools.cache
def one_chip(index: int) -> Any:
    """The sharding of an array on ``tpu:index`` alone."""
    import jax

    return jax.sharding.SingleDeviceSharding(device(index))


_for_tpu_chips = threading.local()


@contextlib.contextmanager
def lowering_for_tpu_chips() -> Iterator[None]:
    """While a program is lowered for TPU chips from another platform (``jax.export(platforms=["tpu"])``):
    Pallas kernels traced now are lowered by Mosaic, as on the chips, not in TPU interpret mode."""
    outer = getattr(_for_tpu_chips, "active", False)
    _for_tpu_chips.active = True
    try:
        yield
    finally:
        _for_tpu_chips.active = outer


def pallas_interpreted() -> bool:
    """Whether Pallas TPU kernels traced now run in TPU interpret mode: off TPU chips, except while lowering
    for them (:func:`lowering_for_tpu_chips`)."""
    return backing_platform() != "tpu" and not getattr(_for_tpu_chips, "active", False)


interpreted_kernel_traces = 0
"""How many traces held a Pallas kernel in TPU interpret mode (counted by ``hf_tpu.kernels.pallas.platform``)."""


def waiting(fn: Any) -> Any:
    """``fn`` (a jitted function or executable) waiting for its results before it returns, on JAX's CPU platform.

    For programs holding a Pallas kernel in TPU interpret mode: there the kernel's callbacks run programs of
    their own, which queue behind the CPU client's bound on programs in flight; once the programs issued
    after the kernel's fill that bound, the kernel and they wait for each other forever.
    """
    if backing_platform() != "cpu":
        return fn
    import jax

    def run(*args: Any) -> Any:
        return jax.block_until_ready(fn(*args))

    return run


def waiting_if_interpreted(fn: Any) -> Any:
    """``fn`` (a jitted function, traced at its calls) :func:`waiting` from the first call whose trace held a
    Pallas kernel in TPU interpret mode, on JAX's CPU platform."""
    if backing_platform() != "cpu":
        return fn
    import jax

    interpreted = False

    def run(*args: Any) -> Any:
        nonlocal interpreted
        traces = interpreted_kernel_traces
        result = fn(*args)
        if interpreted or interpreted_kernel_traces != traces:
            interpreted = True
            jax.block_until_ready(result)
        return result

    run.__wrapped__ = fn  # what fused eager mode records, where nothing is interpreted
    return run


def backing_platform() -> str:
    """``tpu``, ``gpu`` or ``cpu``: what really runs the ``tpu`` device."""
    return devices()[0].platform


def device_name(index: int = 0) -> str:
    jax_device = device(index)
    if jax_device.platform == "tpu":
        return str(getattr(jax_device, "device_kind", "TPU"))
    kind = getattr(jax_device, "device_kind", jax_device.platform)
    return f"JAX {jax_device.platform} stand-in ({kind})"
