#!/usr/bin/env bash
# Installs everything the test suite needs into the Python environment of `python3` (or of $PYTHON):
#
#   1. one pip resolution: torch pinned to the tested release, this package with its [test] extras (pytest,
#      ruff, mypy, and the loader libraries that install normally: torchdata, webdataset), and litdata's own
#      requirements except torchvision;
#   2. litdata itself with --no-deps. It declares torchvision, and torchvision's PyPI wheels are built against
#      CUDA torch: next to the CPU torch, `import torchvision` fails, and with it `import lightning` (torchmetrics
#      imports torchvision when it is installed). litdata works without it.
#   3. a check that torch is still the pinned release and that every library the tests import loads.
#
# Then run `python3 -m pytest` (README, "Run the tests"). On a GPU machine, install the torch build for your CUDA
# version first: pip keeps an installed 2.13.0 build, whichever it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

TORCH="torch==2.13.0"
LITDATA="litdata==0.2.76"
# litdata 0.2.76's Requires-Dist (its METADATA), less torchvision; its torch>=2.4.0 is met by the pin above.
# Pinned with litdata: --no-deps installs none of a newer release's requirements.
LITDATA_REQUIREMENTS=(boto3 filelock lightning-utilities numpy obstore requests "urllib3>=1.26" tifffile)

"$PYTHON" -m pip install "$TORCH" -e ".[test]" "${LITDATA_REQUIREMENTS[@]}"
"$PYTHON" -m pip install --no-deps "$LITDATA"

"$PYTHON" - <<'EOF'
import importlib.metadata as md

import torch

assert torch.__version__.split("+")[0] == "2.13.0", f"torch {torch.__version__} replaced the pinned 2.13.0"
import lightning  # fails here if a torchvision that does not match torch crept in
import litdata
import torchdata.stateful_dataloader
import webdataset

names = ("torch", "lightning", "torchdata", "webdataset", "litdata")
print("test dependencies:", ", ".join(f"{n} {md.version(n)}" for n in names))
EOF
