"""The Jupyter tour runs top to bottom: part 1 on the reference backend, part 2's ipyparallel MPI engines forming
an epjit group (their kernel cells run where there are GPUs and say they skip elsewhere)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebooks" / "epjit_tour.ipynb"


def _text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                parts.append(f"ERROR {out.get('ename')}: {out.get('evalue')}")
            parts.append(out.get("text", "") or str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def test_tour_notebook_runs(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipyparallel")
    if not (shutil.which("mpiexec") or (Path(sys.executable).parent / "mpiexec").exists()):
        pytest.skip("no mpiexec for ipyparallel's MPI engines")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = _text(nb)
    assert "ERROR" not in text, text[-4000:]
    assert "from (source rank, token): [(0, 1), (0, 4), (2, 2)]" in text, text[-4000:]
    assert "rank 1 of " in text and "(mpi)" in text, text[-4000:]  # every engine joined one MPI group
