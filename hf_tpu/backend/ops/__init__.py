"""Lowerings by op family. Importing this package fills the op table in :mod:`..dispatch`."""

from . import memory, pointwise, views  # noqa: F401
from . import factories, indexing, linalg, nn, random  # noqa: F401
from . import foreach, reductions  # noqa: F401
from . import attention, transformer_fast_path, bessel, convolution, fft, pooling, special  # noqa: F401
from . import moe  # noqa: F401
from . import optim  # noqa: F401
from . import histogram  # noqa: F401
from . import sampling  # noqa: F401
from . import grid_sample  # noqa: F401
from . import ctc  # noqa: F401
from . import ldl  # noqa: F401
from . import antialias  # noqa: F401
from . import backward, margin_losses  # noqa: F401
from . import asserts  # noqa: F401
