"""transformers' continuous batching on tpu: compiled steps of bounded shapes, inputs staged on the host, and the
paged cache sized from the chip's memory, not the host's.

**Compiled steps.** transformers runs each batch eagerly unless a compile config is given, and pads a batch's query
and key sizes only when it compiles. On tpu, eager batches of new sizes are new XLA programs at every step, so a tpu
model's batches are compiled by default (``CompileConfig(dynamic=True)``: Dynamo traces once per manager, hf_tpu
compiles one program per padded size), and the sizes are padded to powers of two: the query tokens to at least
:data:`MIN_QUERY_TOKENS` and at most ``max_batch_tokens``, the tokens read from the cache to at least one page and at
most the cache. A batch that reads nothing from the cache (new prompts only, the first batch of every run) reads a
page too: transformers gives it a path of its own (no read), which would be a Dynamo graph and programs of their own.
A run therefore compiles at most ``(log2(max_batch_tokens / MIN_QUERY_TOKENS) + 2) * (log2(max_tokens_read /
page_size) + 2)`` programs of the step, whatever the number and lengths of its requests (:func:`padded_sizes`). A user
who sets transformers' ``q_padding_interval_size`` or ``kv_padding_interval_size`` gets that size padded to a multiple
of the interval instead (finer intervals: less padded work a step, more programs). A compile config of the user's is
used as given, with these sizes. hf_tpu's default compiles the prefill (varlen) and decode steps as one compiled
function (transformers makes two of the same method, Dynamo graphs of one code object either way), so that torch's
caching precompile keeps both in one package (:mod:`hf_tpu.integrations.dynamo`): a new process, a restarted server,
loads what Dynamo and AOTAutograd made of the steps instead of tracing them again. transformers' warm-up, which runs a
step at the largest sizes so that CUDA graphs are captured before any request, is skipped: on tpu it would compile a
program of a batch that may never come, with an attention over the whole cache (tens of GiB for a cache sized from the
memory), and each program compiles when a batch of its size first comes. With ``dynamic=True`` Dynamo would also
take the model's float attributes (norms' epsilons, attention scalings) as symbolic inputs, then trace the step a
second time to specialize the ones an operator needs as numbers: hf_tpu's steps take them as constants, as Dynamo
does without ``dynamic=True`` (3.4 s of a 24 s cold call of ``benchmarks/continuous_batching.py`` was that second
trace).

**One program per step.** transformers keeps ``PagedAttentionCache.update`` out of compiled graphs
(``torch.compiler.disable``: Inductor does not handle the cache tensor's views), which splits a step at every
layer. hf_tpu's graph mode lowers the writes into the cache's views, so a tpu cache traces its update and a step
is one program. The views of a model with several kinds of layers (sliding-window and full attention) are made
views of one tensor first, which AOTAutograd needs of inputs written in one graph
(:func:`_static_views_on_one_base`).

**Inputs staged on the host.** Each batch's inputs (token ids, positions, sequence lengths, cache indices, the
attention mask) are written by transformers slice by slice into static tensors, a few dozen writes at offsets that
change every step. For a tpu model these static tensors live on the host, and only the slices a step reads go to
the chip, one transfer per input; the step's output tokens come back in one transfer.

**Decode steps read only their own pages.** Once every request of a batch has one new token, transformers
can run the step on its *decode fast path*: each request's keys and values are found through a block table (its
pages in the cache) instead of through one mask of every query against every cached token of the batch.
transformers enables it only for flash attention's ``flash_attn_with_kvcache`` on CUDA and XPU. For a tpu model
with SDPA attention (what continuous batching uses by default) it is enabled here, and the block-table call of
SDPA runs :func:`paged_decode_attention` (the cache's update first writes the new token into its page,
:func:`write_decode_tokens`): a gather of each request's keys and one attention per request, all inside the
step's program. The requests are padded to a power of two from :data:`MIN_DECODE_REQUESTS`; each request reads
as many keys as the longest request of the batch has, padded to a power of two from :data:`MIN_DECODE_KEYS`
(transformers' ``max_length_k``, which it leaves at 1 on this path), and the block table sent to the chip keeps
the columns of those keys' pages, so decode steps compile at most ``(log2(max_requests_per_batch /
MIN_DECODE_REQUESTS) + 1) * (log2(max_blocks_per_request * page_size / MIN_DECODE_KEYS) + 1)`` programs, and a
step's attention reads requests x their keys, not query tokens x every cached token of the batch.
``max_blocks_per_request=0`` turns the path off, as elsewhere.

**Asynchronous batching.** transformers can prepare batch N+1 on the host while the device runs batch N
(``use_async_batching``: two sets of inputs used in turn, the tokens of batch N carried into N+1's program on the
device, N's outputs read after N+1 has started), with CUDA streams and events. On tpu the same runs without them: a
device runs its programs in the order they are started, and each set of inputs is host-staged as above (a
``ContinuousBatchingAsyncIOs`` made for a tpu device is the subclass :func:`_install_tpu_async_batching` defines).
It is on by default where chips back the device, whose programs run while the host prepares the next batch; on
JAX's CPU platform, where the "device" computes on the host's own cores, the host's work slows the program it
overlaps (the same 0.92-0.94 s warm call either way in ``benchmarks/continuous_batching.py``'s workload), so it
stays off there unless asked for.

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

**generate_batch's collection walks what it made.** ``generate_batch`` ends with a full garbage collection (when it
stops its manager, to release what the batch used); in a process using tpu, which holds about 1.8 times a CPU
process's objects (JAX, the compiled steps), walking them all took 0.4 s of a 1.5 s call of
``benchmarks/continuous_batching.py`` (0.2 s on CPU). For a tpu model the call runs with the objects that existed
before it frozen (:func:`hf_tpu.compile.frozen_heap.kept_to_new_objects`), so its collections walk only what it
made (the manager and its cache included, when the call made them), and garbage from before waits for the next
full collection.

**A manager's stop wakes its loop.** With no request left, transformers' generation loop waits on an event with a
0.1 s timeout (``_generation_loop_body``), and ``stop`` requests the stop without setting that event, so every
``generate_batch`` (on any device) waited up to 0.1 s for its loop to notice; ``join`` now sets the event first. This
applies to managers of every device: it changes no result, only when the loop sees the stop.

Patches ``PagedAttentionCache.__init__`` and the ``get_device_and_memory_breakdown`` it calls
(``transformers/generation/continuous_batching/cache.py``), ``resolve_continuous_batching_config``,
``ensure_decode_fast_path_is_available``, ``decide_use_async_batching`` and ``resolve_max_memory_percent``
(``.../initialization.py``), the
``"sdpa"`` entry of ``AttentionInterface`` (``transformers/modeling_utils.py``), ``ModelRunner.__init__``,
``maybe_pad_inputs`` and ``warmup`` (``.../model_runner.py``), ``ContinuousBatchingIOs`` and the making of
``ContinuousBatchingAsyncIOs`` (``.../input_outputs.py``) and ``ContinuousMixin.generate_batch`` and
``ContinuousBatchingManager.join`` (``.../continuous_api.py``), transformers 5.2x.
"""

from __future__ import annotations

import contextvars
import functools
import math
import types
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from . import traced_by_dynamo

HOST_CACHE_BYTES = 4 << 30
"""The most a paged cache takes by default on JAX's CPU platform (the host's memory)."""

# Floors of the padded sizes: a step of a few tokens, requests or keys costs a chip about what one of these costs
# (its weights are read either way), and each size below them would be programs of its own, which a server under
# load meets one by one for several passes (with floors of 16, 16 and 1, the serving benchmark's continuous-batching
# server still compiled in its fourth pass of 64 requests)
MIN_QUERY_TOKENS = 64
"""The fewest query tokens a compiled continuous-batching step on tpu is padded to."""

MIN_DECODE_REQUESTS = 8
"""The fewest requests a decode step of continuous batching on tpu is padded to (at most ``max_requests_per_batch``)."""

MIN_DECODE_KEYS = 64
"""The fewest keys each request of a decode step on tpu reads (see the module docstring)."""

_SIZED_FOR: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("hf_tpu_paged_cache", default=None)


def _on_chips() -> bool:
    from ..backend import runtime

    return runtime.backing_platform() != "cpu"


def _install_tpu_paged_cache(cache: Any) -> None:
    """A paged cache made for a tpu device sees its chip's memory (``get_device_and_memory_breakdown``), traces
    its update into the compiled step with its views on one base and their sizes static
    (:func:`_static_views_on_one_base`), and on the decode fast path writes the new tokens into their pages
    (:func:`write_decode_tokens`; see the module docstring)."""
    breakdown, init = cache.get_device_and_memory_breakdown, cache.PagedAttentionCache.__init__
    if getattr(init, "_hf_tpu", False):
        return
    disabled_update = cache.PagedAttentionCache.update  # torch.compiler.disable'd: undone on tpu (module docstring)
    traced_update = getattr(disabled_update, "_torchdynamo_orig_callable", disabled_update)

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
        _static_views_on_one_base(self)

    # a method of the class, not of each tpu cache: Dynamo's caching precompile saves a bound method of an instance
    # (a guard's value) only when the instance's attribute of its name is that method
    @traced_by_dynamo  # runs inside the compiled step; hf_tpu's files are skipped by Dynamo otherwise
    def update(self: Any, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device.type != "tpu":
            return disabled_update(self, key_states, value_states, layer_idx, kwargs)
        key_states, value_states = traced_update(self, key_states, value_states, layer_idx, kwargs)
        if kwargs.get("block_table") is not None:
            write_decode_tokens(kwargs["k_cache"], kwargs["v_cache"], key_states, value_states, kwargs["block_table"],
                                kwargs["cu_seq_lens_k"], self.layer_to_allocator[layer_idx].write_trash_index)
        return key_states, value_states

    __init__._hf_tpu = True
    cache.get_device_and_memory_breakdown = get_device_and_memory_breakdown
    cache.PagedAttentionCache.__init__ = __init__
    cache.PagedAttentionCache.update = update


_VIEW_TABLES = ("_kv_token_views", "_kv_page_views", "_latent_token_views")
"""The allocators' views of the cache a step reads and writes, per layer (full and sliding attention; latents)."""


def _static_views_on_one_base(cache: Any) -> None:
    """Makes every allocator's views of the cache views of one tensor, and Dynamo's static inputs.

    One tensor: each allocator views the cache's bytes as its dtype (``Tensor.view(dtype)``, which torch does not
    count as a view: the result is a base of its own), so the views of a model with two kinds of layers (Gemma 2's,
    GPT-OSS's sliding and full attention) had two bases; a step that writes both in one graph was refused by
    AOTAutograd ("does not yet handle non-differentiable view input mutations ... ._base fields that point to
    different tensors") and the run failed. Views of one base are inputs it handles (the layers of one allocator
    always were).

    Static: their sizes never change, and as symbols (the steps compile with ``dynamic=True``) a batch's size equal
    to one of them at the first trace (64 requests, a head dimension of 64) would share its symbol, be specialized
    with it, and cost the step another graph at the next size."""
    bases: dict[torch.dtype, torch.Tensor] = {}

    def on_one_base(view: torch.Tensor) -> torch.Tensor:
        base = bases.get(view.dtype)
        if base is None:
            base = bases[view.dtype] = cache.cache_tensor.view(view.dtype)
        return base.as_strided(view.shape, view.stride(), view.storage_offset())

    for allocator in cache.cache_allocators.values():
        allocator.cache_tensor = on_one_base(allocator.cache_tensor)
        torch._dynamo.mark_static_address(allocator.cache_tensor)
        for table in _VIEW_TABLES:
            views = getattr(allocator, table, {})
            for layer_index, pair in views.items():
                views[layer_index] = tuple(map(on_one_base, pair))
                for view in views[layer_index]:
                    torch._dynamo.mark_static(view)


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


_RESOLVING_FOR: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("hf_tpu_cb_config", default=None)


def _install_tpu_decode_fast_path(initialization: Any) -> None:
    """The decode fast path kept for a tpu model with SDPA attention (see the module docstring)."""
    resolve = initialization.resolve_continuous_batching_config
    ensure = initialization.ensure_decode_fast_path_is_available
    if getattr(ensure, "_hf_tpu", False):
        return

    @functools.wraps(resolve)
    def resolve_continuous_batching_config(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device", args[4] if len(args) > 4 else None)
        device = None if device is None else torch.device(device)
        given = kwargs.get("cb_config", args[1] if len(args) > 1 else None)
        resolving = _RESOLVING_FOR.set(device)
        try:
            resolved = resolve(*args, **kwargs)
        finally:
            _RESOLVING_FOR.reset(resolving)
        if device is not None and device.type == "tpu":  # intervals left unset: hf_tpu's powers of two
            for interval in ("q_padding_interval_size", "kv_padding_interval_size"):
                if not getattr(given, interval):
                    setattr(resolved, interval, 0)
        return resolved

    @functools.wraps(ensure)
    def ensure_decode_fast_path_is_available(config: Any, cb_config: Any, user_requested: bool) -> None:
        device = _RESOLVING_FOR.get()
        if device is None or device.type != "tpu" or config._attn_implementation != "sdpa" or not all(
                initialization.ATTN_TYPE_TO_ALLOCATOR[attn_type].supports_block_table
                for attn_type in initialization.group_layers_by_attn_type(config)):
            return ensure(config, cb_config, user_requested)

    ensure_decode_fast_path_is_available._hf_tpu = True
    initialization.resolve_continuous_batching_config = resolve_continuous_batching_config
    initialization.ensure_decode_fast_path_is_available = ensure_decode_fast_path_is_available


def _decode_lengths(block_table: torch.Tensor, cu_seq_lens_k: torch.Tensor) -> torch.Tensor:
    """Each request's length with its new token; 0 for a padding request."""
    requests = block_table.shape[0]
    return cu_seq_lens_k[1:requests + 1] - cu_seq_lens_k[:requests]


def write_decode_tokens(key_pages: torch.Tensor, value_pages: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        block_table: torch.Tensor, cu_seq_lens_k: torch.Tensor, write_trash_index: int) -> None:
    """Writes each request's new key and value into its page, as flash-attn's ``flash_attn_with_kvcache`` does on
    transformers' decode fast path.

    ``key``/``value`` are ``[1, Hkv, R, D]``: token ``r`` is request ``r``'s new token. ``key_pages`` and
    ``value_pages`` are the layer's cache as ``[pages, page_size, Hkv, D]``; row ``r`` of ``block_table``
    (``[R, columns]``) lists request ``r``'s pages in order, ``-1`` past its last. ``cu_seq_lens_k`` (``[R + 1]``)
    gives each request's length with its new token, where the token goes (at length - 1); a request of length 0
    is padding, whose token goes to ``write_trash_index`` (a token of the pages that is never read).
    """
    page_size = key_pages.shape[1]
    lengths = _decode_lengths(block_table, cu_seq_lens_k)
    position = (lengths - 1).clamp(min=0)
    page = block_table.gather(1, (position // page_size).unsqueeze(1)).squeeze(1)
    slot = torch.where((lengths > 0) & (page >= 0), page * page_size + position % page_size, write_trash_index)
    for pages, new in ((key_pages, key), (value_pages, value)):
        pages.view(-1, *pages.shape[2:]).index_copy_(0, slot, new[0].transpose(0, 1).to(pages.dtype))


def paged_decode_attention(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                           block_table: torch.Tensor, cu_seq_lens_k: torch.Tensor, keys_read: int,
                           scale: float | None) -> torch.Tensor:
    """Attention of one new token per request (``query``, ``[1, Hq, R, D]``) over the first length keys and
    values of that request's pages (the arguments of :func:`write_decode_tokens`, which wrote the new token):
    the attention of flash-attn's ``flash_attn_with_kvcache``. Each request reads ``keys_read`` tokens (at least
    the longest request's length, at most its block table's pages) and masks those past its length. Returns
    ``[1, R, Hq, D]``, the layout transformers' attention functions return. A padding request attends to the
    first key of page 0."""
    page_size = key_pages.shape[1]
    position = torch.arange(keys_read, device=block_table.device)
    pages = block_table.index_select(1, position // page_size).clamp(min=0)  # past a request's pages: masked
    tokens = pages * page_size + position % page_size
    heads = torch.arange(key_pages.shape[2], device=block_table.device)
    # gathered by token and head: [R, Hkv, keys, D], the layout attention reads (a gather by token, then a
    # transpose, ran 4 layers' attention in 4.4-5.4 ms against 3.5-4.1 here, 64 requests x 128 keys)
    keys, values = (cache.view(-1, *cache.shape[2:])[tokens[:, None, :], heads[:, None]].to(query.dtype)
                    for cache in (key_pages, value_pages))
    mask = position < _decode_lengths(block_table, cu_seq_lens_k).clamp(min=1).unsqueeze(1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query[0].transpose(0, 1).unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :], scale=scale,
        enable_gqa=True)  # [R, Hq, 1, D]; also right for as many key/value heads as query heads
    return out.permute(2, 0, 1, 3)


def _install_block_table_sdpa(modeling_utils: Any) -> None:
    """SDPA called with a block table (the decode fast path, enabled on tpu by
    :func:`_install_tpu_decode_fast_path`) runs :func:`paged_decode_attention`; other calls are SDPA's own. The
    other calls of a step on tpu (``cu_seq_lens_q`` among their arguments) pass SDPA a boolean mask: transformers
    builds an additive one (0 where a query attends a key, the dtype's lowest value elsewhere), which only XLA's
    dense attention takes, while a boolean one runs on the splash kernel where Pallas kernels are used, and that
    kernel skips the blocks of other requests' keys (a step's queries attend only their own request's keys)."""
    mapping = modeling_utils.AttentionInterface._global_mapping
    sdpa = mapping["sdpa"]
    if getattr(sdpa, "_hf_tpu", False):
        return

    @traced_by_dynamo  # runs inside the compiled step; hf_tpu's files are skipped by Dynamo otherwise
    @functools.wraps(sdpa)
    def sdpa_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        block_table = kwargs.get("block_table")
        if block_table is None:
            if (query.device.type == "tpu" and kwargs.get("cu_seq_lens_q") is not None
                    and attention_mask is not None and attention_mask.is_floating_point()):
                attention_mask = attention_mask == 0
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
        if args or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None \
                or hasattr(module, "sinks"):
            raise NotImplementedError(
                f"{type(module).__name__}: the tpu decode fast path of continuous batching has no attention bias, "
                "softcap or sinks; turn the path off with ContinuousBatchingConfig(max_blocks_per_request=0)")
        out = paged_decode_attention(query, kwargs["k_cache"], kwargs["v_cache"], block_table, kwargs["cu_seq_lens_k"],
                                     kwargs["max_length_k"], kwargs.get("scaling"))
        return out, None

    sdpa_attention_forward._hf_tpu = True
    mapping["sdpa"] = sdpa_attention_forward


def _power_of_two_at_least(size: int, least: int, most: int) -> int:
    return min(most, 1 << max(0, math.ceil(math.log2(max(size, least)))))


def padded_sizes(num_q_tokens: int, max_kv_read: int, max_batch_tokens: int, max_tokens_read: int,
                 page_size: int, q_interval: int = 0, kv_interval: int = 0) -> tuple[int, int]:
    """The query tokens and cache tokens a tpu step of continuous batching runs with, so that a run compiles a
    bounded number of programs: multiples of ``q_interval`` and ``kv_interval`` (transformers'
    ``q_padding_interval_size`` and ``kv_padding_interval_size``, at least one interval) where they are set, else
    powers of two (see the module docstring); at most ``max_batch_tokens`` and ``max_tokens_read``."""
    from transformers.generation.continuous_batching.utils import pad_to_interval

    def padded(size: int, interval: int, least: int, most: int) -> int:
        return pad_to_interval(size, interval, most) if interval > 0 else _power_of_two_at_least(size, least, most)

    return (padded(num_q_tokens, q_interval, MIN_QUERY_TOKENS, max_batch_tokens),
            padded(max_kv_read, kv_interval, page_size, max_tokens_read))


def _with_floats_specialized(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled``, a step compiled with ``dynamic=True``, traced with the model's Python floats as constants (see
    the module docstring)."""
    @functools.wraps(compiled)
    def step(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args, **kwargs)

    return step


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
        on_tpu = torch.device(cache.device).type == "tpu"
        varlen = on_tpu and cb_config.varlen_compile_config is None
        decode = on_tpu and cb_config.decode_compile_config is None and cache.max_blocks_per_request > 0
        if varlen:
            cb_config.varlen_compile_config = CompileConfig(fullgraph=False, dynamic=True)
        elif decode:
            cb_config.decode_compile_config = CompileConfig(fullgraph=False, dynamic=True)
        init(self, logit_processor, cb_config, inputs_and_outputs, cache, *args, **kwargs)
        if varlen:
            self._compiled_varlen = _with_floats_specialized(self._compiled_varlen)
        if varlen and decode:  # one compiled function for both steps: one package of Dynamo's caching precompile
            cb_config.decode_compile_config = cb_config.varlen_compile_config
            self._compiled_decode = self._compiled_varlen
        elif decode:
            self._compiled_decode = _with_floats_specialized(self._compiled_decode)

    @functools.wraps(maybe_pad_inputs)
    def pad_inputs(self: Any, num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool) -> tuple[int, int]:
        if torch.device(self.cache.device).type != "tpu":
            return maybe_pad_inputs(self, num_q_tokens, max_kv_read, use_decode_fast_path)
        if use_decode_fast_path:
            num_q_tokens, max_kv_read = maybe_pad_inputs(self, num_q_tokens, max_kv_read, use_decode_fast_path)
            return min(max(num_q_tokens, MIN_DECODE_REQUESTS), self.cb_config.max_requests_per_batch), max_kv_read
        return padded_sizes(num_q_tokens, max_kv_read, self.cache.max_batch_tokens, self.cache.max_tokens_read,
                            self.cb_config.page_size, self.cb_config.q_padding_interval_size,
                            self.cb_config.kv_padding_interval_size)

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
        block_table = model_kwargs.get("block_table")
        if block_table is not None:  # the keys each request reads (a power of two), and the pages they are on
            columns = 1
            for layer_type, longest in self.max_length_k.items():
                page_size = self.cache.cache_allocators[layer_type].tokens_per_page
                keys_read = _power_of_two_at_least(longest, MIN_DECODE_KEYS, block_table.shape[-1] * page_size)
                model_kwargs["max_length_k"][layer_type] = keys_read
                columns = max(columns, -(-keys_read // page_size))
            model_kwargs["block_table"] = block_table[..., :columns]
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


def _install_async_batching_default(initialization: Any) -> None:
    """A tpu model batches asynchronously by default on chips (see the module docstring)."""
    decide = initialization.decide_use_async_batching
    if getattr(decide, "_hf_tpu", False):
        return

    @functools.wraps(decide)
    def decide_use_async_batching(cb_config: Any, *args: Any, **kwargs: Any) -> None:
        device = _RESOLVING_FOR.get()
        if device is not None and device.type == "tpu" and cb_config.use_async_batching is None:
            cb_config.use_async_batching = _on_chips()
        return decide(cb_config, *args, **kwargs)

    decide_use_async_batching._hf_tpu = True
    initialization.decide_use_async_batching = decide_use_async_batching


def _install_tpu_async_batching(input_outputs: Any) -> None:
    """transformers' asynchronous batching for a tpu model (``ContinuousBatchingAsyncIOs``; see the module
    docstring)."""
    base = input_outputs.ContinuousBatchingAsyncIOs
    if getattr(base, "_hf_tpu", False):
        return

    class TpuAsyncIOs(base):
        """Two sets of host-staged inputs, as :func:`_install_host_staged_inputs` makes them, used in turn: batch N+1
        is prepared on the host and started while the chip runs batch N, whose new tokens batch N+1's program takes
        from N's outputs on the chip (transformers' carry-over) and the host reads after starting N+1. A chip runs
        the programs of a device in the order they are started, so no streams or events order them."""

        compute_stream = None

        def __init__(self, cache: Any, config: Any, continuous_batching_config: Any, device: Any, model_dtype: Any,
                     logit_processor: Any) -> None:
            self.device = torch.device(device)
            self.current_pair = 0
            self.max_batch_tokens = cache.max_batch_tokens
            self.io_pairs = []
            for _ in range(2):
                staged = input_outputs.ContinuousBatchingIOs(
                    cache=cache, config=config, continuous_batching_config=continuous_batching_config,
                    device=self.device, model_dtype=model_dtype, logit_processor=logit_processor)
                self.io_pairs.append(types.SimpleNamespace(host_io=staged, device_io=staged))

        def get_model_kwargs(self, use_padding: bool = False) -> Any:
            return self.io_pairs[self.current_pair].host_io.get_model_kwargs(use_padding=use_padding)

        def get_cb_kwargs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            current, previous = self.io_pairs[self.current_pair].host_io, self.io_pairs[1 - self.current_pair].host_io
            carry_over_ids = current.carry_over_ids[:current.num_q_tokens]  # the batch's tokens, not max_batch_tokens
            return carry_over_ids.to(self.device), previous.device_output_ids, current.device_output_ids

        def retrieve_device_outputs(self) -> None:
            self.swap_io_pairs()

        def prepare_batch_update(self) -> Any:
            staged = self.io_pairs[self.current_pair].host_io
            staged.retrieve_device_outputs()
            return staged.prepare_batch_update()

        def reset(self) -> None:
            self.current_pair = 0
            for pair in self.io_pairs:
                pair.host_io.reset()

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device", args[3] if len(args) > 3 else None)
        if cls is base and device is not None and torch.device(device).type == "tpu":
            cls = TpuAsyncIOs
        return object.__new__(cls)

    base.__new__ = __new__
    base._hf_tpu = True


def _install_collections_of_new_objects(continuous_api: Any) -> None:
    """A tpu model's ``generate_batch`` collects only what it made (see the module docstring)."""
    mixin = continuous_api.ContinuousMixin
    generate_batch = mixin.generate_batch
    if getattr(generate_batch, "_hf_tpu", False):
        return

    @functools.wraps(generate_batch)
    def generate_batch_collecting_what_it_makes(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.device.type != "tpu":
            return generate_batch(self, *args, **kwargs)
        from ..compile import frozen_heap

        with frozen_heap.kept_to_new_objects():
            return generate_batch(self, *args, **kwargs)

    generate_batch_collecting_what_it_makes._hf_tpu = True
    mixin.generate_batch = generate_batch_collecting_what_it_makes


def _install_stop_that_wakes_the_loop(continuous_api: Any) -> None:
    """A manager's ``stop`` wakes its generation loop (on every device; see the module docstring)."""
    manager = continuous_api.ContinuousBatchingManager
    join = manager.join
    if getattr(join, "_hf_tpu", False):
        return

    @functools.wraps(join)
    def join_after_waking_the_loop(self: Any, *args: Any, **kwargs: Any) -> None:
        wake_up = getattr(self, "_wake_up_loop", None)
        if wake_up is not None:
            wake_up.set()
        join(self, *args, **kwargs)

    join_after_waking_the_loop._hf_tpu = True
    manager.join = join_after_waking_the_loop


def install(cache: Any) -> None:
    """Patches ``transformers.generation.continuous_batching.cache`` and its ``initialization``, ``model_runner``,
    ``input_outputs`` and ``continuous_api`` siblings."""
    from . import when_imported

    _install_tpu_paged_cache(cache)
    when_imported("transformers.modeling_utils", _install_block_table_sdpa)
    when_imported("transformers.generation.continuous_batching.initialization", _install_default_share)
    when_imported("transformers.generation.continuous_batching.initialization", _install_tpu_decode_fast_path)
    when_imported("transformers.generation.continuous_batching.initialization", _install_async_batching_default)
    when_imported("transformers.generation.continuous_batching.model_runner", _install_compiled_tpu_steps)
    when_imported("transformers.generation.continuous_batching.input_outputs", _install_host_staged_inputs)
    when_imported("transformers.generation.continuous_batching.input_outputs", _install_tpu_async_batching)
    when_imported("transformers.generation.continuous_batching.continuous_api", _install_collections_of_new_objects)
    when_imported("transformers.generation.continuous_batching.continuous_api", _install_stop_that_wakes_the_loop)
