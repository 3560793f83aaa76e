"""GPU tier of normal-mode intranode dispatch/combine: every case against epjit.reference on 2 and 4 ranks (and,
where there are fewer GPUs than ranks, ranks sharing them: tests/gpu.py's RANKS)."""

from __future__ import annotations

import re

import pytest

from .gpu import RANKS, placement, quick, run_ranks, run_shrink_loop, two_ranks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n, shared", RANKS)
def test_intranode_against_reference(n, shared):
    env = placement(n, shared)
    pytest.importorskip("torch")
    code, output, results = run_ranks(
        "launch", n, "tests/ranks/intranode.py", *quick(n, shared), env={"EPJIT_TIMEOUT_S": "60", **env}, timeout=500
    )
    assert code == 0, output[-8000:]
    assert len(results) == n, output[-4000:]
    assert_normal_results(results, n)
    assert_fp8_combine_results(results)
    print("\n".join(str(r) for r in results))


def assert_fp8_combine_results(results: list[dict]) -> None:
    """Every case of tests/ranks/intranode.py also ran the FP8 combine, bit for bit the reference's; its largest
    calc_diff against the bf16 combine is printed."""
    for r in results:
        assert r["fp8_combine"]["cases"] > 0, r
        assert "needs hidden % 128 == 0" in r["refused"]["combine_fp8"], r["refused"]
        print(f"rank {r['rank']}: FP8 combine of {r['fp8_combine']['cases']} cases, largest calc_diff against the "
              f"bf16 combine {r['fp8_combine']['max_calc_diff']:.2e}")


def assert_normal_results(results: list[dict], n: int) -> None:
    """What every rank of tests/ranks/intranode.py reports (inside one node or across nodes alike)."""
    for r in results:
        assert r["loops_identical"], r
        assert r["retries"] >= 1, r  # rank 0 starts with no tokens: its first outputs are too small
        assert "hidden differs across ranks" in r["mismatch_error"], r
        assert f"outside [-1, num_experts=64) on rank(s) {n - 1}" in r["invalid_ids_error"], r
        refused = r["refused"]
        assert "x must be contiguous" in refused["non_contiguous"], refused
        assert "x must be bfloat16, got float32" in refused["wrong_dtype"], refused
        assert "topk_idx must have shape" in refused["idx_rows"], refused
        assert "not divisible" in refused["experts_not_divisible"], refused
        assert re.search("bytes of (NVLink buffer|symmetric heap)", refused["buffer_too_small"]), refused
        for key, message in (("experts_not_int", "num_experts must be an int >= 1, got 64.0"),
                             ("alignment_not_int", "expert_alignment must be an int >= 1, got 1.0"),
                             ("worst_not_int", "num_worst_tokens must be an int >= 0, got '512'"),
                             ("layout_experts_not_int", "num_experts must be an int >= 1, got '64'")):
            assert refused[key].startswith(f"ArgumentTypeError: {message}"), refused
        assert "num_worst_tokens=8 is too small for what arrives" in r["worst_too_small"], r
        assert "num_worst_tokens=8 is too small for what arrives" in r["run_ahead_refusal"], r
        assert "num_worst_tokens=8 is too small for what arrives" in r["close_refusal"], r


# Config's warp roles beside the defaults (the variants the 4-rank A/B times): the phased dispatch and other combine
# sender counts must give the same bits as the reference, through each script's quick cases.
VARIANTS = {"phased-combine3": "dispatch_phased=1,combine_send_warps=3", "combine5": "combine_send_warps=5"}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n, shared", [p for p in RANKS if p.values[0] <= 4])
def test_intranode_variants_against_reference(variant, n, shared):
    env = placement(n, shared)
    pytest.importorskip("torch")
    env = {"EPJIT_TIMEOUT_S": "60", **env}
    code, output, results = run_ranks("launch", n, "tests/ranks/intranode.py", "--quick", "--loops", "20",
                                      "--warp-roles", VARIANTS[variant], env=env, timeout=400)
    assert code == 0, output[-8000:]
    assert len(results) == n, output[-4000:]
    for r in results:
        assert r["loops_identical"], r
        for setting in VARIANTS[variant].replace("=1", "=true").split(","):
            assert setting in r["kernels"], r["kernels"]


def test_a_rank_that_never_arrives_times_out_naming_it():
    env = two_ranks()
    pytest.importorskip("torch")
    code, output, _ = run_ranks("launch", 2, "tests/ranks/intranode_timeout.py",
                                env={"EPJIT_TIMEOUT_S": "3", **env}, timeout=120)
    assert code != 0, output[-4000:]
    assert "EpjitTimeoutError" in output and "rank 0 timed out" in output, output[-4000:]
    assert "intranode_notify" in output and "waiting for peer rank 1" in output, output[-4000:]


@pytest.mark.parametrize("n, shared", RANKS)
def test_worst_token_dispatch_and_combine_in_a_cuda_graph(n, shared):
    env = placement(n, shared)
    pytest.importorskip("torch")
    code, output, results = run_ranks("launch", n, "tests/ranks/intranode_graph.py",
                                      env={"EPJIT_TIMEOUT_S": "60", **env}, timeout=300)
    assert code == 0, output[-8000:]
    assert [r["replays"] for r in results] == [5] * n, output[-4000:]
    for r in results:
        assert "replayed from a CUDA graph was refused on every rank" in r["graph_refusal"], r
        assert "num_worst_tokens=8 is too small for what arrives" in r["graph_refusal"], r


@pytest.mark.parametrize("mode", ["update", "stop", "kill"])
def test_shrink_mode_goes_on_without_a_rank_that_leaves(mode):
    """Normal-mode shrink inside one node (enable_shrink): rank 1 leaves a loop of layout, dispatch and combine at
    iteration 3, masked by every live rank (update), by the others' notify barrier that times out (stop), or SIGKILLed
    between its dispatch and its combine (kill: the others' combine waits mask it). Every output the survivors see is
    the reference's with the ranks their mask names out; after an update every rank, rank 1 too, cleans the mask and
    runs once more with nobody masked; every rank ends on its own."""
    n, output, results = run_shrink_loop("tests/ranks/intranode_shrink.py", mode)
    survivors = [r for r in range(n) if r != 1]
    assert sorted(r["rank"] for r in results) == (list(range(n)) if mode == "update" else survivors), output[-4000:]
    for r in results:
        assert all(after == [[], []] for after in r["masks"][:3]), r  # before rank 1 leaves: nobody masked
        assert r["after_clean"] == ([[], []] if mode == "update" else None), r
        if r["rank"] == 1:  # the update's rank 1: it stopped at iteration 3, then cleaned and rejoined
            assert len(r["masks"]) == 3 and r["reports"] == [], r
            continue
        assert len(r["masks"]) == 7 and all(after == [[1], [1]] for after in r["masks"][4:]), r
        assert r["masks"][3] == ([[], [1]] if mode == "kill" else [[1], [1]]), r
        if mode == "update":
            assert r["reports"] == [], r  # masked by the caller: no wait had to
        else:
            assert [(x["rank"], x["peer"]) for x in r["reports"]] == [(r["rank"], 1)], r
            site = "intranode_combine" if mode == "kill" else "intranode_notify"
            assert r["reports"][0]["site"].startswith(site), r
            assert 2.9e9 < r["reports"][0]["elapsed_ns"] < 10e9, r
    print("\n".join(str(r) for r in results))
