# Session 45's last call: on an H200 the before/after decode bench (as .gpu/s46.sh); on an H100 the GPU tests of the
# kernel families and the AOTInductor test on the current tree (the lowerings and models ran earlier this session).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=0
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $name"
if echo "$name" | grep -q H200; then
  bash .gpu/before_after.sh 170 200
  exit 0
fi
OUT=$OUT bash scripts/gpu_check.sh kernel-tests
OUT=$OUT bash scripts/gpu_check.sh aoti
