# Session 45's H200 attempts (fresh machine each): on an H200 the before/after decode bench (issue 26's table on its
# card) and the target rows; on an H100 print the card and stop (the sanitizer ran on an H100 this session).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=0
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $name; tree $(git rev-parse --short HEAD 2>/dev/null || cat .gpu/TREE)"
if echo "$name" | grep -q H200; then
  bash .gpu/before_after.sh 170 200
  PYTHONPATH=/tmp/site timeout 100 python3 .gpu/target_rows.py
fi
