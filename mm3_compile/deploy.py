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
    """``aoti_compile_and_package`` with the platform of ``device`` recorded in the package metadata.

    ``device`` must be the one the program was exported on: its kernels are compiled for it."""
    device = torch.device(device)
    traced_on = {
        node.meta["val"].device.type
        for node in exported.graph.nodes
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor)
    }
    if traced_on and traced_on != {device.type}:
        raise ValueError(f"device: the program was exported on {sorted(traced_on)} tensors, got device {device}")
    metadata = {**inductor_configs.pop("aot_inductor.metadata", {}), **platform_stamp(device)}
    return torch._inductor.aoti_compile_and_package(
        exported, package_path=os.fspath(path), inductor_configs={"aot_inductor.metadata": metadata, **inductor_configs}
    )


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
    """
    metadata = package_metadata(path, "model")
    device = torch.device(device if device is not None else metadata.get("AOTI_DEVICE_KEY", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device}: the package runs on a GPU and none is available here")
    check_platform(metadata, device)
    index = device.index if device.index is not None else -1
    return torch._inductor.aoti_load_package(os.fspath(path), device_index=index)
