"""torch.distributed's ``set_timeout(timeout, group=None)``, on torch releases without it.

Later torch releases have ``torch.distributed.set_timeout`` (``torch/distributed/distributed_c10d.py``), which
TorchTitan 0.3 calls after its first step to shorten every group's timeout; torch 2.11-2.13 only have the group's
own ``ProcessGroup.set_timeout``, so TorchTitan stopped there with ``AttributeError``. Where the function is missing,
it is added: it sets the group's (by default the default group's) timeout, which for a ``tpu_dist`` group is the
longest its collectives are waited for. A no-op on a torch that has it.
"""

from __future__ import annotations

import datetime
from typing import Any


def install(distributed: Any) -> None:
    if hasattr(distributed, "set_timeout") or not distributed.is_available():
        return

    def set_timeout(timeout: datetime.timedelta, group: Any = None) -> None:
        """Sets ``group``'s timeout (the default group's when ``group`` is ``None``)."""
        (group or distributed.distributed_c10d._get_default_group()).set_timeout(timeout)

    distributed.set_timeout = set_timeout
