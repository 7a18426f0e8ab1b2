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
    import mm3_compile.kernels.sparse_attn.common  # noqa: F401  (the namespaced names do import)
    import mm3_compile.lowerings  # noqa: F401
