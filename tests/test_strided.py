"""The strided view math (reading and writing a view of a flat buffer) against torch on CPU."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hf_tpu.backend import strided

VIEWS = {
    "contiguous": lambda b: b.view(4, 30),
    "permute": lambda b: b.view(4, 5, 6).permute(2, 0, 1),
    "step_slices": lambda b: b.view(10, 12)[2:7, 1:11:3],
    "transpose_select": lambda b: b.view(10, 12).t()[3],
    "expand": lambda b: b[5:9].view(2, 2).expand(3, 2, 2),
    "unfold_overlapping": lambda b: b.unfold(0, 7, 3),
    "wide_step": lambda b: b.view(2, 60)[:, ::7],
    "as_strided_overlap": lambda b: torch.as_strided(b, (3, 3), (1, 1), 2),
    "tail": lambda b: b[119:],
    "diagonal": lambda b: b.view(12, 10).diagonal(),
    "last_column": lambda b: b.view(4, 30)[:, 29:30],
    "row_tail": lambda b: b.view(10, 12)[9, 5:],
    "scalar": lambda b: b[7],
    "empty": lambda b: b[3:3],
    "size_one_dims": lambda b: b.view(1, 120, 1)[:, 10:20],
}
OVERLAPPING = {"expand", "unfold_overlapping", "as_strided_overlap"}


def _geometry(view: torch.Tensor) -> tuple:
    return tuple(view.shape), tuple(view.stride()), view.storage_offset()


@pytest.mark.parametrize("name", VIEWS)
def test_read_matches_torch(name):
    base = torch.arange(120, dtype=torch.float32)
    view = VIEWS[name](base)
    got = np.asarray(strided.read(jnp.asarray(base.numpy()), *_geometry(view)))
    np.testing.assert_array_equal(got, view.numpy())


@pytest.mark.parametrize("name", sorted(set(VIEWS) - OVERLAPPING))
def test_write_matches_torch(name):
    base = torch.arange(120, dtype=torch.float32)
    expected = base.clone()
    view = VIEWS[name](expected)
    value = torch.randn(view.shape)
    view.copy_(value)
    got = strided.write(jnp.asarray(base.numpy()), jnp.asarray(value.numpy()), *_geometry(view))
    np.testing.assert_array_equal(np.asarray(got), expected.numpy())
