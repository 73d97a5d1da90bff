"""The ``tpu`` PyTorch device, implemented in Python over JAX/XLA.

Layout: :mod:`registration` (PrivateUse1 rename, hooks, guard, patches), :mod:`device_module`
(``torch.tpu``), :mod:`runtime` (which JAX devices back the chips), :mod:`storage` and
:mod:`strided` (storage model and views), :mod:`dtypes`, :mod:`dispatch` (the op table) and
:mod:`ops` (lowerings by family).
"""

from .registration import register

__all__ = ["register"]
