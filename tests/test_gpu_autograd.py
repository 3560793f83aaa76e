"""GPU tier of epjit.autograd: a small MoE layer trained one step on 2 and 4 ranks through the real Buffer (normal
mode, exact and worst-token; low latency in bf16; the custom ops under torch.compile with the aot_eager backend and,
on 2 ranks, with inductor, torch.compile's default), each rank's outputs and gradients against the same layer
computed densely on one device (tests/ranks/autograd.py)."""

from __future__ import annotations

import pytest

from .gpu import run_ranks
from .test_gpu_torch import TORCH_RANKS, torch_placement

pytestmark = pytest.mark.gpu

# Every case tests/ranks/autograd.py runs, by the torch.compile backends asked for: a case missing from a rank's
# RESULT fails the test.
EAGER = {"normal", "normal_worst_tokens", "low_latency"}
COMPILED = {"aot_eager": {"ops_low_latency", "ops_normal"},
            "inductor": {"inductor_low_latency", "inductor_normal"}}


def backends_of(n: int) -> list[str]:
    """inductor on 2 ranks only: the graph it compiles around the custom ops is the same whatever the rank count
    (the ops are opaque to it), so 4 ranks would only pay for every rank's compile, with 4 ranks sharing the CPUs
    (and, 4-shared, the GPUs) while each compiles."""
    return ["aot_eager", "inductor"] if n == 2 else ["aot_eager"]


@pytest.mark.parametrize("n, shared", TORCH_RANKS)
def test_moe_layer_gradients_match_the_dense_layer(n, shared):
    env = torch_placement(n, shared)
    pytest.importorskip("torch")
    backends = backends_of(n)
    # Each rank compiles its own graphs: inductor's pool of compile workers (one a core, in every rank) would start
    # dozens of processes for a few small kernels, which compile in each rank's own process instead. A rank that
    # finishes compiling first waits inside the first op's kernel for the others: the kernels' timeout leaves room
    # for one rank's compile being slower than another's.
    inductor = "inductor" in backends
    env = {"EPJIT_TIMEOUT_S": "180" if inductor else "60", "TORCHINDUCTOR_COMPILE_THREADS": "1", **env}
    code, output, results = run_ranks("launch", n, "tests/ranks/autograd.py", "--backends", ",".join(backends),
                                      env=env, timeout=600 if inductor else 450)
    assert len(results) == n, output[-8000:]
    want = EAGER.union(*(COMPILED[b] for b in backends))
    for r in results:
        assert "error" not in r, (r, output[-6000:])
        assert r["size"] == n and r["backends"] == backends, r
        assert {c["case"] for c in r["cases"]} == want, r
        for case in r["cases"]:
            assert case["ok"], case
    assert code == 0, output[-8000:]
    print("\n".join(str(r) for r in results))
