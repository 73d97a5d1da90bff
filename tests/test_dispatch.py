"""The op table's jit cache keys: what must make a cached program not apply."""

from __future__ import annotations

import torch

from hf_tpu.backend import dispatch


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


def test_specialized_scalars_get_a_program_each_and_other_values_share_one():
    """pow's exponent is traced (one program for every value) except at the values its lowering specializes."""
    x = torch.rand(13, 7, generator=torch.Generator().manual_seed(0)).to("tpu") + 0.5  # a shape no other test uses
    x.pow(1.25), x.pow(2)  # both kinds compiled
    before = dispatch.eager_program_count()
    for exponent in (1.5, 1.75, 2.5, -0.75):
        torch.testing.assert_close(x.pow(exponent).cpu(), x.cpu().pow(exponent))
    assert dispatch.eager_program_count() == before
    assert torch.equal(x.pow(2).cpu(), x.cpu() * x.cpu())
    assert torch.equal(x.pow(0.5).cpu(), x.sqrt().cpu())
    assert dispatch.eager_program_count() == before + 2  # 0.5 and sqrt: a program each
