"""Sliding-window cache layers in the one-program decode loops: each step's update and mask from its position.

transformers' ``StaticSlidingWindowLayer`` (``transformers/cache_utils.py``) holds the last ``W`` positions of each
row in ``W`` slots. Until ``W`` positions are written, a step writes the new one at the layer's count
(``cumulative_length``, a tensor); from then on it rolls the slots left by one and writes the new position last.
Which of the two it does, the query's position and the offset of the attention mask over the slots, it reads from a
Python count (``cumulative_length_int``), so a decode step traced at one position would replay that position's
choice and mask at every later step. While a loop's step is traced (:func:`at_position`), each such layer reads the
step's position from a tensor of the program instead: the step computes both writes and keeps the one that applies,
and the mask is built over the layer's slots as they are then (slot ``j`` holds position ``j`` until the window is
full, position ``p - W + 1 + j`` after), which is the mask transformers builds for that step. One program then
serves every step. After a run the loop adds its steps to each layer's Python count (:func:`advance`), and the cache
is as transformers' loop leaves it.

Swaps, while a step is traced, ``update`` and ``get_seq_length`` of the cache's sliding-window layers
(``transformers/cache_utils.py``, transformers 5.x); the masks' sizes come from :func:`slot_mask_arguments`, which
``hf_tpu.integrations.generation`` calls from ``_preprocess_mask_arguments`` of ``transformers/masking_utils.py``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator, Sequence

import torch


def layers_of(layers: Sequence) -> list:
    """The sliding-window layers among a cache's ``layers``."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    return [layer for layer in layers if type(layer) is StaticSlidingWindowLayer]


def check_position(layers: Sequence, position: int) -> None:
    """Raises ``NotImplementedError`` unless every sliding-window layer among ``layers`` holds the positions before
    ``position`` (the first step's), which the loop's steps take their place from."""
    if any(layer.cumulative_length_int != position for layer in layers_of(layers)):
        raise NotImplementedError("a sliding-window layer of the cache holds other positions than the tokens so far")


def advance(layers: Sequence, steps: int) -> None:
    """Counts ``steps`` more positions in every sliding-window layer among ``layers``, as its updates would have."""
    for layer in layers_of(layers):
        layer.cumulative_length_int += steps


def _update(layer: Any, position: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
            *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``StaticSlidingWindowLayer.update`` of one position, ``position``: written at the layer's count while the
    window has room, else last, after the slots are rolled left by one."""
    if key_states.shape[-2] != 1:
        raise NotImplementedError("a decode step writes more than one position into a sliding-window layer")
    window = layer.max_cache_len
    full = position >= window
    slot = torch.where(full, window - 1, layer.cumulative_length.clamp(max=window - 1)).reshape(1)
    for cached, new in ((layer.keys, key_states), (layer.values, value_states)):
        shifted = torch.where(full, cached.roll(-1, dims=-2), cached)
        cached.copy_(shifted.index_copy(2, slot, new))
    layer.cumulative_length.add_((~full).to(layer.cumulative_length.dtype))
    return layer.keys, layer.values


_traced = threading.local()  # .layers: {id(layer): (layer, position)} while this thread traces a loop's step


def slot_mask_arguments(arguments: tuple, cache: Any, layer_idx: int | None) -> tuple:
    """``_preprocess_mask_arguments``' results (``arguments``, for ``cache``'s layer ``layer_idx``), as the
    ``create_*_mask`` functions size a mask with them: for a mask over a sliding-window layer this thread is
    tracing (:func:`at_position`), the layer's slots as the positions they hold (the 2D padding mask read at those
    positions) and the query at the last slot written, so that upstream's causal and window rules keep exactly the
    slots written; else ``arguments`` as they are (``hf_tpu.integrations.generation`` hands them over)."""
    traced = getattr(_traced, "layers", None)
    layer, position = traced.get(id(cache.layers[layer_idx]), (None, None)) if traced and layer_idx is not None \
        else (None, None)
    if layer is None or arguments[0]:
        return arguments
    _, mask, packed, query_length, _, _, _ = arguments
    if query_length != 1 or packed is not None or (mask is not None and mask.ndim != 2):
        raise NotImplementedError("a sliding-window mask of a decode step is not over one position")
    window = layer.max_cache_len
    slots = torch.arange(window, device=position.device)
    held = torch.where(position >= window, position - window + 1 + slots, slots)
    if mask is not None:
        mask = mask.gather(1, held.expand(mask.shape[0], window))
    return False, mask, None, 1, window, position.clamp(max=window - 1), 0


@contextlib.contextmanager
def at_position(layers: Sequence, position: torch.Tensor | None) -> Iterator[None]:
    """While a decode step is traced: the sliding-window layers among ``layers`` (a cache's) write and mask
    ``position`` (the step's, a 0-dim tensor), not the position their Python count says. Raises
    ``NotImplementedError`` for such layers without a ``position``."""
    sliding = layers_of(layers)
    if not sliding:
        yield
        return
    if position is None:
        raise NotImplementedError("this loop does not carry the position a sliding-window layer needs")
    _traced.layers = {id(layer): (layer, position) for layer in sliding}
    for layer in sliding:
        layer.update = functools.partial(_update, layer, position)
        layer.get_seq_length = lambda: position
    try:
        yield
    finally:
        _traced.layers = None
        for layer in sliding:
            del layer.update, layer.get_seq_length
