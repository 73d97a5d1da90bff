"""Per-device random state: a seed and an offset, like CUDA's Philox generator.

Each random op draws the key ``fold_in(key(seed), offset)`` and advances the offset, so a seed
reproduces the same stream and ``get_rng_state``/``set_rng_state`` round-trip it exactly.
"""

from __future__ import annotations

import random
import threading

import torch

_DEFAULT_SEED = 67280421310721  # torch's default_rng_seed_val
_lock = threading.Lock()
_states: dict[int, list[int]] = {}
_seed_of_all = _DEFAULT_SEED  # the seed of every device not seeded since manual_seed_all


def _state(device_index: int) -> list[int]:
    return _states.setdefault(device_index, [_seed_of_all, 0])


def manual_seed(seed: int, device_index: int) -> None:
    with _lock:
        _states[device_index] = [int(seed) & 0xFFFF_FFFF_FFFF_FFFF, 0]


def manual_seed_all(seed: int) -> None:
    """Seeds every device, without counting them: ``torch.manual_seed`` may come before JAX may start
    (``tpu_dist`` starts it in ``init_process_group``)."""
    global _seed_of_all
    with _lock:
        _seed_of_all = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
        _states.clear()


def seed(device_index: int) -> int:
    value = random.getrandbits(63)
    manual_seed(value, device_index)
    return value


def initial_seed(device_index: int) -> int:
    return _state(device_index)[0]


def next_key_parts(device_index: int) -> tuple[int, int]:
    """(seed, offset) for one random op, advancing the device's stream."""
    with _lock:
        state = _state(device_index)
        offset = state[1]
        state[1] += 1
    return state[0], offset


def position(device_index: int) -> tuple[int, int]:
    """The device's (seed, offset): the key parts the next random op draws, without advancing the stream."""
    with _lock:
        seed_value, offset = _state(device_index)
    return seed_value, offset


def advance(device_index: int, count: int) -> None:
    """Advances the device's stream past ``count`` draws that a program made itself, from the offset of
    :func:`position` on (one key per draw, as ``count`` calls of :func:`next_key_parts` would give)."""
    with _lock:
        _state(device_index)[1] += count


def get_state(device_index: int) -> torch.Tensor:
    seed_value, offset = _state(device_index)
    return torch.tensor([seed_value, offset], dtype=torch.uint64).view(torch.uint8)


def set_state(new_state: torch.Tensor, device_index: int) -> None:
    if new_state.dtype != torch.uint8 or new_state.numel() != 16:
        raise RuntimeError("Expected a tpu RNG state: a torch.uint8 tensor of 16 bytes from torch.tpu.get_rng_state().")
    seed_value, offset = new_state.detach().cpu().contiguous().view(torch.uint64).tolist()
    with _lock:
        _states[device_index] = [int(seed_value), int(offset)]
