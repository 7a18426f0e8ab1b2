#!/usr/bin/env bash
# Everything that needs the GPU, in device calls of <= 10 minutes each (the device machine has
# torch/triton but no installs; the GPU tests take two calls, the bench its budget + ~1 minute):
#   bash scripts/gpu_check.sh tests           (lowerings and models)
#   bash scripts/gpu_check.sh kernel-tests    (the kernel families' GPU tests: ~100 s for sparse_attn + ~150 s for the rest)
#   bash scripts/gpu_check.sh aoti
#   BENCH_BUDGET=380 bash scripts/gpu_check.sh bench
#   bash scripts/gpu_check.sh sanitize   (compute-sanitizer over scripts/sanitize_calls.py, ~8 minutes)
#   bash scripts/gpu_check.sh props      (tests/properties on CUDA at larger shapes)
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
    # (~110 s on the device machine) has its own mode.  All GPU tests in one call ran past 420 s (H200,
    # 2026-12-03): the kernel families' tests have their own mode.
    timeout 420 python3 -m pytest -v -p no:cacheprovider --durations=15 -m gpu -k "not aoti" tests/lowerings tests/models \
      >"$out/gpu_tests.log" 2>&1
    # not GPU-marked (it runs on CPU in CI too); on CUDA it adds prefill length 4096.  Alone on a warm H100 it
    # took 70 s (2026-12-06); after the tests above 110 s cut its second case, so it gets 160.
    timeout 160 python3 -m pytest -v -p no:cacheprovider \
      "tests/lowerings/test_lowerings.py::test_every_op_compiles_once_and_matches_eager" >>"$out/gpu_tests.log" 2>&1
    grep -E "(FAILED|ERROR|SKIPPED)|passed|failed" "$out/gpu_tests.log" | tail -30 ;;
  kernel-tests)
    timeout 420 python3 -m pytest -v -p no:cacheprovider --durations=15 -m gpu -k "not aoti" tests \
      --ignore=tests/lowerings --ignore=tests/models >"$out/gpu_kernel_tests.log" 2>&1
    grep -E "(FAILED|ERROR|SKIPPED)|passed|failed" "$out/gpu_kernel_tests.log" | tail -30 ;;
  aoti)
    timeout 300 python3 -m pytest -v -p no:cacheprovider -rs -m gpu -k aoti tests >"$out/gpu_aoti.log" 2>&1
    tail -5 "$out/gpu_aoti.log" ;;
  bench)
    budget=${BENCH_BUDGET:-380}
    timeout $((budget + 120)) python3 bench/run.py --budget-s "$budget" --out "$out/bench" >"$out/bench.log" 2>&1
    tail -15 "$out/bench.log" ;;
  sanitize)
    # compute-sanitizer over scripts/sanitize_calls.py: memcheck on every call (the caching allocator off, so
    # an access past a tensor is past its allocation), racecheck + synccheck on the split-decode merge calls.
    # A plain run first compiles every kernel (the sanitized runs then load them from Triton's cache) and
    # must finish its calls.  Needs 0 errors from every tool; the summary table is printed last.
    export PYTORCH_NO_CUDA_MEMORY_CACHING=1 MM3_VALIDATE=0
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    if [ -z "$cs" ]; then echo "sanitize: compute-sanitizer not found (PATH, /usr/local/cuda*/bin)"; exit 1; fi
    status=0
    summary=""
    timeout 150 python3 scripts/sanitize_calls.py >"$out/sanitize_plain.log" 2>&1
    rc=$?; calls=$(grep -E "^CALLS:" "$out/sanitize_plain.log" | tail -1)
    [ $rc -eq 0 ] || status=1
    summary+=$(printf '%-10s rc=%-4s %s' plain "$rc" "${calls:-no CALLS line (timeout or crash)}")$'\n'
    for spec in "memcheck 240" "racecheck 90 --merge" "synccheck 90 --merge"; do
      set -- $spec
      tool=$1 limit=$2; shift 2
      log="$out/sanitize_$tool.log"
      timeout "$limit" "$cs" --tool "$tool" --target-processes all --print-limit 50 \
        python3 scripts/sanitize_calls.py "$@" >"$log" 2>&1
      rc=$?
      # racecheck ends with "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)", the others with
      # "ERROR SUMMARY: E errors".
      errors=$(grep -E "(ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: .*\([0-9]+ error)" "$log" | tail -1 |
        grep -oE "[0-9]+ error" | grep -oE "[0-9]+")
      calls=$(grep -E "^CALLS:" "$log" | tail -1)
      if [ "$rc" -ne 0 ] || [ "${errors:-x}" != "0" ]; then status=1; fi
      summary+=$(printf '%-10s rc=%-4s errors=%-4s %s' "$tool" "$rc" "${errors:-?}" "${calls:-no CALLS line (timeout or crash)}")$'\n'
    done
    grep -hE "^(FAILED|=========.*(Invalid|Race|Barrier|ERROR SUMMARY: [1-9]|RACECHECK SUMMARY: [1-9]))" "$out"/sanitize_*.log | head -20
    printf '%s' "$summary"
    if [ $status -eq 0 ]; then echo "sanitize: 0 errors"; else echo "sanitize: FAILED (logs in $out/sanitize_*.log)"; fi
    exit $status ;;
  props)
    # The CPU property suite on CUDA tensors, at MM3_PROPS_SCALE times the shapes (tests/properties).
    MM3_PROPS_DEVICE=cuda MM3_PROPS_SCALE=${MM3_PROPS_SCALE:-8} timeout 540 python3 -m pytest -q -p no:cacheprovider \
      tests/properties >"$out/gpu_props.log" 2>&1
    rc=$?; tail -15 "$out/gpu_props.log"; exit $rc ;;
  *) echo "usage: $0 tests|kernel-tests|aoti|bench|sanitize|props" >&2; exit 2 ;;
esac
