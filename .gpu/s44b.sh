# Session 44: on an H200 the target rows and the decode bench (its rows for bench/results/results.csv);
# on an H100 the compiled graphs' GPU tests (symbolic splits now read V as pairs) and the decode bench.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=0
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $name; tree $(cat .gpu/TREE 2>/dev/null)"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
if echo "$name" | grep -q H200; then
  timeout 120 python3 .gpu/target_rows.py
  python3 bench/run.py --families decode --budget-s 200 --out "$OUT/results" --no-readme 2>&1 | tail -4
  exit 0
fi
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 4 -m gpu -k "not aoti" tests/lowerings tests/models 2>&1 | tail -4
python3 bench/run.py --families decode --budget-s 200 --out "$OUT/results" --no-readme 2>&1 | tail -4
