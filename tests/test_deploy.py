"""mm3_compile.deploy: platform stamps, AOTInductor packages, and the libstdc++ check of their libraries.

The libstdc++ check runs on real ELF files built here with g++: a shared object linked with
``-static-libstdc++`` carries a private libstdc++ (what the H200 machine's ``CXX=/opt/gcc/bin/g++``
produced, crashing the package loader); a normal one needs ``libstdc++.so``.
"""

import json
import re
import shutil
import stat
import subprocess
import zipfile

import pytest
import torch

from mm3_compile import deploy, platform
from tests.every_op import EveryOp, make_batch
from tests.python_process import run_python

GXX = shutil.which("g++")
needs_gxx = pytest.mark.skipif(GXX is None, reason="needs g++ to build the ELF files under test")

SOURCE = """
#include <regex>
#include <string>
extern "C" int probe(const char* s) { return std::regex_match(std::string(s), std::regex("cuda(:[0-9]+)?")); }
"""


def build(tmp_path, name, *flags):
    src = tmp_path / "probe.cpp"
    src.write_text(SOURCE)
    out = tmp_path / name
    proc = subprocess.run(
        [GXX, "-shared", "-fPIC", "-O1", *flags, str(src), "-o", str(out)], check=False, capture_output=True, text=True
    )
    if proc.returncode and "-static-libstdc++" in flags:
        pytest.skip(f"g++ cannot link libstdc++ statically here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr
    return out


def static_gxx(tmp_path):
    """A compiler that links libstdc++ statically into shared objects, like the H200 machine's GCC wrapper."""
    wrapper = tmp_path / "static-gxx"
    wrapper.write_text(
        f'#!/bin/sh\ncase " $* " in *" -shared "*) exec {GXX} -static-libstdc++ "$@" ;; esac\nexec {GXX} "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return wrapper


def nm_defined(path):
    """Defined dynamic symbols as binutils' nm lists them (the reader's independent reference)."""
    proc = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    return {line.split()[-1].split("@")[0] for line in proc.stdout.splitlines() if line.strip()}


@needs_gxx
def test_reader_tells_a_private_libstdcxx_from_the_shared_one(tmp_path):
    shared = deploy.read_shared_library(build(tmp_path, "shared.so").read_bytes())
    private = deploy.read_shared_library(build(tmp_path, "private.so", "-static-libstdc++").read_bytes())
    assert any(n.startswith("libstdc++.so") for n in shared.needed) and shared.private_libstdcxx() == []
    assert not any(n.startswith("libstdc++") for n in private.needed)
    # the symbols the crash went through (std::locale::id::_M_id, the C locale, facet installation)
    symbols = private.private_libstdcxx()
    for name in ("_ZNKSt6locale2id5_M_idEv", "_ZNSt6locale5_Impl16_M_install_facetEPKNS_2idEPKNS_5facetE"):
        assert name in symbols
    assert any("_S_create_c_locale" in n for n in symbols)
    assert "probe" in shared.defined and "probe" in private.defined
    if shutil.which("nm"):
        for name in ("shared.so", "private.so"):
            assert deploy.read_shared_library((tmp_path / name).read_bytes()).defined == nm_defined(tmp_path / name)


def test_reader_refuses_what_is_not_an_elf_file(tmp_path):
    with pytest.raises(ValueError, match="lib.so: not an ELF file"):
        deploy.read_shared_library(b"#!/bin/sh\n", "lib.so")
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    header[0x28:0x30] = (1 << 20).to_bytes(8, "little")  # section headers past the end of the file
    header[0x3A:0x3E] = (64).to_bytes(2, "little") + (3).to_bytes(2, "little")
    with pytest.raises(ValueError, match="cut.so: truncated ELF file"):
        deploy.read_shared_library(bytes(header), "cut.so")


@needs_gxx
def test_compiler_probe_and_verified_compiler(tmp_path):
    wrapper = static_gxx(tmp_path)
    build(tmp_path, "can_link_static.so", "-static-libstdc++")  # skips where libstdc++.a is missing
    assert deploy.compiler_links_libstdcxx_dynamically(GXX)
    assert not deploy.compiler_links_libstdcxx_dynamically(str(wrapper))
    assert not deploy.compiler_links_libstdcxx_dynamically(str(tmp_path / "no-such-compiler"))
    assert deploy.verified_compiler((str(wrapper), GXX)) == GXX
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler among .*static-gxx.* links libstdc\\+\\+ dynamically"):
        deploy.verified_compiler((str(wrapper),))


class Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1


@pytest.mark.slow  # a CPU AOTInductor build: a minute or more on a loaded 2-core machine
@needs_gxx
def test_package_built_with_a_static_libstdcxx_is_refused_and_deleted(tmp_path):
    """A real CPU AOTInductor package linked by the static-libstdc++ compiler: refused, the error names
    the compiler and the fix, and no package file is left behind (a package built with g++ passes: the
    stamp test below)."""
    wrapper = static_gxx(tmp_path)
    build(tmp_path, "can_link_static.so", "-static-libstdc++")
    x = torch.randn(4, 8)
    exported = torch.export.export(Doubler(), (x,), strict=False)
    path = tmp_path / "static.pt2"
    refused = pytest.raises(RuntimeError, match=r"private copy of libstdc\+\+.*static-gxx.*cpp\.cxx.*CXX=")
    with torch._inductor.config.patch({"cpp.cxx": (str(wrapper),)}), refused:
        deploy.package(exported, path, "cpu")
    assert not path.exists()


def test_deploy_refuses_other_fp8_platform():
    with platform.emulate("sm_90"):
        stamp = deploy.platform_stamp("cpu")
    with platform.emulate("gfx950"):
        deploy.check_platform(stamp, "cpu")  # both OCP: the same bytes mean the same values
    with platform.emulate("gfx942"), pytest.raises(RuntimeError, match="traced for platform sm_90.*gfx942"):
        deploy.check_platform(stamp, "cpu")
    with pytest.raises(ValueError, match="no mm3_compile platform stamp"):
        deploy.check_platform({}, "cpu")


class AtenOnly(torch.nn.Module):
    def forward(self, x):
        return (x.float() * 2).sin()


@needs_gxx
def test_deploy_package_stamp_is_checked_before_loading(tmp_path):
    """A real (CPU) AOTInductor package, built with g++ (its libraries use the shared libstdc++, so it is
    accepted): the stamp is read from the archive; a refused package is never loaded."""
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    exported = torch.export.export(AtenOnly(), (x,), strict=False)
    with platform.emulate("gfx942"), torch._inductor.config.patch({"cpp.cxx": (GXX,)}):
        path = deploy.package(exported, tmp_path / "aten.pt2", "cpu")
    with zipfile.ZipFile(path) as archive:
        libraries = [n for n in archive.namelist() if n.endswith(".so")]
        assert libraries
        for name in libraries:
            assert deploy.read_shared_library(archive.read(name), name).private_libstdcxx() == []
    assert deploy.package_metadata(path)["mm3_compile.fp8_e4m3"] == "torch.float8_e4m3fnuz"
    with platform.emulate("sm_90"), pytest.raises(RuntimeError, match="traced for platform gfx942"):
        deploy.load(path, "cpu")
    with platform.emulate("gfx942"):
        torch.testing.assert_close(deploy.load(path, "cpu")(x), AtenOnly()(x))
        torch.testing.assert_close(deploy.load(path)(x), AtenOnly()(x))  # default: the package's own device
        with pytest.raises(ValueError, match="device: the package was compiled for cpu, got meta"):
            deploy.load(path, "meta")  # another device type: refused, not run on the package's own
    with pytest.raises(ValueError, match="no AOTInductor model 'model'"):
        with zipfile.ZipFile(tmp_path / "other.zip", "w") as archive:
            archive.writestr("model/weights.bin", b"")
        deploy.package_metadata(tmp_path / "other.zip")
    # Only the loaded model's stamp counts: another model's (here first in the archive) is not read.
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp_path / "two.pt2", "w") as dst:
        prefix = src.namelist()[0].split("/")[0]
        dst.writestr(f"{prefix}/data/aotinductor/aaa/a_wrapper_metadata.json", json.dumps(deploy.platform_stamp("cpu")))
        for name in src.namelist():
            dst.writestr(name, src.read(name))
    with platform.emulate("sm_90"), pytest.raises(RuntimeError, match="traced for platform gfx942"):
        deploy.load(tmp_path / "two.pt2", "cpu")
    (tmp_path / "text.pt2").write_text("not a package")
    with pytest.raises(ValueError, match=r"text.pt2: not a zip archive"):
        deploy.load(tmp_path / "text.pt2")
    with pytest.raises(ValueError, match=r"device: the program was exported on \['cpu'\] tensors, got device meta"):
        deploy.package(exported, tmp_path / "meta.pt2", "meta")


# GPU: an AOTInductor package of every op runs in a Python that never imports mm3_compile.

AOTI_RUNNER = r"""
import sys, torch
torch.cuda.init()
inputs = torch.load(sys.argv[2])
runner = torch._inductor.aoti_load_package(sys.argv[1])
outputs = runner(*inputs)
outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
torch.save([o.cpu() for o in outputs], sys.argv[3])
assert not any(name.startswith("mm3_compile") for name in sys.modules), "the package needed mm3_compile"
"""


def run_package_in_fresh_process(path, inputs, workdir):
    """Load and run an AOTInductor package in a Python that never imports mm3_compile; its outputs on the CPU."""
    torch.save(list(inputs), workdir / "inputs.pt")
    runner = run_python(AOTI_RUNNER, str(path), str(workdir / "inputs.pt"), str(workdir / "out.pt"), cwd=workdir)
    return runner, (torch.load(workdir / "out.pt") if runner.returncode == 0 else None)


def control_package_diagnosis(tmp_path, device) -> str:
    """A control package without any mm3 op, built and run the same way: tells a toolchain problem
    (the control fails too) from one of ours, for the failure message of the mm3 package."""
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    x = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    exported = torch.export.export(AtenOnly(), (x,), strict=False)
    path = torch._inductor.aoti_compile_and_package(exported, package_path=str(control_dir / "control.pt2"))
    runner, outputs = run_package_in_fresh_process(path, (x,), control_dir)
    if runner.returncode != 0:
        return f"a package without mm3 ops fails too (exit {runner.returncode}): {runner.stderr[-1500:]}"
    ok = torch.equal(outputs[0], AtenOnly()(x).cpu())
    return f"a package without mm3 ops loads and runs ({'matches' if ok else 'DIFFERS from'} eager)"


@pytest.mark.gpu
def test_gpu_aoti_package_runs_without_mm3_compile(tmp_path, device):
    class ReadOnlyStep(torch.nn.Module):
        """Every op but the cache write (AOTI runs on caches passed in, not on module state)."""

        def forward(self, q, kv_cache, index_q, index_cache, gate_up, block_table, cu_seqlens_q, seq_lens):
            topk_idx = torch.ops.mm3.index_topk(index_q, index_cache, block_table, cu_seqlens_q, seq_lens, 2, 0, 1)
            out = torch.ops.mm3.sparse_attn_prefill(q, kv_cache, topk_idx, block_table, cu_seqlens_q, seq_lens, 0.125)
            act_values, act_scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up)
            out_values, out_scales = torch.ops.mm3.mxfp8_quantize(out.flatten(1))
            return (
                out,
                act_values.view(torch.uint8),
                act_scales.view(torch.uint8),
                out_values.view(torch.uint8),
                out_scales.view(torch.uint8),
            )

    module = EveryOp(num_blocks=32, D=64, device=device)
    batch = make_batch(module, [0, 300], [130, 40], device=device)
    module.prefill(*batch.args())  # fill the caches
    inputs = (
        batch.q,
        module.kv_cache,
        batch.index_q,
        module.index_cache,
        batch.gate_up,
        batch.block_table,
        batch.cu_seqlens_q,
        batch.seq_lens,
    )
    expected = ReadOnlyStep()(*inputs)
    exported = torch.export.export(ReadOnlyStep(), inputs, strict=False)
    # a compiler that links libstdc++ dynamically (package() refuses a library with a private copy)
    with torch._inductor.config.patch({"cpp.cxx": (deploy.verified_compiler(),)}):
        path = deploy.package(exported, tmp_path / "step.pt2", device)

    with zipfile.ZipFile(path) as archive:
        sources = "".join(
            archive.read(n).decode(errors="ignore") for n in archive.namelist() if n.endswith((".cpp", ".h"))
        )
        assert sources and "aoti_torch_proxy_executor_call_function" not in sources and "mm3::" not in sources
        attention = ("pair_keys_kernel", "kv_centric_attn_kernel", "merge_slots_kernel")
        compiled_in = (
            "_index_score_kernel",
            "_index_topk_kernel",
            *attention,
            "_swiglu_oai_mxfp8_kernel",
            "_mxfp8_quantize_kernel",
        )
        assert all(re.search(rf"call_{name}_\d+\(", sources) for name in compiled_in), (
            "a kernel is not in the C++ wrapper"
        )

    assert deploy.package_metadata(path)["mm3_compile.platform"] == "sm_90"
    with platform.emulate("gfx942"), pytest.raises(RuntimeError, match="gfx942"):
        deploy.load(path, device)  # refused before the package's library is loaded

    runner, outputs = run_package_in_fresh_process(path, inputs, tmp_path)
    if runner.returncode != 0:
        with torch._inductor.config.patch({"cpp.cxx": (deploy.verified_compiler(),)}):
            diagnosis = control_package_diagnosis(tmp_path, device)
        failure = f"the package failed in a fresh process (exit {runner.returncode}): {runner.stderr[-3000:]}"
        pytest.fail(f"{failure}\n{diagnosis}")
    for got, want in zip(outputs, expected):
        assert torch.equal(got, want.cpu())
    for got, want in zip(deploy.load(path, device)(*inputs), expected):
        assert torch.equal(got, want)
