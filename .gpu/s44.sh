# Session 44's first call: on an H200 the before/after bench (fresh machine); on an H100 the symbolic split's pairs
# A/B and the GPU tests after the split_pairs asm fold.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=0
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $name"
if echo "$name" | grep -q H200; then
  bash .gpu/before_after.sh 170 200
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 260 python3 .gpu/compiled_pairs.py
timeout 240 python3 -m pytest -q -n 4 -m gpu -k "not aoti" tests/sparse_attn 2>&1 | tail -5
