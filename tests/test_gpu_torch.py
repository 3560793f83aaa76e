"""GPU tier of the torch.distributed transport: a normal-mode Buffer made from a torch ProcessGroup under torchrun
(gloo, NCCL, or the gloo group epjit.init() makes) on 2 and 4 ranks, checked against the reference."""

from __future__ import annotations

import pytest

from .gpu import placement, torchrun_ranks, two_ranks

pytestmark = pytest.mark.gpu

# The rank placements of the torch-ecosystem tests (this file, test_gpu_deep_ep.py, test_gpu_autograd.py), from
# tests/gpu.py's RANKS up to four ranks: "2" is two_ranks() (one rank a GPU, or both on the GPU of a 1-GPU machine),
# "4" one rank a GPU, "4-shared" four ranks on fewer GPUs (EPJIT_SHARE_GPUS). A 2-GPU machine runs 2 and 4-shared.
TORCH_RANKS = [pytest.param(2, False, id="2"), pytest.param(4, False, id="4"), pytest.param(4, True, id="4-shared")]


def torch_placement(n: int, shared: bool, backend: str = "gloo") -> dict[str, str]:
    """The environment of ``n`` ranks over a ``backend`` process group, skipping as tests/gpu.py's placement does.
    NCCL runs one rank a GPU only: it refuses two ranks on one GPU, which is what sharing GPUs means."""
    if backend == "nccl":
        if shared:
            pytest.skip(f"NCCL refuses two ranks on one GPU: {n} ranks over an NCCL group need {n} GPUs")
        return placement(n, False)
    return two_ranks() if n == 2 and not shared else placement(n, shared)


def _run(backend: str, n: int, env: dict[str, str]) -> list[dict]:
    results = torchrun_ranks("tests/ranks/torch_buffer.py", n, backend, env=env, timeout=300 if n == 2 else 450)
    assert [r["rank"] for r in results] == list(range(n)), results
    for r in results:
        assert r["group_backend"] == "torch" and r["size"] == n and r["same_group"], r
        assert r["cases"] == 2 and r["mismatch"] is None, r
    return results


@pytest.mark.parametrize("n, shared", TORCH_RANKS)
@pytest.mark.parametrize("backend", ["gloo", "none"])
def test_buffer_over_a_gloo_group_matches_the_reference(backend, n, shared):
    results = _run(backend, n, torch_placement(n, shared))
    if backend == "none":  # the group epjit.init() made is gone with the epjit group
        assert not any(r["default_group_left"] for r in results), results


@pytest.mark.parametrize("n, shared", TORCH_RANKS)
def test_buffer_over_an_nccl_group_matches_the_reference(n, shared):
    _run("nccl", n, torch_placement(n, shared, "nccl"))
