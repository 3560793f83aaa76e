"""Normal mode: dispatch (given a layout, with its layout, replaying a handle), FP8 dispatch and combine, inside
one NVLink node or across several (the RDMA leg's accounting), each beside NCCL and, with ``--peers deepep``,
DeepEP."""

from __future__ import annotations

import argparse
from typing import Any

from ..config import Config, get_combine_config, get_dispatch_config
from .peers import DeepEPPeer, nccl_case_us
from .protocol import median_us, routing, start_together
from .report import PLAIN_STORE_CEILING_GBS, Row, print_row, slowest, with_deepep
from .roles import RoleBytes, role_bytes, role_table

# Normal-mode modes: the operation (dispatch, dispatch-fp8, combine), or a dispatch made another way: "layout-": with
# get_dispatch_layout inside the timed call (as a user calls it on a fresh routing), "cached-": replaying the handle
# of an earlier dispatch; combine-fp8: combine(..., use_fp8=True) of the same rows as combine (its bytes, NCCL peer
# and config are the bf16 combine's: what it replaces).
NORMAL_MODES = ("dispatch", "dispatch-fp8", "combine", "layout-dispatch", "layout-dispatch-fp8", "cached-dispatch",
                "cached-dispatch-fp8", "combine-fp8")


def base_mode(mode: str) -> str:
    """The operation a normal-mode mode times (``cached-dispatch-fp8`` -> ``dispatch-fp8``): its bytes, inputs and
    NCCL peer are the operation's; ``combine-fp8``'s are the bf16 combine's."""
    return "combine" if mode == "combine-fp8" else mode.removeprefix("layout-").removeprefix("cached-")


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


def case_config(mode: str, num_ranks: int, sms: int, chunk_send: int, chunk_recv: int,
                roles: dict[str, int] | None = None, *, num_nvl_ranks: int | None = None, rdma_chunk_send: int = 0,
                rdma_chunk_recv: int = 0) -> Config:
    """The Config a normal-mode case runs with: the operation's own default (what a call without config gets:
    combine's chunk differs from dispatch's, and inside one node both follow the warp roles, the defaults or
    ``roles``: Config's warp-role fields), with each of sms, chunk_send, chunk_recv (and across NVLink nodes,
    ``num_nvl_ranks`` below ``num_ranks``, rdma_chunk_send and rdma_chunk_recv) in its place where given (0: the
    default's)."""
    combine = base_mode(mode) == "combine"
    if num_nvl_ranks is not None and num_nvl_ranks < num_ranks:
        getter = get_combine_config if combine else get_dispatch_config
        default = getter(num_ranks, num_nvl_ranks=num_nvl_ranks)
        return Config(num_sms=sms or default.num_sms, nvl_chunk_send=chunk_send or default.nvl_chunk_send,
                      nvl_chunk_recv=chunk_recv or default.nvl_chunk_recv,
                      rdma_chunk_send=rdma_chunk_send or default.rdma_chunk_send,
                      rdma_chunk_recv=rdma_chunk_recv or default.rdma_chunk_recv)
    spec = Config(**(roles or {})).spec(num_ranks)
    default = get_combine_config(num_ranks, spec) if combine else get_dispatch_config(num_ranks, spec)
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


def bench_normal(group: Any, dist: Any, args: argparse.Namespace, modes: list[str],
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
                            print_row(rows[-1])
    finally:
        try:
            buf.close()
        finally:
            if peer is not None:
                peer.close_normal()
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


def _rdma_pairs(group: Any, layout: Any, idx: Any, mode: str, num_experts: int) -> tuple[int, int, list[list[int]]]:
    """(pairs whose messages leave this rank, pairs of all ranks) on the RDMA leg, from the routing on the host, and
    every rank's tokens bound for each node; a layout's own per-node counts that disagree are reported."""
    r, v = group.size, group.num_nvl_ranks
    counts = tokens_per_node(idx.cpu().numpy(), num_experts, r, v)
    per_node = getattr(layout, "num_tokens_per_rdma_rank", None)
    if per_node is not None and [int(c) for c in per_node.cpu().tolist()] != counts:
        print(f"rank {group.rank}: layout.num_tokens_per_rdma_rank {per_node.cpu().tolist()} but the routing "
              f"sends {counts} tokens to each node", flush=True)
    all_counts = group.allgather_object(counts)
    return (rdma_pairs_out(mode, all_counts, group.rank, v),
            sum(rdma_pairs_out(mode, all_counts, rank, v) for rank in range(r)), all_counts)


def _profile_case(buf: Any, group: Any, op: Any, mode: str, tokens: int, hidden: int, cfg: Any,
                  moved: dict[str, RoleBytes] | None = None) -> None:
    """Three calls of a case with EPJIT_PROFILE's marks and every rank's per-block stamps printed; across nodes
    (``moved``: what each role of this rank moves a call) each rank's role table of the last call too."""
    for _ in range(3):
        start_together(group)  # as in the timed runs: the host's launches hidden behind the spin
        op()
        prof = buf.profile()
        if group.rank == 0:
            print(f"  profile {mode} {tokens}x{hidden} sms={cfg.num_sms}: {prof}", flush=True)
        for name, rows in buf.profile_blocks().items():  # every rank's: a channel's two ends are on two ranks
            print(f"  blocks {mode} {name} (sm, channel, points...): {sorted(rows, key=lambda b: b[1])}",
                  flush=True)
    summaries = buf.profile_roles()
    if moved is not None and summaries:
        lines = "\n".join(f"    {line}" for line in role_table(summaries, moved))
        print(f"  roles {mode} rank {group.rank} (µs from the kernel's start; waits a waiter's):\n{lines}", flush=True)


def _moved(operation: str, mode: str, group: Any, send_counts: list[list[int]], node_counts: list[list[int]],
           tokens: int, hidden: int, topk: int) -> dict[str, RoleBytes]:
    """What each role of this rank's internode kernel moves a call (epjit.bench.roles), by the case's sizes:
    combine-fp8's forwarders put FP8 partials (e4m3, a float32 scale a 128 channels, the weights)."""
    message = rdma_message_bytes(operation, hidden, topk)
    moved = role_bytes(operation, group.rank, group.num_nvl_ranks, send_counts, node_counts, message, tokens,
                       2 * hidden + 4 * topk)
    if mode == "combine-fp8":
        partial = moved["forwarder"].rows
        moved["forwarder"] = RoleBytes(partial, partial * (hidden + hidden // 32 + 4 * topk))
    return moved


def _epjit_call(buf: Any, mode: str, x: Any, idx: Any, w: Any, layout: Any, d: Any, cfg: Any,
                num_experts: int) -> Any:
    """The call a normal-mode row times: ``d`` is an earlier dispatch of the same inputs (its rows and handle)."""
    if mode == "combine":
        return lambda: buf.combine(d.x, d.handle, config=cfg)
    if mode == "combine-fp8":
        return lambda: buf.combine(d.x, d.handle, config=cfg, use_fp8=True)
    if mode.startswith("cached-"):  # the handle's routing replayed
        return lambda: buf.dispatch(x, handle=d.handle, config=cfg)
    if mode.startswith("layout-"):  # the call as a user makes it with a fresh routing
        return lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, layout=buf.get_dispatch_layout(idx, num_experts),
                                    config=cfg)
    return lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, layout=layout, config=cfg)


def _print_fp8_combine_error(buf: Any, group: Any, d: Any, cfg: Any) -> None:
    """How far the FP8 combine is from the bf16 one on the same rows, on every rank's tokens: calc_diff (DeepEP's
    measure, epjit.reference.calc_diff) and the largest difference relative to the bf16 result's largest magnitude;
    printed by rank 0, the worst rank's."""
    from ..reference import calc_diff

    exact = buf.combine(d.x, d.handle, config=cfg).x.float().cpu().numpy()
    cast = buf.combine(d.x, d.handle, config=cfg, use_fp8=True).x.float().cpu().numpy()
    rel = float(abs(exact - cast).max(initial=0.0) / max(float(abs(exact).max(initial=0.0)), 1e-30))
    worst = max(group.allgather_object((calc_diff(exact, cast), rel)))
    if group.rank == 0:
        print(f"  FP8 combine against bf16, {exact.shape[0]} tokens: calc_diff {worst[0]:.2e}, largest difference "
              f"{worst[1]:.2e} of the largest value (worst rank)", flush=True)


def _bench_case(buf: Any, group: Any, dist: Any, mode: str, tokens: int, hidden: int, args: argparse.Namespace,
                cfg: Any, put_gbs: float | None = None, peer: DeepEPPeer | None = None) -> Row:
    r, rank = group.size, group.rank
    internode = group.num_nvl_ranks < r
    operation = base_mode(mode)  # its bytes, its NCCL peer, its RDMA leg
    idx, w = routing(tokens, args.topk, args.experts, seed=1234 + rank)
    x_arg, row_bytes = _case_input(operation, tokens, hidden)
    layout = buf.get_dispatch_layout(idx, args.experts)
    d = buf.dispatch(x_arg, topk_idx=idx, topk_weights=w, layout=layout, config=cfg)
    send_counts = layout.num_tokens_per_rank.cpu().tolist()
    all_send = group.allgather_object(send_counts)
    recv_counts = [int(c[rank]) for c in all_send]
    recv_rows = sum(recv_counts)
    op = _epjit_call(buf, mode, x_arg, idx, w, layout, d, cfg, args.experts)
    if operation == "combine":
        out_rows = recv_rows - recv_counts[rank]  # rows going back to other ranks
    else:
        out_rows = sum(send_counts) - send_counts[rank]
    rdma_out, rdma_all, node_counts = _rdma_pairs(group, layout, idx, operation, args.experts) if internode \
        else (0, 0, [])
    t_epjit = median_us(op, group, args.repeat)
    if mode == "combine-fp8":
        _print_fp8_combine_error(buf, group, d, cfg)
    if args.profile:
        moved = _moved(operation, mode, group, all_send, node_counts, tokens, hidden, args.topk) if internode else None
        _profile_case(buf, group, op, mode, tokens, hidden, cfg, moved)
    nccl_us = None if args.no_nccl else nccl_case_us(dist, group, operation, row_bytes, send_counts, recv_counts,
                                                     args.repeat)
    deepep_us = None if peer is None or mode == "combine-fp8" else peer.normal_us(  # (DeepEP has no FP8 combine)
        mode, x_arg, idx, w, args.experts, cfg.num_sms, args.repeat)
    out_gbs = out_rows * row_bytes / (t_epjit * 1e-6) / 1e9
    deepep_gbs = recv_rows * row_bytes / (t_epjit * 1e-6) / 1e9
    rdma_gbs = rdma_leg_bytes(operation, hidden, args.topk, rdma_out) / (t_epjit * 1e-6) / 1e9
    # Report the slowest rank's time (every rank waits for it in a real step).
    times = group.allgather_object((t_epjit, nccl_us, out_gbs, rdma_gbs, deepep_us))
    t_epjit = max(t[0] for t in times)
    nccl_us = slowest([t[1] for t in times])
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
    return with_deepep(row, slowest([t[4] for t in times]), t_epjit)


