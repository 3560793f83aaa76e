"""One rank of the shrink-mode GPU check: a decode loop (low-latency dispatch then combine, repeated) on a Buffer
made with enable_shrink, where rank VICTIM leaves at iteration LEAVE_AT, and every other rank checks every
iteration's outputs against epjit.reference with the ranks its mask named after each call.

    --mode update  every live rank masks VICTIM (low_latency_update_mask_buffer) before LEAVE_AT; VICTIM stops
    --mode stop    VICTIM stops calling without anyone masking it: the others' waits time out and mask it
    --mode kill    VICTIM is SIGKILLed between its dispatch and its combine of LEAVE_AT

Each rank's work runs in a child process (--worker), so a rank SIGKILLed is the child and its rank exits 0: the
launcher, which ends the job when a rank fails, lets the survivors finish. After the loop the survivors clean the
buffer (shrink mode's clean needs no dead rank), run one more iteration, print ``RESULT {json}`` and leave with
os._exit(0): a Buffer shared with a dead rank cannot be closed collectively.

    EPJIT_SHRINK_TIMEOUT_S=3 python -m epjit.launch -n 4 tests/ranks/low_latency_shrink.py --mode kill
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from intranode import same, to_numpy, to_torch  # noqa: E402  (sibling rank script)
from low_latency import expert_outputs, make_inputs, sync  # noqa: E402
from shrink_loop import ITERATIONS, LEAVE_AT, VICTIM, finish, read_mask, run_in_child  # noqa: E402

import epjit
from epjit import reference

M, HIDDEN, TOPK = 16, 1024, 4


def masked_now(buf, n: int) -> set[int]:
    return read_mask(buf, buf.low_latency_query_mask_buffer, n)


def iteration(buf, rank: int, n: int, seed: int, experts: int) -> tuple[set[int], set[int]]:
    """One dispatch + combine, checked against the reference with the mask after each; returns the two masks."""
    xs, idxs, ws = make_inputs(seed, [M - r for r in range(n)], HIDDEN, TOPK, experts, 0.1)
    x, idx, w = to_torch(xs[rank]), to_torch(idxs[rank]), to_torch(ws[rank])
    d = buf.low_latency_dispatch(x, idx, M, experts, use_fp8=False)
    sync(buf)
    after_dispatch = masked_now(buf, n)
    want = reference.low_latency_dispatch(xs, idxs, M, experts, use_fp8=False, masked_ranks=after_dispatch)
    name = f"iteration seed={seed} masked={sorted(after_dispatch)}"
    same(f"{name} recv_count", to_numpy(d.recv_count), want[rank].recv_count)
    same(f"{name} layout_range", to_numpy(d.handle.layout_range), want[rank].handle.layout_range)
    got_x = to_numpy(d.x)
    for e, count in enumerate(want[rank].recv_count.tolist()):
        same(f"{name} x[{e}]", got_x[e, :count], want[rank].x[e, :count])
    y = to_torch(expert_outputs(to_numpy(d.handle.src_info), to_numpy(d.handle.layout_range), xs, rank, experts))
    c = buf.low_latency_combine(y, idx, w, d.handle)
    sync(buf)
    after_combine = masked_now(buf, n)
    ys = [None if r_ is None else expert_outputs(r_.handle.src_info, r_.handle.layout_range, xs, r, experts)
          for r, r_ in enumerate(want)]
    ref_c = reference.low_latency_combine(ys, idxs, ws, [None if r_ is None else r_.handle for r_ in want],
                                          masked_ranks=after_combine)
    same(f"{name} combined (masked after it: {sorted(after_combine)})", to_numpy(c.x), ref_c[rank].x)
    return after_dispatch, after_combine


def worker(mode: str) -> int:
    group = epjit.init()
    torch.cuda.set_device(group.device)
    rank, n = group.rank, group.size
    experts = 4 * n
    buf = epjit.Buffer(group, low_latency_mode=True, num_max_dispatch_tokens_per_rank=M, hidden=HIDDEN,
                       num_experts=experts, enable_shrink=True)
    masks, started = [], time.monotonic()
    for i in range(ITERATIONS):
        if i == LEAVE_AT and mode == "update" and rank != VICTIM:
            buf.low_latency_update_mask_buffer(VICTIM, True)
        if i == LEAVE_AT and rank == VICTIM:
            if mode == "kill":  # its dispatch of this iteration runs with the others; its combine never does
                xs, idxs, _ = make_inputs(1000 + i, [M - r for r in range(n)], HIDDEN, TOPK, experts, 0.1)
                buf.low_latency_dispatch(to_torch(xs[rank]), to_torch(idxs[rank]), M, experts, use_fp8=False)
                sync(buf)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(30)  # stopped: alive (its memory mapped) while the others finish, then gone
            os._exit(0)
        masks.append([sorted(m) for m in iteration(buf, rank, n, 1000 + i, experts)])
    buf.clean_low_latency_buffer()
    after_clean = iteration(buf, rank, n, 2000, experts)
    finish(rank, mode, masks, [sorted(m) for m in after_clean], buf.low_latency_mask_reports(), started)
    return 0


if __name__ == "__main__":
    sys.exit(run_in_child(__file__, worker))
