"""GPU tier of the foundation: peer memory, the NVLink barrier and the NVSHMEM put + signal, on 2 and 4 ranks
(and ranks sharing GPUs where there are fewer GPUs than ranks: tests/gpu.py's RANKS), under epjit.launch and under
mpirun; a rank that never arrives becomes a timeout error naming it."""

from __future__ import annotations

import time

import pytest

from .gpu import RANKS, placement, run_ranks, two_ranks

pytestmark = pytest.mark.gpu
SCRIPT = "tests/ranks/peer_memory.py"


@pytest.mark.parametrize("launcher", ["launch", "mpirun"])
@pytest.mark.parametrize("n, shared", RANKS)
def test_barrier_and_nvshmem(n, shared, launcher):
    code, output, results = run_ranks(launcher, n, SCRIPT, env=placement(n, shared))
    assert code == 0, output[-6000:]
    assert [r["rank"] for r in results] == list(range(n)), output[-4000:]
    for r in results:
        assert r["size"] == n
        assert r["nvl_exchange_errors"] == 0
        assert r["nvshmem_put_errors"] == 0
        assert r["direct_peers"], "NVSHMEM gave no NVLink pointer to a peer on the same host"
        assert r["nvshmem_direct_errors"] == 0
    print("\n".join(str(r) for r in results))


@pytest.mark.parametrize("skip_in", ["barrier", "nvshmem"])
def test_missing_rank_times_out(skip_in):
    env = two_ranks()
    start = time.monotonic()
    code, output, _ = run_ranks("launch", 2, SCRIPT, "--skip-rank", "1", "--skip-in", skip_in,
                                env={"EPJIT_TIMEOUT_S": "3", **env}, timeout=120)
    elapsed = time.monotonic() - start
    assert code != 0, output[-4000:]
    assert "EpjitTimeoutError" in output and "rank 0 timed out" in output, output[-4000:]
    assert "waiting for peer rank 1" in output, output[-4000:]
    assert elapsed < 90, f"took {elapsed:.0f} s"
