"""GPU tier of epjit.autograd: a small MoE layer trained one step on 2 ranks through the real Buffer (normal mode,
exact and worst-token; low latency in bf16; the custom ops under torch.compile), each rank's outputs and gradients
against the same layer computed densely on one device (tests/ranks/autograd.py)."""

from __future__ import annotations

import pytest

from .gpu import run_ranks, two_ranks

pytestmark = pytest.mark.gpu

CASES = {"normal", "normal_worst_tokens", "low_latency", "ops_low_latency", "ops_normal"}


def test_moe_layer_gradients_match_the_dense_layer():
    env = two_ranks()
    pytest.importorskip("torch")
    code, output, results = run_ranks("launch", 2, "tests/ranks/autograd.py", env={"EPJIT_TIMEOUT_S": "60", **env},
                                      timeout=400)
    assert len(results) == 2, output[-8000:]
    for r in results:
        assert "error" not in r, r
        assert {c["case"] for c in r["cases"]} == CASES, r
        for case in r["cases"]:
            assert case["ok"], case
    assert code == 0, output[-8000:]
    print("\n".join(str(r) for r in results))
