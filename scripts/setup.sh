#!/usr/bin/env bash
# One-time set-up used by `make demo` / `make test`: a .venv with torch, triton, numpy and this
# package (editable, with the test extra and, except on ROCm, the cpu extra). Without a GPU it installs the CPU build torch==2.13.0+cpu
# (from PyTorch's CPU index, or a local wheel); a plain `torch` requirement would pull a multi-GB
# CUDA build. With an NVIDIA GPU: a CUDA build of torch 2.11-2.15. ROCm: install a ROCm build of
# torch into .venv first (PyPI has none); the script keeps a torch that can see the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
stamp=.venv/.mm3-setup-done

has_nvidia() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
has_rocm() { [ -e /dev/kfd ]; }
# 0 when the installed torch matches the machine: a GPU build where there is a GPU, any build elsewhere
torch_fits() {
  if has_nvidia || has_rocm; then
    .venv/bin/python -c "import sys, torch; sys.exit(0 if torch.version.cuda or torch.version.hip else 1)" 2>/dev/null
  else
    .venv/bin/python -c "import torch" 2>/dev/null
  fi
}

[ -x .venv/bin/python ] || "$python" -m venv .venv
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ] || ! torch_fits; then
  .venv/bin/python -m pip install -q --upgrade pip
  if ! torch_fits; then
    # a torch that cannot see this machine's GPU (a +cpu build) would satisfy any version pin: replace it
    .venv/bin/python -m pip uninstall -q -y torch 2>/dev/null || true
    if has_nvidia; then
      .venv/bin/python -m pip install -q "torch>=2.11,<2.16"
    elif has_rocm; then
      echo "ROCm GPU found: install a ROCm build of torch 2.11-2.15 into .venv (see pytorch.org), then rerun" >&2
      exit 1
    else
      # a local/configured wheel first; else PyTorch's CPU index (PyPI's torch is the CUDA build)
      .venv/bin/python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null ||
        .venv/bin/python -m pip install -q "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
    fi
  fi
  # Triton comes with CUDA torch (`triton`) and ROCm torch (`pytorch-triton-rocm`, which a PyPI `triton`
  # would overwrite); the `cpu` extra adds it for CPU builds (the interpreter) and is a no-op on CUDA
  if has_rocm; then extras="test"; else extras="test,cpu"; fi
  .venv/bin/python -m pip install -q -e ".[$extras]"
  touch "$stamp"
fi
