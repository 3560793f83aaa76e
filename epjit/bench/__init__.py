"""``python -m epjit.launch -n N -m epjit.bench [--json out.json]``: epjit beside NCCL all_to_all_single.

Same run, same inputs, same bytes: for each case the routing's split sizes feed NCCL's ``all_to_all_single`` (what a
user would write instead of epjit). Timing follows docs/benchmark.md's protocol: CUDA events around the operation,
warm-up first, median of ``--repeat`` runs (>= 20), a barrier between runs: a host barrier, a 500 us wall-clock
spin on the GPU that hides the host's launches of what follows, then a one-element NCCL all_reduce so every GPU
starts the timed operation at about the same moment (see _start_together).

Bandwidth columns:
  out GB/s    bytes that leave this GPU (rows to other ranks) / time: what NVLink carries
  DeepEP GB/s received rows (self included) x row bytes / time: DeepEP's accounting, to compare with theirs
  % NVLink    out GB/s against the measured plain-store ceiling (PLAIN_STORE_CEILING_GBS; docs/performance.md)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..config import Config, get_combine_config, get_dispatch_config
from ..env import settings
from ..kernels.low_latency import deepep_low_latency_size_hint

# 16-byte stores from all SMs, all ranks to all peers at once, 4 x H200 (docs/performance.md: the ceilings)
PLAIN_STORE_CEILING_GBS = 345.0


@dataclass
class Row:
    mode: str
    tokens: int
    hidden: int
    topk: int
    experts: int
    sms: int
    ranks: int
    epjit_us: float
    nccl_us: float | None
    out_gbs: float
    deepep_gbs: float
    nccl_out_gbs: float | None
    ratio: float | None  # NCCL time / epjit time
    pct_nvlink: float


def current_cupy_stream() -> Any:
    """CuPy's object for torch's current stream, for launching epjit's kernels where torch's work runs."""
    import torch

    from ..arrays import cupy_stream

    return cupy_stream(torch.cuda.current_stream().cuda_stream, torch.cuda.current_device())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _start_together(group: Any) -> None:
    """Make every rank's next timed work start at about the same moment, right behind the host's launches.

    A host barrier; then the GPU spins a fixed wall-clock time, long enough for the host to enqueue everything up
    to the end event behind it (as inside a step, where the host runs ahead of the GPU); then a one-element NCCL
    all_reduce, the last thing before the start event: it ends at about the same moment on every GPU, so no
    rank's launch delay or barrier skew (tens of microseconds on 4 processes) is timed as part of whatever waits
    for a peer first. Without the spin a one-kernel graph timed several times its floor (docs/benchmark.md)."""
    import torch
    import torch.distributed as dist

    from ..ops.loader import load
    from .kernels import SpinSpec

    global _ALIGN, _SPIN
    group.barrier()
    if _ALIGN is None:
        _ALIGN = torch.zeros(1, device="cuda")
        _SPIN = load(SpinSpec(), torch.cuda.current_device())
    _SPIN.launch(_SPIN.spec.args("spin_for_ns", ns=_HIDE_LAUNCH_NS), 1, 1,
                 stream=torch.cuda.current_stream().cuda_stream)
    dist.all_reduce(_ALIGN)


_ALIGN: Any = None
_SPIN: Any = None
# Longer than any host-side launch timed here, with room for slow hosts (docs/benchmark.md).
_HIDE_LAUNCH_NS = 500_000


def _median_us(fn: Any, group: Any, repeat: int, warmup: int = 5) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        _start_together(group)  # every rank starts together, as in a real step
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _host_us(fn: Any, repeat: int) -> float:
    """Median wall time the host spends inside one eager call (the GPU is drained between calls, not timed)."""
    import torch

    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _routing(num_tokens: int, topk: int, num_experts: int, seed: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device="cuda", generator=g)
    idx = scores.topk(topk, dim=1).indices.to(torch.int64)  # uniform random distinct experts
    w = torch.rand(num_tokens, topk, device="cuda", generator=g)
    return idx, w


def init_with_nccl() -> Any:
    """epjit's group, this rank's GPU made torch's current device, and torch.distributed's NCCL group over the same
    ranks: the peer every case is timed beside (the tuning scripts start the same way). The caller ends it with
    torch.distributed.destroy_process_group()."""
    import torch
    import torch.distributed as dist

    import epjit

    group = epjit.init()
    torch.cuda.set_device(group.device)
    port = int(group.bcast_bytes(str(_free_port()).encode() if group.rank == 0 else None).decode())
    dist.init_process_group("nccl", init_method=f"tcp://{group.hosts[0]}:{port}", rank=group.rank,
                            world_size=group.size, device_id=torch.device("cuda", group.device))
    return group


def run(args: argparse.Namespace) -> list[Row]:
    import torch.distributed as dist

    group = init_with_nccl()
    rows: list[Row] = []
    normal_modes = [m for m in args.modes if not m.startswith("ll-") and m != "ceiling"]
    ll_modes = [m for m in args.modes if m.startswith("ll-")]
    try:
        if "ceiling" in args.modes:
            rows += _bench_ceiling(group, args)
        if ll_modes:
            rows += _bench_low_latency(group, dist, args, ll_modes)
        if normal_modes:
            rows += _bench_normal(group, dist, args, normal_modes)
    finally:
        dist.destroy_process_group()
    return rows


_CEILING_BYTES = 64 << 20  # per destination: ~0.2 ms at NVLink speed, far above launch and skew
_CEILING_STAGES = 8  # kCeilingStages of cuda_src/ceiling.cu


def _bench_ceiling(group: Any, args: argparse.Namespace) -> list[Row]:
    """What copies from local memory reach by SM count: towards one peer's NVLink buffer ("peer"), towards every
    peer at once with the SMs split among them ("peers"), towards every peer in turn with all the SMs, each rank
    starting at the next one ("rotate": NCCL's p2p schedule, one writer per GPU at a time), towards every peer from
    every warp, piece by piece ("interleave": how the normal-mode kernels' blocks send), and within this GPU
    ("local"); "-pull": the same bytes read out of the peers' buffers instead of written into them; "-skew": each
    rank starts at a different place of its regions, so senders into one GPU do not keep step on its addresses.
    Each with the normal-mode kernels' warp_copy (768 threads a block; the split pushes also 1024) and, split
    pushes only, with bulk (TMA) copies driven by one thread a warp through 8 shared-memory stages of 7 KiB (4
    warps a block, or 2). The kernels are measured against these."""
    import torch

    import epjit

    from ..kernels.intranode import NUM_THREADS
    from ..ops.loader import load
    from .kernels import CopyCeilingSpec

    r, me = group.size, group.rank
    n = _CEILING_BYTES
    buf = epjit.Buffer(group, num_nvl_bytes=r * n)
    module = load(CopyCeilingSpec(), group.device)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    num_sms = torch.cuda.get_device_properties(group.device).multi_processor_count
    # name: (destination mask, schedule, pull, skew); schedules as in cuda_src/ceiling.cu
    split, rotate, interleave = 0, 1, 2
    patterns = {"local": (1 << me, split, 0, 0)}
    if r > 1:
        patterns["peer"] = (1 << ((me + 1) % r), split, 0, 0)
        patterns["peer-pull"] = (1 << ((me + 1) % r), split, 1, 0)
    if r > 2:
        others = ((1 << r) - 1) & ~(1 << me)
        patterns.update({"peers": (others, split, 0, 0), "peers-skew": (others, split, 0, 1),
                         "rotate": (others, rotate, 0, 0), "interleave": (others, interleave, 0, 0),
                         "interleave-skew": (others, interleave, 0, 1), "peers-pull": (others, split, 1, 0),
                         "rotate-pull": (others, rotate, 1, 0)})
    stage = 7168
    variants = {"": ("copy_ceiling", NUM_THREADS, 0), "-1024": ("copy_ceiling", 1024, 0),
                "-bulk4": ("copy_ceiling_bulk", 128, 4), "-bulk2": ("copy_ceiling_bulk", 64, 2)}
    rows: list[Row] = []
    try:
        for pattern, (mask, schedule, pull, skew) in patterns.items():
            dsts = bin(mask).count("1")
            for suffix, (kernel, threads, warps) in variants.items():
                if (schedule != split or pull or skew) and (warps or threads != NUM_THREADS):
                    continue  # the bulk kernel only pushes on the split schedule; 1024 threads only there too
                for sms in sorted({*args.ceiling_sms, num_sms}):
                    blocks = max(dsts, min(sms, num_sms) // dsts * dsts) if schedule == split else min(sms, num_sms)
                    launch_args = module.spec.args(kernel, peers=buf.mem.table_ptr, dst_mask=mask,
                                                   src=src.data_ptr())
                    if warps:
                        shared = warps * _CEILING_STAGES * (stage + 8)
                        launch_args.set(n_bytes=n, stage_bytes=stage)
                    else:
                        shared = 0
                        launch_args.set(schedule=schedule, pull=pull, skew=skew, n_int4=n // 16)

                    def copy(launch_args: Any = launch_args, blocks: int = blocks, threads: int = threads,
                             shared: int = shared) -> None:
                        module.launch(launch_args, blocks, threads, shared_mem=shared, stream=stream)

                    t = max(group.allgather_object(_median_us(copy, group, args.repeat)))
                    gbs = round(dsts * n / (t * 1e-6) / 1e9, 1)
                    rows.append(Row(f"ceil-{pattern}{suffix}", 0, 0, 0, 0, blocks, r, round(t, 1), None, gbs, gbs,
                                    None, None, round(100 * gbs / PLAIN_STORE_CEILING_GBS, 1)))
                    if me == 0:
                        _print_row(rows[-1])
    finally:
        buf.close()
    return rows


def case_config(mode: str, num_ranks: int, sms: int, chunk_send: int, chunk_recv: int,
                roles: dict[str, int] | None = None) -> Config:
    """The Config a normal-mode case runs with: the operation's own default chunk (what a call without config
    gets: combine's differs from dispatch's, and both follow the warp roles, the defaults or ``roles``: Config's
    warp-role fields), or chunk_send when given."""
    spec = Config(**(roles or {})).spec(num_ranks)
    default = get_combine_config(num_ranks, spec) if mode == "combine" else get_dispatch_config(num_ranks, spec)
    return Config(sms, chunk_send or default.nvl_chunk_send, chunk_recv, **(roles or {}))


def parse_roles(text: str) -> dict[str, int]:
    """``dispatch_phased=1,combine_send_warps=3`` -> Config's warp-role fields (--warp-roles)."""
    roles: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name.strip() not in ("dispatch_send_warps", "dispatch_drain_warps", "combine_send_warps",
                                "dispatch_phased") or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"--warp-roles {text!r}: {item!r} is not FIELD=INTEGER with FIELD one of Config's "
                             "dispatch_send_warps, dispatch_drain_warps, combine_send_warps, dispatch_phased")
        roles[name.strip()] = int(value)
    return roles


def _bench_normal(group: Any, dist: Any, args: argparse.Namespace, modes: list[str]) -> list[Row]:
    import epjit

    r = group.size
    hint = epjit.Buffer.get_normal_size_hint(r, max(args.hidden), args.topk, args.experts,
                                             Config(max(args.sms), 1, args.chunk_recv))
    buf = epjit.Buffer(group, num_nvl_bytes=hint)
    roles = parse_roles(args.warp_roles)
    if group.rank == 0:  # which warp roles these rows are of
        print(f"intranode kernels: {Config(**roles).spec(r).family}", flush=True)
    rows: list[Row] = []
    try:
        for hidden in args.hidden:
            for tokens in args.tokens:
                for sms in args.sms:
                    for mode in modes:
                        cfg = case_config(mode, r, sms, args.chunk_send, args.chunk_recv, roles)
                        rows.append(_bench_case(buf, group, dist, mode, tokens, hidden, args, cfg))
                        if group.rank == 0:
                            _print_row(rows[-1])
    finally:
        buf.close()
    return rows


def _graph(fn: Any, warmup: Any = None) -> Any:
    """``fn`` captured once in a torch CUDA graph, after two eager calls of ``warmup`` (default: ``fn``) on the
    capture stream (CuPy's memory pool is per stream: the capture must find its blocks there)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            (warmup or fn)()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


def _graph_floor_us(group: Any, repeat: int) -> float:
    """What the timing protocol itself costs: the median of a CUDA graph holding one one-element kernel, timed as
    the low-latency ops are (slowest rank)."""
    import torch

    z = torch.zeros(1, device="cuda")
    g = _graph(lambda: z.add_(1))
    return max(group.allgather_object(_median_us(g.replay, group, repeat)))


def _median_halves_us(first: Any, second: Any, group: Any, repeat: int) -> tuple[float, float]:
    """Medians of two back-to-back steps (a send half, then its receive half), timed separately."""
    import torch

    for _ in range(3):
        first()
        second()
    torch.cuda.synchronize()
    a, b = [], []
    for _ in range(repeat):
        _start_together(group)
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        first()
        e[1].record()
        second()
        e[2].record()
        e[2].synchronize()
        a.append(e[0].elapsed_time(e[1]) * 1e3)
        b.append(e[1].elapsed_time(e[2]) * 1e3)
    return statistics.median(a), statistics.median(b)


def hook_halves_us(send_half: Any, group: Any, repeat: int) -> tuple[float, float]:
    """Medians of the send and receive halves of a low-latency call: ``send_half`` makes the call with
    return_recv_hook=True and returns its result. Each half in its own CUDA graph: the send half's capture leaves
    its hook pending, the receive half's runs it."""
    held: list[Any] = []

    def whole_call() -> None:  # the warm-up runs both halves, so no hook is left pending
        send_half().hook()

    send = _graph(lambda: held.append(send_half()), warmup=whole_call)
    recv = _graph(lambda: held.pop().hook(), warmup=lambda: None)
    return _median_halves_us(send.replay, recv.replay, group, repeat)


def _bench_low_latency(group: Any, dist: Any, args: argparse.Namespace, modes: list[str]) -> list[Row]:
    """Low-latency dispatch (FP8) and combine (bf16), each timed over CUDA-graph replays, beside NCCL moving the
    same (token, expert) messages; with ll-hook, the send and receive halves of each, timed separately."""
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
    floor = _graph_floor_us(group, args.repeat)
    if rank == 0:
        print(f"protocol floor: a CUDA graph of one tiny kernel times {floor:.1f} us here", flush=True)
    try:
        for tokens in args.ll_tokens:
            for row in _bench_low_latency_case(buf, group, dist, args, modes, tokens):
                rows.append(row)
                if rank == 0:
                    _print_row(row)
    finally:
        buf.close()
    return rows


def _nccl_bytes_us(dist: Any, group: Any, send_rows: list[int], recv_rows: list[int], row_bytes: int,
                   repeat: int) -> float:
    """NCCL all_to_all_single moving these rows of ``row_bytes`` bytes (as uint8)."""
    import torch

    inp = torch.empty(sum(send_rows), row_bytes, dtype=torch.uint8, device="cuda")
    out = torch.empty(sum(recv_rows), row_bytes, dtype=torch.uint8, device="cuda")
    return _median_us(lambda: dist.all_to_all_single(out, inp, recv_rows, send_rows), group, repeat)


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
            _start_together(group)
            result = call(hook)
            if hook:
                torch.cuda.synchronize()
                time.sleep(1e-3)
                result.hook()
            torch.cuda.synchronize()
            prof = {k: v for k, v in buf.profile().items() if k.startswith("ll_")}
            if group.rank == 0:
                print(f"  profile ll-{name} {tokens} tokens{' (hook)' if hook else ''}: {prof}", flush=True)


def _bench_low_latency_case(buf: Any, group: Any, dist: Any, args: argparse.Namespace, modes: list[str],
                            tokens: int) -> list[Row]:
    import torch

    r, rank, hidden, experts, topk = group.size, group.rank, buf.hidden, buf.num_experts, args.topk
    max_tokens, num_local = buf.num_max_dispatch_tokens_per_rank, experts // r
    rows: list[Row] = []
    idx, w = _routing(tokens, topk, experts, seed=4321 + rank)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    y = torch.randn(num_local, r * max_tokens, hidden, device="cuda").to(torch.bfloat16)
    pairs = [int(v) for v in torch.bincount(idx.flatten() // num_local, minlength=r).tolist()]
    recv_pairs = [int(p[rank]) for p in group.allgather_object(pairs)]
    msg = hidden + hidden // 128 * 4 + 16
    d = buf.low_latency_dispatch(x, idx, max_tokens, experts)
    handle = d.handle
    timed: dict[str, float] = {}
    if "ll-dispatch" in modes:
        g = _graph(lambda: buf.low_latency_dispatch(x, idx, max_tokens, experts))
        timed["ll-dispatch"] = _median_us(g.replay, group, args.repeat)
    if "ll-combine" in modes:
        g = _graph(lambda: buf.low_latency_combine(y, idx, w, handle))
        timed["ll-combine"] = _median_us(g.replay, group, args.repeat)
    if "ll-hook" in modes:
        halves = {
            "ll-dispatch": lambda: buf.low_latency_dispatch(x, idx, max_tokens, experts, return_recv_hook=True),
            "ll-combine": lambda: buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True),
        }
        for name, send_half in halves.items():
            timed[f"{name}-send"], timed[f"{name}-recv"] = hook_halves_us(send_half, group, args.repeat)
    if args.profile:
        _profile_low_latency(buf, group, x, idx, w, y, handle, tokens)
    else:  # EPJIT_PROFILE's stamps would be timed too
        host = {name: _host_us(call, args.repeat) for name, call in (
            ("dispatch", lambda: buf.low_latency_dispatch(x, idx, max_tokens, experts)),
            ("combine", lambda: buf.low_latency_combine(y, idx, w, handle)))}
        if rank == 0:
            print(f"  host time of an eager call, {tokens} tokens: " +
                  ", ".join(f"{k} {v:.1f} us" for k, v in host.items()), flush=True)
    nccl: dict[str, float | None] = {"dispatch": None, "combine": None}
    if not args.no_nccl:
        nccl["dispatch"] = _nccl_bytes_us(dist, group, pairs, recv_pairs, msg, args.repeat)
        nccl["combine"] = _nccl_bytes_us(dist, group, recv_pairs, pairs, 2 * hidden, args.repeat)
    all_times = group.allgather_object((timed, nccl))
    for mode in timed:
        t = max(a[0][mode] for a in all_times)
        kind = "combine" if "combine" in mode else "dispatch"
        peer = [a[1][kind] for a in all_times]
        nccl_us = max(peer) if None not in peer else None
        row_bytes = msg if kind == "dispatch" else 2 * hidden
        moved = sum(pairs) * row_bytes  # docs/benchmark.md: valid (token, expert) pairs x message bytes
        out_bytes = (sum(pairs) - pairs[rank]) * row_bytes
        rows.append(Row(mode, tokens, hidden, topk, experts, buf._ll.num_sms if buf._ll else 0, r,
                        round(t, 1), round(nccl_us, 1) if nccl_us else None,
                        round(out_bytes / (t * 1e-6) / 1e9, 1), round(moved / (t * 1e-6) / 1e9, 1),
                        round(out_bytes / (nccl_us * 1e-6) / 1e9, 1) if nccl_us else None,
                        round(nccl_us / t, 2) if nccl_us else None,
                        round(100 * out_bytes / (t * 1e-6) / 1e9 / PLAIN_STORE_CEILING_GBS, 1)))
    return rows


def _bench_case(buf: Any, group: Any, dist: Any, mode: str, tokens: int, hidden: int, args: argparse.Namespace,
                cfg: Any) -> Row:
    import torch

    r, rank = group.size, group.rank
    idx, w = _routing(tokens, args.topk, args.experts, seed=1234 + rank)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    fp8 = mode == "dispatch-fp8"
    if fp8:
        scales = x.float().view(tokens, hidden // 128, 128).abs().amax(-1).clamp(min=1e-4) / 448
        xq = (x.float().view(tokens, hidden // 128, 128) / scales[..., None]).view(tokens, hidden)
        x_arg: Any = (xq.to(torch.float8_e4m3fn), scales.contiguous())
        row_bytes = hidden + hidden // 128 * 4
    else:
        x_arg = x
        row_bytes = hidden * 2
    layout = buf.get_dispatch_layout(idx, args.experts)
    d = buf.dispatch(x_arg, topk_idx=idx, topk_weights=w, layout=layout, config=cfg)
    send_counts = layout.num_tokens_per_rank.cpu().tolist()
    recv_counts = [int(c[rank]) for c in group.allgather_object(send_counts)]
    recv_rows = sum(recv_counts)
    if mode == "combine":
        op = (lambda: buf.combine(d.x, d.handle, config=cfg))  # noqa: E731
        out_rows = recv_rows - recv_counts[rank]  # rows going back to other ranks
    else:
        op = (lambda: buf.dispatch(x_arg, topk_idx=idx, topk_weights=w, layout=layout, config=cfg))  # noqa: E731
        out_rows = sum(send_counts) - send_counts[rank]
    t_epjit = _median_us(op, group, args.repeat)
    for _ in range(3 if args.profile else 0):
        _start_together(group)  # as in the timed runs: the host's launches hidden behind the spin
        op()
        prof = buf.profile()
        if group.rank == 0:
            print(f"  profile {mode} {tokens}x{hidden} sms={cfg.num_sms}: {prof}", flush=True)
        for name, rows in buf.profile_blocks().items():  # every rank's: a channel's two ends are on two ranks
            print(f"  blocks {mode} {name} (sm, channel, points...): {sorted(rows, key=lambda b: b[1])}",
                  flush=True)

    nccl_us = None
    if not args.no_nccl:
        elem = 1 if fp8 else 2
        cols = row_bytes // elem if not fp8 else row_bytes
        dtype = torch.uint8 if fp8 else torch.bfloat16
        if mode == "combine":
            inp = torch.empty(recv_rows, cols, dtype=dtype, device="cuda")
            out = torch.empty(sum(send_counts), cols, dtype=dtype, device="cuda")
            in_split, out_split = recv_counts, send_counts
        else:
            inp = torch.empty(sum(send_counts), cols, dtype=dtype, device="cuda")
            out = torch.empty(recv_rows, cols, dtype=dtype, device="cuda")
            in_split, out_split = send_counts, recv_counts
        nccl_us = _median_us(lambda: dist.all_to_all_single(out, inp, out_split, in_split), group, args.repeat)
    out_gbs = out_rows * row_bytes / (t_epjit * 1e-6) / 1e9
    deepep_gbs = recv_rows * row_bytes / (t_epjit * 1e-6) / 1e9
    # Report the slowest rank's time (every rank waits for it in a real step).
    times = group.allgather_object((t_epjit, nccl_us, out_gbs))
    t_epjit = max(t[0] for t in times)
    nccl_us = max(t[1] for t in times) if nccl_us is not None else None
    out_gbs = min(t[2] for t in times)
    return Row(mode, tokens, hidden, args.topk, args.experts, cfg.num_sms, r, round(t_epjit, 1),
               round(nccl_us, 1) if nccl_us else None, round(out_gbs, 1), round(deepep_gbs, 1),
               round(out_rows * row_bytes / (nccl_us * 1e-6) / 1e9, 1) if nccl_us else None,
               round(nccl_us / t_epjit, 2) if nccl_us else None, round(100 * out_gbs / PLAIN_STORE_CEILING_GBS, 1))


_HEADER = (f"{'mode':<16} {'tokens':>6} {'hidden':>6} {'sms':>3} {'R':>2} {'epjit us':>9} {'out GB/s':>8} "
           f"{'DeepEP GB/s':>11} {'NCCL us':>8} {'NCCL GB/s':>9} {'NCCL/epjit':>10} {'% NVLink':>8}")


def _print_row(row: Row) -> None:
    if not getattr(_print_row, "header", False):
        print(_HEADER)
        _print_row.header = True  # type: ignore[attr-defined]
    print(f"{row.mode:<16} {row.tokens:>6} {row.hidden:>6} {row.sms:>3} {row.ranks:>2} {row.epjit_us:>9.1f} "
          f"{row.out_gbs:>8.1f} {row.deepep_gbs:>11.1f} {row.nccl_us or float('nan'):>8.1f} "
          f"{row.nccl_out_gbs or float('nan'):>9.1f} {row.ratio or float('nan'):>10.2f} {row.pct_nvlink:>8.1f}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epjit.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--hidden", type=int, nargs="+", default=[7168])
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--sms", type=int, nargs="+", default=[24])
    parser.add_argument("--chunk-send", type=int, default=0, help="tokens between tail updates (0: the default)")
    parser.add_argument("--chunk-recv", type=int, default=256)
    parser.add_argument("--warp-roles", default="",
                        help="normal mode: Config's warp-role fields, e.g. dispatch_phased=1,combine_send_warps=3 "
                             "(default: the defaults for the rank count)")
    parser.add_argument("--modes", nargs="+", default=["dispatch", "dispatch-fp8", "combine"],
                        choices=["dispatch", "dispatch-fp8", "combine", "ll-dispatch", "ll-combine", "ll-hook",
                                 "ceiling"],
                        help="normal mode: dispatch, dispatch-fp8, combine; low latency (CUDA-graph replays): "
                             "ll-dispatch (FP8), ll-combine, ll-hook (send and receive halves of each); ceiling: "
                             "warp and bulk (TMA) copies to one peer, to every peer and locally, by SMs "
                             "(--ceiling-sms)")
    parser.add_argument("--ceiling-sms", type=int, nargs="+", default=[4, 8, 12, 16, 24, 32],
                        help="SM counts of the ceiling mode (all SMs are always added)")
    parser.add_argument("--ll-tokens", type=int, nargs="+", default=[128],
                        help="tokens per rank of the low-latency cases (the buffer holds the largest)")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--no-nccl", action="store_true")
    parser.add_argument("--json", help="write the rows here (rank 0)")
    parser.add_argument("--profile", action="store_true", help="print where one call of each case spends its time")
    parser.add_argument("--summary", nargs="+", metavar="JSON",
                        help="print the rows of earlier --json files as one table, and nothing else (no GPU)")
    args = parser.parse_args(argv)
    if args.summary:
        for path in args.summary:
            with open(path) as f:
                for row in json.load(f)["rows"]:
                    _print_row(Row(**row))
        return 0
    try:
        parse_roles(args.warp_roles)
    except ValueError as e:
        parser.error(str(e))
    if args.repeat < 20:
        parser.error("--repeat must be >= 20 (docs/benchmark.md's protocol)")
    if settings().share_gpus:
        parser.error("EPJIT_SHARE_GPUS is set: ranks sharing a GPU are time-sliced, so their timings mean nothing "
                     "(and NCCL refuses two ranks on one GPU)")
    start = time.time()
    if args.profile:
        os.environ["EPJIT_PROFILE"] = "1"
    rows = run(args)
    import epjit

    group = epjit.init()
    if group.rank == 0 and args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "host": socket.gethostname(), "seconds": time.time() - start,
                "argv": sys.argv, "env": {k: v for k, v in os.environ.items() if k.startswith(("EPJIT_", "NCCL_"))}}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0
