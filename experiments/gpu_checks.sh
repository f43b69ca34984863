#!/usr/bin/env bash
# The performance issue's GPU checks as one prepared run on a machine with an NVIDIA GPU: the
# checks that no GPU has run yet come first, each under a time cap, and a check whose cap no
# longer fits in the run's budget is left out (and said so), so that a run of about ten minutes
# brings back whatever it finished.
#
#   1. vector leaves' tests on the GPU (tests/test_vector_leaves.py: the accelerators' split
#      scan, damped solve and level histograms, against their NumPy references);
#   2. vector leaves' speed: the benchmark's multiclass task, jaxboost against XGBoost;
#   3. the leaf refit's segment sums (experiments/gpu_segment_sums.py, written for a GPU);
#   4. absolute error's speed with its refit (at about 1.6x XGBoost's time on an H100);
#   5. the benchmark's two main tasks, as in experiments/results/bench_gpu.md.
#
# Usage, from the repository root:  OUT=folder bash experiments/gpu_checks.sh
#   OUT                 where the log and the result files go (default experiments/results/gpu_checks)
#   GPU_CHECKS_SECONDS  the run's budget (default 540)
#   GPU_CHECKS_DEVICE   cpu: the same steps on the CPU at a tenth of the rows, to try the script
#                       itself on a machine without a GPU
# On a machine without network access, wheels left in .whl/ (XGBoost's, built for its Python)
# are installed first, into /tmp/site.

set -u
OUT=${OUT:-experiments/results/gpu_checks}
BUDGET=${GPU_CHECKS_SECONDS:-540}
DEVICE=${GPU_CHECKS_DEVICE:-gpu}
mkdir -p "$OUT"
LOG="$OUT/gpu_checks.log"
: >"$LOG"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS

say() { echo "$*" | tee -a "$LOG"; }

# step NAME CAP_SECONDS COMMAND...: the command under its cap, its output in the log; skipped
# when the cap does not fit in what is left of the budget.
step() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if ((cap > left)); then
    say "== $name: left out ($left s of the budget left, its cap is $cap s)"
    return
  fi
  say "== $name (cap $cap s): $*"
  local began=$SECONDS
  timeout "$cap" "$@" >>"$LOG" 2>&1
  local status=$?
  say "== $name: exit $status after $((SECONDS - began)) s$( ((status == 124)) && echo ' (its cap)')"
}

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

if [[ $DEVICE == gpu ]]; then
  ROWS=1000000
  TEST_ENV=()
  nvidia-smi -L >>"$LOG" 2>&1
else
  ROWS=100000
  TEST_ENV=(env JAX_PLATFORMS=cpu)
fi
python3 -c "import jax, numpy; print('jax', jax.__version__, 'numpy', numpy.__version__, jax.devices())" >>"$LOG" 2>&1
python3 -c "import xgboost; print('xgboost', xgboost.__version__)" >>"$LOG" 2>&1 || say "xgboost: not importable"

BENCH=(python3 experiments/bench.py --device "$DEVICE" --rows "$ROWS")
step "vector leaves: tests" 180 ${TEST_ENV[@]+"${TEST_ENV[@]}"} python3 -m pytest -q -x -p no:cacheprovider tests/test_vector_leaves.py
step "vector leaves: benchmark" 150 "${BENCH[@]}" --tasks multiclass --vector-leaves full --repeats 2 --rounds 50 \
  --libraries jaxboost,xgboost --output "$OUT/bench_gpu_vector_leaves.md"
step "segment sums" 90 python3 experiments/gpu_segment_sums.py --rows $((ROWS * 2 / 5)) --output "$OUT/gpu_segment_sums.md"
step "absolute error: benchmark" 120 "${BENCH[@]}" --tasks absolute_error --repeats 2 --libraries jaxboost,xgboost \
  --output "$OUT/bench_gpu_absolute_error.md"
step "main tasks: benchmark" 150 "${BENCH[@]}" --repeats 2 --libraries jaxboost,xgboost --output "$OUT/bench_gpu.md"
say "== done in $((SECONDS - START)) s of a $BUDGET s budget"
