"""transformers' continuous batching on tpu: the paged cache sized from the chip's memory, and CPU's tokens."""

from __future__ import annotations

import gc
import math
import threading
import time
import weakref

import pytest
import torch
from torch._C._dynamo.eval_frame import _reset_precompile_entries, reset_code
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingAsyncIOs
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.initialization import resolve_continuous_batching_config
from transformers.generation.continuous_batching.model_runner import ModelRunner

from conftest import tiny_llama
from hf_tpu.compile import compile_stats
from hf_tpu.integrations import continuous_batching, traced_by_dynamo

MiB = 1 << 20


def _cache_made_for(model: torch.nn.Module, device: str, **settings) -> PagedAttentionCache:
    """The paged cache continuous batching makes for ``model`` on ``device``, resolved as ``generate_batch``
    resolves it."""
    config = model.config.get_text_config()
    cb_config = resolve_continuous_batching_config(config=config, cb_config=ContinuousBatchingConfig(**settings),
                                                   workload_hints=None, has_logit_processors=False,
                                                   device=torch.device(device))
    cache = PagedAttentionCache(config=config, continuous_batching_config=cb_config, device=device,
                                distributed_helper=DistributedHelper(None, None), dtype=torch.float32)
    assert cache.cache_tensor.device.type == torch.device(device).type
    return cache


def _cache_bytes(model: torch.nn.Module, device: str, **settings) -> int:
    """The bytes of :func:`_cache_made_for`."""
    cache_tensor = _cache_made_for(model, device, **settings).cache_tensor
    return cache_tensor.numel() * cache_tensor.element_size()


def test_a_tpu_cache_is_sized_from_the_chips_free_memory(monkeypatch):
    monkeypatch.setattr(continuous_batching, "_on_chips", lambda: True)
    sizes = {}
    for free in (256 * MiB, 512 * MiB):
        monkeypatch.setattr(torch.tpu, "mem_get_info", lambda device=None, free=free: (free, 1024 * MiB))
        sizes[free] = _cache_bytes(tiny_llama(), "tpu", max_batch_tokens=64)
        assert sizes[free] <= 0.9 * free  # transformers' share for an accelerator, of what the chip has free
    assert sizes[512 * MiB] == pytest.approx(2 * sizes[256 * MiB], rel=0.05)
    halved = _cache_bytes(tiny_llama(), "tpu", max_batch_tokens=64, max_memory_percent=0.45)  # the user's share
    assert halved == pytest.approx(sizes[512 * MiB] / 2, rel=0.05)


def test_on_the_cpu_platform_the_default_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(continuous_batching, "_on_chips", lambda: False)
    monkeypatch.setattr(continuous_batching, "HOST_CACHE_BYTES", 32 * MiB)
    monkeypatch.setattr(torch.tpu, "mem_get_info", lambda device=None: (64 << 30, 128 << 30))  # a large host
    bounded = _cache_bytes(tiny_llama(), "tpu", max_batch_tokens=64)
    assert bounded == _cache_bytes(tiny_llama(), "tpu", max_batch_tokens=64, max_memory_percent=32 * MiB / (64 << 30))
    assert bounded <= 32 * MiB
    assert _cache_bytes(tiny_llama(), "tpu", max_batch_tokens=64, num_blocks=4) < MiB  # the user's size


def test_padded_sizes_bound_the_programs_of_a_run():
    reads = [*range(0, 16385, 61), *(2 ** n + d for n in range(17) for d in (-1, 0, 1) if 2 ** n + d <= 16384)]
    sizes = {continuous_batching.padded_sizes(q, kv, 256, 16384, 256) for q in range(1, 257) for kv in reads}
    assert {q for q, _ in sizes} == {64, 128, 256}
    assert {kv for _, kv in sizes} == {256, 512, 1024, 2048, 4096, 8192, 16384}  # none without a read
    assert len(sizes) <= (math.log2(256 / continuous_batching.MIN_QUERY_TOKENS) + 2) * (math.log2(16384 / 256) + 2)


def test_padding_intervals_set_by_the_user_replace_the_powers_of_two():
    q_sizes = {continuous_batching.padded_sizes(q, 0, 256, 16384, 256, q_interval=48)[0] for q in range(1, 257)}
    assert q_sizes == {48, 96, 144, 192, 240, 256}  # multiples of the interval, at most the batch
    kv_sizes = {continuous_batching.padded_sizes(16, kv, 256, 16384, 256, kv_interval=1000)[1]
                for kv in range(0, 16385, 7)}
    assert min(kv_sizes) == 1000 and max(kv_sizes) == 16384 and all(
        size % 1000 == 0 for size in kv_sizes - {16384})  # a batch that reads nothing reads one interval
    assert continuous_batching.padded_sizes(20, 300, 256, 16384, 256, kv_interval=1000) == (64, 1000)

    config = tiny_llama().config
    resolved = {}
    for device in ("tpu", "cpu"):
        for given in ({}, {"q_padding_interval_size": 32, "kv_padding_interval_size": 512}):
            cb_config = resolve_continuous_batching_config(
                config=config, cb_config=ContinuousBatchingConfig(**given), workload_hints=None,
                has_logit_processors=False, device=torch.device(device))
            resolved[device, bool(given)] = cb_config.q_padding_interval_size, cb_config.kv_padding_interval_size
    assert resolved["tpu", True] == resolved["cpu", True] == (32, 512)
    assert resolved["tpu", False] == (0, 0)  # unset on tpu: hf_tpu's powers of two, not transformers' 64
    assert resolved["cpu", False] != (0, 0)  # transformers' own defaults elsewhere


def test_a_run_with_the_users_padding_intervals_gives_cpus_tokens(monkeypatch):
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    sizes = []
    pad_inputs = ModelRunner.maybe_pad_inputs

    def maybe_pad_inputs(self, *args, **kwargs):
        sizes.append(pad_inputs(self, *args, **kwargs))
        return sizes[-1]

    monkeypatch.setattr(ModelRunner, "maybe_pad_inputs", maybe_pad_inputs)
    model = tiny_llama(max_position_embeddings=256).eval()
    prompts = [torch.randint(3, 120, (length,), generator=torch.Generator().manual_seed(length)).tolist()
               for length in (5, 37, 3, 60, 12)]
    settings = dict(num_blocks=8, max_batch_tokens=64, max_blocks_per_request=0, q_padding_interval_size=24,
                    kv_padding_interval_size=96)
    expected = _generate_batch(model, prompts, ContinuousBatchingConfig(**settings))
    sizes.clear()
    assert _generate_batch(model.to("tpu"), prompts, ContinuousBatchingConfig(**settings)) == expected
    assert sizes and all(q in (24, 48, 64) and (kv % 96 == 0 or kv == 8 * 256) for q, kv in sizes)


def _generate_batch(model, prompts, cb_config=None, **generation):
    generation = GenerationConfig(**{"max_new_tokens": 6, "eos_token_id": -1, "pad_token_id": 0, **generation})
    cb_config = cb_config or ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=64)
    outputs = model.generate_batch(inputs=prompts, generation_config=generation, continuous_batching_config=cb_config)
    return [outputs[key].generated_tokens for key in sorted(outputs, key=lambda key: int(key.split("_")[-1]))]


def test_continuous_batching_compiles_a_bounded_number_of_programs_and_gives_cpus_tokens():
    torch.manual_seed(0)
    model = tiny_llama(max_position_embeddings=256).eval()
    lengths = (5, 37, 3, 60, 12, 9, 41, 2, 18, 30, 7, 25)  # more query tokens than a batch takes: several batches
    prompts = [torch.randint(3, 120, (length,)).tolist() for length in lengths]
    expected = _generate_batch(model, prompts)

    before = compile_stats()
    tokens = _generate_batch(model.to("tpu"), prompts)
    compiled = compile_stats()["compilations"] - before["compilations"]

    assert tokens == expected and all(len(t) == 6 for t in tokens)
    # query tokens padded to 64; tokens read to a power of two from one page (256) to the cache
    assert 0 < compiled <= 1 * 5
    assert compile_stats()["fallbacks"] == before["fallbacks"]  # every step ran as one program
    assert _generate_batch(model, prompts[::-1]) == expected[::-1]  # new lengths of batches, the same programs
    assert compile_stats()["compilations"] - before["compilations"] <= 1 * 5


def test_a_model_with_sliding_and_full_attention_layers_gives_cpus_tokens():
    # Gemma 2 alternates sliding-window and full attention: two allocators, each viewing the cache's bytes as floats;
    # a step writing both views in one graph failed in AOTAutograd (views of two bases of one storage)
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                          max_position_embeddings=256, pad_token_id=0, initializer_range=0.5)
    model = Gemma2ForCausalLM(config).eval()
    assert config.layer_types == ["sliding_attention", "full_attention"]
    prompts = [torch.randint(3, 120, (length,)).tolist() for length in (5, 37, 3, 20)]
    expected = _generate_batch(model, prompts)

    tokens = _generate_batch(model.to("tpu"), prompts)

    assert tokens == expected and all(len(t) == 6 for t in tokens)
    cache = _cache_made_for(model, "tpu", num_blocks=8, max_batch_tokens=64)  # as _generate_batch's
    views = [view for allocator in cache.cache_allocators.values()
             for pair in allocator._kv_token_views.values() for view in pair]
    assert len(views) == 4 and len({id(view._base) for view in views}) == 1


def test_a_tpu_caches_tensors_are_static_inputs_of_the_steps():
    config = tiny_llama().config
    cb_config = resolve_continuous_batching_config(config=config, cb_config=ContinuousBatchingConfig(num_blocks=4),
                                                   workload_hints=None, has_logit_processors=False,
                                                   device=torch.device("tpu"))
    cache = PagedAttentionCache(config=config, continuous_batching_config=cb_config, device="tpu",
                                distributed_helper=DistributedHelper(None, None), dtype=torch.float32)
    views = [tensor for allocator in cache.cache_allocators.values()
             for pairs in (allocator._kv_token_views, allocator._kv_page_views) for pair in pairs.values()
             for tensor in pair]
    assert views and all(getattr(view, "_dynamo_static_indices", set()) == set(range(view.dim())) for view in views)


def _steps_traced_afresh() -> None:
    """The steps' code forgets what an earlier test left on it through ``torch._dynamo.reset()``, which resets only
    the code Dynamo traced in this process: the entries loaded from a saved package, and the code's state once a
    package an earlier process saved (with other entries) was loaded for it (the step then ran without Dynamo)."""
    code = ModelRunner._forward_process_and_sample.__code__
    _reset_precompile_entries(code)
    reset_code(code)


def test_a_steps_attention_runs_on_the_splash_kernel_where_pallas_kernels_are_used(fresh_dynamo, monkeypatch):
    """HF_TPU_PALLAS=1 takes the TPU chips' path here: a step's attention gets a boolean mask (transformers builds an
    additive one), and the steps of 256 query tokens reading 1,024 cached tokens or more run on JAX's splash kernel
    (interpreted), which skips the blocks of other requests' keys; the tokens are CPU's."""
    from hf_tpu.kernels import pallas

    masks, kernel = [], pallas.masked_attention
    monkeypatch.setattr(pallas, "masked_attention", lambda *a, **k: masks.append(a[3]) or kernel(*a, **k))
    monkeypatch.setenv("HF_TPU_PALLAS", "1")
    model = tiny_llama(max_position_embeddings=256).eval()
    lengths = (100, 90, 110, 95, 105, 120, 80, 99, 101, 97, 111, 93)  # 1,201 prompt tokens, 256 a step
    prompts = [torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]
    settings = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=256, max_blocks_per_request=0)
    expected = _generate_batch(model, prompts, settings)
    _steps_traced_afresh()
    assert _generate_batch(model.to("tpu"), prompts, settings) == expected
    assert masks and all(mask.dtype == bool and mask.shape[-2] == 256 and mask.shape[-1] >= 1024 for mask in masks)


def test_each_step_is_traced_once_with_the_models_floats_as_constants_whatever_the_batch(fresh_dynamo, monkeypatch):
    """Under ``dynamic=True`` Dynamo takes float attributes (norms' epsilons, attention scalings) as symbolic
    inputs, then traces the step again to specialize those an operator needs as numbers; hf_tpu's steps take them
    as constants. A first decode batch as large as the head dimension does not specialize the decode step either
    (the cache's sizes are static inputs): the prefill step and the decode step are traced once each, and a later
    run with decode steps of 8 requests reuses them."""
    from torch._dynamo import convert_frame

    model = tiny_llama().eval()
    head_dim = model.config.hidden_size // model.config.num_attention_heads  # 16: the first decode batch's size
    prompts = [[3 + i, 5, 7] for i in range(head_dim)]  # one prefill batch, then decode steps of them all
    expected = _generate_batch(model, prompts)
    model.to("tpu")  # no step graphs of earlier tests or processes (fresh_dynamo): these runs trace their own
    _steps_traced_afresh()
    traced = []
    transform = convert_frame.transform_code_object

    def counted_transform(code, *args, **kwargs):
        traced.append(code.co_name)
        return transform(code, *args, **kwargs)

    monkeypatch.setattr(convert_frame, "transform_code_object", counted_transform)
    assert _generate_batch(model, prompts) == expected
    assert _generate_batch(model, prompts[:head_dim // 2]) == expected[:head_dim // 2]
    assert traced == ["_forward_process_and_sample"] * 2  # the prefill step, the decode step: no second attempt


def test_asynchronous_batching_on_tpu_gives_cpus_tokens():
    """Batch N+1 is prepared and started before batch N's tokens are read: its program takes them from N's
    outputs on the device (transformers' carry-over), over requests of mixed lengths that join and leave."""
    torch.manual_seed(0)
    model = tiny_llama(max_position_embeddings=256).eval()
    lengths = (5, 37, 3, 60, 12, 9, 41, 2, 18, 30, 7, 25)
    prompts = [torch.randint(3, 120, (length,)).tolist() for length in lengths]
    expected = _generate_batch(model, prompts)
    made = []
    new = ContinuousBatchingAsyncIOs.__new__

    def recording_new(cls, *args, **kwargs):
        made.append(new(cls, *args, **kwargs))
        return made[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ContinuousBatchingAsyncIOs, "__new__", recording_new)
        tokens = _generate_batch(model.to("tpu"), prompts, ContinuousBatchingConfig(
            num_blocks=8, max_batch_tokens=64, use_async_batching=True))
    assert tokens == expected
    assert len(made) == 1 and type(made[0]) is not ContinuousBatchingAsyncIOs  # the tpu's: no streams, no events
    assert made[0].compute_stream is None


@pytest.mark.parametrize("on_chips", [False, True])
def test_asynchronous_batching_is_on_by_default_on_chips(monkeypatch, on_chips):
    monkeypatch.setattr(continuous_batching, "_on_chips", lambda: on_chips)
    config = tiny_llama().config

    def resolved(device, **settings):
        return resolve_continuous_batching_config(
            config=config, cb_config=ContinuousBatchingConfig(num_blocks=4, **settings), workload_hints=None,
            has_logit_processors=False, device=torch.device(device)).use_async_batching

    assert resolved("tpu") is on_chips
    assert resolved("tpu", use_async_batching=not on_chips) is (not on_chips)  # the user's choice stands
    assert resolved("cpu") is False  # transformers' default: with CUDA graphs only


def test_sampled_continuous_batching_follows_the_seed():
    model = tiny_llama().eval().to("tpu")
    prompts = [[5, 9, 3], [7, 1, 4, 4, 2]]
    runs = []
    for _ in range(2):
        torch.manual_seed(1)
        runs.append(_generate_batch(model, prompts, do_sample=True, top_k=0, temperature=1.0))
    assert runs[0] == runs[1] and all(0 <= token < 128 for tokens in runs[0] for token in tokens)


class _Cycle:
    pass


def test_generate_batch_on_tpu_collects_only_what_it_made(monkeypatch):
    """Its manager's stop collects garbage; with the objects from before the call frozen, that walks what the call
    made, and the garbage from before goes at the next collection after it."""
    model = tiny_llama().eval()
    prompts = [[5, 9, 3], [7, 1, 4, 4, 2]]
    expected = _generate_batch(model, prompts)
    frozen_at_stop = []
    stop = ContinuousBatchingManager.stop

    def recording_stop(self, *args, **kwargs):
        frozen_at_stop.append(gc.get_freeze_count())
        return stop(self, *args, **kwargs)

    monkeypatch.setattr(ContinuousBatchingManager, "stop", recording_stop)
    older = _Cycle()
    older.itself = older
    older_garbage = weakref.ref(older)
    del older
    assert _generate_batch(model.to("tpu"), prompts) == expected
    assert frozen_at_stop and frozen_at_stop[-1] > 0 and gc.get_freeze_count() == 0
    gc.collect()
    assert older_garbage() is None


class _WaitsOnlyToBeWoken(threading.Event):
    """The loop's wake-up event, whose waits end only when it is set (not after transformers' 0.1 s timeout)."""

    def wait(self, timeout=None):
        self.waited = True
        return super().wait(timeout=60)


def test_a_managers_stop_wakes_its_idle_loop(monkeypatch):
    """With no request left, the loop waits on its event (0.1 s timeout); the stop sets it, on any device."""
    start = ContinuousBatchingManager.start

    def start_with_an_event_that_only_wakes(self):
        self._wake_up_loop = _WaitsOnlyToBeWoken()
        start(self)

    monkeypatch.setattr(ContinuousBatchingManager, "start", start_with_an_event_that_only_wakes)
    model = tiny_llama().eval()
    manager = model.init_continuous_batching(generation_config=GenerationConfig(
        max_new_tokens=2, eos_token_id=-1, pad_token_id=0), continuous_batching_config=ContinuousBatchingConfig(
        num_blocks=8, max_batch_tokens=64))
    manager.start()
    manager.add_request([5, 9, 3], request_id="only")
    assert manager.get_result(request_id="only", timeout=60).is_finished()
    while not getattr(manager._wake_up_loop, "waited", False):  # the loop is idle, waiting for requests
        time.sleep(0.01)
    manager.stop(block=True, timeout=10)
    assert not manager.is_running()  # woken by the stop, not by a timeout


def _paged_cache(tokens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's key and value pages as transformers lays them out (a block's key page, then its value page),
    both views of ``tokens``."""
    page_shape = (-1, page_size, *tokens.shape[1:])
    return tokens, tokens.view(page_shape)[:-1], tokens[page_size:].view(page_shape)


def _write_and_attend(query, key, value, tokens, block_table, cu_seq_lens_k, keys_read, trash):
    _, key_pages, value_pages = _paged_cache(tokens, 4)
    continuous_batching.write_decode_tokens(key_pages, value_pages, key, value, block_table, cu_seq_lens_k, trash)
    return continuous_batching.paged_decode_attention(query, key_pages, value_pages, block_table, cu_seq_lens_k,
                                                      keys_read, None)


def test_paged_decode_attention_is_attention_over_each_requests_own_tokens():
    torch.manual_seed(0)
    page, kv_heads, heads, head_dim = 4, 2, 4, 8
    tokens = torch.randn(40 * page, kv_heads, head_dim)  # 20 blocks of a key page and a value page
    lengths = torch.tensor([3, 9, 1, 0, 5])  # with its new token; 0: a padding request
    blocks = iter((1 + torch.randperm(19)).tolist())  # block 0 holds the write trash
    block_table = torch.full((5, 3), -1)
    for request, length in enumerate(lengths.tolist()):
        for column in range(-(-length // page)):
            block_table[request, column] = 2 * next(blocks)  # a block's key page, among the layer's pages
    cu_seq_lens_k = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    query, key, value = torch.randn(1, heads, 5, head_dim), torch.randn(1, kv_heads, 5, head_dim), \
        torch.randn(1, kv_heads, 5, head_dim)

    written = tokens.clone()
    out = _write_and_attend(query, key, value, written, block_table, cu_seq_lens_k, 12, 0)
    _, key_pages, value_pages = _paged_cache(written, page)
    for request, length in enumerate(lengths.tolist()):
        if length == 0:
            continue
        pages = [p for p in block_table[request].tolist() if p >= 0]
        keys, values = (torch.cat([cache[p] for p in pages])[:length] for cache in (key_pages, value_pages))
        assert keys[-1].equal(key[0, :, request]) and values[-1].equal(value[0, :, request])
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, request:request + 1], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            enable_gqa=True)
        torch.testing.assert_close(out[0, request], expected[0, :, 0])
    assert not written[0].equal(tokens[0])  # the padding request's key went to the trash

    # compiled as inside a continuous-batching step: traced into one graph (hf_tpu's files are skipped by default)
    for run in (_write_and_attend, torch.compile(traced_by_dynamo(_write_and_attend), backend="tpu", dynamic=True)):
        on_tpu = tokens.to("tpu")
        result = run(*(t.to("tpu") for t in (query, key, value, on_tpu, block_table, cu_seq_lens_k)), 12, 0)
        torch.testing.assert_close(result.cpu(), out)
        assert on_tpu.cpu().equal(written)


def test_decode_steps_read_each_requests_pages_and_give_cpus_tokens(monkeypatch):
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    decode_batches = []
    prepare = ContinuousBatchingIOs.prepare_batch_tensors

    def prepare_batch_tensors(self, *args, **kwargs):
        prepare(self, *args, **kwargs)
        decode_batches.append(self.use_block_table)

    monkeypatch.setattr(ContinuousBatchingIOs, "prepare_batch_tensors", prepare_batch_tensors)
    model = tiny_llama(max_position_embeddings=256, initializer_range=0.3).eval()  # tokens that vary
    lengths = (5, 37, 3, 60, 12, 9, 41, 2, 18, 30, 7, 25)
    prompts = [torch.randint(3, 120, (length,), generator=torch.Generator().manual_seed(length)).tolist()
               for length in lengths]
    config = dict(num_blocks=16, max_batch_tokens=64, page_size=16)
    expected = _generate_batch(model, prompts, ContinuousBatchingConfig(**config), max_new_tokens=12)
    assert not any(decode_batches)  # on CPU, transformers keeps the fast path to flash attention on CUDA
    assert len({tuple(tokens) for tokens in expected}) == len(prompts)

    before = compile_stats()
    tokens = _generate_batch(model.to("tpu"), prompts, ContinuousBatchingConfig(**config), max_new_tokens=12)
    assert tokens == expected
    assert sum(decode_batches) >= 8  # most steps of 12 requests x 12 tokens decode through block tables
    assert compile_stats()["fallbacks"] == before["fallbacks"]
    compiled = compile_stats()["compilations"] - before["compilations"]
    # varlen: query tokens 64 x tokens read a power of two from a page (16) to the cache (256); decode: 8 or 16
    # requests x 64 or 128 keys read
    assert 0 < compiled <= 1 * 5 + 2 * 2
    unpaged = _generate_batch(model, prompts, ContinuousBatchingConfig(**config, max_blocks_per_request=0),
                              max_new_tokens=12)
    assert unpaged == expected  # the path turned off: every step through the mask, the same tokens
