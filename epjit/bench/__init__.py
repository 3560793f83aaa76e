"""``python -m epjit.launch -n N -m epjit.bench [--json out.json]``: epjit beside NCCL all_to_all_single and DeepEP.

Same run, same inputs, same bytes: for each case the routing's split sizes feed NCCL's ``all_to_all_single`` (what a
user would write instead of epjit); with --peers deepep, DeepEP V1 (built from source, importable as deep_ep) makes
the same calls on the same inputs (epjit/bench/peers.py). Every figure is timed the same way, following
docs/benchmark.md's protocol: CUDA events around the operation, warm-up first, median of ``--repeat`` runs (>= 20),
a barrier between runs: a host barrier, a 500 us wall-clock spin on the GPU that hides the host's launches of what
follows, then a one-element NCCL all_reduce so every GPU starts the timed operation at about the same moment (see
_start_together).

Columns beside epjit's time:
  NCCL us, DeepEP us  the peers' medians of the same work (slowest rank); NCCL/epjit, DeepEP/epjit: their ratios
  out GB/s    bytes that leave this GPU (rows to other ranks) / time: what NVLink carries
  DeepEP GB/s epjit's time in DeepEP's accounting: received rows (self included) x row bytes / time
  % NVLink    out GB/s against the measured plain-store ceiling (PLAIN_STORE_CEILING_GBS; docs/performance.md)
Across NVLink nodes (--num-nvl-ranks V below the ranks), also:
  V           ranks of one NVLink node
  RDMA pairs  (token, destination node other than the sender's) pairs that crossed the RDMA leg, all ranks
  RDMA MB     their bytes on the wire (rdma_message_bytes each), all ranks
  RDMA GB/s   RDMA bytes leaving a rank / its time (slowest rank)
  % put       RDMA GB/s against the best NVSHMEM put ceiling measured in the same run (--put-ceiling)
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
from ..env import WORLD_SIZE, settings
from ..kernels.low_latency import deepep_low_latency_size_hint
from .peers import DeepEPPeer, deepep_problem, nccl_bytes_us, nccl_case_us

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
    # Rows of runs before internode lack these (None).
    num_nvl_ranks: int | None = None  # ranks of one NVLink node in this run
    rdma_pairs: int | None = None  # (token, other node) pairs that crossed the RDMA leg, all ranks
    rdma_bytes: int | None = None  # their bytes on the wire, all ranks (put ceiling: bytes put by all ranks)
    rdma_gbs: float | None = None  # RDMA bytes leaving a rank / its time, slowest rank
    pct_put: float | None = None  # rdma_gbs against the best put ceiling of the same run
    # Rows of runs before --peers deepep lack these (None), as do rows DeepEP was not timed for.
    deepep_us: float | None = None  # DeepEP's median of the same call (slowest rank)
    deepep_ratio: float | None = None  # DeepEP time / epjit time: above 1, epjit is faster


# Normal-mode modes: the operation (dispatch, dispatch-fp8, combine), or a dispatch made another way: "layout-": with
# get_dispatch_layout inside the timed call (as a user calls it on a fresh routing), "cached-": replaying the handle
# of an earlier dispatch.
NORMAL_MODES = ("dispatch", "dispatch-fp8", "combine", "layout-dispatch", "layout-dispatch-fp8", "cached-dispatch",
                "cached-dispatch-fp8")
LOW_LATENCY_MODES = ("ll-dispatch", "ll-combine", "ll-hook")
PEERS = ("nccl", "deepep")


def base_mode(mode: str) -> str:
    """The operation a normal-mode mode times (``cached-dispatch-fp8`` -> ``dispatch-fp8``): its bytes, inputs and
    NCCL peer are the operation's."""
    return mode.removeprefix("layout-").removeprefix("cached-")


def rdma_message_bytes(mode: str, hidden: int, topk: int) -> int:
    """Bytes of one token's message on the internode RDMA leg, for one (token, destination node) pair.

    dispatch: the bf16 row (``2 * hidden``), its top-k ids and weights (``8 * topk``: an int32 and a float32 each)
    and a 16-byte header; dispatch-fp8: the same with the FP8 row and its scales (``hidden + hidden / 128 * 4``)
    in place of the bf16 row; combine: the node's bf16 partial sum (``2 * hidden``) and its summed weights
    (``4 * topk``). Slots padding aside, what the rail puts carry.
    """
    if mode == "combine":
        return 2 * hidden + 4 * topk
    if mode not in ("dispatch", "dispatch-fp8"):
        raise ValueError(f"no RDMA message for mode {mode!r}")
    row = hidden + hidden // 128 * 4 if mode == "dispatch-fp8" else 2 * hidden
    return row + 8 * topk + 16


def rdma_leg_bytes(mode: str, hidden: int, topk: int, pairs: int) -> int:
    """Bytes that cross the RDMA leg for ``pairs`` (token, destination node other than the sender's) pairs: a token
    crosses to each other node once, whatever number of that node's ranks hold its experts."""
    return pairs * rdma_message_bytes(mode, hidden, topk)


def tokens_per_node(topk_idx: Any, num_experts: int, num_ranks: int, num_nvl_ranks: int) -> list[int]:
    """Tokens of ``topk_idx`` ([tokens, topk] global expert ids, -1 for none) bound for each NVLink node: a token
    counts once a node, however many of its experts live there (``layout.num_tokens_per_rdma_rank``). Expert
    ``e`` lives on rank ``e // (num_experts / num_ranks)``, which is on node ``rank // num_nvl_ranks``."""
    import numpy as np

    idx = np.asarray(topk_idx)
    num_nodes = num_ranks // num_nvl_ranks
    node = np.where(idx >= 0, idx // (num_experts // num_ranks) // num_nvl_ranks, -1)
    hit = np.zeros((idx.shape[0], num_nodes), dtype=bool)
    tokens, slots = np.nonzero(node >= 0)
    hit[tokens, node[tokens, slots]] = True
    return [int(n) for n in hit.sum(axis=0)]


def rdma_pairs_out(mode: str, node_counts: list[list[int]], rank: int, num_nvl_ranks: int) -> int:
    """(token, other node) pairs whose messages leave ``rank`` on the RDMA leg, from every rank's
    ``tokens_per_node`` (``node_counts[r][m]``: tokens of rank r bound for node m). Dispatch: this rank's tokens
    bound for other nodes, each put once to its rail peer there. Combine, the way back: this rank forwarded the
    tokens its rail peers of the other nodes sent to its node, and puts each one's partial sum home."""
    node, local = divmod(rank, num_nvl_ranks)
    if mode == "combine":
        return sum(counts[node] for r, counts in enumerate(node_counts)
                   if r % num_nvl_ranks == local and r // num_nvl_ranks != node)
    return sum(node_counts[rank]) - node_counts[rank][node]


def rail_peers(rank: int, num_ranks: int, num_nvl_ranks: int) -> tuple[int, int]:
    """(the rank this one puts to, the rank that puts to it) in the put ceiling: the ranks with its local index on
    the next and on the previous NVLink node (its rail, which carries the RDMA leg)."""
    num_nodes = num_ranks // num_nvl_ranks
    node, local = divmod(rank, num_nvl_ranks)
    return (node + 1) % num_nodes * num_nvl_ranks + local, (node - 1) % num_nodes * num_nvl_ranks + local


def put_mode_name(chunk_bytes: int, warps: int) -> str:
    """The mode of a put-ceiling row: ``ceil-put-64k-w24`` (chunks of 64 KiB, 24 warps a block)."""
    if chunk_bytes % (1 << 20) == 0:
        size = f"{chunk_bytes >> 20}m"
    elif chunk_bytes % 1024 == 0:
        size = f"{chunk_bytes >> 10}k"
    else:
        size = f"{chunk_bytes}b"
    return f"ceil-put-{size}-w{warps}"


def topology_problem(num_ranks: int | None, num_nvl_ranks: int | None, modes: list[str], warp_roles: str = "",
                     sms: list[int] | None = None, peers: list[str] | None = None) -> str | None:
    """Why these options cannot run on ``num_ranks`` ranks (None: not known yet, only what needs no rank count is
    checked), or None. Every rank finds the same answer."""
    v = num_nvl_ranks
    if v is not None and not 1 <= v <= 8:
        return f"--num-nvl-ranks {v} must be in [1, 8] (the ranks of one NVLink node)"
    if "deepep" in (peers or []) and v is not None and (num_ranks is None or v < num_ranks):
        return (f"--peers deepep with --num-nvl-ranks {v}: DeepEP is timed inside one NVLink node only (its "
                "internode kernels need nodes of 8 GPUs over RDMA, not virtual nodes); drop one of them")
    if "put-ceiling" in modes and (v is None or v == num_ranks):
        return ("--put-ceiling times NVSHMEM puts between ranks of different NVLink nodes: it needs several, "
                "--num-nvl-ranks V with V below the ranks (e.g. 2 on 4 GPUs: two virtual nodes of 2)")
    if num_ranks is None or v is None:
        return None
    if num_ranks % v:
        return f"--num-nvl-ranks {v} does not divide the {num_ranks} ranks into NVLink nodes"
    if v == num_ranks:
        return None
    if "ceiling" in modes:
        return ("the copy ceilings are of one NVLink node: run --modes ceiling without --num-nvl-ranks (the "
                "internode leg's ceiling is --put-ceiling)")
    if warp_roles.strip():
        return "--warp-roles are the intranode kernels' fields: not with --num-nvl-ranks below the ranks"
    if any(s % 2 for s in sms or []):
        return f"--sms {sms}: internode runs two blocks a channel, so every SM count must be even"
    return None


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


def _median_us(fn: Any, group: Any, repeat: int, warmup: int = 5, before: Any = None) -> float:
    """Median microseconds of ``fn`` (docs/benchmark.md's protocol); ``before``, if given, runs before each call,
    untimed (it restores a state the call needs)."""
    import torch

    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
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


def init_with_nccl(num_nvl_ranks: int | None = None) -> Any:
    """epjit's group (``num_nvl_ranks``: ranks of one NVLink node, None: a host's), this rank's GPU made torch's
    current device, and torch.distributed's NCCL group over the same ranks: the peer every case is timed beside
    (the tuning scripts start the same way). The caller ends it with torch.distributed.destroy_process_group()."""
    import torch
    import torch.distributed as dist

    import epjit

    group = epjit.init(num_nvl_ranks=num_nvl_ranks)
    torch.cuda.set_device(group.device)
    port = int(group.bcast_bytes(str(_free_port()).encode() if group.rank == 0 else None).decode())
    dist.init_process_group("nccl", init_method=f"tcp://{group.hosts[0]}:{port}", rank=group.rank,
                            world_size=group.size, device_id=torch.device("cuda", group.device))
    return group


def run(args: argparse.Namespace) -> list[Row]:
    import torch.distributed as dist

    group = init_with_nccl(args.num_nvl_ranks)
    rows: list[Row] = []
    normal_modes = [m for m in args.modes if m in NORMAL_MODES]
    ll_modes = [m for m in args.modes if m in LOW_LATENCY_MODES]
    peer = None
    try:
        problem = topology_problem(group.size, args.num_nvl_ranks, args.modes, args.warp_roles, args.sms,
                                   args.peers)
        if problem:  # the same on every rank: each leaves with it
            raise SystemExit(f"python -m epjit.bench: error: {problem}")
        peer = DeepEPPeer(group) if "deepep" in args.peers else None
        if "put-ceiling" in args.modes:
            rows += _bench_put_ceiling(group, args)
        if "ceiling" in args.modes:
            rows += _bench_ceiling(group, args)
        if ll_modes:
            rows += _bench_low_latency(group, dist, args, ll_modes, peer)
        if normal_modes:
            put_gbs = max((row.rdma_gbs or 0.0 for row in rows if row.mode.startswith("ceil-put")), default=0.0)
            rows += _bench_normal(group, dist, args, normal_modes, put_gbs or None, peer)
    finally:
        try:
            if peer is not None:
                peer.close()  # DeepEP's Buffers first: their destroy() synchronises the ranks
        finally:
            dist.destroy_process_group()
    for row in rows:
        row.num_nvl_ranks = group.num_nvl_ranks
    return rows


_PUT_CEILING_BYTES = 64 << 20  # a rank puts this much a launch: ~1.3 ms at 400 Gb/s, far above launch and skew


def _bench_put_ceiling(group: Any, args: argparse.Namespace) -> list[Row]:
    """What NVSHMEM warp puts with signals reach between ranks of different NVLink nodes, by blocks, warps a block
    and chunk size: every rank puts to its rail peer on the next node while the one on the previous node puts to
    it (cuda_src/bench/put_ceiling.cu), both directions at once as on the RDMA leg. A row's GB/s: bytes a rank
    puts / the slowest rank's median time. On virtual nodes of one host NVSHMEM's peer-to-peer transport (NVLink)
    carries the puts, so the figure is that transport's, not a NIC's."""
    import torch

    from ..memory import PeerMemory
    from ..ops.loader import load
    from .kernels import PutCeilingSpec, put_ceiling_heap_bytes

    r, v = group.size, group.num_nvl_ranks
    if v >= r:
        raise SystemExit(f"python -m epjit.bench: error: the put ceiling needs several NVLink nodes ({r} ranks in "
                         f"nodes of {v}): pass --num-nvl-ranks V below the ranks")
    n = _PUT_CEILING_BYTES
    dst, src = rail_peers(group.rank, r, v)
    mem = PeerMemory.create(group, 0, put_ceiling_heap_bytes(n))
    module = load(PutCeilingSpec(), group.device)
    stream = torch.cuda.current_stream().cuda_stream
    num_sms = torch.cuda.get_device_properties(group.device).multi_processor_count
    put = {"expected": 0}  # chunks the rail peer has put since the heap was made: the signal only grows
    rows: list[Row] = []
    if group.rank == 0:
        print(f"put ceiling: {r // v} nodes of {v} ranks, {n >> 20} MiB a rank and launch, rank 0 puts to rank "
              f"{dst} and gets from rank {src}", flush=True)
    try:
        for warps in args.put_warps:
            for chunk_kib in args.put_chunks:
                chunk = chunk_kib << 10
                for blocks in sorted({min(sms, num_sms) for sms in args.put_sms}):
                    launch_args = module.spec.args("put_ceiling", peers=mem.table_ptr, dst_pe=dst, src_pe=src,
                                                   n_bytes=n, chunk_bytes=chunk, expected=0)

                    def put_all(launch_args: Any = launch_args, blocks: int = blocks, warps: int = warps,
                                num_chunks: int = -(-n // chunk)) -> None:
                        put["expected"] += num_chunks
                        launch_args.set(expected=put["expected"])
                        module.launch(launch_args, blocks, 32 * warps, stream=stream)

                    try:
                        t = max(group.allgather_object(_median_us(put_all, group, args.repeat)))
                    except RuntimeError as e:  # a wait that timed out trapped: name the rail peer
                        mem.raise_for(e)
                        raise
                    gbs = round(n / (t * 1e-6) / 1e9, 1)
                    rows.append(Row(put_mode_name(chunk, warps), 0, 0, 0, 0, blocks, r, round(t, 1), None, gbs, gbs,
                                    None, None, round(100 * gbs / PLAIN_STORE_CEILING_GBS, 1), num_nvl_ranks=v,
                                    rdma_bytes=n * r, rdma_gbs=gbs))
                    if group.rank == 0:
                        _print_row(rows[-1])
    finally:
        mem.close()
    return rows


_CEILING_BYTES = 64 << 20  # per destination: ~0.2 ms at NVLink speed, far above launch and skew
_CEILING_STAGES = 8  # kCeilingStages of cuda_src/bench/ceiling.cu


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
    # name: (destination mask, schedule, pull, skew); schedules as in cuda_src/bench/ceiling.cu
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
                roles: dict[str, int] | None = None, *, num_nvl_ranks: int | None = None, rdma_chunk_send: int = 0,
                rdma_chunk_recv: int = 0) -> Config:
    """The Config a normal-mode case runs with: the operation's own default (what a call without config gets:
    combine's chunk differs from dispatch's, and inside one node both follow the warp roles, the defaults or
    ``roles``: Config's warp-role fields), with each of sms, chunk_send, chunk_recv (and across NVLink nodes,
    ``num_nvl_ranks`` below ``num_ranks``, rdma_chunk_send and rdma_chunk_recv) in its place where given (0: the
    default's)."""
    if num_nvl_ranks is not None and num_nvl_ranks < num_ranks:
        getter = get_combine_config if mode == "combine" else get_dispatch_config
        default = getter(num_ranks, num_nvl_ranks=num_nvl_ranks)
        return Config(num_sms=sms or default.num_sms, nvl_chunk_send=chunk_send or default.nvl_chunk_send,
                      nvl_chunk_recv=chunk_recv or default.nvl_chunk_recv,
                      rdma_chunk_send=rdma_chunk_send or default.rdma_chunk_send,
                      rdma_chunk_recv=rdma_chunk_recv or default.rdma_chunk_recv)
    spec = Config(**(roles or {})).spec(num_ranks)
    default = get_combine_config(num_ranks, spec) if mode == "combine" else get_dispatch_config(num_ranks, spec)
    return Config(sms or default.num_sms, chunk_send or default.nvl_chunk_send, chunk_recv or default.nvl_chunk_recv,
                  **(roles or {}))


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


def _case_configs(args: argparse.Namespace, modes: list[str], num_ranks: int,
                  roles: dict[str, int]) -> dict[tuple[str, int], Config]:
    """The Config of each (mode, --sms) case of this run (case_config)."""
    return {(mode, sms): case_config(mode, num_ranks, sms, args.chunk_send, args.chunk_recv, roles,
                                     num_nvl_ranks=args.num_nvl_ranks, rdma_chunk_send=args.rdma_chunk_send,
                                     rdma_chunk_recv=args.rdma_chunk_recv)
            for mode in modes for sms in args.sms}


def _normal_buffer(group: Any, args: argparse.Namespace, configs: list[Config]) -> Any:
    """One Buffer for every case: the largest size hint over the cases' configs, at the largest hidden size; across
    NVLink nodes an internode Buffer, with its RDMA heap."""
    import epjit

    r, v, hidden = group.size, group.num_nvl_ranks, max(args.hidden)
    sizes = (args.topk, args.experts)
    if v == r:
        nvl = max(epjit.Buffer.get_normal_size_hint(r, hidden, *sizes, c) for c in configs)
        return epjit.Buffer(group, num_nvl_bytes=nvl)
    nvl = max(epjit.Buffer.get_normal_size_hint(r, hidden, *sizes, c, num_nvl_ranks=v) for c in configs)
    rdma = max(epjit.Buffer.get_rdma_size_hint(r, hidden, *sizes, c, num_nvl_ranks=v) for c in configs)
    if group.rank == 0:
        print(f"internode kernels: {r // v} nodes of {v} ranks; NVLink buffer {nvl / 2**20:.1f} MiB, RDMA heap "
              f"{rdma / 2**20:.1f} MiB a rank", flush=True)
    return epjit.Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=rdma)


def _bench_normal(group: Any, dist: Any, args: argparse.Namespace, modes: list[str],
                  put_gbs: float | None = None, peer: DeepEPPeer | None = None) -> list[Row]:
    """Normal-mode dispatch (with a given layout, with its layout, replaying a handle), FP8 dispatch and combine,
    inside one NVLink node or across several (an internode Buffer, with the RDMA leg's columns; ``put_gbs``: the
    run's best put ceiling, for their % put); with ``peer``, DeepEP's figure of each."""
    r = group.size
    roles = parse_roles(args.warp_roles)
    configs = _case_configs(args, modes, r, roles)
    buf = _normal_buffer(group, args, list(configs.values()))
    if group.rank == 0 and group.num_nvl_ranks == r:  # which warp roles these rows are of
        print(f"intranode kernels: {Config(**roles).spec(r).family}", flush=True)
    rows: list[Row] = []
    try:
        if peer is not None:
            peer.open_normal(max(args.hidden), [cfg.num_sms for cfg in configs.values()])
        for hidden in args.hidden:
            for tokens in args.tokens:
                for sms in args.sms:
                    for mode in modes:
                        cfg = configs[mode, sms]
                        rows.append(_bench_case(buf, group, dist, mode, tokens, hidden, args, cfg, put_gbs, peer))
                        if group.rank == 0:
                            _print_row(rows[-1])
    finally:
        try:
            buf.close()
        finally:
            if peer is not None:
                peer.close_normal()
    return rows


def _graph(fn: Any, warmup: Any = None, stream: Any = None) -> Any:
    """``fn`` captured once in a torch CUDA graph, after two eager calls of ``warmup`` (default: ``fn``) on the
    capture stream (CuPy's memory pool is per stream: the capture must find its blocks there): ``stream``, or a new
    one."""
    import torch

    stream = stream or torch.cuda.Stream()
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


def _median_halves_us(first: Any, second: Any, group: Any, repeat: int, before: Any = None) -> tuple[float, float]:
    """Medians of two back-to-back steps (a send half, then its receive half), timed separately; ``before`` as for
    _median_us, once before each pair."""
    import torch

    for _ in range(3):
        if before is not None:
            before()
        first()
        second()
    torch.cuda.synchronize()
    a, b = [], []
    for _ in range(repeat):
        if before is not None:
            before()
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


def hook_halves_us(send_half: Any, group: Any, repeat: int, before: Any = None) -> tuple[float, float]:
    """Medians of the send and receive halves of a low-latency call: ``send_half`` makes the call with
    return_recv_hook=True and returns its result (with the hook as ``.hook``). Each half in its own CUDA graph: the
    send half's capture leaves its hook pending, the receive half's runs it, both captured on one stream (DeepEP's
    hook launches on the stream its call ran on). ``before`` as for _median_us."""
    import torch

    held: list[Any] = []

    def whole_call() -> None:  # the warm-up runs both halves, so no hook is left pending
        send_half().hook()

    stream = torch.cuda.Stream()
    send = _graph(lambda: held.append(send_half()), warmup=whole_call, stream=stream)
    recv = _graph(lambda: held.pop().hook(), warmup=lambda: None, stream=stream)
    return _median_halves_us(send.replay, recv.replay, group, repeat, before)


def _bench_low_latency(group: Any, dist: Any, args: argparse.Namespace, modes: list[str],
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
    floor = _graph_floor_us(group, args.repeat)
    if rank == 0:
        print(f"protocol floor: a CUDA graph of one tiny kernel times {floor:.1f} us here", flush=True)
    try:
        if peer is not None:
            peer.open_low_latency(max_tokens, hidden, experts)
        for tokens in args.ll_tokens:
            for row in _bench_low_latency_case(buf, group, dist, args, modes, tokens, peer):
                rows.append(row)
                if rank == 0:
                    _print_row(row)
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


def _time_low_latency(buf: Any, group: Any, args: argparse.Namespace, modes: list[str], x: Any, idx: Any, w: Any,
                      y: Any, handle: Any) -> dict[str, float]:
    """epjit's medians of a low-latency case, keyed by row mode; then its profile, or its host time."""
    max_tokens, experts = buf.num_max_dispatch_tokens_per_rank, buf.num_experts
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
        _profile_low_latency(buf, group, x, idx, w, y, handle, idx.shape[0])
    else:  # EPJIT_PROFILE's stamps would be timed too
        host = {name: _host_us(call, args.repeat) for name, call in (
            ("dispatch", lambda: buf.low_latency_dispatch(x, idx, max_tokens, experts)),
            ("combine", lambda: buf.low_latency_combine(y, idx, w, handle)))}
        if group.rank == 0:
            print(f"  host time of an eager call, {idx.shape[0]} tokens: " +
                  ", ".join(f"{k} {v:.1f} us" for k, v in host.items()), flush=True)
    return timed


def _slowest(values: list[float | None]) -> float | None:
    """The slowest rank's figure, or None where some rank has none (a peer not timed)."""
    return None if not values or None in values else max(v for v in values if v is not None)


def _with_deepep(row: Row, deepep_us: float | None, epjit_us: float) -> Row:
    """``row`` with DeepEP's time of the same call and its ratio to epjit's (None: not timed)."""
    if deepep_us:
        row.deepep_us, row.deepep_ratio = round(deepep_us, 1), round(deepep_us / epjit_us, 2)
    return row


def _bench_low_latency_case(buf: Any, group: Any, dist: Any, args: argparse.Namespace, modes: list[str],
                            tokens: int, peer: DeepEPPeer | None = None) -> list[Row]:
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
    timed = _time_low_latency(buf, group, args, modes, x, idx, w, y, d.handle)
    nccl: dict[str, float | None] = {"dispatch": None, "combine": None}
    if not args.no_nccl:
        nccl["dispatch"] = nccl_bytes_us(dist, group, pairs, recv_pairs, msg, args.repeat)
        nccl["combine"] = nccl_bytes_us(dist, group, recv_pairs, pairs, 2 * hidden, args.repeat)
    deepep = peer.low_latency_us(modes, x, idx, w, y, args.repeat) if peer is not None else {}
    all_times = group.allgather_object((timed, nccl, deepep))
    for mode in timed:
        t = max(a[0][mode] for a in all_times)
        kind = "combine" if "combine" in mode else "dispatch"
        nccl_us = _slowest([a[1][kind] for a in all_times])
        row_bytes = msg if kind == "dispatch" else 2 * hidden
        moved = sum(pairs) * row_bytes  # docs/benchmark.md: valid (token, expert) pairs x message bytes
        out_bytes = (sum(pairs) - pairs[rank]) * row_bytes
        row = Row(mode, tokens, hidden, topk, experts, buf._ll.num_sms if buf._ll else 0, r,
                  round(t, 1), round(nccl_us, 1) if nccl_us else None,
                  round(out_bytes / (t * 1e-6) / 1e9, 1), round(moved / (t * 1e-6) / 1e9, 1),
                  round(out_bytes / (nccl_us * 1e-6) / 1e9, 1) if nccl_us else None,
                  round(nccl_us / t, 2) if nccl_us else None,
                  round(100 * out_bytes / (t * 1e-6) / 1e9 / PLAIN_STORE_CEILING_GBS, 1))
        rows.append(_with_deepep(row, _slowest([a[2].get(mode) for a in all_times]), t))
    return rows


def _case_input(mode: str, tokens: int, hidden: int) -> tuple[Any, int]:
    """A case's dispatch input (bf16 rows, or FP8 rows with one scale per 128 channels, for a mode ending in -fp8)
    and its row's bytes."""
    import torch

    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    if not mode.endswith("-fp8"):
        return x, hidden * 2
    scales = x.float().view(tokens, hidden // 128, 128).abs().amax(-1).clamp(min=1e-4) / 448
    xq = (x.float().view(tokens, hidden // 128, 128) / scales[..., None]).view(tokens, hidden)
    return (xq.to(torch.float8_e4m3fn), scales.contiguous()), hidden + hidden // 128 * 4


def _rdma_pairs(group: Any, layout: Any, idx: Any, mode: str, num_experts: int) -> tuple[int, int]:
    """(pairs whose messages leave this rank, pairs of all ranks) on the RDMA leg, from the routing on the host;
    a layout's own per-node counts that disagree are reported."""
    r, v = group.size, group.num_nvl_ranks
    counts = tokens_per_node(idx.cpu().numpy(), num_experts, r, v)
    per_node = getattr(layout, "num_tokens_per_rdma_rank", None)
    if per_node is not None and [int(c) for c in per_node.cpu().tolist()] != counts:
        print(f"rank {group.rank}: layout.num_tokens_per_rdma_rank {per_node.cpu().tolist()} but the routing "
              f"sends {counts} tokens to each node", flush=True)
    all_counts = group.allgather_object(counts)
    return (rdma_pairs_out(mode, all_counts, group.rank, v),
            sum(rdma_pairs_out(mode, all_counts, rank, v) for rank in range(r)))


def _profile_case(buf: Any, group: Any, op: Any, mode: str, tokens: int, hidden: int, cfg: Any) -> None:
    """Three calls of a case with EPJIT_PROFILE's marks and every rank's per-block stamps printed."""
    for _ in range(3):
        _start_together(group)  # as in the timed runs: the host's launches hidden behind the spin
        op()
        prof = buf.profile()
        if group.rank == 0:
            print(f"  profile {mode} {tokens}x{hidden} sms={cfg.num_sms}: {prof}", flush=True)
        for name, rows in buf.profile_blocks().items():  # every rank's: a channel's two ends are on two ranks
            print(f"  blocks {mode} {name} (sm, channel, points...): {sorted(rows, key=lambda b: b[1])}",
                  flush=True)


def _epjit_call(buf: Any, mode: str, x: Any, idx: Any, w: Any, layout: Any, d: Any, cfg: Any,
                num_experts: int) -> Any:
    """The call a normal-mode row times: ``d`` is an earlier dispatch of the same inputs (its rows and handle)."""
    if mode == "combine":
        return lambda: buf.combine(d.x, d.handle, config=cfg)
    if mode.startswith("cached-"):  # the handle's routing replayed
        return lambda: buf.dispatch(x, handle=d.handle, config=cfg)
    if mode.startswith("layout-"):  # the call as a user makes it with a fresh routing
        return lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, layout=buf.get_dispatch_layout(idx, num_experts),
                                    config=cfg)
    return lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, layout=layout, config=cfg)


def _bench_case(buf: Any, group: Any, dist: Any, mode: str, tokens: int, hidden: int, args: argparse.Namespace,
                cfg: Any, put_gbs: float | None = None, peer: DeepEPPeer | None = None) -> Row:
    r, rank = group.size, group.rank
    internode = group.num_nvl_ranks < r
    operation = base_mode(mode)  # its bytes, its NCCL peer, its RDMA leg
    idx, w = _routing(tokens, args.topk, args.experts, seed=1234 + rank)
    x_arg, row_bytes = _case_input(operation, tokens, hidden)
    layout = buf.get_dispatch_layout(idx, args.experts)
    d = buf.dispatch(x_arg, topk_idx=idx, topk_weights=w, layout=layout, config=cfg)
    send_counts = layout.num_tokens_per_rank.cpu().tolist()
    recv_counts = [int(c[rank]) for c in group.allgather_object(send_counts)]
    recv_rows = sum(recv_counts)
    op = _epjit_call(buf, mode, x_arg, idx, w, layout, d, cfg, args.experts)
    if operation == "combine":
        out_rows = recv_rows - recv_counts[rank]  # rows going back to other ranks
    else:
        out_rows = sum(send_counts) - send_counts[rank]
    rdma_out, rdma_all = _rdma_pairs(group, layout, idx, operation, args.experts) if internode else (0, 0)
    t_epjit = _median_us(op, group, args.repeat)
    if args.profile:
        _profile_case(buf, group, op, mode, tokens, hidden, cfg)
    nccl_us = None if args.no_nccl else nccl_case_us(dist, group, operation, row_bytes, send_counts, recv_counts,
                                                     args.repeat)
    deepep_us = None if peer is None else peer.normal_us(mode, x_arg, idx, w, args.experts, cfg.num_sms,
                                                         args.repeat)
    out_gbs = out_rows * row_bytes / (t_epjit * 1e-6) / 1e9
    deepep_gbs = recv_rows * row_bytes / (t_epjit * 1e-6) / 1e9
    rdma_gbs = rdma_leg_bytes(operation, hidden, args.topk, rdma_out) / (t_epjit * 1e-6) / 1e9
    # Report the slowest rank's time (every rank waits for it in a real step).
    times = group.allgather_object((t_epjit, nccl_us, out_gbs, rdma_gbs, deepep_us))
    t_epjit = max(t[0] for t in times)
    nccl_us = _slowest([t[1] for t in times])
    out_gbs = min(t[2] for t in times)
    rdma_gbs = min(t[3] for t in times)
    row = Row(mode, tokens, hidden, args.topk, args.experts, cfg.num_sms, r, round(t_epjit, 1),
              round(nccl_us, 1) if nccl_us else None, round(out_gbs, 1), round(deepep_gbs, 1),
              round(out_rows * row_bytes / (nccl_us * 1e-6) / 1e9, 1) if nccl_us else None,
              round(nccl_us / t_epjit, 2) if nccl_us else None, round(100 * out_gbs / PLAIN_STORE_CEILING_GBS, 1),
              group.num_nvl_ranks)
    if internode:
        row.rdma_pairs, row.rdma_bytes = rdma_all, rdma_leg_bytes(operation, hidden, args.topk, rdma_all)
        row.rdma_gbs = round(rdma_gbs, 1)
        row.pct_put = round(100 * rdma_gbs / put_gbs, 1) if put_gbs else None
    return _with_deepep(row, _slowest([t[4] for t in times]), t_epjit)


_HEADER = (f"{'mode':<19} {'tokens':>6} {'hidden':>6} {'sms':>3} {'R':>2} {'epjit us':>9} {'out GB/s':>8} "
           f"{'DeepEP GB/s':>11} {'NCCL us':>8} {'NCCL GB/s':>9} {'NCCL/epjit':>10} {'DeepEP us':>9} "
           f"{'DeepEP/epjit':>12} {'% NVLink':>8} {'V':>2} {'RDMA pairs':>10} {'RDMA MB':>8} {'RDMA GB/s':>9} "
           f"{'% put':>6}")


def _cell(value: float | None, width: int, spec: str = ".1f") -> str:
    """A column that rows without it (None) leave as '-'."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def _print_row(row: Row) -> None:
    if not getattr(_print_row, "header", False):
        print(_HEADER)
        _print_row.header = True  # type: ignore[attr-defined]
    rdma_mb = row.rdma_bytes / 1e6 if row.rdma_bytes is not None else None
    print(f"{row.mode:<19} {row.tokens:>6} {row.hidden:>6} {row.sms:>3} {row.ranks:>2} {row.epjit_us:>9.1f} "
          f"{row.out_gbs:>8.1f} {row.deepep_gbs:>11.1f} {row.nccl_us or float('nan'):>8.1f} "
          f"{row.nccl_out_gbs or float('nan'):>9.1f} {row.ratio or float('nan'):>10.2f} {_cell(row.deepep_us, 9)} "
          f"{_cell(row.deepep_ratio, 12, '.2f')} {row.pct_nvlink:>8.1f} {_cell(row.num_nvl_ranks, 2, 'd')} "
          f"{_cell(row.rdma_pairs, 10, 'd')} {_cell(rdma_mb, 8)} {_cell(row.rdma_gbs, 9)} {_cell(row.pct_put, 6)}",
          flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m epjit.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--hidden", type=int, nargs="+", default=[7168])
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--sms", type=int, nargs="+", default=[0],
                        help="normal mode: Config.num_sms (0: the default, 24; internode: even, two blocks a channel)")
    parser.add_argument("--chunk-send", type=int, default=0, help="tokens between tail updates (0: the default)")
    parser.add_argument("--chunk-recv", type=int, default=0, help="ring slots (Config.nvl_chunk_recv; 0: the default)")
    parser.add_argument("--rdma-chunk-send", type=int, default=0,
                        help="internode: Config.rdma_chunk_send (0: the default)")
    parser.add_argument("--rdma-chunk-recv", type=int, default=0,
                        help="internode: Config.rdma_chunk_recv (0: the default)")
    parser.add_argument("--num-nvl-ranks", type=int, default=None, metavar="V",
                        help="ranks of one NVLink node (epjit.init(num_nvl_ranks=V); default: a host's). Below the "
                             "ranks: the normal modes run on an internode Buffer, with the RDMA leg's columns; on "
                             "one host, virtual nodes")
    parser.add_argument("--warp-roles", default="",
                        help="normal mode: Config's warp-role fields, e.g. dispatch_phased=1,combine_send_warps=3 "
                             "(default: the defaults for the rank count)")
    parser.add_argument("--modes", nargs="+", default=["dispatch", "dispatch-fp8", "combine"],
                        choices=[*NORMAL_MODES, *LOW_LATENCY_MODES, "ceiling", "put-ceiling"],
                        help="normal mode: dispatch, dispatch-fp8 (given a layout computed before), combine; "
                             "layout-dispatch, layout-dispatch-fp8 (get_dispatch_layout and dispatch in the timed "
                             "call); cached-dispatch, cached-dispatch-fp8 (replaying an earlier dispatch's handle); "
                             "low latency (CUDA-graph replays): ll-dispatch (FP8), ll-combine, ll-hook (send and "
                             "receive halves of each); ceiling: warp and bulk (TMA) copies to one peer, to every "
                             "peer and locally, by SMs (--ceiling-sms); put-ceiling: as --put-ceiling")
    parser.add_argument("--ceiling-sms", type=int, nargs="+", default=[4, 8, 12, 16, 24, 32],
                        help="SM counts of the ceiling mode (all SMs are always added)")
    parser.add_argument("--put-ceiling", action="store_true",
                        help="first time NVSHMEM warp puts with signals between rail peers of different NVLink "
                             "nodes, both ways at once (needs --num-nvl-ranks below the ranks); the internode rows' "
                             "%% put is against the best of them")
    parser.add_argument("--put-sms", type=int, nargs="+", default=[4, 8, 16, 24], help="blocks of the put ceiling")
    parser.add_argument("--put-warps", type=int, nargs="+", default=[1, 24],
                        help="warps a block of the put ceiling (1: one putting warp a channel, as the RDMA leg)")
    parser.add_argument("--put-chunks", type=int, nargs="+", default=[16, 64, 256, 1024], metavar="KIB",
                        help="bytes of one put of the put ceiling, in KiB")
    parser.add_argument("--ll-tokens", type=int, nargs="+", default=[128],
                        help="tokens per rank of the low-latency cases (the buffer holds the largest)")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--peers", nargs="+", default=["nccl"], choices=PEERS,
                        help="what each case is timed beside, in the same processes on the same inputs: nccl "
                             "(all_to_all_single of the same bytes), deepep (DeepEP V1's same call; `import deep_ep` "
                             "must give DeepEP built from source)")
    parser.add_argument("--no-nccl", action="store_true", help="no nccl peer (whatever --peers says)")
    parser.add_argument("--json", help="write the rows here (rank 0)")
    parser.add_argument("--profile", action="store_true", help="print where one call of each case spends its time")
    parser.add_argument("--summary", nargs="+", metavar="JSON",
                        help="print the rows of earlier --json files as one table, and nothing else (no GPU)")
    return parser


def _launched_ranks(environ: Any) -> int | None:
    """The job's rank count as its launcher tells it (epjit's, MPI's, torchrun's), or None where none does."""
    for name in (WORLD_SIZE, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE"):
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _print_summary(paths: list[str]) -> None:
    fields = set(Row.__dataclass_fields__)
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["rows"]:
                _print_row(Row(**{k: v for k, v in row.items() if k in fields}))


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what cannot be timed, before any rank starts (the rank count is checked again once known)."""
    try:
        parse_roles(args.warp_roles)
    except ValueError as e:
        parser.error(str(e))
    if args.repeat < 20:
        parser.error("--repeat must be >= 20 (docs/benchmark.md's protocol)")
    if settings().share_gpus:
        parser.error("EPJIT_SHARE_GPUS is set: ranks sharing a GPU are time-sliced, so their timings mean nothing "
                     "(and NCCL refuses two ranks on one GPU)")
    if min(args.put_sms) < 1 or min(args.put_chunks) < 1 or not 1 <= min(args.put_warps) <= max(args.put_warps) <= 32:
        parser.error("--put-sms and --put-chunks must be >= 1, --put-warps in [1, 32]")
    problem = topology_problem(_launched_ranks(os.environ), args.num_nvl_ranks, args.modes, args.warp_roles,
                               args.sms, args.peers)
    if problem:
        parser.error(problem)
    if "deepep" in args.peers:  # each rank imports it: every one finds the same, before any rank starts timing
        problem = deepep_problem()
        if problem:
            parser.error(problem)


def _resolve_peers(args: argparse.Namespace) -> None:
    """--peers without repeats, less nccl under --no-nccl; args.no_nccl then says whether nccl is timed."""
    args.peers = [p for p in dict.fromkeys(args.peers) if not (args.no_nccl and p == "nccl")]
    args.no_nccl = "nccl" not in args.peers


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.summary:
        _print_summary(args.summary)
        return 0
    if args.put_ceiling and "put-ceiling" not in args.modes:
        args.modes = ["put-ceiling", *args.modes]
    _resolve_peers(args)
    _check_args(parser, args)
    start = time.time()
    if args.profile:
        os.environ["EPJIT_PROFILE"] = "1"
    rows = run(args)
    import epjit

    group = epjit.init()
    if group.rank == 0 and args.json:
        env = {k: v for k, v in os.environ.items() if k.startswith(("EPJIT_", "NCCL_", "DEEPEP_", "NVSHMEM_"))}
        meta = {"date": time.strftime("%Y-%m-%d"), "host": socket.gethostname(), "seconds": time.time() - start,
                "argv": sys.argv, "env": env}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0
