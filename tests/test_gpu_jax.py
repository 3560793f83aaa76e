"""GPU tier of epjit.jax: tests/ranks/jax_moe.py on 2 and 4 ranks, one a GPU (JAX runs one process a GPU), or sharing
the GPUs of a smaller machine (tests/gpu.py's placements: correctness only, their times are not the GPUs'): jitted
low-latency (bf16, FP8) and worst-token normal-mode steps bit-identical with the eager Buffer over 1,000 steps of
moving inputs, eager and jitted calls interleaved; step 0 against epjit.reference; the normal-mode layer's gradients
against the dense layer; and the per-call time of jitted low-latency dispatch and combine at 1 and 128 tokens beside
the CUDA-graph replay of the eager calls, printed as a table (``jax |`` lines)."""

from __future__ import annotations

import pytest

from .gpu import RANKS, placement, run_ranks, two_ranks

pytestmark = pytest.mark.gpu

CASES = {f"{c}_jit_eq_eager" for c in ("ll_bf16", "ll_fp8", "normal")} | \
    {f"{c}_vs_reference" for c in ("ll_bf16", "ll_fp8", "normal")} | {"gradients_vs_dense"}


@pytest.mark.parametrize(("n", "shared"), [p for p in RANKS if p.id != "8-shared"])
def test_jitted_calls_match_eager_reference_and_dense(n, shared):
    pytest.importorskip("jax")
    env = {"EPJIT_TIMEOUT_S": "60", **placement(n, shared)}
    # ranks sharing a GPU time-slice every kernel: fewer steps and timed calls there (their times mean nothing)
    args = ("--steps", "300", "--repeat", "20") if shared else ()
    code, output, results = run_ranks("launch", n, "tests/ranks/jax_moe.py", *args, env=env, timeout=200)
    assert len(results) == n, output[-8000:]
    for r in results:
        assert "error" not in r, (r, output[-6000:])
        assert {c["case"] for c in r["cases"]} == CASES, r
        for case in r["cases"]:
            assert case["ok"], case
    assert code == 0, output[-8000:]
    t = results[0]["timing"]
    where = f"{n} ranks sharing GPUs (times not the GPUs')" if shared else f"{n} ranks"
    lines = [f"jax | {where} | steps {r['cases'][0]['steps']} | loop {results[0]['loop_s']} s | all cases ok"]
    for tokens in (1, 128):
        lines.append(f"jax | {where} | {tokens:>3} tokens | dispatch jit {t[f'jit_dispatch_{tokens}']} us, graph "
                     f"{t[f'graph_dispatch_{tokens}']} us | combine jit {t[f'jit_combine_{tokens}']} us, graph "
                     f"{t[f'graph_combine_{tokens}']} us")
    print("\n" + "\n".join(lines))


def test_jax_example_matches_the_reference():
    pytest.importorskip("jax")
    env = {"EPJIT_TIMEOUT_S": "60", **two_ranks()}
    code, output, _ = run_ranks("launch", 2, "examples/jax_moe.py", env=env, timeout=150)
    assert code == 0, output[-6000:]
    assert output.count("calc_diff vs epjit.reference") == 2, output[-6000:]
    print("\njax | 2 ranks | examples/jax_moe.py matches epjit.reference")
