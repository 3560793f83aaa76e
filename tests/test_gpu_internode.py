"""GPU tier of normal mode across NVLink nodes: tests/ranks/intranode.py's every case against epjit.reference (its
two-level combine) on virtual nodes of one host (num_nvl_ranks below the ranks: the RDMA leg goes through NVSHMEM
puts as on a cluster), 2 x 1, 2 x 2, 4 x 1 and, with ranks sharing the GPUs, 2 x 4 and 4 x 2; up to 4 ranks again
with the RDMA leg as NVLink stores and no NVSHMEM (EPJIT_RDMA_BY_STORES); each case also the FP8 combine
(use_fp8=True), bit for bit the reference's, and its calc_diff against the bf16 combine; a CUDA graph of
worst-token calls; a rail peer that never arrives."""

from __future__ import annotations

import pytest

from .gpu import placement, quick, run_ranks
from .test_gpu_intranode import assert_fp8_combine_results, assert_normal_results

pytestmark = pytest.mark.gpu

# (ranks, ranks a node, shared): one rank a GPU, or ranks sharing the GPUs where there are fewer (tests/gpu.py).
TOPOLOGIES = [pytest.param(2, 1, False, id="2x1"), pytest.param(2, 1, True, id="2x1-shared"),
              pytest.param(4, 2, False, id="2x2"), pytest.param(4, 2, True, id="2x2-shared"),
              pytest.param(4, 1, False, id="4x1"), pytest.param(4, 1, True, id="4x1-shared"),
              pytest.param(8, 4, True, id="2x4-shared"), pytest.param(8, 2, True, id="4x2-shared")]


@pytest.mark.parametrize("n, nvl_ranks, shared", TOPOLOGIES)
def test_internode_against_reference(n, nvl_ranks, shared):
    env = placement(n, shared)
    pytest.importorskip("torch")
    code, output, results = run_ranks(
        "launch", n, "tests/ranks/intranode.py", "--num-nvl-ranks", str(nvl_ranks), *quick(n, shared),
        env={"EPJIT_TIMEOUT_S": "60", **env}, timeout=500)
    assert code == 0, output[-8000:]
    assert len(results) == n, output[-4000:]
    assert_normal_results(results, n)
    for r in results:
        assert r["kernels"].startswith(f"internode.num_nodes={n // nvl_ranks},num_nvl_ranks={nvl_ranks}"), r
    assert_fp8_combine_results(results)  # each node's partial quantised once: the reference's two-level FP8 sum
    print("\n".join(str(r) for r in results))


@pytest.mark.parametrize("n, nvl_ranks, shared", [p for p in TOPOLOGIES if p.values[0] <= 4])
def test_internode_with_the_rdma_leg_as_nvlink_stores_against_reference(n, nvl_ranks, shared):
    """EPJIT_RDMA_BY_STORES=1: the symmetric region on CUDA IPC memory every rank maps, the kernels' build with the
    RDMA leg as NVLink stores (the internode_stores build), NVSHMEM never started; the same cases, the same answers."""
    env = placement(n, shared)
    pytest.importorskip("torch")
    code, output, results = run_ranks(
        "launch", n, "tests/ranks/intranode.py", "--num-nvl-ranks", str(nvl_ranks), "--loops", "100",
        env={"EPJIT_TIMEOUT_S": "60", "EPJIT_RDMA_BY_STORES": "1", **env}, timeout=500)
    assert code == 0, output[-8000:]
    assert len(results) == n, output[-4000:]
    assert_normal_results(results, n)
    for r in results:
        assert r["symmetric"] == "IpcHeap" and r["nvshmem_initialised"] == 0, r
        assert set(r["modules"]) == {"internode_stores", "internode_combine_fp8_stores"}, r
    assert_fp8_combine_results(results)
    print("\n".join(str(r) for r in results))


@pytest.mark.parametrize("n, nvl_ranks, shared", [p for p in TOPOLOGIES if p.values[0] <= 4])
def test_internode_worst_tokens_in_a_cuda_graph(n, nvl_ranks, shared):
    env = placement(n, shared)
    pytest.importorskip("torch")
    code, output, results = run_ranks("launch", n, "tests/ranks/intranode_graph.py", str(nvl_ranks),
                                      env={"EPJIT_TIMEOUT_S": "60", **env}, timeout=300)
    assert code == 0, output[-8000:]
    assert [r["replays"] for r in results] == [5] * n, output[-4000:]
    for r in results:
        assert "replayed from a CUDA graph was refused on every rank" in r["graph_refusal"], r


def test_a_rail_peer_that_never_arrives_times_out_naming_it_and_the_leg():
    env = placement(2, False) if _gpus() >= 2 else placement(2, True)
    pytest.importorskip("torch")
    code, output, _ = run_ranks("launch", 2, "tests/ranks/intranode_timeout.py", "1",
                                env={"EPJIT_TIMEOUT_S": "3", **env}, timeout=120)
    assert code != 0, output[-4000:]
    assert "EpjitTimeoutError" in output and "rank 0 timed out" in output, output[-4000:]
    assert "internode_notify" in output and "RDMA leg" in output and "waiting for peer rank 1" in output, \
        output[-4000:]


def _gpus() -> int:
    from . import gpu

    gpu.require_gpus(1)
    return gpu._GPUS or 0
