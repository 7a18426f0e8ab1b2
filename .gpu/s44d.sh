# Session 44, last call: on an H200 the target rows; on an H100 the one-block B1 stage A/B.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=0
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $name; tree $(cat .gpu/TREE 2>/dev/null)"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
if echo "$name" | grep -q H200; then timeout 150 python3 .gpu/target_rows.py; else timeout 150 python3 .gpu/b1_stages.py; fi
