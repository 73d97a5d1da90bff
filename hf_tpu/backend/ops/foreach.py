"""``_foreach_*`` ops (torch.optim's multi-tensor paths, grad clipping) as one XLA program per call.

Each lowering maps the single-tensor lowering over the lists: tensor lists arrive as tuples of arrays
and ScalarLists as tuples of (traced) scalars, so one call updates every tensor in one jitted program,
and new learning rates or bias corrections do not recompile. Per element the math, type promotion and
rounding are exactly those of the single-tensor op.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from ..dispatch import LOWERINGS, kernel, lowering
from . import pointwise, reductions


def _over_lists(fn):
    """``fn`` applied element by element; tuple arguments are zipped, all others repeated."""

    def lower(*args):
        length = next(len(a) for a in args if isinstance(a, tuple))
        columns = [a if isinstance(a, tuple) else (a,) * length for a in args]
        return tuple(fn(*row) for row in zip(*columns))

    lower.__name__ = f"foreach_{fn.__name__}"
    return lower


def _names(op: str, *overloads: str, inplace: bool = True) -> list[str]:
    """``_foreach_op.O``, its ``.O_out`` and (when it exists) the in-place ``_foreach_op_.O``."""
    names = []
    for overload in overloads or ("",):
        names += [f"_foreach_{op}.{overload}" if overload else f"_foreach_{op}",
                  f"_foreach_{op}.{overload}_out" if overload else f"_foreach_{op}.out"]
        if inplace:
            names.append(f"_foreach_{op}_.{overload}" if overload else f"_foreach_{op}_")
    return names


lowering(*_names("add", "List", "Scalar", "ScalarList", "Tensor"))(_over_lists(pointwise.add))
lowering(*_names("sub", "List", "Scalar", "ScalarList"))(_over_lists(pointwise.sub))
lowering(*_names("mul", "List", "Scalar", "ScalarList", "Tensor"))(_over_lists(pointwise.mul))
lowering(*_names("div", "List", "Scalar", "ScalarList", "Tensor"))(_over_lists(pointwise.div))
lowering(*_names("pow", "List", "Scalar", "ScalarList"), "_foreach_pow.ScalarAndTensor")(_over_lists(pointwise.power))
lowering(*_names("lerp", "List", "Scalar", "ScalarList"))(_over_lists(pointwise.lerp))
lowering(*_names("addcmul", "Scalar", "ScalarList"))(_over_lists(pointwise.addcmul))
lowering(*_names("addcdiv", "Scalar", "ScalarList"))(_over_lists(pointwise.addcdiv))
for _op in ("maximum", "minimum", "clamp_min", "clamp_max"):
    lowering(*_names(_op, "List", "Scalar", "ScalarList"))(_over_lists(LOWERINGS[_op].fn))
for _op in ("abs", "neg", "sign", "sqrt", "rsqrt", "reciprocal", "exp", "expm1", "log", "log2", "log10", "log1p",
            "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "sigmoid", "erf", "erfc",
            "floor", "ceil", "round", "trunc", "frac"):
    lowering(*_names(_op))(_over_lists(LOWERINGS[_op].fn))

lowering(*_names("max", inplace=False))(_over_lists(reductions.max_all))


@lowering("_foreach_norm.Scalar", "_foreach_norm.Scalar_out", static=("ord",))
def foreach_norm(self, ord=2, dtype=None):
    return tuple(reductions.vector_norm(x, ord, None, False, dtype) for x in self)


@lowering(*_names("zero"))
def foreach_zero(self):
    return tuple(jnp.zeros(x.shape, x.dtype) for x in self)


@lowering(*_names("copy", inplace=False))
def foreach_copy(self, src, non_blocking=False):
    return tuple(jnp.broadcast_to(s.astype(x.dtype), x.shape) for x, s in zip(self, src))


@kernel("_foreach_copy_")
def foreach_copy_(self, src, non_blocking=False):
    """Per tensor: ``copy_`` of a whole tpu tensor only swaps in the source's buffer (no program at all),
    and sources may live on the host, as with CUDA's ``_foreach_copy_``."""
    for destination, source in zip(self, src):
        destination.copy_(source, non_blocking)


def _scalars_from_tensor(op: str):
    """The ``.Tensor`` overload (one scalar per list entry, in a CPU tensor): the ScalarList lowering."""
    functional, inplace = f"_foreach_{op}", f"_foreach_{op}_"
    scalar_list = getattr(torch.ops.aten, functional).ScalarList
    scalar_list_out = getattr(torch.ops.aten, functional).ScalarList_out
    scalar_list_ = getattr(torch.ops.aten, inplace).ScalarList

    def values(scalars, count):
        if scalars.dim() != 1 or scalars.numel() != count:
            raise RuntimeError(
                f"Expected length of scalars to match input of length {count} but got {scalars.numel()} instead."
            )
        return scalars.tolist()

    @kernel(f"{functional}.Tensor")
    def foreach_tensor(self, tensor1, tensor2, scalars):
        return scalar_list(self, tensor1, tensor2, values(scalars, len(self)))

    @kernel(f"{functional}.Tensor_out")
    def foreach_tensor_out(self, tensor1, tensor2, scalars, *, out):
        scalar_list_out(self, tensor1, tensor2, values(scalars, len(self)), out=out)

    @kernel(f"{inplace}.Tensor")
    def foreach_tensor_(self, tensor1, tensor2, scalars):
        scalar_list_(self, tensor1, tensor2, values(scalars, len(self)))


for _op in ("addcmul", "addcdiv"):
    _scalars_from_tensor(_op)
