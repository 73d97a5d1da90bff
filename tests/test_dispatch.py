"""The op table's jit cache keys: what must make a cached program not apply."""

from __future__ import annotations

import torch


def test_static_numbers_of_different_types_do_not_share_a_program():
    assert torch.arange(4.0, device="tpu").dtype == torch.float32
    assert torch.arange(4, device="tpu").dtype == torch.int64  # 4 == 4.0, but not the same op


def test_default_dtype_is_part_of_the_key():
    ints = torch.arange(3, device="tpu")
    assert (ints + 2.5).dtype == torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert (ints + 2.5).dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
