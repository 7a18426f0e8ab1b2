#!/bin/bash
# ncu of the prefill GEMMs (main; carry [".gpu", ".whl"]; ~4 minutes): bash .gpu/ncu.sh
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 400 ncu -k regex:_mxfp8_gemm_kernel --launch-skip 6 --launch-count 6 --section SpeedOfLight \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
  python3 .gpu/ncu_prefill.py > $OUT/ncu_prefill.txt 2>&1
grep -E "GEMM|_mxfp8|Duration|Throughput|Pipe|Hit Rate|Stall|Registers|Achieved Occ|Issued" $OUT/ncu_prefill.txt | head -150
