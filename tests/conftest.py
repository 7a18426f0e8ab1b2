"""Test set-up: without a GPU, mm3 kernels run in the Triton interpreter.

TRITON_INTERPRET must be set before triton is first imported (torch._dynamo / _inductor import
it), so this runs before any test module imports torch.
"""

import os
import shutil
import subprocess

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the interpreter is ~3x faster single-threaded
# Inductor's FX graph cache keys neither our lowerings nor the emulated FP8 platform (the op's output
# dtype lives only in node metadata): a graph traced for sm_90 would be served to a gfx942 trace.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")


def _has_gpu() -> bool:
    if os.environ.get("MM3_TEST_DEVICE") == "cpu":
        return False
    return (
        shutil.which("nvidia-smi") is not None
        and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
        or os.path.exists("/dev/kfd")
    )


if not _has_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import mm3_compile  # noqa: E402,F401

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
# Kernels under test run on the GPU when there is one, else in the interpreter on the CPU.
DEVICE = torch.device("cuda") if GPU else torch.device("cpu")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a GPU (runs on the H200 device machine)")
    skip_interpreter = pytest.mark.skip(
        reason="runs kernels on CPU tensors, which needs the Triton interpreter (off with a GPU)"
    )
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip_gpu)
        # a gpu test in a module marked interpreter as a whole (tests/test_moe.py) runs on the GPU
        if "interpreter" in item.keywords and GPU and "gpu" not in item.keywords:
            item.add_marker(skip_interpreter)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from torch seed 0: a failure with unseeded random inputs reproduces."""
    torch.manual_seed(0)
