"""The ceilings the kernels are measured against: plain copies inside one NVLink node (``--modes ceiling``) and
NVSHMEM puts between rail peers of different NVLink nodes (``--put-ceiling``), timed with the same protocol."""

from __future__ import annotations

import argparse
from typing import Any

from .protocol import median_us
from .report import PLAIN_STORE_CEILING_GBS, Row, print_row


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


_PUT_CEILING_BYTES = 64 << 20  # a rank puts this much a launch: ~1.3 ms at 400 Gb/s, far above launch and skew


def bench_put_ceiling(group: Any, args: argparse.Namespace) -> list[Row]:
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
                        t = max(group.allgather_object(median_us(put_all, group, args.repeat)))
                    except RuntimeError as e:  # a wait that timed out trapped: name the rail peer
                        mem.raise_for(e)
                        raise
                    gbs = round(n / (t * 1e-6) / 1e9, 1)
                    rows.append(Row(put_mode_name(chunk, warps), 0, 0, 0, 0, blocks, r, round(t, 1), None, gbs, gbs,
                                    None, None, round(100 * gbs / PLAIN_STORE_CEILING_GBS, 1), num_nvl_ranks=v,
                                    rdma_bytes=n * r, rdma_gbs=gbs))
                    if group.rank == 0:
                        print_row(rows[-1])
    finally:
        mem.close()
    return rows


_CEILING_BYTES = 64 << 20  # per destination: ~0.2 ms at NVLink speed, far above launch and skew
_CEILING_STAGES = 8  # kCeilingStages of cuda_src/bench/ceiling.cu


def bench_ceiling(group: Any, args: argparse.Namespace) -> list[Row]:
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

                    t = max(group.allgather_object(median_us(copy, group, args.repeat)))
                    gbs = round(dsts * n / (t * 1e-6) / 1e9, 1)
                    rows.append(Row(f"ceil-{pattern}{suffix}", 0, 0, 0, 0, blocks, r, round(t, 1), None, gbs, gbs,
                                    None, None, round(100 * gbs / PLAIN_STORE_CEILING_GBS, 1)))
                    if me == 0:
                        print_row(rows[-1])
    finally:
        buf.close()
    return rows


