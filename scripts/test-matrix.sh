#!/usr/bin/env bash
# Runs the tests on the oldest and the newest torch and Lightning that pyproject.toml declares, each in a venv of its
# own, and shows that installing the package there keeps the torch the venv already had.
#
#   scripts/test-matrix.sh [oldest|newest|all] [pytest arguments]     # default: all, the compatibility subset
#   scripts/test-matrix.sh oldest tests                               # the whole suite on the oldest releases
#
# Legs:
#   oldest   torch 2.6.0 + torchvision 0.21.0, lightning 2.5.0 (from the package index: CUDA builds of several GB,
#            which run on the CPU). torchvision is pinned with torch in each leg: litdata requires it, and an unpinned
#            one is the newest, which replaces torch with its own
#   newest   torch 2.14.1 + torchvision 0.29.1, lightning 2.6.6, litdata with its own requirements: the environment
#            that runs the torchvision tests (tests/test_torchvision.py); CI runs this leg after the main suite
#
# Each leg installs its torch (and torchvision) and Lightning first, then `pip install -e ".[test]"`, then checks that
# torch is still the release it installed. The venvs live under $DLTUNE_MATRIX_DIR (default ~/.cache/dltune-matrix)
# and are reused by later runs. Without pytest arguments a leg runs the compatibility subset below: every private
# Lightning and PyTorch attribute the tuner uses, every hook with a real Trainer, failures, resume, in-epoch switching,
# the loader libraries, the torchvision pipeline, and PyTorch's worker-death message the fork watch reads. Prints one
# line per leg; exits non-zero when a leg failed.
set -uo pipefail
cd "$(dirname "$0")/.."

COMPAT_TESTS=(
    tests/test_lightning_private.py
    tests/test_callback.py
    tests/test_exception.py
    tests/test_failure_paths.py
    tests/test_forkwatch.py
    tests/test_resume.py
    tests/test_in_epoch.py
    tests/test_eval_loaders.py
    tests/test_loader_libraries.py
    tests/test_torchvision.py
)

leg=${1:-all}
shift || true
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=("${COMPAT_TESTS[@]}")
root=${DLTUNE_MATRIX_DIR:-$HOME/.cache/dltune-matrix}
base_python=${PYTHON:-python3}

pins() {
    case "$1" in
        oldest) echo "torch==2.6.0 torchvision==0.21.0 lightning==2.5.0" ;;
        newest) echo "torch==2.14.1 torchvision==0.29.1 lightning==2.6.6" ;;
        *) echo "unknown leg '$1': use oldest, newest or all" >&2; return 2 ;;
    esac
}

run_leg() {
    local name=$1 venv="$root/$1" py want
    want=$(pins "$name") || return 2
    echo "== $name: $want"
    [ -x "$venv/bin/python" ] || "$base_python" -m venv "$venv" || return 1
    py="$venv/bin/python"
    # shellcheck disable=SC2086  # the pins are words
    "$py" -m pip install -q $want || return 1
    local torch_before
    torch_before=$("$py" -c "import torch; print(torch.__version__)") || return 1
    "$py" -m pip install -q -e ".[test]" litdata==0.2.76 || return 1
    "$py" - "$torch_before" <<'EOF' || return 1
import importlib.metadata as md
import sys

import torch

assert torch.__version__ == sys.argv[1], f"installing lightning-dltune replaced torch {sys.argv[1]} by {torch.__version__}"
import lightning  # noqa: E402  (fails where a torchvision that does not match torch crept in)

names = ("torch", "torchvision", "lightning", "torchmetrics", "torchdata", "litdata")
found = []
for n in names:
    try:
        found.append(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        pass
print("kept torch", sys.argv[1], "|", ", ".join(found))
EOF
    "$py" -m pytest -q -p no:cacheprovider "${tests[@]}"
}

legs=("$leg")
[ "$leg" = all ] && legs=(oldest newest)
summary=()
rc=0
for name in "${legs[@]}"; do
    started=$SECONDS
    out=$(mktemp)
    run_leg "$name" 2>&1 | tee "$out"
    leg_rc=${PIPESTATUS[0]}
    result=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed).*=+$| passed| failed" "$out" | tail -n 1)
    kept=$(grep -E "^kept torch" "$out" | tail -n 1)
    summary+=("matrix $name: rc=$leg_rc in $((SECONDS - started)) s | ${kept:-torch not checked} | ${result:-no test result}")
    rm -f "$out"
    [ "$leg_rc" -eq 0 ] || rc=1
done
printf '%s\n' "${summary[@]}"
exit "$rc"
