# The next session's first call (fresh machine): on an H200 the before/after decode bench (issue 26's table on its
# card) and then the target rows; on an H100 compute-sanitizer over the pairs path (scripts/gpu_check.sh sanitize).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=0
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $name; tree $(git rev-parse --short HEAD 2>/dev/null || cat .gpu/TREE)"
if echo "$name" | grep -q H200; then
  bash .gpu/before_after.sh 170 200
  PYTHONPATH=/tmp/site timeout 100 python3 .gpu/target_rows.py
  exit 0
fi
bash scripts/gpu_check.sh sanitize
