"""torch's FlexAttention on tpu: ``flex_attention`` takes tpu tensors, and transformers uses it.

**torch** (installed when ``torch.nn.attention.flex_attention`` is imported). ``_validate_device``
(``torch/nn/attention/flex_attention.py``, torch 2.11-2.13) refuses devices other than cuda, cpu, xpu, hpu and
mps. On tpu, ``flex_attention`` runs torch's own implementation of its operator (the ``CompositeExplicitAutograd``
one: the scores of every query and key, ``score_mod`` applied to them, the block mask's ``mask_mod`` to mask
them), forward and backward (which torch refuses on CPU). Compiled, each graph that holds the operator runs as
one program (:mod:`hf_tpu.compile.flex_attention`).

**transformers** (installed when ``transformers.utils.import_utils`` has just executed, before ``transformers.utils``
binds the name). ``is_torch_flex_attn_available`` (``import_utils.py:785``, transformers 5.2x) answers ``False``
in any process whose accelerator is a tpu, written for a TPU runtime whose ``flex_attention`` refuses its tensors:
with hf_tpu installed, ``attn_implementation="flex_attention"`` raised "PyTorch Flex Attention is not supported on
TPU" for every model, on CPU too. Here it answers as on any other device.
"""

from __future__ import annotations

import functools
from typing import Any

from . import traced_by_dynamo


def _available_for_transformers(import_utils: Any) -> None:
    available = import_utils.is_torch_flex_attn_available
    if getattr(available, "_hf_tpu", False):
        return

    @functools.lru_cache
    @import_utils._make_compile_constant
    def is_torch_flex_attn_available() -> bool:
        return import_utils.is_torch_available()

    is_torch_flex_attn_available._hf_tpu = True
    import_utils.is_torch_flex_attn_available = is_torch_flex_attn_available


def _accept_tpu_tensors(module: Any) -> None:
    validate = module._validate_device
    if getattr(validate, "_hf_tpu", False):
        return

    @traced_by_dynamo  # called inside compiled flex_attention: a skipped call would break its graph
    @functools.wraps(validate)
    def _validate_device(query: Any, key: Any, value: Any) -> None:
        if query.device.type != "tpu":
            validate(query, key, value)

    _validate_device._hf_tpu = True
    module._validate_device = _validate_device


def install(module: Any) -> None:
    if module.__name__ == "transformers.utils.import_utils":
        _available_for_transformers(module)
    else:
        _accept_tpu_tensors(module)
