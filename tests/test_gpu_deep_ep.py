"""GPU tier of epjit.deep_ep: DeepEP's V1 API, installed as ``deep_ep``, driven under torchrun the way Megatron-LM's
fused_a2a and vLLM's and SGLang's DeepEP paths drive it (tests/ranks/deep_ep.py), checked against the reference:
normal mode over a gloo or an NCCL process group on 2 and 4 ranks, low-latency mode with DeepEP's FP8 scale layouts,
and the same across virtual NVLink nodes of one host (``--num-nvl-ranks``: the internode kernels, the reference's
two-level combine)."""

from __future__ import annotations

import pytest

from .gpu import torchrun_ranks
from .test_gpu_torch import TORCH_RANKS, torch_placement

pytestmark = pytest.mark.gpu


def _run(backend: str, n: int, env: dict[str, str], *args: str) -> list[dict]:
    results = torchrun_ranks("tests/ranks/deep_ep.py", n, backend, *args, env=env, timeout=400 if n == 2 else 550)
    for r in results:
        assert r["size"] == n and r["mismatch"] is None, r
        assert r["cases"] == 4 + 9 and r["ll_hint_matches"], r
        assert r["local_buffers"]["nvl_ints"] > 0 and r["local_buffers"]["rdma_bytes"] > 0, r
    return results


def _run_in_one_node(backend: str, n: int, shared: bool) -> None:
    for r in _run(backend, n, torch_placement(n, shared, backend)):
        assert r["num_nvl_ranks"] == n and r["kernels"].startswith(f"intranode.num_ranks={n},"), r
        assert r["rdma_bytes"] == 0, r  # inside one node deep_ep gives the epjit Buffer no symmetric heap


@pytest.mark.parametrize("n, shared", TORCH_RANKS)
def test_deepep_api_over_a_gloo_group_matches_the_reference(n, shared):
    _run_in_one_node("gloo", n, shared)


@pytest.mark.parametrize("n, shared", TORCH_RANKS)
def test_deepep_api_over_an_nccl_group_matches_the_reference(n, shared):
    _run_in_one_node("nccl", n, shared)


# (ranks, ranks a node, shared), named nodes x ranks a node as in test_gpu_internode.py: "2x1" is two_ranks()'s
# placement (2 GPUs, or both ranks on a 1-GPU machine's GPU); the 4-rank topologies one rank a GPU, or "-shared".
NODES = [pytest.param(2, 1, False, id="2x1"), pytest.param(4, 2, False, id="2x2"),
         pytest.param(4, 2, True, id="2x2-shared"), pytest.param(4, 1, False, id="4x1"),
         pytest.param(4, 1, True, id="4x1-shared")]


@pytest.mark.parametrize("n, nvl_ranks, shared", NODES)
def test_deepep_api_across_nvlink_nodes_matches_the_reference(n, nvl_ranks, shared):
    results = _run("gloo", n, torch_placement(n, shared), "--num-nvl-ranks", str(nvl_ranks))
    for r in results:
        # the epjit group has V-rank nodes (the low-latency calls crossed them too) and the normal-mode epjit
        # Buffer is an internode one: its calls ran the internode kernels of this topology
        assert r["num_nvl_ranks"] == nvl_ranks, r
        assert r["kernels"].startswith(f"internode.num_nodes={n // nvl_ranks},num_nvl_ranks={nvl_ranks},"), r
        assert r["rdma_bytes"] > 0, r
