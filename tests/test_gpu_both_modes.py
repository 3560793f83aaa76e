"""GPU tier of one Buffer serving both modes across NVLink nodes (tests/ranks/both_modes.py): on virtual nodes of one
host, 2 x 1 and 2 x 2 (and the same with ranks sharing the GPUs, and 2 x 2 with the RDMA leg as NVLink stores),
normal-mode and low-latency calls alternating on one Buffer, each checked against epjit.reference, on a Buffer made
with both and on a normal-mode Buffer given low-latency mode after its first calls; each mode's region where the
layout puts it (normal mode's from the heap's start, low latency's its last get_low_latency_size_hint bytes)."""

from __future__ import annotations

import pytest

from .gpu import placement, run_ranks

pytestmark = pytest.mark.gpu

TOPOLOGIES = [pytest.param(2, 1, False, {}, id="2x1"), pytest.param(2, 1, True, {}, id="2x1-shared"),
              pytest.param(4, 2, False, {}, id="2x2"), pytest.param(4, 2, True, {}, id="2x2-shared"),
              pytest.param(4, 2, False, {"EPJIT_RDMA_BY_STORES": "1"}, id="2x2-stores")]


@pytest.mark.parametrize("n, nvl_ranks, shared, extra", TOPOLOGIES)
def test_one_buffer_serves_both_modes_across_nodes(n, nvl_ranks, shared, extra):
    env = placement(n, shared)
    pytest.importorskip("torch")
    code, output, results = run_ranks("launch", n, "tests/ranks/both_modes.py", "--num-nvl-ranks", str(nvl_ranks),
                                      env={"EPJIT_TIMEOUT_S": "60", **env, **extra}, timeout=400)
    assert code == 0, output[-8000:]
    assert len(results) == n, output[-4000:]
    for r in results:
        assert r["cases"] == 2 * 10 + 1, r
        assert r["kernels"][0].startswith(f"internode.num_nodes={n // nvl_ranks},num_nvl_ranks={nvl_ranks}"), r
        assert r["symmetric"] == ("IpcHeap" if extra else "SymmetricHeap"), r
        for where in (r, r["later"]):
            assert where["peers_moved"] and where["low_latency_offset"] + where["low_latency_bytes"] == where["heap"]
            assert where["normal_bytes"] <= where["low_latency_offset"], where  # the regions apart
    print("\n".join(str(r) for r in results))
