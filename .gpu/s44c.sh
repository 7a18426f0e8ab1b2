# Session 44: on an H200 the target rows and the decode bench; on an H100 the AOTInductor test (exported
# graphs have symbolic splits, which now read FP8 V as pairs) and the compile-once test.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=0
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $name; tree $(cat .gpu/TREE 2>/dev/null)"
if echo "$name" | grep -q H200; then
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
  timeout 120 python3 .gpu/target_rows.py
  python3 bench/run.py --families decode --budget-s 200 --out "$OUT/results" --no-readme 2>&1 | tail -4
  exit 0
fi
bash scripts/gpu_check.sh aoti
timeout 160 python3 -m pytest -q -p no:cacheprovider -W ignore \
  "tests/lowerings/test_lowerings.py::test_every_op_compiles_once_and_matches_eager" 2>&1 | tail -3
