"""transformers' continuous batching on tpu: compiled steps of bounded shapes, inputs staged on the host, and the
paged cache sized from the chip's memory, not the host's.

**Compiled steps.** transformers runs each batch eagerly unless a compile config is given, and pads a batch's
query and key sizes only when it compiles. On tpu, eager batches of new sizes are new XLA programs at every
step, so a tpu model's batches are compiled by default (``CompileConfig(dynamic=True)``: Dynamo traces once per
manager, hf_tpu compiles one program per padded size), and the sizes are padded to powers of two: the query
tokens to at least :data:`MIN_QUERY_TOKENS` and at most ``max_batch_tokens``, the tokens read from the cache to
zero or at least one page and at most the cache. A run therefore compiles at most
``(log2(max_batch_tokens / MIN_QUERY_TOKENS) + 2) * (log2(max_tokens_read / page_size) + 2)`` programs of the step,
whatever the number and lengths of its requests (:func:`padded_sizes`). A compile config of the user's is used as
given, with these sizes. transformers' warm-up, which runs a step at the largest sizes so that CUDA graphs are
captured before any request, is skipped: on tpu it would compile a program of a batch that may never come, with an
attention over the whole cache (tens of GiB for a cache sized from the memory), and each program compiles when a
batch of its size first comes.

**One program per step.** transformers keeps ``PagedAttentionCache.update`` out of compiled graphs
(``torch.compiler.disable``: Inductor does not handle the cache tensor's views), which splits a step at every
layer. hf_tpu's graph mode lowers the writes into the cache's views, so a tpu cache traces its update and a step
is one program.

**Inputs staged on the host.** Each batch's inputs (token ids, positions, sequence lengths, cache indices, the
attention mask) are written by transformers slice by slice into static tensors, a few dozen writes at offsets that
change every step. For a tpu model these static tensors live on the host, and only the slices a step reads go to
the chip, one transfer per input; the step's output tokens come back in one transfer.

``PagedAttentionCache`` sizes its cache from ``get_device_and_memory_breakdown()``, which knows cuda, xpu and mps
and, for any other device, reports the host's RAM: for a tpu model it asked for 90% of the host (the process was
killed while the cache's zeros were written on JAX's CPU platform; a TPU VM's hundreds of GB of RAM would be asked
of a chip of 16-95 GB). Here a cache made for a tpu device is sized from ``torch.tpu.mem_get_info`` of its chip: on
chips, the chip's free memory; on JAX's CPU platform, the memory the host has available (see
:func:`hf_tpu.backend.devices.mem_get_info`).

The share of it the cache may take is the user's ``max_memory_percent`` when set, else transformers' default for
an accelerator (0.9, 0.8 with logits processors) on chips; on JAX's CPU platform, whose memory is the host's and
whose zeros are written (not lazily mapped as CPU tensors' are), transformers' CPU default (0.6) of the available
memory, capped at :data:`HOST_CACHE_BYTES`. An explicit ``num_blocks`` is used as is.

Patches ``PagedAttentionCache.__init__`` and the ``get_device_and_memory_breakdown`` it calls
(``transformers/generation/continuous_batching/cache.py``), ``resolve_max_memory_percent``
(``.../initialization.py``), ``ModelRunner.__init__``, ``maybe_pad_inputs`` and ``warmup``
(``.../model_runner.py``) and
``ContinuousBatchingIOs`` (``.../input_outputs.py``), transformers 5.2x.
"""

from __future__ import annotations

import contextvars
import functools
import math
import types
from typing import Any

import torch
from torch.utils import _pytree as pytree

HOST_CACHE_BYTES = 4 << 30
"""The most a paged cache takes by default on JAX's CPU platform (the host's memory)."""

MIN_QUERY_TOKENS = 16
"""The fewest query tokens a compiled continuous-batching step on tpu is padded to."""

_SIZED_FOR: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("hf_tpu_paged_cache", default=None)


def _on_chips() -> bool:
    from ..backend import runtime

    return runtime.backing_platform() != "cpu"


def _install_tpu_paged_cache(cache: Any) -> None:
    """A paged cache made for a tpu device sees its chip's memory (``get_device_and_memory_breakdown``) and traces
    its update into the compiled step (see the module docstring)."""
    breakdown, init = cache.get_device_and_memory_breakdown, cache.PagedAttentionCache.__init__
    if getattr(init, "_hf_tpu", False):
        return

    @functools.wraps(breakdown)
    def get_device_and_memory_breakdown() -> tuple[torch.device, int, int, int]:
        device = _SIZED_FOR.get()
        if device is None:
            return breakdown()
        free, total = torch.tpu.mem_get_info(device)
        used = total - free
        return device, total, used, used

    @functools.wraps(init)
    def __init__(self: Any, config: Any, continuous_batching_config: Any, device: Any, *args: Any, **kwargs: Any):
        device = torch.device(device)
        if device.type != "tpu":
            return init(self, config, continuous_batching_config, device, *args, **kwargs)
        chip = torch.device("tpu", torch.tpu.current_device() if device.index is None else device.index)
        sizing = _SIZED_FOR.set(chip)
        try:
            init(self, config, continuous_batching_config, device, *args, **kwargs)
        finally:
            _SIZED_FOR.reset(sizing)
        traced_update = getattr(cache.PagedAttentionCache.update, "_torchdynamo_orig_callable", None)
        if traced_update is not None:
            self.update = types.MethodType(traced_update, self)

    __init__._hf_tpu = True
    cache.get_device_and_memory_breakdown = get_device_and_memory_breakdown
    cache.PagedAttentionCache.__init__ = __init__


def _install_default_share(initialization: Any) -> None:
    """The share of memory a tpu model's paged cache takes by default (see the module docstring)."""
    resolve = initialization.resolve_max_memory_percent
    if getattr(resolve, "_hf_tpu", False):
        return

    @functools.wraps(resolve)
    def resolve_max_memory_percent(cb_config: Any, has_logit_processors: bool, device: Any = None) -> None:
        if device is None or torch.device(device).type != "tpu" or cb_config.max_memory_percent is not None \
                or _on_chips():
            return resolve(cb_config, has_logit_processors, device)
        free, _ = torch.tpu.mem_get_info(device)
        cb_config.max_memory_percent = min(0.6, HOST_CACHE_BYTES / max(free, 1))

    resolve_max_memory_percent._hf_tpu = True
    initialization.resolve_max_memory_percent = resolve_max_memory_percent


def _power_of_two_at_least(size: int, least: int, most: int) -> int:
    return min(most, 1 << max(0, math.ceil(math.log2(max(size, least)))))


def padded_sizes(num_q_tokens: int, max_kv_read: int, max_batch_tokens: int, max_tokens_read: int,
                 page_size: int) -> tuple[int, int]:
    """The query tokens and cache tokens a tpu step of continuous batching runs with: powers of two (see the module
    docstring), so that a run compiles a bounded number of programs."""
    num_q_tokens = _power_of_two_at_least(num_q_tokens, MIN_QUERY_TOKENS, max_batch_tokens)
    if max_kv_read > 0:
        max_kv_read = _power_of_two_at_least(max_kv_read, page_size, max_tokens_read)
    return num_q_tokens, max_kv_read


def _install_compiled_tpu_steps(model_runner: Any) -> None:
    """A tpu model's batches are compiled by default and padded by :func:`padded_sizes` (``ModelRunner``)."""
    runner = model_runner.ModelRunner
    init, maybe_pad_inputs, warmup = runner.__init__, runner.maybe_pad_inputs, runner.warmup
    if getattr(init, "_hf_tpu", False):
        return
    from transformers.generation.configuration_utils import CompileConfig

    @functools.wraps(init)
    def __init__(self: Any, logit_processor: Any, cb_config: Any, inputs_and_outputs: Any, cache: Any,
                 *args: Any, **kwargs: Any) -> None:
        if torch.device(cache.device).type == "tpu" and cb_config.varlen_compile_config is None:
            cb_config.varlen_compile_config = CompileConfig(fullgraph=False, dynamic=True)
        init(self, logit_processor, cb_config, inputs_and_outputs, cache, *args, **kwargs)

    @functools.wraps(maybe_pad_inputs)
    def pad_inputs(self: Any, num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool) -> tuple[int, int]:
        if torch.device(self.cache.device).type != "tpu" or use_decode_fast_path:
            return maybe_pad_inputs(self, num_q_tokens, max_kv_read, use_decode_fast_path)
        return padded_sizes(num_q_tokens, max_kv_read, self.cache.max_batch_tokens, self.cache.max_tokens_read,
                            self.cb_config.page_size)

    @functools.wraps(warmup)
    def warm_up_unless_on_tpu(self: Any, model: Any) -> None:
        if torch.device(self.cache.device).type != "tpu":
            return warmup(self, model)

    __init__._hf_tpu = True
    runner.__init__, runner.maybe_pad_inputs, runner.warmup = __init__, pad_inputs, warm_up_unless_on_tpu


def _install_host_staged_inputs(input_outputs: Any) -> None:
    """A tpu model's batch inputs are written on the host and sent to the chip once per step
    (``ContinuousBatchingIOs``; see the module docstring)."""
    ios = input_outputs.ContinuousBatchingIOs
    init, get_model_kwargs, get_cb_kwargs = ios.__init__, ios.get_model_kwargs, ios.get_cb_kwargs
    retrieve_device_outputs = ios.retrieve_device_outputs
    if getattr(init, "_hf_tpu", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, cache: Any, config: Any, continuous_batching_config: Any, device: Any,
                 *args: Any, **kwargs: Any) -> None:
        device = torch.device(device)
        self.model_device = device if device.type == "tpu" else None
        if self.model_device is None:
            return init(self, cache, config, continuous_batching_config, device, *args, **kwargs)
        init(self, cache, config, continuous_batching_config, torch.device("cpu"), *args, **kwargs)
        self.device_output_ids = torch.zeros_like(self.output_ids, device=device)

    @functools.wraps(get_model_kwargs)
    def staged_model_kwargs(self: Any, *args: Any, **kwargs: Any) -> Any:
        model_kwargs = get_model_kwargs(self, *args, **kwargs)
        if self.model_device is None:
            return model_kwargs
        return pytree.tree_map_only(torch.Tensor, lambda tensor: tensor.to(self.model_device), model_kwargs)

    @functools.wraps(get_cb_kwargs)
    def staged_cb_kwargs(self: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.model_device is None:
            return get_cb_kwargs(self)
        return self.device_output_ids, self.device_output_ids, self.device_output_ids  # no carry-over when in sync

    @functools.wraps(retrieve_device_outputs)
    def retrieve_staged_outputs(self: Any) -> None:
        retrieve_device_outputs(self)
        if self.model_device is not None:
            self.output_ids.copy_(self.device_output_ids)

    __init__._hf_tpu = True
    ios.__init__, ios.get_model_kwargs, ios.get_cb_kwargs = __init__, staged_model_kwargs, staged_cb_kwargs
    ios.retrieve_device_outputs = retrieve_staged_outputs


def install(cache: Any) -> None:
    """Patches ``transformers.generation.continuous_batching.cache`` and its ``initialization``, ``model_runner``
    and ``input_outputs`` siblings."""
    from . import when_imported

    _install_tpu_paged_cache(cache)
    when_imported("transformers.generation.continuous_batching.initialization", _install_default_share)
    when_imported("transformers.generation.continuous_batching.model_runner", _install_compiled_tpu_steps)
    when_imported("transformers.generation.continuous_batching.input_outputs", _install_host_staged_inputs)
