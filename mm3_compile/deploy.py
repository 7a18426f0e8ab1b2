"""AOTInductor packages that remember the FP8 platform they were traced for.

``package`` compiles an exported program with AOTInductor (on a GPU the mm3 kernels are
compiled into the package: it runs without Python or this library) and stamps the dtype
authority's answers into the package metadata. ``load`` refuses a package whose FP8 answers
differ from those of the device it is loaded on: bytes written as e4m3fnuz and read as e4m3fn
decode 2x too large (upstream #45562), which no runtime error would reveal.
"""

from __future__ import annotations

import json
import os
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
        raise ValueError(f"package metadata: no mm3_compile platform stamp ({', '.join(missing)}); package it with mm3_compile.deploy.package")
    here = platform_stamp(device)
    if any(metadata[k] != here[k] for k in STAMP_KEYS[1:]):
        raise RuntimeError(
            f"this package was traced for platform {metadata[STAMP_KEYS[0]]} (e4m3 {metadata[STAMP_KEYS[1]]}, "
            f"e5m2 {metadata[STAMP_KEYS[2]]}) but {torch.device(device)} is {here[STAMP_KEYS[0]]} (e4m3 "
            f"{here[STAMP_KEYS[1]]}, e5m2 {here[STAMP_KEYS[2]]}): its FP8 bytes would be decoded with the wrong "
            "encoding; re-export and package it on (or emulating) this platform"
        )


def package(exported: torch.export.ExportedProgram, path: str | os.PathLike, device: torch.device | str, **inductor_configs) -> str:
    """``aoti_compile_and_package`` with the platform of ``device`` recorded in the package metadata."""
    metadata = {**inductor_configs.pop("aot_inductor.metadata", {}), **platform_stamp(device)}
    return torch._inductor.aoti_compile_and_package(
        exported, package_path=os.fspath(path), inductor_configs={"aot_inductor.metadata": metadata, **inductor_configs}
    )


def package_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The metadata an AOTInductor package records, read from the archive without loading its library."""
    with zipfile.ZipFile(path) as archive:
        names = sorted((n for n in archive.namelist() if n.endswith("metadata.json")), key=lambda n: "wrapper" not in n)
        if not names:
            raise ValueError(f"{os.fspath(path)}: not an AOTInductor package (no *metadata.json in the archive)")
        return json.loads(archive.read(names[0]))


def load(path: str | os.PathLike, device: torch.device | str | None = None):
    """Load an AOTInductor package after checking its platform stamp against ``device``.

    The stamp is checked before the package's library is loaded: a refused package never runs code.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    check_platform(package_metadata(path), device)
    return torch._inductor.aoti_load_package(os.fspath(path))
