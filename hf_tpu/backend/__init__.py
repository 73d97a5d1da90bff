"""The ``tpu`` PyTorch device, implemented in Python over JAX/XLA: the floor every other layer stands on.

Layout: :mod:`runtime` (which JAX devices back the chips), :mod:`devices` (device count, the current
device, memory), :mod:`storage` and :mod:`strided` (storage model and views), :mod:`dtypes`,
:mod:`dispatch` (schema reading and kernels), :mod:`op_table` (the table installed as PrivateUse1
kernels), :mod:`ops` (lowerings by family) and the hooks :mod:`hf_tpu.registration` installs. Nothing here
imports a layer above (``compile``, ``distributed``, ``kernels``, ``integrations``, ``torch.tpu``).
"""
