"""GPU tier of normal-mode intranode dispatch/combine: every case against epjit.reference on 2 and 4 ranks."""

from __future__ import annotations

import pytest

from .gpu import require_gpus, run_ranks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [2, 4])
def test_intranode_against_reference(n):
    require_gpus(n)
    pytest.importorskip("torch")
    code, output, results = run_ranks(
        "launch", n, "tests/ranks/intranode.py", env={"EPJIT_TIMEOUT_S": "60"}, timeout=500
    )
    assert code == 0, output[-8000:]
    assert len(results) == n, output[-4000:]
    for r in results:
        assert r["loops_identical"], r
        assert "hidden differs across ranks" in r["mismatch_error"], r
        assert f"outside [-1, num_experts=64) on rank(s) {n - 1}" in r["invalid_ids_error"], r
    print("\n".join(str(r) for r in results))


@pytest.mark.parametrize("n", [2, 4])
def test_worst_token_dispatch_and_combine_in_a_cuda_graph(n):
    require_gpus(n)
    pytest.importorskip("torch")
    code, output, results = run_ranks("launch", n, "tests/ranks/intranode_graph.py", env={"EPJIT_TIMEOUT_S": "60"},
                                      timeout=300)
    assert code == 0, output[-8000:]
    assert [r["replays"] for r in results] == [5] * n, output[-4000:]
