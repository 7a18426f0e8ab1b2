#!/usr/bin/env bash
# Everything that needs the GPU, in one device call (the device machine has torch/triton but no installs):
#   BENCH_BUDGET=250 bash scripts/gpu_check.sh
# Wheels carried in .whl/ (expecttest for the inline kernel-list expectation) are installed to /tmp/site.
# Logs and bench results go to $OUT (or out/ here).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
budget=${BENCH_BUDGET:-250}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
export PYTHONUNBUFFERED=1
timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests \
  "tests/test_lowerings.py::test_every_op_compiles_once_and_matches_eager" >"$out/gpu_tests.log" 2>&1
grep -E "^FAILED|^ERROR|passed|failed" "$out/gpu_tests.log" | tail -30
timeout $((budget + 80)) python3 bench/run.py --budget-s "$budget" --out "$out/bench" >"$out/bench.log" 2>&1
tail -15 "$out/bench.log"
