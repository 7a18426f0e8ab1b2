"""Register caps and programmatic dependent launches of our kernels under Inductor: the compile options its
user-kernel path drops, restored."""

import functools
import logging
import pickle
import types

import pytest
import torch
import torch._higher_order_ops.triton_kernel_wrap as triton_kernel_wrap
import triton
import triton.language as tl
from torch._inductor import async_compile, codecache
from torch._inductor.runtime import triton_heuristics

import mm3_compile
from mm3_compile import lowerings
from mm3_compile.kernels import _launch
from mm3_compile.kernels.moe import gemm as gemm_kernels
from mm3_compile.kernels.moe.schedule import schedule
from mm3_compile.lowerings import kernel_options
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


def test_pdl_constexpr_becomes_the_launch_pdl_option():
    assert compile_options({"PDL": True})["launch_pdl"] is True
    assert not compile_options({"PDL": False}).get("launch_pdl", False)
    assert not compile_options({"BLOCK_M": 128}).get("launch_pdl", False)
    assert "launch_pdl" not in compile_options({"PDL": True}, device_type="hip")


def recording_kernel(arg_names):
    seen = {}

    class Kernel:
        __name__ = "kernel"

        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(kwargs)

    kernel = Kernel()
    kernel.arg_names = arg_names
    return kernel, seen


def test_pdl_travels_as_a_constexpr_into_traced_launches(monkeypatch):
    monkeypatch.setattr(torch.library, "wrap_triton", lambda kernel: kernel)
    monkeypatch.setattr(_launch.platform, "interpreting", lambda: False)
    kernel, seen = recording_kernel(["x", "PDL"])
    _launch.launch(kernel, (1,), pdl=True)
    assert seen == {"PDL": True, "launch_pdl": True}  # eager: Triton's option and the constexpr
    seen.clear()
    with _launch.traced_launches():
        _launch.launch(kernel, (1,), pdl=True)
    assert seen == {"PDL": True}  # traced: the constexpr only (wrap_triton has no launch_pdl)
    seen.clear()
    _launch.launch(kernel, (1,))
    assert seen == {"PDL": False}
    with pytest.raises(ValueError, match="^pdl: kernel kernel declares no PDL"):
        _launch.launch(recording_kernel(["x"])[0], (1,), pdl=True)


def test_access_analysis_sees_our_kernels_without_their_opaque_asm(monkeypatch):
    """Inductor's TTIR analysis of a user kernel's reads and writes cannot see through non-pure inline assembly
    (``gdc_wait``, the FP8 V tile's ordering move): our kernels are analysed as their build with those
    constexprs off; other kernels are untouched."""
    from mm3_compile.kernels.sparse_attn.union import sparse_attn_fwd_kernel

    assert triton_kernel_wrap.generate_ttir.mm3_without_opaque_asm
    seen = []
    wrapped = kernel_options._analysed_without_opaque_asm(lambda kernel, kwargs, tma: seen.append(kwargs) or "ttir")
    assert wrapped(sparse_attn_fwd_kernel, {"x": 1, "PDL": True, "CONVERT_V_FIRST": True}, {}) == "ttir"
    assert seen.pop() == {"x": 1, "PDL": False, "CONVERT_V_FIRST": False}
    wrapped(sparse_attn_fwd_kernel, {"x": 1, "PDL": False, "CONVERT_V_FIRST": True}, {})
    assert seen.pop() == {"x": 1, "PDL": False, "CONVERT_V_FIRST": False}

    @triton.jit
    def foreign(x, PDL: tl.constexpr):
        pass

    wrapped(foreign, {"x": 1, "PDL": True}, {})
    assert seen.pop() == {"x": 1, "PDL": True}


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


def compiled_autotuners(prefix: str) -> list:
    """Inductor's compiled kernels named ``prefix*``, in the modules it has loaded."""
    cache = codecache.PyCodeCache
    modules = list(cache.modules) + list(getattr(cache, "modules_no_attr", {}).values())
    return [
        value
        for module in modules
        for name, value in vars(module).items()
        if name.startswith(prefix) and isinstance(value, triton_heuristics.CachingAutotuner)
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gpu_compiled_decode_step_launches_dependently(device, kv_cache_dtype, caplog):
    """On sm_90 the compiled decode step's indexer and attention kernels are programmatic dependent launches,
    like eager ones: the constexpr is on, the compiled binaries carry ``launch_pdl``, and the outputs are
    eager's bits.  Two requests at two KV heads merge their splits in a dependent launch, itself PDL.  Inductor's
    analysis of the kernels' accesses succeeds (on failure it takes every input as written), with the FP8 V
    tile's ordering asm too."""
    from tests.every_op import EveryOp, make_batch

    if not _launch.use_pdl(device):
        pytest.skip("programmatic dependent launch needs an NVIDIA sm_90+ device")
    torch._dynamo.reset()
    module = EveryOp(num_blocks=64, D=128, kv_cache_dtype=kv_cache_dtype, device=device)
    batch = make_batch(module, [300, 700], [1, 1], device=device)
    compiled = torch.compile(module.decode, fullgraph=True)
    with torch._inductor.utils.fresh_cache(), caplog.at_level(logging.WARNING):
        got = compiled(*batch.args())
        assert "assuming every input is mutated" not in caplog.text
        for prefix in ("sparse_attn_fwd_kernel", "split_merge_kernel", "_index_score_kernel", "_index_topk_kernel"):
            autotuners = compiled_autotuners(prefix)
            assert autotuners, f"no compiled {prefix}"
            for autotuner in autotuners:
                assert autotuner.triton_meta["constants"].get("PDL"), prefix
                binaries = [result.kernel for result in autotuner.compile_results]  # Triton's, not the static launcher
                assert binaries and all(binary.metadata.launch_pdl for binary in binaries), prefix
    for g, e in zip(got, module.decode(*batch.args())):
        assert torch.equal(g.view(torch.uint8), e.view(torch.uint8))
