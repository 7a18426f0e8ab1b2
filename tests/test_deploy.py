"""The libstdc++ check of AOTInductor packages, on real ELF files built here with g++.

A shared object linked with ``-static-libstdc++`` carries a private libstdc++ (what the H200 machine's
``CXX=/opt/gcc/bin/g++`` produced, crashing the package loader); a normal one needs ``libstdc++.so``.
"""

import shutil
import stat
import subprocess
import zipfile

import pytest
import torch

from mm3_compile import deploy

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


@pytest.mark.slow  # two CPU AOTInductor builds: minutes on a loaded 2-core machine
@needs_gxx
def test_package_built_with_a_static_libstdcxx_is_refused_and_deleted(tmp_path):
    """A real CPU AOTInductor package linked by the static-libstdc++ compiler: refused, the error names
    the compiler and the fix, and no package file is left behind; the same package built with g++ passes."""
    wrapper = static_gxx(tmp_path)
    build(tmp_path, "can_link_static.so", "-static-libstdc++")
    x = torch.randn(4, 8)
    exported = torch.export.export(Doubler(), (x,), strict=False)
    path = tmp_path / "static.pt2"
    refused = pytest.raises(RuntimeError, match=r"private copy of libstdc\+\+.*static-gxx.*cpp\.cxx.*CXX=")
    with torch._inductor.config.patch({"cpp.cxx": (str(wrapper),)}), refused:
        deploy.package(exported, path, "cpu")
    assert not path.exists()
    with torch._inductor.config.patch({"cpp.cxx": (GXX,)}):
        good = deploy.package(exported, tmp_path / "shared.pt2", "cpu")
    with zipfile.ZipFile(good) as archive:
        libraries = [n for n in archive.namelist() if n.endswith(".so")]
        assert libraries
        for name in libraries:
            assert deploy.read_shared_library(archive.read(name), name).private_libstdcxx() == []
    torch.testing.assert_close(deploy.load(good, "cpu")(x), Doubler()(x))
