"""GPU tier of the torch.distributed transport: a normal-mode Buffer made from a torch ProcessGroup under torchrun
(gloo, NCCL, or the gloo group epjit.init() makes), checked against the reference."""

from __future__ import annotations

import pytest

from .gpu import placement, torchrun_two_ranks, two_ranks

pytestmark = pytest.mark.gpu


def _run(backend: str, env: dict[str, str]) -> list[dict]:
    results = torchrun_two_ranks("tests/ranks/torch_buffer.py", backend, env, timeout=300)
    for r in results:
        assert r["group_backend"] == "torch" and r["size"] == 2 and r["same_group"], r
        assert r["cases"] == 2 and r["mismatch"] is None, r
    return results


@pytest.mark.parametrize("backend", ["gloo", "none"])
def test_buffer_over_a_gloo_group_matches_the_reference(backend):
    results = _run(backend, two_ranks())
    if backend == "none":  # the group epjit.init() made is gone with the epjit group
        assert not any(r["default_group_left"] for r in results), results


def test_buffer_over_an_nccl_group_matches_the_reference():
    _run("nccl", placement(2, False))  # NCCL refuses two ranks on one GPU
