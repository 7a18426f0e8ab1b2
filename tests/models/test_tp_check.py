"""scripts/tp_check.py under torchrun with gloo at tiny size: the multi-GPU check's code path, on CPU in CI."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.interpreter
def test_tp_check_script_runs_with_gloo(tmp_path):
    out = tmp_path / "tp.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.join(REPO, "scripts", "tp_check.py"),
        "--config",
        "tiny",
        "--batch",
        "2",
        "--prompt",
        "16",
        "--steps",
        "1",
        "--backend",
        "eager",
        "--no-rerun",
        "--out",
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert report["graph_breaks"] == 0 and report["recompiles"] == 0
    # prefill and decode graphs, 2 all-reduces per layer each (tiny: 2 layers), each with its wait
    assert report["collectives"] == {"_c10d_functional.all_reduce": 8, "_c10d_functional.wait_tensor": 8}
    assert report["per_token_median"] < 3e-2 and report["ok"] and all(report["checks"].values())
    assert "PASS recompiles == 0" in proc.stdout
