"""One rank of the kernel lab's GPU check: a kernel of the user's own over epjit.lab.Peers, an all-gather of one
row per rank through every rank's NVLink buffer with epjit's in-kernel barrier, checked; then, with
``--wait-forever``, a timed wait nobody ends, which must become EpjitTimeoutError naming the rank.

    python -m epjit.launch -n 2 tests/ranks/lab_peers.py [--wait-forever]

Prints one ``RESULT {json}`` line per rank.
"""

from __future__ import annotations

import argparse
import json
import sys

import cupy

import epjit
import epjit.lab

SOURCE = r"""
#include "barrier.cuh"

// One block: write my row into slot [my nvl rank] of every rank's payload, barrier (which fences those writes
// system-wide first), copy every rank's row of my payload out, barrier again (no rank overwrites a row before
// everyone has read it, should the kernel run again).
extern "C" __global__ void all_gather_row(const epjit::PeersTable* peers, const int* row, int row_ints, int* out) {
    const int me = peers->nvl_rank;
    for (int dst = 0; dst < NUM_NVL_RANKS; ++dst) {
        int* slot = epjit::nvl_ptr<int>(peers, dst, epjit::kNvlHeaderBytes) + static_cast<int64_t>(me) * row_ints;
        for (int i = threadIdx.x; i < row_ints; i += blockDim.x) slot[i] = row[i];
    }
    epjit::nvl_barrier_block<NUM_NVL_RANKS>(peers, "all_gather_row: peer's rows written");
    const int* mine = epjit::nvl_ptr<int>(peers, me, epjit::kNvlHeaderBytes);
    for (int i = threadIdx.x; i < NUM_NVL_RANKS * row_ints; i += blockDim.x) out[i] = mine[i];
    epjit::nvl_barrier_block<NUM_NVL_RANKS>(peers, "all_gather_row: peers' rows read");
}

// A flag in my payload's last int that nobody sets: the timed wait must expire and report.
extern "C" __global__ void wait_forever(const epjit::PeersTable* peers, int flag_index) {
    const int* flag = epjit::nvl_ptr<int>(peers, peers->nvl_rank, epjit::kNvlHeaderBytes) + flag_index;
    if (threadIdx.x == 0) {
        const epjit::WaitSite site{"wait_forever: flag < 1", -1, -1, 1};
        epjit::timeout_while(peers, site, [&](int64_t& observed) {
            observed = epjit::ptx::ld_acquire_sys_s32(flag);
            return observed < 1;
        });
    }
}
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wait-forever", action="store_true")
    args = parser.parse_args()
    group = epjit.init()
    n = group.num_nvl_ranks
    row_ints = 1000
    module = epjit.lab.compile(SOURCE, defines={"NUM_NVL_RANKS": n})
    peers = epjit.lab.Peers(group, 4 * row_ints * n + 4)
    result: dict = {"rank": group.rank, "size": group.size, "from_cache": module.from_cache}
    row = cupy.arange(row_ints, dtype=cupy.int32) + 1_000_000 * group.nvl_rank
    out = cupy.full(n * row_ints, -1, dtype=cupy.int32)
    module.all_gather_row(grid=1, block=256, peers=peers.table, row=row, row_ints=row_ints, out=out)
    peers.synchronize()
    expected = (cupy.arange(row_ints, dtype=cupy.int32)[None, :]
                + 1_000_000 * cupy.arange(n, dtype=cupy.int32)[:, None]).ravel()
    result["gather_errors"] = int((out != expected).sum())
    peers.barrier()
    peers.synchronize()
    # Before the wait that must fail: a rank the launcher ends when its peer fails first has reported already.
    print("RESULT " + json.dumps(result), flush=True)
    if args.wait_forever:
        module.wait_forever(grid=1, block=32, peers=peers.table, flag_index=row_ints * n)
        peers.synchronize()  # raises EpjitTimeoutError: the launcher ends every rank
    peers.close()
    group.close()
    return 1 if result["gather_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
