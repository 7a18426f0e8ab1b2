# Session 45's H200 attempts (fresh machine each): on an H200 the before/after decode bench, whose rows hold issue 26's
# target rows; on an H100 print the card and stop (the sanitizer and the GPU tests ran on an H100 this session).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=0
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $name"
if echo "$name" | grep -q H200; then
  bash .gpu/before_after.sh 170 200
fi
