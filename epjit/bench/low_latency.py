"""Low latency: FP8 dispatch and bf16 combine, each timed over CUDA-graph replays (and with ll-hook, the send and
receive halves apart), beside NCCL moving the same (token, expert) messages and, with ``--peers deepep``, DeepEP."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..kernels.low_latency import deepep_low_latency_size_hint
from .peers import DeepEPPeer, nccl_bytes_us
from .protocol import graph_floor_us, graph_us, hook_halves_us, host_us, routing, start_together
from .report import PLAIN_STORE_CEILING_GBS, Row, print_row, slowest, with_deepep

LOW_LATENCY_MODES = ("ll-dispatch", "ll-combine", "ll-combine-logfmt", "ll-hook")
# ll-combine-logfmt's expert outputs: y x LOGFMT_Y_SCALE, so that most 128-channel groups stay under 1 in magnitude
# and travel as LogFMT-10 (DeepEP's own benchmark scales them by 0.1 for the same reason); with randn as it is,
# nearly every group has a value past 1 and travels as bf16.
LOGFMT_Y_SCALE = 0.1


def bench_low_latency(group: Any, dist: Any, args: argparse.Namespace, modes: list[str],
                      peer: DeepEPPeer | None = None) -> list[Row]:
    """Low-latency dispatch (FP8) and combine (bf16), each timed over CUDA-graph replays, beside NCCL moving the
    same (token, expert) messages and, with ``peer``, DeepEP's same calls; with ll-hook, the send and receive
    halves of each, timed separately."""
    import epjit

    r, rank, hidden, experts = group.size, group.rank, args.hidden[0], args.experts
    max_tokens = max(args.ll_tokens)
    buf = epjit.Buffer(group, low_latency_mode=True, num_max_dispatch_tokens_per_rank=max_tokens, hidden=hidden,
                       num_experts=experts)
    if rank == 0:
        deepep = deepep_low_latency_size_hint(max_tokens, hidden, r, experts)
        print(f"low-latency buffer: {buf.num_rdma_bytes / 2**20:.1f} MiB per rank for {max_tokens} tokens x {hidden} "
              f"x {experts} experts (DeepEP's formula: {deepep / 2**20:.1f} MiB)", flush=True)
    rows: list[Row] = []
    floor = graph_floor_us(group, args.repeat)
    if rank == 0:
        print(f"protocol floor: a CUDA graph of one tiny kernel times {floor:.1f} us here", flush=True)
    try:
        if peer is not None:
            peer.open_low_latency(max_tokens, hidden, experts)
        for tokens in args.ll_tokens:
            for row in _bench_low_latency_case(buf, group, dist, args, modes, tokens, peer):
                rows.append(row)
                if rank == 0:
                    print_row(row)
    finally:
        try:
            buf.close()
        finally:
            if peer is not None:
                peer.close_low_latency()
    return rows


def _profile_low_latency(buf: Any, group: Any, x: Any, idx: Any, w: Any, y: Any, handle: Any, tokens: int) -> None:
    """Rank 0 prints when the blocks of each low-latency kernel reached each point (EPJIT_PROFILE's timeline),
    for one eager call of each op, whole and split by the hook (the receive half launched 1 ms after the send)."""
    import torch

    m, e = buf.num_max_dispatch_tokens_per_rank, buf.num_experts
    calls = {
        "dispatch": lambda hook: buf.low_latency_dispatch(x, idx, m, e, return_recv_hook=hook),
        "combine": lambda hook: buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook),
    }
    for name, call in calls.items():
        for hook in (False, True):
            start_together(group)
            result = call(hook)
            if hook:
                torch.cuda.synchronize()
                time.sleep(1e-3)
                result.hook()
            torch.cuda.synchronize()
            prof = {k: v for k, v in buf.profile().items() if k.startswith("ll_")}
            if group.rank == 0:
                print(f"  profile ll-{name} {tokens} tokens{' (hook)' if hook else ''}: {prof}", flush=True)


def _print_logfmt_error(buf: Any, group: Any, y: Any, idx: Any, w: Any, handle: Any) -> None:
    """How far the LogFMT combine is from the bf16 one on the same expert outputs, on every rank's tokens:
    epjit.reference.calc_diff (DeepEP's measure) and the largest difference relative to the bf16 result's largest
    magnitude; printed by rank 0, the worst rank's."""
    from ..reference import calc_diff

    exact = buf.low_latency_combine(y, idx, w, handle).x.float().cpu().numpy()
    cast = buf.low_latency_combine(y, idx, w, handle, use_logfmt=True).x.float().cpu().numpy()
    rel = float(abs(exact - cast).max(initial=0.0) / max(float(abs(exact).max(initial=0.0)), 1e-30))
    worst = max(group.allgather_object((calc_diff(exact, cast), rel)))
    if group.rank == 0:
        print(f"  LogFMT combine against bf16, {idx.shape[0]} tokens, y x {LOGFMT_Y_SCALE}: calc_diff {worst[0]:.2e}, "
              f"largest difference {worst[1]:.2e} of the largest value (worst rank)", flush=True)


def _time_low_latency(buf: Any, group: Any, args: argparse.Namespace, modes: list[str], x: Any, idx: Any, w: Any,
                      y: Any, handle: Any) -> dict[str, float]:
    """epjit's medians of a low-latency case, keyed by row mode; then its profile, or its host time."""
    max_tokens, experts = buf.num_max_dispatch_tokens_per_rank, buf.num_experts
    timed: dict[str, float] = {}
    if "ll-dispatch" in modes:
        timed["ll-dispatch"] = graph_us(lambda: buf.low_latency_dispatch(x, idx, max_tokens, experts), group,
                                        args.repeat)
    if "ll-combine" in modes:
        timed["ll-combine"] = graph_us(lambda: buf.low_latency_combine(y, idx, w, handle), group, args.repeat)
    if "ll-combine-logfmt" in modes:
        y_small = y * LOGFMT_Y_SCALE
        timed["ll-combine-logfmt"] = graph_us(
            lambda: buf.low_latency_combine(y_small, idx, w, handle, use_logfmt=True), group, args.repeat)
        _print_logfmt_error(buf, group, y_small, idx, w, handle)
    if "ll-hook" in modes:
        halves = {
            "ll-dispatch": lambda: buf.low_latency_dispatch(x, idx, max_tokens, experts, return_recv_hook=True),
            "ll-combine": lambda: buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True),
        }
        for name, send_half in halves.items():
            timed[f"{name}-send"], timed[f"{name}-recv"] = hook_halves_us(send_half, group, args.repeat)
    if args.profile:
        _profile_low_latency(buf, group, x, idx, w, y, handle, idx.shape[0])
    else:  # EPJIT_PROFILE's stamps would be timed too
        host = {name: host_us(call, args.repeat) for name, call in (
            ("dispatch", lambda: buf.low_latency_dispatch(x, idx, max_tokens, experts)),
            ("combine", lambda: buf.low_latency_combine(y, idx, w, handle)))}
        if group.rank == 0:
            print(f"  host time of an eager call, {idx.shape[0]} tokens: " +
                  ", ".join(f"{k} {v:.1f} us" for k, v in host.items()), flush=True)
    return timed


def _bench_low_latency_case(buf: Any, group: Any, dist: Any, args: argparse.Namespace, modes: list[str],
                            tokens: int, peer: DeepEPPeer | None = None) -> list[Row]:
    import torch

    r, rank, hidden, experts, topk = group.size, group.rank, buf.hidden, buf.num_experts, args.topk
    max_tokens, num_local = buf.num_max_dispatch_tokens_per_rank, experts // r
    rows: list[Row] = []
    idx, w = routing(tokens, topk, experts, seed=4321 + rank)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    y = torch.randn(num_local, r * max_tokens, hidden, device="cuda").to(torch.bfloat16)
    pairs = [int(v) for v in torch.bincount(idx.flatten() // num_local, minlength=r).tolist()]
    recv_pairs = [int(p[rank]) for p in group.allgather_object(pairs)]
    msg = hidden + hidden // 128 * 4 + 16
    d = buf.low_latency_dispatch(x, idx, max_tokens, experts)
    timed = _time_low_latency(buf, group, args, modes, x, idx, w, y, d.handle)
    nccl: dict[str, float | None] = {"dispatch": None, "combine": None}
    if not args.no_nccl:
        nccl["dispatch"] = nccl_bytes_us(dist, group, pairs, recv_pairs, msg, args.repeat)
        nccl["combine"] = nccl_bytes_us(dist, group, recv_pairs, pairs, 2 * hidden, args.repeat)
    deepep = peer.low_latency_us(modes, x, idx, w, y, args.repeat, LOGFMT_Y_SCALE) if peer is not None else {}
    all_times = group.allgather_object((timed, nccl, deepep))
    for mode in timed:
        t = max(a[0][mode] for a in all_times)
        kind = "combine" if "combine" in mode else "dispatch"
        nccl_us = slowest([a[1][kind] for a in all_times])
        row_bytes = msg if kind == "dispatch" else 2 * hidden
        moved = sum(pairs) * row_bytes  # docs/benchmark.md: valid (token, expert) pairs x message bytes
        out_bytes = (sum(pairs) - pairs[rank]) * row_bytes
        row = Row(mode, tokens, hidden, topk, experts, buf.low_latency_num_sms, r,
                  round(t, 1), round(nccl_us, 1) if nccl_us else None,
                  round(out_bytes / (t * 1e-6) / 1e9, 1), round(moved / (t * 1e-6) / 1e9, 1),
                  round(out_bytes / (nccl_us * 1e-6) / 1e9, 1) if nccl_us else None,
                  round(nccl_us / t, 2) if nccl_us else None,
                  round(100 * out_bytes / (t * 1e-6) / 1e9 / PLAIN_STORE_CEILING_GBS, 1))
        rows.append(with_deepep(row, slowest([a[2].get(mode) for a in all_times]), t))
    return rows


