# Session 45: on an H200 the before/after decode bench and the target rows (as .gpu/s46.sh); on an H100 one-block
# FP8 B1 programs in 3 and 4 stages against the plan's 1 (the compiled FP8 B1 row, whose symbolic split takes 3
# stages, came out 0.18 us under eager in session 44's bench).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=0
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $name"
if echo "$name" | grep -q H200; then
  bash .gpu/before_after.sh 170 200
  PYTHONPATH=/tmp/site timeout 100 python3 .gpu/target_rows.py
  exit 0
fi
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 .gpu/b1_stages.py 4x3 4x4
