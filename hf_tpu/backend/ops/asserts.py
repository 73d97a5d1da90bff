"""Device-side asserts: ``aten::_assert_async``, raised at the next host sync as on CUDA (see :mod:`..checks`).

transformers' ``eager`` experts and ``torch._check``-style code put them in graphs; on CPU they raise at once.
"""

from __future__ import annotations

from .. import checks
from ..dispatch import lowering

_ZERO = "Expected Tensor with single nonzero value, but got zero"


def _single_value(self):
    if self.size != 1:
        raise ValueError("Boolean value of Tensor with more than one value is ambiguous")
    return self.reshape(())


@lowering("_assert_async")
def assert_async(self):
    """Raises ``RuntimeError`` at the next sync if the one value of ``self`` is zero (``False``)."""
    checks.require(_single_value(self) != 0, RuntimeError, _ZERO)
    return ()


@lowering("_assert_async.msg", static=("assert_msg",))
def assert_async_msg(self, assert_msg):
    """:func:`assert_async` with the message ``assert_msg``."""
    checks.require(_single_value(self) != 0, RuntimeError, assert_msg.replace("{", "{{").replace("}", "}}"))
    return ()
