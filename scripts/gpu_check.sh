#!/usr/bin/env bash
# Everything that needs the GPU, in device calls of <= 10 minutes each (the device machine has
# torch/triton but no installs; the GPU tests take ~7 minutes, the bench its budget + ~1 minute):
#   bash scripts/gpu_check.sh tests
#   bash scripts/gpu_check.sh aoti
#   BENCH_BUDGET=380 bash scripts/gpu_check.sh bench
# Wheels carried in .whl/ (expecttest for the inline kernel-list expectation) are installed to /tmp/site.
# Logs and bench results go to $OUT (or out/ here).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
# Inductor builds AOTInductor libraries with $CXX; a compiler that links libstdc++ statically (the H200
# machine's CXX=/opt/gcc/bin/g++) makes packages that crash their loader: use a verified one.
if cxx=$(python3 -c "from mm3_compile import deploy; print(deploy.verified_compiler())"); then
  export CXX=$cxx
else
  echo "no C++ compiler that links libstdc++ dynamically: AOTInductor packages will be refused"
fi
export PYTHONUNBUFFERED=1
case "${1:-tests}" in
  tests)
    # -v: a log cut short by the time limit still names every finished test.  The AOTInductor test
    # (~110 s on the device machine) has its own mode.
    timeout 420 python3 -m pytest -v -p no:cacheprovider --durations=15 -m gpu -k "not aoti" tests >"$out/gpu_tests.log" 2>&1
    # not GPU-marked (it runs on CPU in CI too); on CUDA it adds prefill length 4096
    timeout 110 python3 -m pytest -v -p no:cacheprovider \
      "tests/test_lowerings.py::test_every_op_compiles_once_and_matches_eager" >>"$out/gpu_tests.log" 2>&1
    grep -E "(FAILED|ERROR|SKIPPED)|passed|failed" "$out/gpu_tests.log" | tail -30 ;;
  aoti)
    timeout 300 python3 -m pytest -v -p no:cacheprovider -rs -m gpu -k aoti tests >"$out/gpu_aoti.log" 2>&1
    tail -5 "$out/gpu_aoti.log" ;;
  bench)
    budget=${BENCH_BUDGET:-380}
    timeout $((budget + 120)) python3 bench/run.py --budget-s "$budget" --out "$out/bench" >"$out/bench.log" 2>&1
    tail -15 "$out/bench.log" ;;
  *) echo "usage: $0 tests|aoti|bench" >&2; exit 2 ;;
esac
