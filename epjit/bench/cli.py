"""``python -m epjit.launch -n N -m epjit.bench [--json out.json]``: epjit beside NCCL all_to_all_single and DeepEP.

Same run, same inputs, same bytes: for each case the routing's split sizes feed NCCL's ``all_to_all_single`` (what a
user would write instead of epjit); with --peers deepep, DeepEP V1 (built from source, importable as deep_ep) makes
the same calls on the same inputs (epjit/bench/peers.py). Every figure is timed the same way, following
docs/benchmark.md's protocol: CUDA events around the operation, warm-up first, median of ``--repeat`` runs (>= 20),
a barrier between runs: a host barrier, a 500 us wall-clock spin on the GPU that hides the host's launches of what
follows, then a one-element NCCL all_reduce so every GPU starts the timed operation at about the same moment (see
epjit/bench/protocol.py).

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
import os
import sys
import time
from typing import Any

from ..env import WORLD_SIZE, settings
from .ceilings import bench_ceiling, bench_put_ceiling
from .low_latency import LOW_LATENCY_MODES, bench_low_latency
from .normal import NORMAL_MODES, bench_normal, parse_roles
from .peers import PEERS, DeepEPPeer, deepep_problem
from .protocol import init_with_nccl, set_spin_us
from .report import Row, print_summary, write_json

# What a machine without a GPU can still do with the benchmark (the end of every refusal for a missing requirement).
_WITHOUT_A_GPU = ("Without a GPU, `python -m epjit.bench --summary FILE...` prints the rows of runs saved with --json "
                  "(those docs/performance.md cites are in bench/results/ of the repository).")


def requirements_problem() -> str | None:
    """What this process lacks to time anything, as one paragraph that says how to get it, or None: PyTorch (the
    inputs, CUDA events and graphs, and the NCCL peer are torch's), a GPU it can see, NCCL in torch.distributed, and
    epjit's GPU stack (CuPy). Checked before a rank starts its group, so that a machine without them ends in this
    message rather than in a traceback from deep inside the first call that needs one."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - ImportError, or a library of a broken install failing to load (OSError)
        return (f"PyTorch is missing: `import torch` failed ({type(e).__name__}: {e}). The benchmark makes its inputs, "
                "CUDA events and CUDA graphs with torch and times NCCL through torch.distributed: install a CUDA build "
                "of PyTorch that matches the NVIDIA driver (`pip install torch`; pytorch.org lists the builds for each "
                f"CUDA version). {_WITHOUT_A_GPU}")
    if not torch.cuda.is_available():
        why = ("a CPU-only build: torch.version.cuda is None" if torch.version.cuda is None else
               "torch.cuda.is_available() is False: no NVIDIA GPU or driver visible to this process, "
               f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
        return (f"no GPU: PyTorch {torch.__version__} sees none here ({why}). The benchmark times epjit's kernels on "
                "NVIDIA GPUs, one rank a GPU: run it on a machine with NVIDIA GPUs and their driver, with a CUDA build "
                "of PyTorch, under the launcher (`python -m epjit.launch -n N -m epjit.bench`, N at most the GPUs). "
                f"{_WITHOUT_A_GPU}")
    if not (dist.is_available() and dist.is_nccl_available()):
        return (f"NCCL is missing: PyTorch {torch.__version__} has none (torch.distributed.is_nccl_available() is "
                "False). The benchmark times every case beside NCCL and starts its ranks together with an NCCL "
                "all_reduce: install a CUDA build of PyTorch for Linux, which ships NCCL.")
    try:
        import cupy  # noqa: F401 - only whether it loads
    except ImportError as e:
        return (f"CuPy is missing: `import cupy` failed ({type(e).__name__}: {e}). epjit's kernels are loaded and "
                "launched through CuPy: install epjit's GPU stack, `pip install 'epjit[cuda13]'` for a CUDA 13 driver "
                "or 'epjit[cuda12]' for CUDA 12 (docs/running.md).")
    return None


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
    if "ll-combine-logfmt" in modes:
        return ("ll-combine-logfmt: the LogFMT combine runs only where every peer is an NVLink pointer, and across "
                "NVLink nodes the low-latency kernels have a put path: not with --num-nvl-ranks below the ranks")
    if any(s % 2 for s in sms or []):
        return f"--sms {sms}: internode runs two blocks a channel, so every SM count must be even"
    return None


def run(args: argparse.Namespace) -> list[Row]:
    """Every case of ``args`` on this rank (main runs on every rank of the job): the rows, the slowest rank's."""
    problem = requirements_problem()
    if problem:  # the same on every rank of a host: each leaves with it, before any joins the group
        print(f"python -m epjit.bench: error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    import torch.distributed as dist

    group = init_with_nccl(args.num_nvl_ranks)
    set_spin_us(args.spin_us)
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
            rows += bench_put_ceiling(group, args)
        if "ceiling" in args.modes:
            rows += bench_ceiling(group, args)
        if ll_modes:
            rows += bench_low_latency(group, dist, args, ll_modes, peer)
        if normal_modes:
            put_gbs = max((row.rdma_gbs or 0.0 for row in rows if row.mode.startswith("ceil-put")), default=0.0)
            rows += bench_normal(group, dist, args, normal_modes, put_gbs or None, peer)
    finally:
        try:
            if peer is not None:
                peer.close()  # DeepEP's Buffers first: their destroy() synchronises the ranks
        finally:
            dist.destroy_process_group()
    for row in rows:
        row.num_nvl_ranks = group.num_nvl_ranks
    return rows


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
                             "combine-fp8 (combine with use_fp8=True, with its error against bf16); "
                             "low latency (CUDA-graph replays): ll-dispatch (FP8), ll-combine, ll-combine-logfmt (the "
                             "LogFMT-10 combine of expert outputs scaled by 0.1, with its error against bf16), "
                             "ll-hook (send and receive halves of each); ceiling: warp and bulk (TMA) copies to one "
                             "peer, to every peer and locally, by SMs (--ceiling-sms); put-ceiling: as --put-ceiling")
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
    parser.add_argument("--spin-us", type=int, default=500,
                        help="how long the GPU spins before each timed run, hiding the host's launches of it "
                             "(docs/benchmark.md); longer shows whether a row times the host's launches")
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


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what cannot be timed, before any rank starts (the rank count is checked again once known)."""
    try:
        parse_roles(args.warp_roles)
    except ValueError as e:
        parser.error(str(e))
    if args.repeat < 20:
        parser.error("--repeat must be >= 20 (docs/benchmark.md's protocol)")
    if not 100 <= args.spin_us <= 100_000:
        parser.error(f"--spin-us must be in [100, 100000], got {args.spin_us}")
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
    """``python -m epjit.bench``: 0 once the rows are printed (and written, with --json); arguments that cannot be
    timed, or a machine without what the benchmark needs, end in a message and exit code 2."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.summary:
        try:
            print_summary(args.summary)
        except ValueError as e:
            parser.error(str(e))
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
        write_json(args.json, rows, start)
    return 0
