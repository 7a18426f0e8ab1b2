"""AOTInductor packages that remember the FP8 platform they were traced for.

``package`` compiles an exported program with AOTInductor (on a GPU the mm3 kernels are
compiled into the package: it runs without Python or this library) and stamps the dtype
authority's answers into the package metadata. ``load`` refuses a package whose FP8 answers
differ from those of the device it is loaded on: bytes written as e4m3fnuz and read as e4m3fn
decode 2x too large (upstream #45562), which no runtime error would reveal.

``package`` also never hands out a package whose compiled library cannot load.  A C++ compiler
that links libstdc++ statically into shared objects (``-static-libstdc++``, e.g. a GCC wrapper
that makes binaries portable) gives the package's ``wrapper.so`` a private libstdc++ copy: no
``libstdc++.so`` among its ``NEEDED`` entries, ``std::locale`` internals defined inside it.  The
process that loads it already runs the system libstdc++ (torch needs it), and two copies in one
process crash at load time (H200 machine, ``CXX=/opt/gcc/bin/g++``: a segfault in ``std::regex``
under ``parse_device_str``, while the same package built with ``/usr/bin/g++`` loads and runs).
After building, every shared library in the package is read (a small ELF reader, no binutils
needed) and a package with a private copy is deleted and refused with the compiler's name;
:func:`verified_compiler` finds a compiler that links libstdc++ dynamically, to put in ``CXX`` or
``torch._inductor.config.cpp.cxx``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import subprocess
import tempfile
import zipfile

import torch

from mm3_compile import platform

STAMP_KEYS = ("mm3_compile.platform", "mm3_compile.fp8_e4m3", "mm3_compile.fp8_e5m2")


def platform_stamp(device: torch.device | str) -> dict[str, str]:
    p = platform.platform_for(torch.device(device))
    return dict(zip(STAMP_KEYS, (p.target, str(p.fp8_e4m3), str(p.fp8_e5m2))))


def check_platform(metadata: dict[str, str], device: torch.device | str) -> None:
    """Raise when a package stamped by ``platform_stamp`` was traced for other FP8 encodings."""
    missing = [k for k in STAMP_KEYS if k not in metadata]
    if missing:
        raise ValueError(
            f"package metadata: no mm3_compile platform stamp ({', '.join(missing)}); package it with mm3_compile.deploy.package"
        )
    here = platform_stamp(device)
    if any(metadata[k] != here[k] for k in STAMP_KEYS[1:]):
        raise RuntimeError(
            f"this package was traced for platform {metadata[STAMP_KEYS[0]]} (e4m3 {metadata[STAMP_KEYS[1]]}, "
            f"e5m2 {metadata[STAMP_KEYS[2]]}) but {torch.device(device)} is {here[STAMP_KEYS[0]]} (e4m3 "
            f"{here[STAMP_KEYS[1]]}, e5m2 {here[STAMP_KEYS[2]]}): its FP8 bytes would be decoded with the wrong "
            "encoding; re-export and package it on (or emulating) this platform"
        )


def package(
    exported: torch.export.ExportedProgram, path: str | os.PathLike, device: torch.device | str, **inductor_configs
) -> str:
    """``aoti_compile_and_package`` with the platform of ``device`` recorded in the package metadata.

    ``device`` must be the one the program was exported on: its kernels are compiled for it.

    Args:
        exported: a ``torch.export`` program (``mm3`` ops stay ``torch.ops.mm3.*`` nodes until AOTInductor).
        path: where to write the ``.pt2`` package.
        device: the device the program was exported on.
        **inductor_configs: passed to ``aoti_compile_and_package`` (``aot_inductor.metadata`` is merged).

    Returns:
        The package path. A package whose shared library carries a private libstdc++ is deleted and refused
        (``RuntimeError`` naming the compiler; see :func:`verified_compiler`).

    Examples:
        >>> exported = torch.export.export(module, args, strict=False)  # doctest: +SKIP
        >>> path = deploy.package(exported, "step.pt2", "cuda")  # doctest: +SKIP
    """
    device = torch.device(device)
    traced_on = {
        node.meta["val"].device.type
        for node in exported.graph.nodes
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor)
    }
    if traced_on and traced_on != {device.type}:
        raise ValueError(f"device: the program was exported on {sorted(traced_on)} tensors, got device {device}")
    metadata = {**inductor_configs.pop("aot_inductor.metadata", {}), **platform_stamp(device)}
    built = torch._inductor.aoti_compile_and_package(
        exported, package_path=os.fspath(path), inductor_configs={"aot_inductor.metadata": metadata, **inductor_configs}
    )
    try:
        check_package_libraries(built)
    except RuntimeError:
        os.remove(built)  # a package that would crash its loader is not handed out
        raise
    return built


def package_metadata(path: str | os.PathLike, model_name: str = "model") -> dict[str, str]:
    """The metadata AOTInductor recorded for ``model_name`` in a package, read without loading its library."""
    where = os.fspath(path)
    try:
        with zipfile.ZipFile(path) as archive:
            folder = f"data/aotinductor/{model_name}/"
            names = sorted(
                (n for n in archive.namelist() if folder in n and n.endswith("metadata.json")),
                key=lambda n: "wrapper" not in n,
            )
            if not names:
                raise ValueError(
                    f"{where}: no AOTInductor model {model_name!r} (no data/aotinductor/{model_name}/*metadata.json)"
                )
            text = archive.read(names[0])
    except zipfile.BadZipFile:
        raise ValueError(f"{where}: not a zip archive (an AOTInductor .pt2 package)") from None
    try:
        metadata = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: {names[0]} is not valid JSON ({e})") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: {names[0]} holds a {type(metadata).__name__}, expected a JSON object")
    return metadata


def load(path: str | os.PathLike, device: torch.device | str | None = None):
    """Load an AOTInductor package's model ``model`` (what ``aoti_load_package`` loads) after checking
    its platform stamp against ``device`` (default: the device type it was compiled for).

    The stamp is checked before the package's library is loaded: a refused package never runs code.

    Args:
        path: a package written by :func:`package`.
        device: where to run it, of the device type it was compiled for (another type is refused); default:
            that type.

    Returns:
        The loaded model, called with the exported program's inputs.

    Examples:
        >>> step = deploy.load("step.pt2")  # doctest: +SKIP
        >>> outputs = step(*args)  # doctest: +SKIP
    """
    metadata = package_metadata(path, "model")
    built_for = torch.device(metadata.get("AOTI_DEVICE_KEY", "cpu")).type
    device = torch.device(device if device is not None else built_for)
    if device.type != built_for:
        # the package's kernels run where they were compiled for whatever device is asked (only an index is
        # passed on): a CUDA package asked to run on the CPU would still run on the GPU
        raise ValueError(f"device: the package was compiled for {built_for}, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device}: the package runs on a GPU and none is available here")
    check_platform(metadata, device)
    index = device.index if device.index is not None else -1
    return torch._inductor.aoti_load_package(os.fspath(path), device_index=index)


# ---------------------------------------------------------------------------------------------------
# Shared libraries inside a package: a private libstdc++ copy crashes the loading process.

# Members of std::locale (and its facet/_Impl/id classes) are defined only by the libstdc++ runtime;
# template instantiations that merely take a std::locale argument mangle with another prefix.
_LIBSTDCXX_RUNTIME_PREFIXES = ("_ZNSt6locale", "_ZNKSt6locale")
_SHT_DYNAMIC, _SHT_DYNSYM, _DT_NEEDED, _SHN_UNDEF = 6, 11, 1, 0


@dataclasses.dataclass(frozen=True)
class SharedLibrary:
    """What the dynamic loader sees of an ELF shared object."""

    needed: tuple[str, ...]  # DT_NEEDED entries, in order
    defined: frozenset[str]  # names of the defined (not undefined) dynamic symbols

    def private_libstdcxx(self) -> list[str]:
        """The libstdc++ runtime symbols this library defines itself (empty: it uses the shared one)."""
        return sorted(n for n in self.defined if n.startswith(_LIBSTDCXX_RUNTIME_PREFIXES))


def read_shared_library(data: bytes, name: str = "library") -> SharedLibrary:
    """NEEDED entries and defined dynamic symbols of an ELF file (32/64-bit, either byte order).

    Args:
        data: the file's bytes.
        name: what error messages call it.
    Returns:
        :class:`SharedLibrary`.
    Examples:
        >>> lib = read_shared_library(open("wrapper.so", "rb").read())  # doctest: +SKIP
        >>> "libstdc++.so.6" in lib.needed  # doctest: +SKIP
    """
    if data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        raise ValueError(f"{name}: not an ELF file")
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"

    def unpack(fmt: str, offset: int) -> tuple:
        try:
            return struct.unpack_from(order + fmt, data, offset)
        except struct.error:
            raise ValueError(f"{name}: truncated ELF file (a table at byte {offset} runs past its end)") from None

    if wide:
        shoff, shentsize, shnum = unpack("Q", 0x28)[0], *unpack("HH", 0x3A)
        section_fmt, dyn_fmt, sym_fmt = "IIQQQQIIQQ", "qQ", "IBBHQQ"
    else:
        shoff, shentsize, shnum = unpack("I", 0x20)[0], *unpack("HH", 0x2E)
        section_fmt, dyn_fmt, sym_fmt = "IIIIIIIIII", "iI", "IIIBBH"
    if shoff == 0 or shnum == 0:
        raise ValueError(f"{name}: the ELF file has no section headers to read its dynamic section from")
    # (type, offset, size, link, entsize) of every section
    sections = [unpack(section_fmt, shoff + i * shentsize) for i in range(shnum)]
    sections = [(s[1], s[4], s[5], s[6], s[9]) for s in sections]

    def table(kind: int):
        for sh_type, offset, size, link, entsize in sections:
            if sh_type == kind and entsize:
                strtab = sections[link]
                yield (
                    [
                        unpack(dyn_fmt if kind == _SHT_DYNAMIC else sym_fmt, offset + i * entsize)
                        for i in range(size // entsize)
                    ],
                    strtab,
                )

    def string(strtab, index: int) -> str:
        start = strtab[1] + index
        end = data.find(b"\0", start, strtab[1] + strtab[2])
        if index >= strtab[2] or end < 0:
            raise ValueError(f"{name}: a symbol name points outside its string table")
        return data[start:end].decode("utf-8", "replace")

    needed = []
    for entries, strtab in table(_SHT_DYNAMIC):
        needed += [string(strtab, value) for tag, value in entries if tag == _DT_NEEDED]
    defined = set()
    for symbols, strtab in table(_SHT_DYNSYM):
        for sym in symbols:
            st_name, st_shndx = sym[0], (sym[3] if wide else sym[5])
            if st_name and st_shndx != _SHN_UNDEF:
                defined.add(string(strtab, st_name))
    return SharedLibrary(tuple(needed), frozenset(defined))


def inductor_compiler() -> str:
    """The C++ compiler Inductor builds with (``torch._inductor.config.cpp.cxx``, from ``$CXX`` by default)."""
    from torch._inductor import cpp_builder

    return cpp_builder.get_cpp_compiler()


def check_package_libraries(path: str | os.PathLike) -> None:
    """Raise ``RuntimeError`` when a shared library in an AOTInductor package carries a private libstdc++.

    Such a library crashes the process that loads it (see the module docstring); the error names the
    compiler Inductor used and the fix."""
    where = os.fspath(path)
    with zipfile.ZipFile(path) as archive:
        libraries = {n: archive.read(n) for n in archive.namelist() if n.endswith(".so")}
    bad = {}
    for member, data in libraries.items():
        symbols = read_shared_library(data, f"{where}:{member}").private_libstdcxx()
        if symbols:
            bad[member] = symbols
    if not bad:
        return
    member, symbols = next(iter(bad.items()))
    needed = read_shared_library(libraries[member]).needed
    compiler = inductor_compiler()
    try:
        fix = f"e.g. CXX={verified_compiler()} (found by mm3_compile.deploy.verified_compiler())"
    except RuntimeError as e:
        fix = f"no such compiler found here: {e}"
    raise RuntimeError(
        f"{where}: {member} carries a private copy of libstdc++ (it defines {', '.join(symbols[:3])}, ... "
        f"{len(symbols)} std::locale symbols; NEEDED: {', '.join(needed) or 'none'}); loading it next to the "
        f"process's own libstdc++ crashes. It was linked by the C++ compiler {compiler!r} "
        "(Inductor's torch._inductor.config.cpp.cxx, set from $CXX), which links libstdc++ statically. "
        "Build with a compiler that links it dynamically: set CXX before importing torch, or "
        f"torch._inductor.config.cpp.cxx = (compiler,); {fix}. The package was deleted."
    )


_PROBE_SOURCE = """
#include <locale>
#include <regex>
#include <string>
extern "C" int mm3_probe(const char* s) { return std::regex_match(std::string(s), std::regex("cuda(:[0-9]+)?")); }
"""


def compiler_links_libstdcxx_dynamically(compiler: str) -> bool:
    """Build a small shared library (std::regex, what AOTInductor's loader calls first) with ``compiler``
    and check that it uses the shared libstdc++ instead of a private copy."""
    with tempfile.TemporaryDirectory(prefix="mm3_cxx_probe") as tmp:
        src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(_PROBE_SOURCE)
        try:
            subprocess.run(
                [compiler, "-shared", "-fPIC", "-O1", src, "-o", lib], capture_output=True, check=True, timeout=120
            )
        except (OSError, subprocess.SubprocessError):
            return False
        with open(lib, "rb") as f:
            library = read_shared_library(f.read(), lib)
    return not library.private_libstdcxx() and any(n.startswith("libstdc++") for n in library.needed)


def verified_compiler(candidates: tuple[str, ...] | None = None) -> str:
    """The first C++ compiler of ``candidates`` that links libstdc++ dynamically into shared libraries.

    Args:
        candidates: compiler names or paths; default: Inductor's configured one (``$CXX``), then
            ``g++``, ``c++``, ``/usr/bin/g++``, ``/usr/bin/c++``, ``clang++``.
    Returns:
        the compiler's absolute path, for ``CXX`` or ``torch._inductor.config.cpp.cxx``.
    Examples:
        >>> with torch._inductor.config.patch({"cpp.cxx": (verified_compiler(),)}):  # doctest: +SKIP
        ...     deploy.package(exported, "model.pt2", "cuda")
    """
    if candidates is None:
        configured = torch._inductor.config.cpp.cxx
        configured = configured if isinstance(configured, (list, tuple)) else (configured,)
        candidates = (*(c for c in configured if c), "g++", "c++", "/usr/bin/g++", "/usr/bin/c++", "clang++")
    tried = []
    for candidate in candidates:
        found = shutil.which(candidate)
        if found is None or found in tried:
            continue
        tried.append(found)
        if compiler_links_libstdcxx_dynamically(found):
            return found
    raise RuntimeError(
        f"no C++ compiler among {list(candidates)} links libstdc++ dynamically (tried {tried or 'none found'})"
    )
