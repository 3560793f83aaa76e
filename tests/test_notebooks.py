"""The Jupyter notebooks run top to bottom. The tour: part 1 on the reference backend, part 2's ipyparallel MPI
engines forming an epjit group (their kernel cells run where there are GPUs and say they skip elsewhere). The kernel
lab: a kernel of one's own and a variant of the low-latency dispatch compiled on every engine (for sm_90 without
GPUs), launched, checked against the reference and timed beside the built-in where there are GPUs."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebooks" / "epjit_tour.ipynb"
KERNEL_LAB = ROOT / "examples" / "notebooks" / "kernel_lab.ipynb"


def _text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                parts.append(f"ERROR {out.get('ename')}: {out.get('evalue')}")
            parts.append(out.get("text", "") or str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def _run(path: Path, tmp_path: Path, timeout: int) -> str:
    """The notebook executed headless on ipyparallel's MPI engines; its outputs' text."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipyparallel")
    if not (shutil.which("mpiexec") or (Path(sys.executable).parent / "mpiexec").exists()):
        pytest.skip("no mpiexec for ipyparallel's MPI engines")
    nb = nbformat.read(path, as_version=4)
    ipython_dir = tmp_path / "ipython"  # the kernel and its engines log here (ipyparallel: profile_default/log)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("IPYTHONDIR", str(ipython_dir))
        try:
            nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                    resources={"metadata": {"path": str(tmp_path)}}).execute()
        except nbclient.exceptions.CellExecutionError as e:
            raise AssertionError(f"{e}\n{_engine_logs(ipython_dir)}") from None
    text = _text(nb)
    assert "ERROR" not in text, text[-4000:]
    return text


def _engine_logs(ipython_dir: Path) -> str:
    """The tail of every log ipyparallel's controller and engines left: why an engine set stopped."""
    logs = sorted(ipython_dir.glob("profile_*/log/*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs) or "(no engine logs)"


def test_tour_notebook_runs(tmp_path):
    text = _run(NOTEBOOK, tmp_path, 240)
    assert "from (source rank, token): [(0, 1), (0, 4), (2, 2)]" in text, text[-4000:]
    assert "rank 1 of " in text and "(mpi)" in text, text[-4000:]  # every engine joined one MPI group


def test_kernel_lab_notebook_runs(tmp_path, monkeypatch):
    """Without GPUs every compile cell runs on both engines (sm_90) and the launch cells say why they skip; with
    GPUs the all-gather is checked, and the variant matches the reference and is timed beside the built-in."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")
    monkeypatch.setenv("EPJIT_CACHE_DIR", str(tmp_path / "cache"))  # the engines inherit it: a cold compile
    text = _run(KERNEL_LAB, tmp_path, 420)
    for rank in (0, 1):
        assert f"rank {rank}: compiled for sm_" in text and "void all_gather_row(" in text, text[-4000:]
        assert f"rank {rank}: <epjit.lab.Variant in_flight_4 of low_latency" in text, text[-4000:]
    assert "parameter row_ints (int, declared at <source>:4) must be an integer, got float" in text, text[-4000:]
    assert "ll_dispatch's parameter 4 is 'int num_topk', the built-in's is 'int num_tokens'" in text, text[-4000:]
    from epjit.group.topology import visible_gpus

    if visible_gpus()[0] >= 2:
        assert text.count("each as sent: True") >= 2 and text.count("both match the reference") >= 2, text[-4000:]
        # the variant's check and timing beside the built-in, one line an engine (shown by pytest -rA)
        print("\n".join(line for line in text.splitlines() if "both match the reference" in line))
    else:
        assert "launching it needs a GPU an engine" in text and "running it needs a GPU an engine" in text
