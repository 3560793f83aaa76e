"""GPU tier of epjit.deep_ep: DeepEP's V1 API, installed as ``deep_ep``, driven under torchrun the way Megatron-LM's
fused_a2a and vLLM's and SGLang's DeepEP paths drive it (tests/ranks/deep_ep.py), checked against the reference:
normal mode over a gloo or an NCCL process group, low-latency mode with DeepEP's FP8 scale layouts."""

from __future__ import annotations

import pytest

from .gpu import placement, torchrun_two_ranks, two_ranks

pytestmark = pytest.mark.gpu


def _run(backend: str, env: dict[str, str]) -> None:
    for r in torchrun_two_ranks("tests/ranks/deep_ep.py", backend, env, timeout=400):
        assert r["size"] == 2 and r["mismatch"] is None, r
        assert r["cases"] == 4 + 7 and r["ll_hint_matches"], r


def test_deepep_api_over_a_gloo_group_matches_the_reference():
    _run("gloo", two_ranks())


def test_deepep_api_over_an_nccl_group_matches_the_reference():
    _run("nccl", placement(2, False))  # NCCL refuses two ranks on one GPU
