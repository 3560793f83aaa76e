"""One rank of the foundation's GPU check: init, peer memory, NVLink barrier + exchange, NVSHMEM put + signal.

Run by tests/test_gpu_foundation.py under ``python -m epjit.launch -n N`` and under ``mpirun -np N``:

    python -m epjit.launch -n 4 tests/ranks/peer_memory.py [--skip-rank R] [--rounds K]

With ``--skip-rank R`` rank R skips the barrier (or the NVSHMEM signal): the others must raise
EpjitTimeoutError naming rank R (set EPJIT_TIMEOUT_S low). Prints one ``RESULT {json}`` line per rank.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

t_start = time.perf_counter()

import cupy  # noqa: E402

import epjit  # noqa: E402
from epjit.kernels import BarrierSpec, PutSignalCheckSpec  # noqa: E402
from epjit.memory import PeerMemory  # noqa: E402
from epjit.ops.loader import load  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-rank", type=int, default=-1)
    parser.add_argument("--skip-in", choices=["barrier", "nvshmem"], default="barrier")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--nvl-bytes", type=int, default=64 << 20)
    parser.add_argument("--rdma-bytes", type=int, default=64 << 20)
    args = parser.parse_args()

    t0 = time.perf_counter()
    group = epjit.init()
    t_init = time.perf_counter() - t0
    t0 = time.perf_counter()
    mem = PeerMemory.create(group, args.nvl_bytes, args.rdma_bytes)
    t_mem = time.perf_counter() - t0

    result: dict = {"rank": group.rank, "size": group.size, "backend": group.backend, "parts": mem.setup_seconds,
                    "init_s": round(t_init, 3), "peer_memory_s": round(t_mem, 3)}
    try:
        t0 = time.perf_counter()
        barrier = load(BarrierSpec(group.num_nvl_ranks), group.device)
        checks = {direct: load(PutSignalCheckSpec(direct), group.device) for direct in (False, True)}
        result["load_s"] = round(time.perf_counter() - t0, 3)
        result["compiled_now"] = [m.spec.family for m in (barrier, *checks.values()) if not m.compiled.from_cache]

        errors = cupy.zeros(1, dtype=cupy.int32)
        num_ints = 1 << 16  # 4 sources x 256 KiB: enough to catch a barrier that lets a reader in early
        skip = args.skip_rank if args.skip_in == "barrier" else -1
        barrier.launch(barrier.spec.args("nvl_exchange_check", peers=mem.table_ptr, num_rounds=args.rounds,
                                         num_ints=num_ints, skip_rank=skip, errors=errors), 1, 512)
        mem.synchronize()
        result["nvl_exchange_errors"] = int(errors.get()[0])

        t0 = time.perf_counter()
        barrier_args = barrier.spec.args("nvl_barrier", peers=mem.table_ptr)
        for _ in range(100):
            barrier.launch(barrier_args, 1, 32)
        mem.synchronize()
        result["nvl_barrier_us"] = round((time.perf_counter() - t0) / 100 * 1e6, 1)

        result["direct_peers"] = mem.sym.has_direct_peers
        for direct, module in checks.items():
            if direct and not mem.sym.has_direct_peers:
                continue
            errors.fill(0)
            skip = args.skip_rank if args.skip_in == "nvshmem" else -1
            for round_ in range(1, 9):
                # Fresh rounds only after everyone checked the last one: the inbox is reused.
                group.barrier()
                module.launch(module.spec.args("put_signal_check", peers=mem.table_ptr, round=round_ + 8 * direct,
                                               num_ints=4096, skip_rank=skip, errors=errors), group.size, 256)
                mem.synchronize()
            result[f"nvshmem_{'direct' if direct else 'put'}_errors"] = int(errors.get()[0])
        group.barrier()
    finally:
        mem.close()
    result["total_s"] = round(time.perf_counter() - t_start, 3)
    print("RESULT " + json.dumps(result), flush=True)
    bad = {k: v for k, v in result.items() if k.endswith("_errors") and v}
    if bad:
        print(f"rank {group.rank}: wrong data {bad}", file=sys.stderr)
        return 1
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
