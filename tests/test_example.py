"""The main job and the mpirun wrapper: the MoE layer example runs on the reference backend (CPU tier) and on the
GPUs (GPU tier) and agrees with a single-device layer; launch/mpirun.sh starts ranks that find each other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .gpu import placement, run_ranks
from .ranks.procs import PYTHON, clean_env, mpiexec

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("ranks", [2, 4])
def test_moe_layer_example_on_the_reference_backend(ranks):
    out = subprocess.run([sys.executable, "examples/moe_layer.py", "--cpu", "--ranks", str(ranks), "--tokens", "64"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=clean_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"ran the NumPy reference backend on {ranks} simulated ranks" in out.stdout
    assert "prefill: max relative error" in out.stdout and "decode (low latency)" in out.stdout
    assert "MISMATCH" not in out.stdout and out.stdout.count("-> OK") == 2


def test_mpirun_wrapper_starts_ranks_that_find_each_other():
    how = mpiexec(2)
    if isinstance(how, str):
        pytest.skip(how)
    (exe, *_), extra = how
    env = clean_env(**extra)
    env["PATH"] = os.pathsep.join([str(Path(exe).parent), env.get("PATH", "")])  # the mpirun beside that mpiexec
    env["PYTHON"] = PYTHON
    out = subprocess.run(["bash", "launch/mpirun.sh", "2", "tests/ranks/collectives.py", "2", "mpi"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("COLLECTIVES OK") == 2, out.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("n, shared", [pytest.param(2, False, id="2"), pytest.param(2, True, id="2-shared")])
def test_moe_layer_example_on_gpus(n, shared):
    """The README's main job on GPUs: prefill through normal mode and a decode step through low latency, each within
    bf16 rounding of the single-device layer (no poisoned outputs: the path users run)."""
    env = placement(n, shared)
    pytest.importorskip("torch")
    code, output, _ = run_ranks("launch", n, "examples/moe_layer.py", env={"EPJIT_TIMEOUT_S": "60", **env},
                                timeout=300)
    assert code == 0, output[-4000:]
    assert output.count("-> OK") == 2 and "MISMATCH" not in output, output[-4000:]
