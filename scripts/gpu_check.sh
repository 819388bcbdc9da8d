#!/usr/bin/env bash
# The GPU check of lightning-dltune, for a machine with a CUDA GPU: installs what it needs, runs the GPU tests
# (tests marked `gpu`, plus the GPU-path tests that run anywhere), then a short GPU benchmark (a small CNN on the
# GPU fed by a CPU-decoded dataset and validated after every epoch: DataLoaderTuner from 0 workers on both loaders
# against every static config set on both), and prints a CUDA truth benchmark (benchmarks/truth_gpu.py: the tuner's event-based stall against a synchronized reference), and
# prints a compact result. About 3-5 minutes on an H200 with 16 CPUs; each stage has a time limit, 7.5 minutes in all.
#
#   scripts/gpu_check.sh [OUT_DIR]        # default OUT_DIR: benchmarks/results
#
# Writes OUT_DIR/gpu_check.log, OUT_DIR/gpu_cuda.json and OUT_DIR/truth_gpu_quick.json. Without a CUDA device
# the tests skip and the benchmarks run as CPU smoke runs (--device cpu), so the script can be checked anywhere.
# Needs no network where torch, lightning, torchmetrics, nvidia-ml-py, psutil, tensorboard and pytest are
# installed; otherwise it pip-installs the missing ones.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
py=${PYTHON:-python3}
log="$out/gpu_check.log"
export PYTHONUNBUFFERED=1

run() {
    echo "== environment"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$py" -c "import torch, lightning; print('torch', torch.__version__, '| cuda', torch.version.cuda, \
'| CUDA device:', torch.cuda.is_available(), '| lightning', lightning.__version__)" || return 1

    echo "== install"
    missing=$("$py" - <<'PYEOF'
import importlib.util
need = {"torch": "torch", "lightning": "lightning", "torchmetrics": "torchmetrics", "pynvml": "nvidia-ml-py",
        "psutil": "psutil", "tensorboard": "tensorboard", "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
print(" ".join(pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
    if [ -n "$missing" ]; then
        echo "installing: $missing"
        "$py" -m pip install -q $missing || echo "could not install $missing (no network?); continuing"
    fi
    # with its dependencies checked against the machine's own torch and Lightning (pyproject's ranges), both held
    # where they are (a release outside the ranges fails the install instead of being replaced); without build
    # isolation, which would fetch setuptools from the network
    torch_before=$("$py" -c "import torch; print(torch.__version__)")
    held=$("$py" -c "from importlib.metadata import version as v; print(f'torch=={v(\"torch\")}\nlightning=={v(\"lightning\")}')")
    if ! "$py" -m pip install -q --no-build-isolation -c <(printf '%s\n' "$held") -e .; then
        echo "pip could not install the package over this machine's packages; using PYTHONPATH=$PWD"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
    torch_after=$("$py" -c "import torch; print(torch.__version__)")
    [ "$torch_before" = "$torch_after" ] && echo "kept torch $torch_before" || echo "torch changed: $torch_before -> $torch_after"
    "$py" -c "import lightning_dltune as d; print('lightning-dltune', d.__version__)" || return 1

    bench_args=()
    if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "NOTE: no CUDA device here: the gpu tests skip and the benchmark is a CPU smoke run"
        bench_args=(--device cpu --quick)
    fi

    echo "== GPU tests"
    timeout 170 "$py" -m pytest -q -rs -p no:cacheprovider -m "gpu or not gpu" \
        tests/test_cuda.py tests/test_gpu_timeline.py tests/test_gpu_callback.py tests/test_nvml.py
    tests_rc=$?

    echo "== GPU benchmark"
    timeout 180 "$py" benchmarks/gpu.py --out "$out" "${bench_args[@]}"
    bench_rc=$?

    echo "== CUDA truth benchmark"
    timeout 100 "$py" benchmarks/truth_gpu.py --quick --out "$out" "${bench_args[@]:0:2}"
    truth_rc=$?
    echo "== done: tests rc=$tests_rc, benchmark rc=$bench_rc, truth rc=$truth_rc"
    [ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$truth_rc" -eq 0 ]
}

run 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
echo
echo "== summary (full log: $log)"
grep -E "^(torch |kept torch|NOTE|RESULT|wrote|== done|\| )|passed|failed|skipped|error" "$log" | grep -v "^  " | tail -25
exit "$rc"
