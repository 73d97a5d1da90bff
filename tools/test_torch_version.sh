#!/usr/bin/env bash
# Runs the test suite against another torch release in a fresh virtual environment (not part of CI).
#
#   tools/test_torch_version.sh 2.11.0 [pytest arguments...]
#
# Creates /tmp/hf_tpu-torch-VERSION (reused when it exists), installs torch==VERSION there first (from
# the package index: on PyPI that is a CUDA build of ~530 MB plus NVIDIA libraries; it runs on the CPU),
# then this checkout with its test extra, which leaves torch alone because the pin admits 2.11 to 2.14,
# and runs `python -m pytest` with the arguments given (default: the whole suite). A pip constraint
# capping torch on this machine is ignored for the torch install only.
set -euo pipefail
version="${1:?usage: tools/test_torch_version.sh TORCH_VERSION [pytest arguments...]}"
shift
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="/tmp/hf_tpu-torch-${version}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    PIP_CONSTRAINT= "$venv/bin/pip" install --quiet "torch==${version}"
    "$venv/bin/pip" install --quiet -e "${root}[test]"
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__, '->', (torch.ones(2, device='tpu') + 1).tolist())"
cd "$root"
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
