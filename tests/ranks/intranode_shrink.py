"""One rank of normal-mode shrink inside one node on GPUs: a loop of layout, dispatch and combine on a normal-mode
Buffer made with enable_shrink, where rank VICTIM leaves at iteration LEAVE_AT, and every other rank checks every
iteration's outputs against epjit.reference with the ranks its mask named after each call (masked_ranks).

    --mode update  every live rank masks VICTIM (update_mask) before LEAVE_AT; VICTIM stops calling but stays, and
                   after the loop every rank, VICTIM too, cleans the mask (collective) and runs once more, unmasked
    --mode stop    VICTIM stops calling without anyone masking it: the others' notify barrier times out and masks it
    --mode kill    VICTIM is SIGKILLed between its dispatch and its combine of LEAVE_AT: the others' combine waits
                   mask it, and their combine is the reference's with it masked (docs/reliability.md)

Each rank's work runs in a child process (--worker), so a rank SIGKILLed is the child and its rank exits 0: the
launcher, which ends the job when a rank fails, lets the survivors finish. They print ``RESULT {json}`` and leave with
os._exit(0): a Buffer shared with a dead rank cannot be closed collectively.

    EPJIT_SHRINK_TIMEOUT_S=3 python -m epjit.launch -n 4 tests/ranks/intranode_shrink.py --mode kill
"""

from __future__ import annotations

import os
import signal
import sys
import time

import cupy
import numpy as np
import torch
from intranode import BF16, make_inputs, same, to_numpy, to_torch  # noqa: E402  (sibling script)
from low_latency import sync  # noqa: E402
from shrink_loop import ITERATIONS, LEAVE_AT, VICTIM, finish, read_mask, run_in_child  # noqa: E402

import epjit
from epjit import reference

M, HIDDEN, TOPK = 24, 1024, 4


def masked_now(buf, n: int) -> set[int]:
    return read_mask(buf, buf.query_mask, n)


def inputs(seed: int, n: int, experts: int):
    return make_inputs(seed, [M - 2 * r for r in range(n)], HIDDEN, TOPK, experts, 0.1)


def dispatch(buf, rank: int, seed: int, n: int, experts: int):
    xs, idxs, ws = inputs(seed, n, experts)
    idx = to_torch(idxs[rank])
    layout = buf.get_dispatch_layout(idx, experts)
    return buf.dispatch(to_torch(xs[rank]), topk_idx=idx, topk_weights=to_torch(ws[rank]), layout=layout)


def iteration(buf, rank: int, n: int, seed: int, experts: int) -> tuple[set[int], set[int]]:
    """Layout, dispatch and combine, checked against the reference with the mask after each; returns the masks."""
    xs, idxs, ws = inputs(seed, n, experts)
    d = dispatch(buf, rank, seed, n, experts)
    sync(buf)
    after_dispatch = masked_now(buf, n)
    want = reference.dispatch(xs, idxs, ws, experts, masked_ranks=after_dispatch)
    mine, name = want[rank], f"seed={seed} masked={sorted(after_dispatch)}"
    m = mine.handle.num_recv_tokens
    assert d.handle.num_recv_tokens == m, (name, d.handle.num_recv_tokens, m)
    assert d.num_recv_tokens_per_expert == list(mine.num_recv_tokens_per_expert), (
        name, d.num_recv_tokens_per_expert, mine.num_recv_tokens_per_expert)
    same(f"{name} rank_prefix_matrix[:, {rank}]", cupy.asnumpy(d.handle.rank_prefix_matrix)[:, rank],
         mine.handle.rank_prefix_matrix[:, rank])
    same(f"{name} recv_x", to_numpy(d.x)[:m], mine.x[:m])
    same(f"{name} recv_topk_idx", to_numpy(d.topk_idx)[:m], mine.topk_idx[:m])
    same(f"{name} recv_topk_weights", to_numpy(d.topk_weights)[:m], mine.topk_weights[:m])
    # Expert "outputs": each rank's received rows scaled by its rank, exact in bf16 arithmetic.
    ys = [None if r_ is None else (r_.x.astype(np.float32) * (1.0 + 0.5 * r)).astype(BF16)
          for r, r_ in enumerate(want)]
    y = np.zeros((d.handle.num_rows, HIDDEN), dtype=BF16)
    y[:m] = ys[rank][:m]
    c = buf.combine(to_torch(y), d.handle, topk_weights=d.topk_weights)
    sync(buf)
    after_combine = masked_now(buf, n)
    ref_c = reference.combine(ys, [None if r_ is None else r_.handle for r_ in want],
                              topk_weights=[None if r_ is None else r_.topk_weights for r_ in want],
                              masked_ranks=after_combine)
    name = f"{name} (masked after combine: {sorted(after_combine)})"
    same(f"{name} combined_x", to_numpy(c.x), ref_c[rank].x)
    same(f"{name} combined_topk_weights", to_numpy(c.topk_weights), ref_c[rank].topk_weights)
    return after_dispatch, after_combine


def leave(buf, mode: str, rank: int, n: int, experts: int) -> None:
    """VICTIM at LEAVE_AT: killed after its dispatch, stopped, or (update) waiting to clean and rejoin."""
    if mode == "kill":  # its dispatch of this iteration runs with the others; its combine never does
        dispatch(buf, rank, 1000 + LEAVE_AT, n, experts)
        sync(buf)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "stop":
        time.sleep(30)  # stopped: alive (its memory mapped) while the others finish, then gone
        os._exit(0)


def worker(mode: str) -> int:
    group = epjit.init()
    torch.cuda.set_device(group.device)
    rank, n = group.rank, group.size
    experts = 4 * n
    buf = epjit.Buffer(group, epjit.Buffer.get_normal_size_hint(n, HIDDEN, TOPK, experts), enable_shrink=True)
    masks, started = [], time.monotonic()
    for i in range(ITERATIONS):
        if i == LEAVE_AT and mode == "update" and rank != VICTIM:
            buf.update_mask(VICTIM, True)
        if i == LEAVE_AT and rank == VICTIM:
            leave(buf, mode, rank, n, experts)
            break  # update: it waits in clean_mask for the others' loop to end
        masks.append([sorted(m) for m in iteration(buf, rank, n, 1000 + i, experts)])
    reports = buf.mask_reports()
    after_clean = None
    if mode == "update":  # every rank live: the collective clean, then one iteration with nobody masked
        buf.clean_mask()
        after_clean = [sorted(m) for m in iteration(buf, rank, n, 2000, experts)]
    finish(rank, mode, masks, after_clean, reports, started)
    return 0


if __name__ == "__main__":
    sys.exit(run_in_child(__file__, worker))
