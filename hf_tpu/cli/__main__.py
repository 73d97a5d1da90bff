"""``python -m hf_tpu.cli``: the ``hf-tpu`` command without its console script."""

import sys

from . import main

sys.exit(main())
