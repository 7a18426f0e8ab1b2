# Session 41: the decode bench of the tree before issue 26's work (67a12ab^, .gpu/before: run uninstalled, first, on a
# fresh machine so no editable install of this tree can shadow it) and of this tree, one call, one card.
# Prepare here (the tree is git-ignored): rm -rf .gpu/before && mkdir -p .gpu/before && git archive 67a12ab^ | tar -x -C .gpu/before
# Usage (carry .gpu and .whl): bash .gpu/before_after.sh BEFORE_BUDGET_S AFTER_BUDGET_S
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=0
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name --format=csv,noheader
(cd .gpu/before && python3 -c "import sys; sys.argv=['x']; sys.path.insert(0, '.'); import bench.run as r; r._prepare_environment(False); import mm3_compile.kernels as k; print('before tree:', k.__path__)")
(cd .gpu/before && python3 bench/run.py --families decode --budget-s "$1" --out "$OUT/before" --no-readme 2>&1 | tail -4)
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 bench/run.py --families decode --budget-s "$2" --out "$OUT/results" --no-readme 2>&1 | tail -4
