"""The install layout: kernels/ and lowerings/ ship inside mm3_compile, never as top-level packages."""

import pathlib
import subprocess
import sys

import pytest

tomllib = pytest.importorskip("tomllib")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_source_folder_is_a_listed_package():
    """pyproject lists packages by hand: a new kernel folder missing there would import in an editable
    install but be absent from the wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    roots = {folder: name for name, folder in setuptools["package-dir"].items()}
    found = set()
    for folder, name in roots.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *relative)))
    assert found == listed, f"unlisted: {sorted(found - listed)}, listed but missing: {sorted(listed - found)}"
    assert all(name.startswith("mm3_compile") for name in listed)


def test_no_top_level_kernels_or_lowerings(tmp_path):
    probe = "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(n) for n in ('kernels', 'lowerings')))"
    assert subprocess.run([sys.executable, "-c", probe], cwd=tmp_path).returncode == 0
    import mm3_compile.kernels.sparse_attn.union  # noqa: F401  (the namespaced names do import)
    import mm3_compile.lowerings  # noqa: F401


def test_metadata_version_license_and_dependencies():
    """One version (mm3_compile.__version__, read by setuptools), a license file, and no Triton requirement
    that would fight the one a CUDA/ROCm torch brings (the ``cpu`` extra carries it for CPU builds)."""
    import importlib.metadata

    import mm3_compile

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mm3_compile.__version__"}
    assert importlib.metadata.version("mm3-compile") == mm3_compile.__version__
    assert project["project"]["license"] == "MIT" and (ROOT / "LICENSE").read_text().startswith("MIT License")
    requirements = project["project"]["dependencies"]
    assert not any(r.split(">")[0].split("=")[0].strip() == "triton" for r in requirements), requirements
    assert any(r.startswith("triton") for r in project["project"]["optional-dependencies"]["cpu"])


def test_sdist_carries_what_its_tests_import():
    """tests/test_bench.py imports bench/: the sdist must carry it (MANIFEST.in)."""
    manifest = (ROOT / "MANIFEST.in").read_text().splitlines()
    assert {"graft tests", "graft bench", "include LICENSE"} <= set(manifest)
    assert (ROOT / "bench" / "run.py").exists() and (ROOT / "tests" / "test_bench.py").exists()
