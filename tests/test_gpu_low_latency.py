"""GPU tier of low-latency mode: every case against epjit.reference on 2 and 4 ranks (and ranks sharing GPUs where
there are fewer GPUs than ranks: tests/gpu.py's RANKS), direct NVLink stores and NVSHMEM puts, the receive hook,
CUDA-graph replay, 1000 alternating calls, the Safe rules and a rank that stops."""

from __future__ import annotations

import pytest

from .gpu import RANKS, gpu_count, placement, quick, require_gpus, run_ranks, run_shrink_loop, two_ranks

pytestmark = pytest.mark.gpu


def _check_logfmt(results: list[dict]) -> None:
    """use_logfmt=True: refused with zero_copy and as text; run against the reference where the Buffer has no put
    path, refused where it has one."""
    for r in results:
        logfmt, puts = r["logfmt"], r["build"] != "low_latency"
        refused = logfmt["refused"]
        assert "use_logfmt must be True or False, got 'yes'" in refused["not_bool"], refused
        if puts:  # the put path is refused first, zero_copy or not
            no_puts = "needs every peer reached through an NVLink pointer"
            assert logfmt["cases"] == 0 and no_puts in refused["put_path"] and no_puts in refused["zero_copy"], logfmt
        else:
            assert "zero_copy=True and use_logfmt=True together are not supported" in refused["zero_copy"], refused
            assert logfmt["cases"] == 3 and logfmt["max_diff"] < 1e-5, logfmt


def _check(results: list[dict], n: int) -> None:
    assert len(results) == n
    _check_logfmt(results)
    for r in results:
        assert r["cases"] >= 3 and r["max_diff"] < 1e-3, r
        assert r["graph_replays"] == 6, r
        assert r["loops"] >= 20, r
        assert r["extras"]["stats"] > 0 and "no NVLink buffer" in r["extras"]["normal_refused"], r
        waits = r["wait_stats"]  # (the rank script checks the late rank's entries; here: they came, and refusals)
        assert len(waits["ns"]["dispatch"]) == len(waits["ns"]["combine"]) == n, waits
        assert "dispatch_wait_recv_cost_stats must be int64" in waits["refused"]["dtype"], waits
        assert "dispatch_wait_recv_cost_stats must have shape [R=" in waits["refused"]["shape"], waits
        refused = r["refused"]
        assert "num_max_dispatch_tokens_per_rank=32" in refused["too_many_tokens"], refused
        assert "this Buffer was made for" in refused["wrong_experts"], refused
        assert "not divisible" in refused["not_divisible"], refused
        assert "differ" in refused["differs_across_ranks"], refused
        assert "x must be bfloat16" in refused["wrong_dtype"], refused
        assert "too large for low-latency mode" in refused["too_many_for_shared_memory"], refused
        assert "receive hook that has not run" in refused["set_reused"], refused
        assert "call its hook() first" in refused["combine_before_hook"], refused
        assert "hook already ran" in refused["hook_twice"], refused
        assert "tokens_per_rank must be an int >= 1, got 32.0" in refused["max_tokens_not_int"], refused
        assert "use_fp8 must be True or False, got 'False'" in refused["fp8_flag_as_text"], refused
        if r["rank"] == 0:
            assert "outside [-1, num_experts=" in refused["invalid_ids"], refused
            assert "outside [-1, num_experts=" in refused["invalid_ids_synchronize"], refused


@pytest.mark.parametrize("n, shared", RANKS)
def test_low_latency_against_reference(n, shared):
    env = placement(n, shared)
    pytest.importorskip("torch")
    code, output, results = run_ranks("launch", n, "tests/ranks/low_latency.py", *quick(n, shared),
                                      env={"EPJIT_TIMEOUT_S": "60", **env}, timeout=600)
    assert code == 0, output[-8000:]
    _check(results, n)
    assert all(r["build"] == "low_latency" for r in results), results  # every peer has an NVLink pointer
    print("\n".join(str(r) for r in results))


def test_low_latency_logfmt_combine():
    """use_logfmt=True alone on 2 ranks (DeepEP's LogFMT-10 combine against the reference, its refusals): the
    quick proof of it; the runs above check it too, on every rank count and build."""
    env = two_ranks()
    pytest.importorskip("torch")
    code, output, results = run_ranks("launch", 2, "tests/ranks/low_latency.py", "--logfmt-only",
                                      env={"EPJIT_TIMEOUT_S": "60", **env}, timeout=300)
    assert code == 0, output[-8000:]
    assert len(results) == 2 and all(r["build"] == "low_latency" for r in results), results
    _check_logfmt(results)
    print("\n".join(str(r["logfmt"]) for r in results))


def test_low_latency_through_nvshmem_puts():
    """The path a cluster without NVLink between nodes takes (NVSHMEM puts + signals), forced on one node."""
    env = two_ranks()
    pytest.importorskip("torch")
    code, output, results = run_ranks("launch", 2, "tests/ranks/low_latency.py", "--quick",
                                      env={"EPJIT_TIMEOUT_S": "60", "EPJIT_LL_FORCE_PUTS": "1", **env}, timeout=400)
    assert code == 0, output[-8000:]
    _check(results, 2)
    assert all(r["force_puts"] == "1" and r["build"] == "low_latency_puts" for r in results), results


@pytest.mark.parametrize("n, shared", [p for p in RANKS if p.values[0] <= 4])
def test_low_latency_put_path_as_nvlink_stores(n, shared):
    """EPJIT_LL_FORCE_PUTS with EPJIT_RDMA_BY_STORES: the put path (staging, puts, quiet, signals) with its puts as
    NVLink stores on IPC memory, the build without NVSHMEM (what compute-sanitizer checks of the put path)."""
    env = placement(n, shared)
    pytest.importorskip("torch")
    code, output, results = run_ranks("launch", n, "tests/ranks/low_latency.py", "--quick",
                                      env={"EPJIT_TIMEOUT_S": "60", "EPJIT_LL_FORCE_PUTS": "1",
                                           "EPJIT_RDMA_BY_STORES": "1", **env}, timeout=400)
    assert code == 0, output[-8000:]
    _check(results, n)
    for r in results:
        assert r["build"] == "low_latency_stores" and r["symmetric"] == "IpcHeap", r
        assert r["nvshmem_initialised"] == 0, r


def test_low_latency_across_virtual_nodes():
    """4 ranks as 2 nodes x 2 (num_nvl_ranks=2): a rank reaches its node's other rank through NVLink stores and the
    other node's two through NVSHMEM puts, the mix a cluster runs, on one host (sharing GPUs where there are fewer
    than 4)."""
    require_gpus(1)
    env = placement(4, gpu_count() < 4)
    pytest.importorskip("torch")
    code, output, results = run_ranks("launch", 4, "tests/ranks/low_latency.py", "--quick", "--num-nvl-ranks", "2",
                                      env={"EPJIT_TIMEOUT_S": "60", **env}, timeout=600)
    assert code == 0, output[-8000:]
    _check(results, 4)
    for r in results:
        assert r["num_nvl_ranks"] == 2 and r["build"] == "low_latency_puts", r
        node = r["rank"] // 2
        assert r["nvlink_peers"] == [2 * node, 2 * node + 1], r  # itself and its node's other rank, no one else


def test_a_rank_that_stops_sending_times_out_naming_it():
    env = two_ranks()
    pytest.importorskip("torch")
    code, output, _ = run_ranks("launch", 2, "tests/ranks/low_latency_timeout.py",
                                env={"EPJIT_TIMEOUT_S": "3", **env}, timeout=120)
    assert code != 0, output[-4000:]
    assert "EpjitTimeoutError" in output and "rank 0 timed out" in output, output[-4000:]
    assert "ll_dispatch" in output and "waiting for peer rank 1" in output, output[-4000:]


@pytest.mark.parametrize("mode", ["update", "stop", "kill"])
def test_shrink_mode_goes_on_without_a_rank_that_leaves(mode):
    """Shrink mode (enable_shrink): rank 1 leaves a decode loop at iteration 3, masked by every live rank
    (update), by the others' waits that time out (stop), or SIGKILLed between its dispatch and its combine (kill).
    The survivors finish the loop with every output as the reference's with the masked rank out, the mask naming it,
    then clean the buffer without it and run again; every rank ends on its own."""
    n, output, results = run_shrink_loop("tests/ranks/low_latency_shrink.py", mode)
    assert sorted(r["rank"] for r in results) == [r for r in range(n) if r != 1], output[-4000:]
    for r in results:
        assert all(after == [[], []] for after in r["masks"][:3]), r  # before rank 1 leaves: nobody masked
        assert all(after == [[1], [1]] for after in r["masks"][4:]) and r["after_clean"] == [[1], [1]], r
        leaving = r["masks"][3]
        assert leaving == ([[], [1]] if mode == "kill" else [[1], [1]]), r
        if mode == "update":
            assert r["reports"] == [], r  # masked by the caller: no wait had to
        else:
            assert [(x["rank"], x["peer"]) for x in r["reports"]] == [(r["rank"], 1)], r
            assert 2.9e9 < r["reports"][0]["elapsed_ns"] < 10e9, r
    print("\n".join(str(r) for r in results))
