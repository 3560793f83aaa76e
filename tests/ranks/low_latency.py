"""One rank of the low-latency GPU check: dispatch (FP8 with plain, rounded and UE8M0 scales, and bf16) and combine
against epjit.reference, with and without the receive hook, captured in a CUDA graph and replayed, 1000 calls
alternating the buffer sets, the Safe rules, and the LogFMT combine (use_logfmt=True) against the reference. Every
rank builds every rank's inputs from the same seed and checks its own outputs. Prints ``RESULT {json}``; exits
non-zero on the first mismatch.

    python -m epjit.launch -n 4 tests/ranks/low_latency.py [--quick] [--loops 1000] [--logfmt-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from intranode import BF16, Mismatch, same, to_numpy, to_torch  # noqa: E402  (sibling rank script)

import epjit
from epjit import reference

os.environ.setdefault("EPJIT_POISON_OUTPUTS", "1")


def sync(buf) -> None:
    """Wait for the GPU; a kernel that timed out becomes EpjitTimeoutError saying what it waited for."""
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (the CUDA error of a trapped kernel, from whichever library saw it)
        buf.mem.raise_for(e)


def make_inputs(seed: int, counts: list[int], hidden: int, topk: int, num_experts: int, holes: float,
                repeats: bool = False):
    """Every rank's x, topk_idx, topk_weights. With ``repeats`` a token may name an expert twice."""
    rng = np.random.default_rng(seed)
    xs, idxs, ws = [], [], []
    for n in counts:
        xs.append((rng.standard_normal((n, hidden), dtype=np.float32) * 3).astype(BF16))
        if repeats:
            idx = rng.integers(0, num_experts, (n, topk)).astype(np.int64)
        else:
            idx = np.argsort(rng.random((n, num_experts)), axis=1)[:, :topk].astype(np.int64)
        if holes:
            idx[rng.random(idx.shape) < holes] = -1
        idxs.append(idx)
        ws.append(rng.random((n, topk), dtype=np.float32))
    return xs, idxs, ws


def expert_factor(expert: np.ndarray | int) -> np.ndarray:
    """What the test's expert g does to a token: multiply by 2**(g % 4 - 2), exact in bf16 and float32."""
    return np.ldexp(np.float32(1), (np.asarray(expert) % 4) - 2).astype(np.float32)


def expert_outputs(src_info: np.ndarray, layout_range: np.ndarray, xs: list[np.ndarray], rank: int,
                   num_experts: int) -> np.ndarray:
    """y for combine in a received layout (the GPU's or the reference's): row (e, i) from source s, token t is
    xs[s][t] * factor(expert); rows past each expert's count are NaN, so a combine that reads them shows it."""
    num_ranks = layout_range.shape[1]
    num_local = num_experts // num_ranks
    begins, counts = reference.unpack_layout_range(layout_range)
    y = np.full(src_info.shape + (xs[0].shape[1],), np.nan, dtype=np.float32)
    for e in range(num_local):
        for s in range(num_ranks):
            rows = slice(int(begins[e, s]), int(begins[e, s] + counts[e, s]))
            y[e, rows] = xs[s][src_info[e, rows]].astype(np.float32) * expert_factor(rank * num_local + e)
    return y.astype(BF16)


def expected_combine(x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The reference's combine formula for the test's experts: bf16(sum_k w * float32(x * factor)) in k order."""
    acc = np.zeros(x.shape, dtype=np.float32)
    for k in range(idx.shape[1]):
        valid = idx[:, k] >= 0
        y = x.astype(np.float32) * expert_factor(np.where(valid, idx[:, k], 0))[:, None]
        acc[valid] += (y * w[:, k][:, None])[valid]
    return acc.astype(BF16)


def check_dispatch(name: str, d, want: reference.LowLatencyDispatchResult) -> None:
    recv_count = to_numpy(d.recv_count)
    same(f"{name} recv_count", recv_count, want.recv_count)
    same(f"{name} layout_range", to_numpy(d.handle.layout_range), want.handle.layout_range)
    src_info, x = to_numpy(d.handle.src_info), to_numpy(d.x)
    scales = to_numpy(d.x_scales) if d.x_scales is not None else None
    for e, n in enumerate(recv_count.tolist()):
        same(f"{name} src_info[{e}]", src_info[e, :n], want.src_info[e, :n])
        same(f"{name} x[{e}]", x[e, :n], want.x[e, :n])
        if scales is not None:
            same(f"{name} x_scales[{e}]", scales[e, :n], want.x_scales[e, :n])


def deepep_diff(d, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, buf, use_fp8: bool, ue8m0: bool) -> float:
    """DeepEP's test: combine the dequantised dispatch output with identity experts; compare with x * sum(w)."""
    if use_fp8:
        scales = d.x_scales.float() if not ue8m0 else torch.ldexp(torch.ones_like(d.x_scales, dtype=torch.float32),
                                                                   d.x_scales.to(torch.int32) - 127)
        y = (d.x.float() * scales.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
    else:
        y = d.x
    c = buf.low_latency_combine(y, idx, w, d.handle)
    if x.shape[0] == 0:
        return 0.0
    want = (x.float() * (w * (idx >= 0)).sum(1, keepdim=True)).to(torch.bfloat16)
    return reference.calc_diff(to_numpy(c.x).astype(np.float32), to_numpy(want).astype(np.float32))


def run_case(buf, rank: int, R: int, seed: int, counts: list[int], topk: int, holes: float, use_fp8: bool,
             round_scale: bool, ue8m0: bool, hook: bool, repeats: bool = False, small: bool = False) -> dict:
    m, hidden, experts = buf.num_max_dispatch_tokens_per_rank, buf.hidden, buf.num_experts
    xs, idxs, ws = make_inputs(seed, counts, hidden, topk, experts, holes, repeats)
    x, idx, w = to_torch(xs[rank]), to_torch(idxs[rank]), to_torch(ws[rank])
    name = (f"case seed={seed} counts={counts} H={hidden} E={experts} top-{topk} fp8={use_fp8} round={round_scale} "
            f"ue8m0={ue8m0} hook={hook}")
    d = buf.low_latency_dispatch(x, idx, m, experts, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=ue8m0,
                                 return_recv_hook=hook)
    if hook:
        d.hook()
    sync(buf)
    want = reference.low_latency_dispatch(xs, idxs, m, experts, use_fp8=use_fp8, round_scale=round_scale,
                                          use_ue8m0=ue8m0)
    check_dispatch(name, d, want[rank])

    y = to_torch(expert_outputs(to_numpy(d.handle.src_info), to_numpy(d.handle.layout_range), xs, rank,
                                experts))
    c = buf.low_latency_combine(y, idx, w, d.handle, return_recv_hook=hook)
    if hook:
        c.hook()
    sync(buf)
    same(f"{name} combined", to_numpy(c.x), expected_combine(xs[rank], idxs[rank], ws[rank]))
    if small:  # the reference's own combine, which needs every rank's y in the reference layout
        ys = [expert_outputs(want[r].src_info, want[r].layout_range, xs, r, experts) for r in range(R)]
        ref_c = reference.low_latency_combine(ys, idxs, ws, [r_.handle for r_ in want])
        same(f"{name} combined vs reference.low_latency_combine", to_numpy(c.x), ref_c[rank].x)
    out = torch.full_like(x, float("nan"))
    c2 = buf.low_latency_combine(y, idx, w, d.handle, out=out)
    sync(buf)
    if c2.x.data_ptr() != out.data_ptr():
        raise Mismatch(f"{name}: combine(out=) returned another array")
    same(f"{name} combined into out", to_numpy(out), to_numpy(c.x))
    diff = deepep_diff(d, x, idx, w, buf, use_fp8, ue8m0)  # every rank calls combine: they stay in step
    limit = 1e-3 if use_fp8 else 1e-5
    if not diff < limit:
        raise Mismatch(f"{name}: DeepEP calc_diff {diff} >= {limit}")
    return {"diff": diff}


# LogFMT combine: where the GPU's approximate log2 puts a value's index one step off the reference's (near a
# rounding boundary, rare), the value moves by at most 2^step - 1 <= 2^(32/510) - 1 < 4.5% of itself.
LOGFMT_STEP_OFF = 0.05


def logfmt_expected(x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference's LogFMT combine for the test's experts: each row bf16(x * factor) through
    reference.logfmt_cast_back, weighted and summed in float32 in k order; and sum_k |w * y| a channel (the scale
    of the tolerance)."""
    acc, scale = np.zeros(x.shape, dtype=np.float32), np.zeros(x.shape, dtype=np.float32)
    for k in range(idx.shape[1]):
        valid = idx[:, k] >= 0
        y = (x.astype(np.float32) * expert_factor(np.where(valid, idx[:, k], 0))[:, None]).astype(BF16)
        acc[valid] += (reference.logfmt_cast_back(y) * w[:, k][:, None])[valid]
        scale[valid] += np.abs(y.astype(np.float32) * w[:, k][:, None])[valid]
    return acc.astype(BF16), scale


def check_logfmt(name: str, got: np.ndarray, want: np.ndarray, scale: np.ndarray, bf16_want: np.ndarray) -> float:
    """A LogFMT combine against the reference's: a channel within one bf16 ulp of it plus LOGFMT_STEP_OFF of its
    terms' magnitude, at most 1% of the channels not bit-equal, calc_diff < 1e-6; and DeepEP's bound against the
    bf16 combine (calc_diff < 1e-5). Returns that last calc_diff."""
    g, r = got.astype(np.float32), want.astype(np.float32)
    err = np.abs(g - r)
    bound = 2.0**-7 * np.abs(r) + LOGFMT_STEP_OFF * scale
    if not np.isfinite(g).all() or (err > bound).any():
        bad = np.argwhere(~(err <= bound))
        first = tuple(bad[0])
        raise Mismatch(f"{name}: {len(bad)} channels off the LogFMT reference beyond the tolerance, first at "
                       f"{bad[:3].tolist()}: got {g[first]!r} want {r[first]!r} (bound {bound[first]!r})")
    if g.size == 0:
        return 0.0
    differ = float((err > 0).mean())
    diff_ref = reference.calc_diff(g, r)
    diff = reference.calc_diff(g, bf16_want.astype(np.float32))
    if differ > 0.01 or not diff_ref < 1e-6 or not diff < 1e-5:
        raise Mismatch(f"{name}: {differ:.2%} of the channels differ from the LogFMT reference (calc_diff "
                       f"{diff_ref}), calc_diff against the bf16 combine {diff}")
    return diff


def logfmt_case(buf, rank: int, R: int, seed: int, topk: int, hook: bool, full_reference: bool) -> float:
    """One use_logfmt=True combine against the reference: tokens of three scales (groups all cast, mixed, all
    bf16), zeros inside groups (amin 0), the test's experts scaling by 1/4..2."""
    m, hidden, experts = buf.num_max_dispatch_tokens_per_rank, buf.hidden, buf.num_experts
    xs, idxs, ws = make_inputs(seed, [m - r for r in range(R)], hidden, topk, experts, 0.1)
    rng = np.random.default_rng(seed)
    for i, x in enumerate(xs):
        scaled = x.astype(np.float32) * rng.choice([0.005, 0.1, 1.0], size=(len(x), 1)).astype(np.float32)
        scaled[::5, 5::9] = 0
        xs[i] = scaled.astype(BF16)
    x, idx, w = to_torch(xs[rank]), to_torch(idxs[rank]), to_torch(ws[rank])
    name = f"LogFMT case seed={seed} H={hidden} E={experts} top-{topk} hook={hook}"
    d = buf.low_latency_dispatch(x, idx, m, experts, use_fp8=False)
    sync(buf)
    y = to_torch(expert_outputs(to_numpy(d.handle.src_info), to_numpy(d.handle.layout_range), xs, rank, experts))
    c = buf.low_latency_combine(y, idx, w, d.handle, return_recv_hook=hook, use_logfmt=True)
    if hook:
        c.hook()
    sync(buf)
    got, bf16_want = to_numpy(c.x), expected_combine(xs[rank], idxs[rank], ws[rank])
    want, scale = logfmt_expected(xs[rank], idxs[rank], ws[rank])
    diff = check_logfmt(name, got, want, scale, bf16_want)
    if full_reference:  # the reference's own combine, from every rank's y in the reference layout
        ref_d = reference.low_latency_dispatch(xs, idxs, m, experts, use_fp8=False)
        ys = [expert_outputs(ref_d[r].src_info, ref_d[r].layout_range, xs, r, experts) for r in range(R)]
        ref_c = reference.low_latency_combine(ys, idxs, ws, [r_.handle for r_ in ref_d], use_logfmt=True)
        check_logfmt(f"{name} vs reference.low_latency_combine", got, ref_c[rank].x, scale, bf16_want)
    return diff


def logfmt_check(bufs: list, rank: int, R: int) -> dict:
    """use_logfmt=True: its refusals (zero_copy with it, a flag not a bool; the whole mode where the Buffer has a
    put path), then, where it runs, its cases against the reference."""
    big, mid, small = bufs
    m, experts = mid.num_max_dispatch_tokens_per_rank, mid.num_experts
    xs, idxs, ws = make_inputs(91, [4] * R, mid.hidden, 2, experts, 0.0)
    x, idx, w = to_torch(xs[rank]), to_torch(idxs[rank]), to_torch(ws[rank])
    d = mid.low_latency_dispatch(x, idx, m, experts, use_fp8=False)
    sync(mid)
    refused: dict[str, str] = {}
    calls = {"zero_copy": lambda: mid.low_latency_combine(mid.get_next_low_latency_combine_buffer(d.handle), idx, w,
                                                          d.handle, zero_copy=True, use_logfmt=True),
             "not_bool": lambda: mid.low_latency_combine(d.x, idx, w, d.handle, use_logfmt="yes")}
    if mid._low_latency.ops.puts:
        calls["put_path"] = lambda: mid.low_latency_combine(d.x, idx, w, d.handle, use_logfmt=True)
    for key, call in calls.items():  # refused before any kernel on every rank: the ranks stay in step
        try:
            call()
            refused[key] = "NOT REFUSED"
        except (ValueError, TypeError, epjit.EpjitError) as e:
            refused[key] = str(e)
    if mid._low_latency.ops.puts:
        return {"cases": 0, "refused": refused}
    diffs = [logfmt_case(big, rank, R, 60, 8, False, False), logfmt_case(mid, rank, R, 61, 4, True, False),
             logfmt_case(small, rank, R, 62, min(2, R), False, True)]
    return {"cases": len(diffs), "max_diff": max(diffs), "refused": refused}


def graph_check(buf, group, rank: int, R: int) -> int:
    """Dispatch (hook mode) + combine captured once in a torch CUDA graph, replayed with new routings."""
    m, hidden, experts, topk = buf.num_max_dispatch_tokens_per_rank, buf.hidden, buf.num_experts, 4
    counts = [m] * R
    xs, idxs, ws = make_inputs(500, counts, hidden, topk, experts, 0.1)
    x, idx, w = to_torch(xs[rank]), to_torch(idxs[rank]), to_torch(ws[rank])
    y = torch.empty(experts // R, R * m, hidden, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def step():
        d = buf.low_latency_dispatch(x, idx, m, experts, use_fp8=False, return_recv_hook=True)
        d.hook()
        y.copy_(d.x)  # identity experts
        return d, buf.low_latency_combine(y, idx, w, d.handle)

    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    sync(buf)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        d, c = step()
    replays = 0
    for replay in range(6):
        xs, idxs, ws = make_inputs(600 + replay, counts, hidden, topk, experts, 0.1)
        x.copy_(to_torch(xs[rank]))
        idx.copy_(to_torch(idxs[rank]))
        w.copy_(to_torch(ws[rank]))
        group.barrier()
        graph.replay()
        sync(buf)
        want = reference.low_latency_dispatch(xs, idxs, m, experts, use_fp8=False)
        check_dispatch(f"graph replay {replay}", d, want[rank])
        want_c = (xs[rank].astype(np.float32) * (ws[rank] * (idxs[rank] >= 0)).sum(1, keepdims=True))
        got = to_numpy(c.x).astype(np.float32)
        diff = reference.calc_diff(got, want_c.astype(BF16).astype(np.float32))
        if not diff < 1e-5:
            raise Mismatch(f"graph replay {replay}: combine calc_diff {diff}")
        replays += 1
    return replays


def loops_check(buf, rank: int, R: int, loops: int) -> int:
    """`loops` dispatch+combine pairs with fresh routings, hook and no hook alternating, both buffer sets."""
    m, hidden, experts = buf.num_max_dispatch_tokens_per_rank, buf.hidden, buf.num_experts
    topk = min(4, experts)
    rng = np.random.default_rng(7)
    xs, _, _ = make_inputs(8, [m] * R, hidden, topk, experts, 0.0)
    x = to_torch(xs[rank])
    ok = 0
    for i in range(loops):
        counts = rng.integers(0, m + 1, R).tolist()
        _, idxs, ws = make_inputs(1000 + i, counts, 8, topk, experts, 0.15)
        n = counts[rank]
        idx, w = to_torch(idxs[rank]), to_torch(ws[rank])
        hook = i % 3 == 1
        d = buf.low_latency_dispatch(x[:n], idx, m, experts, use_fp8=False, return_recv_hook=hook)
        if hook:
            d.hook()
        c = buf.low_latency_combine(d.x, idx, w, d.handle)
        want_count = np.zeros(experts, dtype=np.int64)
        for s in range(R):
            want_count += np.bincount(idxs[s][idxs[s] >= 0], minlength=experts)
        got_count = to_numpy(d.recv_count)
        L = experts // R
        if not np.array_equal(got_count, want_count[rank * L:(rank + 1) * L]):
            raise Mismatch(f"loop {i}: recv_count {got_count.tolist()} != {want_count[rank * L:(rank + 1) * L]}")
        if n:
            want_c = (xs[rank][:n].astype(np.float32) * (ws[rank] * (idxs[rank] >= 0)).sum(1, keepdims=True))
            diff = reference.calc_diff(to_numpy(c.x).astype(np.float32), want_c.astype(BF16).astype(np.float32))
            if not diff < 1e-5:
                raise Mismatch(f"loop {i}: combine calc_diff {diff}")
        ok += 1
    return ok


def extras_check(buf, rank: int, R: int) -> dict:
    """Receive statistics, the zero-copy combine buffer, clean_low_latency_buffer, a normal-mode call refused."""
    m, hidden, experts = buf.num_max_dispatch_tokens_per_rank, buf.hidden, buf.num_experts
    topk = min(2, experts)
    xs, idxs, ws = make_inputs(77, [m] * R, hidden, topk, experts, 0.1)
    x, idx, w = to_torch(xs[rank]), to_torch(idxs[rank]), to_torch(ws[rank])
    stats = torch.zeros(experts // R, dtype=torch.int32, device="cuda")
    for _ in range(2):
        d = buf.low_latency_dispatch(x, idx, m, experts, use_fp8=False, cumulative_local_expert_recv_stats=stats)
    sync(buf)
    if not torch.equal(stats, 2 * d.recv_count):
        raise Mismatch(f"cumulative stats {stats.tolist()} != 2 x recv_count {d.recv_count.tolist()}")
    plain = buf.low_latency_combine(d.x, idx, w, d.handle).x.clone()
    zero_copy = buf.get_next_low_latency_combine_buffer(d.handle)
    zero_copy.copy_(d.x)
    c = buf.low_latency_combine(zero_copy, idx, w, d.handle, zero_copy=True)
    sync(buf)
    same("zero-copy combine", to_numpy(c.x), to_numpy(plain))
    buf.clean_low_latency_buffer(m, hidden, experts)  # DeepEP's signature; the sizes must be the Buffer's
    d = buf.low_latency_dispatch(x, idx, m, experts, use_fp8=False)
    c = buf.low_latency_combine(d.x, idx, w, d.handle)
    sync(buf)
    same("combine after clean_low_latency_buffer", to_numpy(c.x), to_numpy(plain))
    # The same calls from CuPy (outputs from CuPy's pool, handed back as CuPy arrays, FP8 as uint8): identical.
    import cupy

    xc, idxc, wc = cupy.from_dlpack(x), cupy.from_dlpack(idx), cupy.from_dlpack(w)
    dt = buf.low_latency_dispatch(x, idx, m, experts)
    dc = buf.low_latency_dispatch(xc, idxc, m, experts)
    sync(buf)
    rows = int(dt.recv_count.sum())
    if not (isinstance(dc.x, cupy.ndarray) and dc.x.dtype == np.uint8 and rows == int(dc.recv_count.sum())):
        raise Mismatch(f"CuPy dispatch gave {type(dc.x).__name__} {dc.x.dtype}, {int(dc.recv_count.sum())} rows")
    for e in range(experts // R):  # the rows each local expert received (the rest are garbage by contract)
        n = int(dt.recv_count[e])
        same(f"CuPy dispatch x (expert {e})", cupy.asnumpy(dc.x[e, :n]), to_numpy(dt.x[e, :n]))
        same(f"CuPy dispatch scales (expert {e})", cupy.asnumpy(dc.x_scales[e, :n]), to_numpy(dt.x_scales[e, :n]))
    d = buf.low_latency_dispatch(xc, idxc, m, experts, use_fp8=False)
    out = cupy.empty((m, hidden), dtype=BF16)
    c = buf.low_latency_combine(d.x, idxc, wc, d.handle, out=out)
    sync(buf)
    if c.x is not out:
        raise Mismatch("combine(out=...) did not return out")
    same("CuPy combine", cupy.asnumpy(out), to_numpy(plain))
    try:
        buf.dispatch(x, topk_idx=idx, num_experts=experts)
        refused = "NOT REFUSED"
    except epjit.EpjitError as e:
        refused = str(e)
    return {"stats": int(stats.sum()), "normal_refused": refused}


def wait_stats_check(buf, group, rank: int, R: int) -> dict:
    """dispatch_wait_recv_cost_stats and combine_wait_recv_cost_stats: the last rank starts each call ~20 ms late (a
    GPU sleep before it on its stream), so every other rank's entry for it is above 10 ms and at least 4 times any
    other entry (each wait is charged to the peer it waited for, not to the slowest one of its warp); no entry is
    negative. A first call with each array loads the wait-stats module, so the timed ones start together. Then the
    wrong arrays refused by name."""
    m, experts = buf.num_max_dispatch_tokens_per_rank, buf.num_experts
    xs, idxs, ws = make_inputs(91, [m] * R, buf.hidden, min(4, experts), experts, 0.0)
    x, idx, w = to_torch(xs[rank]), to_torch(idxs[rank]), to_torch(ws[rank])
    late, cycles = R - 1, 40_000_000  # about 20 ms at an H100's or H200's 2 GHz (more at a lower clock)
    got = {}
    for call in ("dispatch", "combine"):
        waits = torch.zeros(R, dtype=torch.int64, device="cuda")
        for timed in (False, True):
            d = buf.low_latency_dispatch(x, idx, m, experts, use_fp8=False) if call == "combine" else None
            sync(buf)
            waits.zero_()
            group.barrier()
            if rank == late and timed:
                torch.cuda._sleep(cycles)
            if call == "dispatch":
                buf.low_latency_dispatch(x, idx, m, experts, use_fp8=False, dispatch_wait_recv_cost_stats=waits)
            else:
                buf.low_latency_combine(d.x, idx, w, d.handle, combine_wait_recv_cost_stats=waits)
            sync(buf)
        got[call] = waits.tolist()
        others = [v for r, v in enumerate(got[call]) if r != late]
        if min(got[call]) < 0 or (rank != late and (got[call][late] < 10**7 or 4 * max(others) > got[call][late])):
            raise Mismatch(f"{call}_wait_recv_cost_stats {got[call]} (ns): rank {late} started 20 ms late")
    refused = {}
    for key, bad in (("dtype", torch.zeros(R, dtype=torch.int32, device="cuda")),
                     ("shape", torch.zeros(R + 1, dtype=torch.int64, device="cuda"))):
        try:
            buf.low_latency_dispatch(x, idx, m, experts, use_fp8=False, dispatch_wait_recv_cost_stats=bad)
            refused[key] = "NOT REFUSED"
        except (ValueError, TypeError) as e:  # ArgumentError, ArgumentTypeError
            refused[key] = str(e)
    return {"ns": got, "refused": refused}


def refusals(buf, group, rank: int, R: int) -> dict[str, str]:
    """Each Safe rule once: the exception's text (the test asserts on it)."""
    m, hidden, experts = buf.num_max_dispatch_tokens_per_rank, buf.hidden, buf.num_experts
    out: dict[str, str] = {}

    def refused(key: str, fn) -> None:
        try:
            fn()
        except (ValueError, TypeError, epjit.EpjitError) as e:
            out[key] = str(e)
        else:
            out[key] = "NOT REFUSED"

    x = torch.randn(m + 1, hidden, device="cuda").to(torch.bfloat16)
    idx = torch.zeros(m + 1, 2, dtype=torch.int64, device="cuda")
    refused("too_many_tokens", lambda: buf.low_latency_dispatch(x, idx, m, experts))
    refused("wrong_experts", lambda: buf.low_latency_dispatch(x[:1], idx[:1], m, experts + R))
    refused("not_divisible", lambda: epjit.Buffer(group, low_latency_mode=True, num_max_dispatch_tokens_per_rank=8,
                                                  hidden=256, num_experts=R + 1))
    refused("differs_across_ranks", lambda: epjit.Buffer(group, low_latency_mode=True,
                                                         num_max_dispatch_tokens_per_rank=8, hidden=256,
                                                         num_experts=R * (1 + rank)))
    refused("too_many_for_shared_memory", lambda: epjit.Buffer(group, low_latency_mode=True,
                                                               num_max_dispatch_tokens_per_rank=8192, hidden=7168,
                                                               num_experts=R))
    refused("wrong_dtype", lambda: buf.low_latency_dispatch(x[:1].float(), idx[:1], m, experts))
    # A hook run twice; a set reused while its hook is pending (every rank does the same calls, so they stay in step).
    d1 = buf.low_latency_dispatch(x[:2], idx[:2], m, experts, return_recv_hook=True)
    d2 = buf.low_latency_dispatch(x[:2], idx[:2], m, experts, return_recv_hook=True)
    refused("set_reused", lambda: buf.low_latency_dispatch(x[:2], idx[:2], m, experts))
    refused("combine_before_hook", lambda: buf.low_latency_combine(
        torch.empty(experts // R, R * m, hidden, dtype=torch.bfloat16, device="cuda"), idx[:2],
        torch.ones(2, 2, device="cuda"), d1.handle))
    d1.hook()
    d2.hook()
    refused("hook_twice", d1.hook)
    # Not ints or bools: refused before the plan of (m, experts, use_fp8=True) is looked up (m.0 == m, "False" truthy).
    refused("max_tokens_not_int", lambda: buf.low_latency_dispatch(x[:2], idx[:2], float(m), experts))
    refused("fp8_flag_as_text", lambda: buf.low_latency_dispatch(x[:2], idx[:2], m, experts, use_fp8="False"))
    # Out-of-range ids: skipped by the kernel, reported by the next call on every rank that had them.
    bad = idx[:2].clone()
    bad[0, 0] = experts + 5 if rank == 0 else 0
    buf.low_latency_dispatch(x[:2], bad, m, experts)
    sync(buf)
    if rank == 0:
        refused("invalid_ids", lambda: buf.low_latency_dispatch(x[:2], idx[:2], m, experts))
        buf.low_latency_dispatch(x[:2], idx[:2], m, experts)  # the refused call launched nothing: stay in step
    else:
        buf.low_latency_dispatch(x[:2], idx[:2], m, experts)
        out["invalid_ids"] = "(rank 0 only)"
    sync(buf)
    # The same, raised by Buffer.synchronize when no call comes after (not collective: rank 0 alone raises).
    buf.low_latency_dispatch(x[:2], bad, m, experts)
    sync(buf)
    if rank == 0:
        refused("invalid_ids_synchronize", buf.synchronize)
    else:
        buf.synchronize()
        out["invalid_ids_synchronize"] = "(rank 0 only)"
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--loops", type=int, default=1000)
    parser.add_argument("--num-nvl-ranks", type=int, default=None, help="ranks a node (default: the host's)")
    parser.add_argument("--logfmt-only", action="store_true", help="only the use_logfmt=True checks")
    args = parser.parse_args()
    group = epjit.init(num_nvl_ranks=args.num_nvl_ranks)
    torch.cuda.set_device(group.device)
    R, rank = group.size, group.rank
    started = time.perf_counter()
    configs = [(128, 7168, 256), (64, 4096, 64), (32, 2048, R)]
    bufs = [epjit.Buffer(group, low_latency_mode=True, num_max_dispatch_tokens_per_rank=m, hidden=h, num_experts=e)
            for m, h, e in configs]
    result: dict = {"rank": rank, "cases": 0, "force_puts": os.environ.get("EPJIT_LL_FORCE_PUTS", "0"),
                    "bytes": [b.num_rdma_bytes for b in bufs], "build": bufs[0]._low_latency.ops.module.spec.family,
                    "num_nvl_ranks": group.num_nvl_ranks,
                    "nvlink_peers": [pe for pe, ptr in enumerate(bufs[0].mem.sym.peer_ptrs) if ptr],
                    "symmetric": type(bufs[0].mem.sym).__name__}
    big, mid, small = bufs
    result["logfmt"] = logfmt_check(bufs, rank, R)
    if args.logfmt_only:
        return finish(result, bufs, group, started)
    cases = [
        # (buffer, counts, topk, holes, fp8, round, ue8m0, hook, repeats, small)
        (big, [128] * R, 8, 0.0, True, False, False, False, False, False),
        (big, [128 - r for r in range(R)], 8, 0.1, True, True, False, True, False, False),
        (big, [1] + [77] * (R - 1), 8, 0.1, True, True, True, False, False, False),
        (big, [0] + [128] * (R - 1), 8, 0.1, False, False, False, True, False, False),
        (mid, [64] * R, 4, 0.2, True, False, False, True, False, False),
        (mid, [63, 0] + [5] * (R - 2), 4, 0.0, False, False, False, False, False, False),
        (mid, [64] * R, 1, 0.3, True, True, True, True, False, False),
        (small, [32] * R, 1, 0.0, True, False, False, False, False, True),
        (small, [12] + [11] * (R - 1), 2, 0.2, False, False, False, True, True, True),
        (small, [17] * R, 8 if R >= 8 else R, 0.1, True, False, False, False, False, True),
        # Decode sizes, where every rank sends flagged messages (low_latency.cuh: the flagged path): one token,
        # and four in bf16 with holes; then up to the flagged path's 64 tokens a rank, flagged on 2 ranks (one
        # message a token) and past its 160 messages on 4 and 8 (the signal path); then sources of both paths in
        # one call (on 4 ranks at top-8, 56 and 54 tokens are past 160 messages, 52 and 50 within).
        (big, [1] * R, 8, 0.0, True, False, False, False, False, False),
        (big, [4] * R, 8, 0.2, False, False, False, True, False, False),
        (big, [64 - 3 * r for r in range(R)], 8, 0.1, True, False, False, False, False, False),
        (big, [56 - 2 * r for r in range(R)], 8, 0.1, False, False, False, True, False, False),
    ]
    if args.quick:
        cases = cases[:2] + cases[7:8] + cases[10:]
    diffs = []
    for i, (buf, counts, topk, holes, fp8, rnd, ue8m0, hook, repeats, is_small) in enumerate(cases):
        r = run_case(buf, rank, R, 40 + i, counts, topk, holes, fp8, rnd, ue8m0, hook, repeats, is_small)
        diffs.append(r["diff"])
        result["cases"] += 1
    result["max_diff"] = max(diffs)
    result["graph_replays"] = graph_check(mid, group, rank, R)
    result["loops"] = loops_check(small, rank, R, 20 if args.quick else args.loops)
    result["extras"] = extras_check(mid, rank, R)
    result["wait_stats"] = wait_stats_check(mid, group, rank, R)
    result["refused"] = refusals(small, group, rank, R)
    return finish(result, bufs, group, started)


def finish(result: dict, bufs: list, group, started: float) -> int:
    result["nvshmem_initialised"] = epjit.memory.live_resources()["nvshmem_initialised"]
    for b in bufs:
        b.close()
    result["seconds"] = round(time.perf_counter() - started, 1)
    print("RESULT " + json.dumps(result), flush=True)
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
