"""Register caps of our kernels under Inductor: the compile options its user-kernel path drops, restored."""

import functools
import pickle
import types

import pytest
import torch
import triton
from torch._inductor import async_compile, codecache
from torch._inductor.runtime import triton_heuristics

import mm3_compile
from mm3_compile import lowerings
from mm3_compile.kernels import _launch
from mm3_compile.kernels.moe import gemm as gemm_kernels
from mm3_compile.kernels.moe.schedule import schedule
from tests.python_process import run_python

pytestmark = pytest.mark.skipif(not lowerings.supported(), reason="lowerings are off outside SUPPORTED_TORCH")


def compile_options(constants: dict, device_type: str = "cuda") -> dict:
    autotuner = types.SimpleNamespace(device_props=types.SimpleNamespace(type=device_type))
    meta = {"num_warps": 8, "num_stages": 4, "debug": False, "constants": constants}
    return triton_heuristics.CachingAutotuner._create_compile_options(autotuner, triton.Config({}), meta)


def test_register_cap_constexpr_becomes_the_maxnreg_option():
    assert compile_options({"MAXNREG": 128, "BLOCK_M": 128})["maxnreg"] == 128
    assert "maxnreg" not in compile_options({"MAXNREG": 0})  # 0: no cap
    assert "maxnreg" not in compile_options({"BLOCK_M": 128})  # a kernel without the constexpr: untouched
    assert "maxnreg" not in compile_options({"MAXNREG": 128}, device_type="hip")


def test_gemm2_prefill_schedule_carries_a_cap_into_the_kernel_arguments(monkeypatch):
    config = schedule(32768, 6144, 3072, 128, False, x_mx=True)
    assert (config.num_warps, config.maxnreg) == (8, 128)
    assert schedule(32768, 6144, 6144, 128, False).maxnreg is None  # GEMM1 keeps ptxas's choice
    seen = {}

    class Kernel:
        arg_names = gemm_kernels._mxfp8_gemm_kernel.arg_names
        __name__ = "kernel"

        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(kwargs)

    monkeypatch.setattr(torch.library, "wrap_triton", lambda kernel: kernel)
    monkeypatch.setattr(_launch.platform, "interpreting", lambda: False)
    _launch.launch(Kernel(), (1,), maxnreg=128)
    assert seen == {"MAXNREG": 128, "maxnreg": 128}  # eager: Triton's option and the constexpr
    seen.clear()
    with _launch.traced_launches():
        _launch.launch(Kernel(), (1,), maxnreg=128)
    assert seen == {"MAXNREG": 128}  # traced: the constexpr only (wrap_triton has no maxnreg)
    with pytest.raises(ValueError, match="^maxnreg: kernel"):
        _launch.launch(types.SimpleNamespace(arg_names=["x"], __name__="plain"), (1,), maxnreg=128)


WORKER = """
import pickle, sys
from torch._inductor.runtime import triton_heuristics
job = pickle.loads(bytes.fromhex(sys.argv[1]))  # what Inductor's compile worker receives
print(job.func.__module__, getattr(triton_heuristics.CachingAutotuner._create_compile_options, "mm3_register_cap", False))
"""


def test_compile_workers_import_the_options_hook_with_their_job():
    """A worker process receives a pickled reference to the kernel loader: it points at this package, so the
    worker imports ``mm3_compile`` (and installs the hook) before it compiles anything."""
    assert async_compile._load_triton_kernel_from_source.__module__ == "mm3_compile.lowerings.kernel_options"
    job = functools.partial(async_compile._load_triton_kernel_from_source, "kernel", "source")
    proc = run_python(WORKER, pickle.dumps(job).hex())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["mm3_compile.lowerings.kernel_options", "True"]
    assert codecache._load_triton_kernel_from_source is not async_compile._load_triton_kernel_from_source


def capped_launchers(prefix: str) -> list:
    """Launchers of the kernels named ``prefix*`` with a ``MAXNREG`` cap, in the modules Inductor has loaded."""
    cache = codecache.PyCodeCache
    modules = list(cache.modules) + list(getattr(cache, "modules_no_attr", {}).values())
    found = []
    for module in modules:
        for name, value in vars(module).items():
            if name.startswith(prefix) and isinstance(value, triton_heuristics.CachingAutotuner):
                if value.triton_meta.get("constants", {}).get("MAXNREG"):
                    found.extend(value.launchers)
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("compile_threads", [1, 4])
def test_gpu_compiled_gemm2_prefill_runs_capped(compile_threads, device):
    """GEMM2's prefill tile compiled by Inductor, in process and in its compile workers: 128 registers at most
    (two 8-warp programs per SM) and the eager launch's bits."""
    torch.manual_seed(0)
    E, k, T, N, K = 8, 2, 2048, 256, 512  # 512 pairs per expert: the prefill schedule
    v, s = torch.ops.mm3.mxfp8_quantize(torch.randn(E, N, K, device=device, dtype=torch.bfloat16) / K**0.5)
    x, xs = torch.ops.mm3.mxfp8_quantize(torch.randn(T * k, K, device=device, dtype=torch.bfloat16))
    ids = torch.rand(T, E, device=device).topk(k, dim=-1).indices
    w = torch.rand(T * k, device=device)

    def gemm2(x, xs, ids, w):
        pairs, blocks = torch.ops.mm3.moe_align(ids, E, 256)
        return torch.ops.mm3.mxfp8_grouped_gemm(x, v, s, pairs, blocks, 256, 1, xs, w)

    assert schedule(T * k, N, K, E, False, x_mx=True).maxnreg == 128
    torch._dynamo.reset()
    with torch._inductor.config.patch(compile_threads=compile_threads, fx_graph_cache=False):
        compiled = torch.compile(gemm2, fullgraph=True, options=mm3_compile.compile_options())
        got = compiled(x, xs, ids, w)
    torch.testing.assert_close(got, gemm2(x, xs, ids, w), rtol=0, atol=0)
    launchers = capped_launchers("_mxfp8_gemm_kernel")
    assert launchers, "no compiled _mxfp8_gemm_kernel with a register cap found"
    assert all(0 < launcher.n_regs <= 128 for launcher in launchers), [launcher.n_regs for launcher in launchers]
