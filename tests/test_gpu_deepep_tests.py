"""GPU tier: DeepEP V1's own test scripts (intranode, low latency, and internode as 2 virtual nodes) on epjit
through scripts/deepep_tests.py, from the DeepEP checkout DEEPEP_SOURCE names; skips without one, or with fewer than
2 GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .gpu import gpu_count

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["intranode", "low_latency", "internode"])
def test_deepeps_own_test_script_passes_on_epjit(script):
    source = os.environ.get("DEEPEP_SOURCE")
    if not source or not (Path(source) / "tests" / "utils.py").is_file():
        pytest.skip(f"DEEPEP_SOURCE does not name a DeepEP checkout with tests/ (got {source!r})")
    gpus = min(gpu_count(), 4)
    if gpus < 2:
        pytest.skip(f"needs 2 GPUs, found {gpus}")
    gpus -= gpus % 2
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "deepep_tests.py"), "--source", source,
                          "--gpus", str(gpus), "--small", "--only", script, "--timeout", "900"],
                         capture_output=True, text=True, timeout=1000)
    assert out.returncode == 0 and "PASS" in out.stdout, out.stdout[-6000:] + out.stderr[-6000:]
