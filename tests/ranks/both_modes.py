"""One rank of the GPU check of one Buffer serving both modes across virtual NVLink nodes: a Buffer made with
low_latency_mode=True, num_nvl_bytes and num_rdma_bytes the sum of the two hints, whose normal-mode calls
(tests/ranks/intranode.py's cases, against epjit.reference's two-level combine) and low-latency calls
(tests/ranks/low_latency.py's, against the reference) alternate, with a low-latency dispatch whose receive half runs
after a normal-mode call; then a normal-mode Buffer given low-latency mode after its first calls (what
epjit.deep_ep does at its first low-latency call), the same alternation on it. Every rank builds every rank's inputs
from the same seed and checks its own outputs. Prints ``RESULT {json}``; exits non-zero on the first mismatch.

    python -m epjit.launch -n 4 tests/ranks/both_modes.py --num-nvl-ranks 2
"""

from __future__ import annotations

import argparse
import sys
import time

import intranode  # noqa: E402  (sibling rank scripts)
import low_latency
import torch
from intranode import Mismatch, to_numpy, to_torch

import epjit
from epjit import reference

M, HIDDEN, TOPK, EXPERTS = 64, 7168, 8, 256  # low-latency mode's sizes; normal mode's cases take their own


def sizes(group) -> tuple[int, int, int]:
    """(num_nvl_bytes, normal mode's heap bytes, low-latency mode's) for the group."""
    R, V = group.size, group.num_nvl_ranks
    return (epjit.Buffer.get_normal_size_hint(R, HIDDEN, TOPK, EXPERTS, num_nvl_ranks=V),
            epjit.Buffer.get_rdma_size_hint(R, HIDDEN, TOPK, EXPERTS, num_nvl_ranks=V),
            epjit.Buffer.get_low_latency_size_hint(M, HIDDEN, R, EXPERTS))


def normal_case(buf, rank: int, R: int, seed: int, fp8: bool, sms: int = 0) -> None:
    intranode.run_case(buf, rank, R, seed, [0] + [127] * (R - 1), HIDDEN, TOPK, EXPERTS, fp8, 0.1, sms=sms,
                       fp8_combine=not fp8)


def low_latency_case(buf, rank: int, R: int, seed: int, fp8: bool, hook: bool) -> float:
    return low_latency.run_case(buf, rank, R, seed, [M - 3 * r for r in range(R)], TOPK, 0.1, fp8, False, False,
                                hook)["diff"]


def interleaved(buf, rank: int, R: int, seed: int) -> None:
    """A low-latency dispatch's send half, a whole normal-mode call, then its receive half and its combine: the
    modes' regions are apart, so neither disturbs the other."""
    counts = [M - r for r in range(R)]
    xs, idxs, ws = low_latency.make_inputs(seed, counts, HIDDEN, TOPK, EXPERTS, 0.1)
    idx = to_torch(idxs[rank])
    d = buf.low_latency_dispatch(to_torch(xs[rank]), idx, M, EXPERTS, use_fp8=True, return_recv_hook=True)
    normal_case(buf, rank, R, seed + 1, fp8=False)
    d.hook()
    low_latency.sync(buf)
    want = reference.low_latency_dispatch(xs, idxs, M, EXPERTS, use_fp8=True)
    low_latency.check_dispatch(f"interleaved seed={seed}", d, want[rank])
    y = to_torch(low_latency.expert_outputs(to_numpy(d.handle.src_info), to_numpy(d.handle.layout_range), xs, rank,
                                            EXPERTS))
    c = buf.low_latency_combine(y, idx, to_torch(ws[rank]), d.handle)
    low_latency.sync(buf)
    intranode.same(f"interleaved seed={seed} combined", to_numpy(c.x),
                   low_latency.expected_combine(xs[rank], idxs[rank], ws[rank]))


def alternate(buf, rank: int, R: int, seed: int) -> int:
    """Normal-mode and low-latency calls in turn on ``buf``; returns the cases run."""
    cases = 0
    for i, (fp8, hook, sms) in enumerate([(False, False, 0), (True, True, 0), (False, True, 6), (True, False, 0)]):
        normal_case(buf, rank, R, seed + 10 * i, fp8, sms)
        diff = low_latency_case(buf, rank, R, seed + 10 * i + 5, fp8, hook)
        if not diff < 1e-3:
            raise Mismatch(f"low-latency calc_diff {diff} on a Buffer of both modes")
        cases += 2
    interleaved(buf, rank, R, seed + 100)
    return cases + 2


def regions(buf) -> dict:
    """Where each mode's region lies in the heap: normal mode's from its start, low latency's its last bytes."""
    heap, region = buf.mem.sym, buf._low_latency.ops.mem.sym
    offset = region.base - heap.base
    pairs = zip(region.peer_ptrs, heap.peer_ptrs, strict=True)
    return {"heap": heap.num_bytes, "low_latency_offset": offset, "low_latency_bytes": region.num_bytes,
            "normal_bytes": buf.num_rdma_bytes - buf._normal.res.low_latency_heap_bytes,
            "peers_moved": all(p == q + offset if q else p == 0 for p, q in pairs)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-nvl-ranks", type=int, required=True, help="ranks a node, below the ranks")
    args = parser.parse_args()
    group = epjit.init(num_nvl_ranks=args.num_nvl_ranks)
    torch.cuda.set_device(group.device)
    R, rank = group.size, group.rank
    intranode.NVL_RANKS = group.num_nvl_ranks
    started = time.perf_counter()
    nvl, normal, ll = sizes(group)
    result: dict = {"rank": rank, "size": R, "cases": 0}
    with epjit.Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=normal + ll, low_latency_mode=True,
                      num_max_dispatch_tokens_per_rank=M, hidden=HIDDEN, num_experts=EXPERTS) as buf:
        result.update(regions(buf), symmetric=type(buf.mem.sym).__name__,
                      kernels=[buf._normal._spec_of(buf._normal.dispatch_config).family,
                               buf._low_latency.ops.module.spec.family])
        result["cases"] += alternate(buf, rank, R, 1000)
    with epjit.Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=normal + ll) as later:
        normal_case(later, rank, R, 2000, fp8=False)
        later._add_low_latency(M, HIDDEN, EXPERTS)
        result["later"] = regions(later)
        result["cases"] += 1 + alternate(later, rank, R, 3000)
    return low_latency.finish(result, [], group, started)


if __name__ == "__main__":
    sys.exit(main())
