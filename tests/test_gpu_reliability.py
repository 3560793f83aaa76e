"""GPU tier of reliability: Buffers made and closed over and over give back everything they took, and the kernels
that need no NVSHMEM run clean under compute-sanitizer's four tools (docs/reliability.md)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from .gpu import ROOT, gpu_count, require_gpus, run_ranks, two_ranks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("nodes, stores", [pytest.param((), False, id="one-node"),
                                           pytest.param(("--num-nvl-ranks", "1"), False, id="2x1"),
                                           pytest.param(("--num-nvl-ranks", "1"), True, id="2x1-stores")])
def test_buffers_made_and_closed_leak_nothing(nodes, stores):
    """100 Buffers of each kind after 10: normal and low latency inside one NVLink node, internode and low latency
    across two (2 ranks as 2 nodes of 1; through NVSHMEM, and on IPC memory with the RDMA leg as stores). GPU memory,
    pinned host memory, IPC mappings, the NVSHMEM heap, file descriptors, threads and the memory maps backed by
    files, devices or shared memory all where they were (anonymous maps and resident memory move with the
    allocators: reported, not judged)."""
    env = {**two_ranks(), **({"EPJIT_RDMA_BY_STORES": "1"} if stores else {})}
    code, output, results = run_ranks("launch", 2, "scripts/soak_buffers.py", "--cycles", "100", "--warmup", "10",
                                      "--check", *nodes, env=env, timeout=300)
    assert code == 0, output[-6000:]
    assert results and results[0]["leaks"] == [], output[-6000:]
    kinds = {r["kind"] for r in results[0]["results"]}
    assert kinds == ({"internode", "low_latency"} if nodes else {"normal", "low_latency"}), kinds
    print(output[-3000:])


def test_kernels_clean_under_compute_sanitizer():
    """memcheck, racecheck, synccheck and initcheck over the kernels that need no NVSHMEM (which does not start under
    compute-sanitizer: docs/reliability.md): scripts/sanitize.sh's normal case (layout, notify, dispatch, combine),
    its low-latency case (one node: the symmetric region on CUDA IPC memory), ll-puts (the put path, as NVLink
    stores) and, with 2 GPUs, its internode case
    (2 nodes of 1, the RDMA leg as NVLink stores: two ranks' instrumented kernels wait on each other, which ranks
    sharing one GPU may not survive)."""
    require_gpus(1)
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer is not on PATH (it comes with the CUDA toolkit)")
    cases = "normal low-latency ll-puts" + (" internode" if gpu_count() >= 2 else "")
    env = {**os.environ, "SANITIZE_CASES": cases}
    proc = subprocess.run(["bash", "scripts/sanitize.sh", "memcheck", "racecheck", "synccheck", "initcheck"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(proc.stdout)
