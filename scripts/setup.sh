#!/usr/bin/env bash
# One-time set-up used by `make demo` / `make test`: a .venv with torch, triton, numpy and this
# package (editable, with the test extra). Without a GPU it takes the local CPU wheel
# torch==2.13.0; a plain `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
stamp=.venv/.mm3-setup-done

has_gpu() {
  { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; } || [ -e /dev/kfd ]
}

[ -x .venv/bin/python ] || "$python" -m venv .venv
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    if has_gpu; then
      .venv/bin/python -m pip install -q "torch>=2.11"
    else
      .venv/bin/python -m pip install -q torch==2.13.0
    fi
  fi
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
