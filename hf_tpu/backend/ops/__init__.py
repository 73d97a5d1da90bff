"""Lowerings by op family. Importing this package fills the op table in :mod:`..dispatch`."""

from . import memory, pointwise, views  # noqa: F401
