#!/usr/bin/env bash
# Runs a selection of Lightning's own test suite (tests/tests_pytorch) twice: as it is, then with a
# DataLoaderTuner() (all defaults) appended to every Trainer's callbacks, and lists the tests that pass without
# the tuner and fail or error with it (docs/lightning-suite.md).
#
#   scripts/lightning-suite.sh                      # the full selection both ways (~970 tests; 2 CPUs: ~6-8 min each)
#   scripts/lightning-suite.sh --quick              # a small subset both ways (~60 tests; 2 CPUs: under 1 min each)
#   scripts/lightning-suite.sh -k EXPR              # passed on to pytest, both runs
#   scripts/lightning-suite.sh --only-injected tests_pytorch/loops/test_loops.py::test_x ...
#                                                   # just the injected run of these node ids, long tracebacks
#   scripts/lightning-suite.sh --out DIR            # where logs and reports go (default /tmp/lightning-suite)
#   scripts/lightning-suite.sh ... -- PYTEST_ARGS   # anything after -- goes to pytest as it is
#
# Needs no network when the test dependencies are installed: the tests come from a Lightning git repository,
# $LIGHTNING_REPO (a bare git dir or a checkout; default: the mirror below), at the tag of the installed
# lightning version, or the newest tag of its major.minor ($LIGHTNING_TAG overrides), extracted once into
# $DLTUNE_SUITE_CACHE/<tag> (default ~/.cache/dltune-lightning-suite). Missing test dependencies are installed
# with pip within the bounds of Lightning's requirement files at that tag; torch and lightning are never touched.
# Exit status: 0 without regressions, 1 with (or, for --only-injected, pytest's own).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
py=${PYTHON:-python3}
repo=${LIGHTNING_REPO:-/work/.mirror/Lightning-AI+pytorch-lightning/repo}
cache_base=${DLTUNE_SUITE_CACHE:-$HOME/.cache/dltune-lightning-suite}
out=/tmp/lightning-suite
timeout_s=${DLTUNE_SUITE_TIMEOUT:-180}
quick=0
only=()
kexpr=()
extra=()

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1 ;;
        -k) kexpr=(-k "$2"); shift ;;
        --out) out=$2; shift ;;
        --only-injected)
            shift
            while [ $# -gt 0 ] && [ "${1:0:2}" != "--" ] && [ "$1" != "-k" ]; do only+=("$1"); shift; done
            [ ${#only[@]} -gt 0 ] || { echo "--only-injected needs test node ids" >&2; exit 2; }
            continue ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

# ---------------------------------------------------------------- the tests, at the matching tag
if [ -e "$repo/.git" ]; then git_=(git -C "$repo"); else git_=(git --git-dir="$repo"); fi
"${git_[@]}" rev-parse --git-dir >/dev/null 2>&1 || { echo "LIGHTNING_REPO=$repo is not a git repository" >&2; exit 2; }
version=$("$py" -c "import lightning; print(lightning.__version__)")
torch_version=$("$py" -c "import torch; print(torch.__version__)")
if [ -n "${LIGHTNING_TAG:-}" ]; then
    tag=$LIGHTNING_TAG
elif "${git_[@]}" rev-parse -q --verify "refs/tags/$version" >/dev/null; then
    tag=$version
else
    majmin=$(echo "$version" | cut -d. -f1,2)
    tag=$("${git_[@]}" tag -l "$majmin.*" | grep -E "^$majmin\.[0-9]+$" | sort -V | tail -1 || true)
    [ -n "$tag" ] || { echo "no tag $version nor $majmin.* in $repo" >&2; exit 2; }
fi
suite=$cache_base/$tag
if [ ! -f "$suite/.complete" ]; then
    echo "== extracting tests/tests_pytorch at $tag from $repo into $suite"
    rm -rf "$suite"
    mkdir -p "$suite"
    # git may warn about blobs outside these paths missing from a partial mirror; the paths asked for must be there
    "${git_[@]}" archive "$tag" tests/tests_pytorch pyproject.toml requirements/pytorch 2>"$suite/.archive.err" \
        | tar -x -C "$suite"
    [ -f "$suite/tests/tests_pytorch/conftest.py" ] || { cat "$suite/.archive.err" >&2; exit 2; }
    touch "$suite/.complete"
fi
echo "== lightning $version (tests at tag $tag), torch $torch_version, tests in $suite"
dltune_rev=$(git -C "$root" describe --always --dirty 2>/dev/null || echo "not a git checkout")
echo "== lightning_dltune from $root ($dltune_rev)"

# ---------------------------------------------------------------- test dependencies the selection needs
# module:requirement name; the version bounds come from requirements/pytorch/{test,extra}.txt at the tag
deps=(cloudpickle:cloudpickle sklearn:scikit-learn tensorboard:tensorboard tensorboardX:tensorboardX
      omegaconf:omegaconf yaml:pyyaml pytest_timeout:pytest-timeout)
missing=()
for d in "${deps[@]}"; do
    mod=${d%%:*} name=${d#*:}
    if ! "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$mod') is None)"; then
        spec=$(grep -h -i -E "^$name([ <>=!~;]|$)" "$suite"/requirements/pytorch/*.txt 2>/dev/null | head -1 \
               | sed 's/#.*//; s/[[:space:]]*$//' || true)
        missing+=("${spec:-$name}")
    fi
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing ${missing[*]}"
    constraints=$(mktemp)
    "$py" -c "import torch, lightning; print(f'torch=={torch.__version__}\nlightning=={lightning.__version__}')" >"$constraints"
    "$py" -m pip install -q -c "$constraints" "${missing[@]}"
    rm -f "$constraints"
    now=$("$py" -c "import torch; print(torch.__version__)")
    [ "$now" = "$torch_version" ] || { echo "pip changed torch $torch_version -> $now" >&2; exit 2; }
fi

# ---------------------------------------------------------------- the selection
# paths relative to $suite/tests; CPU-only, no standalone (multi-process ddp) tests, no downloads
full=(
    tests_pytorch/loops                                   # less the two unit-test files ignored below
    tests_pytorch/trainer/connectors/test_data_connector.py
    tests_pytorch/trainer/test_dataloaders.py
    tests_pytorch/trainer/flags
    tests_pytorch/trainer/test_trainer.py                 # includes ddp_spawn on CPU
    tests_pytorch/checkpointing/test_model_checkpoint.py
    tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py
    tests_pytorch/checkpointing/test_trainer_checkpoint.py
    tests_pytorch/checkpointing/test_torch_saving.py
    tests_pytorch/models/test_restore.py
    tests_pytorch/models/test_cpu.py
    tests_pytorch/strategies/test_ddp.py
    tests_pytorch/strategies/test_ddp_integration.py      # the CPU ones; most need GPUs or standalone
    tests_pytorch/strategies/launchers/test_multiprocessing.py
    tests_pytorch/trainer/logging_/test_distributed_logging.py
    tests_pytorch/callbacks/test_early_stopping.py        # includes ddp_spawn on CPU
    tests_pytorch/callbacks/test_model_checkpoint_edge_cases.py
    tests_pytorch/callbacks/test_model_checkpoint_additional_cases.py
    tests_pytorch/callbacks/test_prediction_writer.py
    tests_pytorch/callbacks/test_timer.py
    --ignore=tests_pytorch/loops/test_fetchers.py         # 98 parametrized fetcher unit tests
    --ignore=tests_pytorch/loops/test_progress.py         # progress-counter unit tests, no Trainer
)
# ~60 tests: a few whole files plus one or more tests of each kind of regression the full run has found
# (pickling for ddp_spawn, torch.save and deepcopy; files in checkpoint dirs; overfit_batches; logged metrics)
quick_sel=(
    tests_pytorch/trainer/flags/test_overfit_batches.py
    tests_pytorch/trainer/flags/test_fast_dev_run.py
    tests_pytorch/loops/test_evaluation_loop.py
    tests_pytorch/checkpointing/test_torch_saving.py
    tests_pytorch/checkpointing/test_trainer_checkpoint.py
    tests_pytorch/trainer/logging_/test_distributed_logging.py
    tests_pytorch/loops/test_loops.py::test_workers_are_shutdown
    tests_pytorch/loops/test_loops.py::test_loop_hierarchy
    tests_pytorch/loops/test_training_epoch_loop.py::test_should_stop_triggers_validation_once
    tests_pytorch/models/test_cpu.py::test_multi_cpu_model_ddp
    tests_pytorch/models/test_restore.py::test_callbacks_state_fit_ckpt_path
    tests_pytorch/checkpointing/test_model_checkpoint.py::test_model_checkpoint_every_n_epochs
    tests_pytorch/trainer/test_trainer.py::test_trainer_pickle
    tests_pytorch/trainer/test_dataloaders.py::test_train_dataloader_passed_to_fit
    tests_pytorch/trainer/connectors/test_data_connector.py::test_dataloader_persistent_workers_performance_warning
)

mkdir -p "$out"
export PYTHONPATH="$here:$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset DLTUNE_SUITE_OWNER DLTUNE_INJECT
pytest_args=(-p lightning_suite_plugin -p no:cacheprovider -q --color=no -rfE --tb=short
             --timeout="$timeout_s" -c "$suite/pyproject.toml" --rootdir="$suite/tests")

# run NAME INJECT TEST...: pytest in $suite/tests, output to $out/NAME.log (and the terminal)
run() {
    local name=$1 inject=$2
    shift 2
    echo "== $name: DLTUNE_INJECT=$inject, log $out/$name.log"
    local start rc
    start=$(date +%s)
    set +e
    (cd "$suite/tests" && DLTUNE_INJECT=$inject DLTUNE_SUITE_REPORT="$out/$name.json" \
        "$py" -m pytest "${pytest_args[@]}" --junitxml="$out/$name.xml" "${kexpr[@]}" "$@" "${extra[@]}") \
        2>&1 | tee "$out/$name.log"
    rc=${PIPESTATUS[0]}
    set -e
    elapsed=$(( $(date +%s) - start ))
    echo "== $name: pytest exit $rc, $elapsed s" | tee -a "$out/$name.log"
    return 0
}

if [ ${#only[@]} -gt 0 ]; then
    ids=()
    for id in "${only[@]}"; do ids+=("${id#tests/}"); done
    pytest_args+=(--tb=long)
    set +e
    (cd "$suite/tests" && DLTUNE_INJECT=1 DLTUNE_SUITE_REPORT="$out/only-injected.json" \
        "$py" -m pytest "${pytest_args[@]}" -rA "${kexpr[@]}" "${ids[@]}" "${extra[@]}") 2>&1 | tee "$out/only-injected.log"
    rc=${PIPESTATUS[0]}
    echo "== log $out/only-injected.log"
    exit "$rc"
fi

if [ $quick = 1 ]; then sel=("${quick_sel[@]}"); else sel=("${full[@]}"); fi
run baseline 0 "${sel[@]}"
base_s=$elapsed
run injected 1 "${sel[@]}"
inj_s=$elapsed
echo "== logs: $out/baseline.log $out/injected.log (reports: $out/{baseline,injected}.{json,xml})"
"$py" "$here/lightning_suite_compare.py" "$out/baseline.json" "$out/injected.json" --times "$base_s" "$inj_s" \
    | tee "$out/summary.txt"
exit "${PIPESTATUS[0]}"
