"""One rank of the normal-mode GPU check: layout, dispatch and combine against epjit.reference on every case of
the matrix, handle replay, worst-token padding, a cross-rank mismatch, and back-to-back runs that must repeat bit
for bit. Every rank builds every rank's inputs from the same seed (the reference needs all of them) and checks
its own outputs. Prints ``RESULT {json}``; exits non-zero on the first mismatch. With --num-nvl-ranks V below the
ranks, the same cases run across V-rank NVLink nodes (the internode kernels; the reference's two-level combine).

    python -m epjit.launch -n 4 tests/ranks/intranode.py [--quick] [--loops 200] [--num-nvl-ranks 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import cupy
import ml_dtypes
import numpy as np
import torch

import epjit
from epjit import bench, reference
from epjit.config import COMBINE_READERS, MAX_CHANNELS
from epjit.memory import MAX_NVL_RANKS, NVL_HEADER_BYTES, live_resources

BF16 = ml_dtypes.bfloat16
os.environ.setdefault("EPJIT_POISON_OUTPUTS", "1")  # a row the kernel forgets must not read as plausible zeros
NVL_RANKS: int | None = None  # ranks a node across nodes (set by main), None inside one node


def normal_buffer(group, hidden: int = 7168, topk: int = 8, experts: int = 256):
    """A normal-mode Buffer for the group's topology: across nodes with its symmetric heap too."""
    R, V = group.size, group.num_nvl_ranks
    return epjit.Buffer(group, num_nvl_bytes=epjit.Buffer.get_normal_size_hint(R, hidden, topk, experts,
                                                                               num_nvl_ranks=V),
                        num_rdma_bytes=epjit.Buffer.get_rdma_size_hint(R, hidden, topk, experts, num_nvl_ranks=V))


def small_config(R: int, sms: int):
    """Few channels and small chunks and rings, so that every ring wraps many times: inside one node 5 SMs; across
    nodes 6 (three channels of two blocks), RDMA chunks of 3 in rings of 15 chunks, and NVLink rings just large
    enough for combine's sub-rings."""
    if NVL_RANKS is None:
        return epjit.Config(sms, 3, 3 + COMBINE_READERS)
    from epjit.kernels.internode import internode_spec

    nodes = R // NVL_RANKS
    nvl = max(40, nodes * 3 * (1 + internode_spec(nodes, NVL_RANKS).combine_group_warps))
    return epjit.Config(sms + sms % 2, 3, nvl, 3, 45)


def make_inputs(seed: int, counts: list[int], hidden: int, topk: int, num_experts: int, holes: float):
    rng = np.random.default_rng(seed)
    xs, idxs, ws = [], [], []
    for n in counts:
        xs.append(rng.standard_normal((n, hidden), dtype=np.float32).astype(BF16))
        idx = np.argsort(rng.random((n, num_experts)), axis=1)[:, :topk].astype(np.int64)
        if holes:
            idx[rng.random(idx.shape) < holes] = -1
        idxs.append(idx)
        ws.append(rng.random((n, topk), dtype=np.float32))
    return xs, idxs, ws


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.uint16).copy()).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).cpu().numpy().view(BF16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).cpu().numpy()
    return t.cpu().numpy()


class Mismatch(AssertionError):
    pass


def same(name: str, got: np.ndarray, want: np.ndarray) -> None:
    """Bit-exact equality (the kernels reproduce the reference's arithmetic order)."""
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        raise Mismatch(f"{name}: {got.dtype}{list(got.shape)} != reference {want.dtype}{list(want.shape)}")
    if got.tobytes() != want.tobytes():
        bad = np.argwhere(got.astype(np.float64) != want.astype(np.float64))
        first = tuple(bad[0]) if len(bad) else ()
        raise Mismatch(
            f"{name}: {len(bad)} elements differ, first at {bad[:3].tolist()}: got {got[first]!r} want {want[first]!r}"
        )


def run_case(
    buf,
    rank: int,
    R: int,
    seed: int,
    counts: list[int],
    hidden: int,
    topk: int,
    num_experts: int,
    fp8: bool,
    holes: float,
    alignment: int = 1,
    worst: int = 0,
    replay: bool = False,
    bias: bool = False,
    sms: int = 0,
    fp8_combine: bool = True,
) -> dict:
    xs, idxs, ws = make_inputs(seed, counts, hidden, topk, num_experts, holes)
    scales = None
    if fp8:
        cast = [reference.per_token_cast_to_fp8(x) for x in xs]
        xs_in, scales = [c[0] for c in cast], [c[1] for c in cast]
    else:
        xs_in = xs
    ref_layout = reference.get_dispatch_layout(idxs[rank], num_experts, R)
    ref = reference.dispatch(xs_in, idxs, ws, num_experts, x_scales=scales, expert_alignment=alignment)
    m = ref[rank].handle.num_recv_tokens

    idx_t, w_t = to_torch(idxs[rank]), to_torch(ws[rank])
    if fp8:
        x_arg = (to_torch(xs_in[rank]).view(torch.float8_e4m3fn), to_torch(scales[rank]))
    else:
        x_arg = to_torch(xs[rank])
    layout = buf.get_dispatch_layout(idx_t, num_experts)
    same("num_tokens_per_rank", to_numpy(layout.num_tokens_per_rank), ref_layout.num_tokens_per_rank)
    same("num_tokens_per_expert", to_numpy(layout.num_tokens_per_expert), ref_layout.num_tokens_per_expert)
    same("is_token_in_rank", to_numpy(layout.is_token_in_rank), ref_layout.is_token_in_rank)
    if NVL_RANKS is not None:
        nodes = reference.get_dispatch_layout(idxs[rank], num_experts, R, NVL_RANKS).num_tokens_per_rdma_rank
        same("num_tokens_per_rdma_rank", to_numpy(layout.num_tokens_per_rdma_rank), nodes)

    # sms > 0: a non-default channel count with small chunks and rings, so every ring wraps many times.
    config = small_config(R, sms) if sms else None
    d = buf.dispatch(
        x_arg,
        topk_idx=idx_t,
        topk_weights=w_t,
        layout=layout,
        expert_alignment=alignment,
        num_worst_tokens=worst,
        config=config,
    )
    if replay:  # the same routing again from the handle, no layout pass
        d = buf.dispatch(x_arg, topk_idx=idx_t, topk_weights=w_t, handle=d.handle)
    rows = slice(0, m)
    got_x = to_numpy(d.x)
    same("recv_x", got_x[rows], ref[rank].x[rows])
    if fp8:
        same("recv_x_scales", to_numpy(d.x_scales)[rows], ref[rank].x_scales[rows])
    same("recv_topk_idx", to_numpy(d.topk_idx)[rows], ref[rank].topk_idx[rows])
    same("recv_topk_weights", to_numpy(d.topk_weights)[rows], ref[rank].topk_weights[rows])
    if NVL_RANKS is not None:
        check_rdma_pairs(d.handle, idxs, num_experts, rank, R)
    if worst:
        assert got_x.shape[0] == worst, (got_x.shape, worst)
        same("padding topk_idx", to_numpy(d.topk_idx)[m:], np.full((worst - m, topk), -1, np.int64))
    elif not replay:
        assert d.num_recv_tokens_per_expert == list(ref[rank].num_recv_tokens_per_expert), (
            d.num_recv_tokens_per_expert,
            ref[rank].num_recv_tokens_per_expert,
        )

    # Combine: expert "outputs" = received rows scaled per rank, exactly representable in bf16 arithmetic.
    ys = []
    for r in range(R):
        base = reference.fp8_to_float(ref[r].x, ref[r].x_scales) if fp8 else ref[r].x.astype(np.float32)
        ys.append((base * (1.0 + 0.5 * r)).astype(BF16))
    rows_total = d.handle.num_rows
    y_local = np.zeros((rows_total, hidden), dtype=BF16)
    y_local[:m] = ys[rank][:m]
    biases = None
    bias_t = None
    if bias:
        rng = np.random.default_rng(seed + 1)
        biases = [
            (
                rng.standard_normal((n, hidden), dtype=np.float32).astype(BF16),
                rng.standard_normal((n, hidden), dtype=np.float32).astype(BF16),
            )
            for n in counts
        ]
        bias_t = (to_torch(biases[rank][0]), to_torch(biases[rank][1]))
    c = buf.combine(to_torch(y_local), d.handle, topk_weights=d.topk_weights, bias=bias_t,
                    config=small_config(R, sms) if sms else None)
    c_ref = reference.combine(ys, [h.handle for h in ref], topk_weights=[h.topk_weights for h in ref], bias=biases,
                              num_nvl_ranks=NVL_RANKS)
    same("combined_x", to_numpy(c.x), c_ref[rank].x)
    same("combined_topk_weights", to_numpy(c.topk_weights), c_ref[rank].topk_weights)
    if not fp8_combine:
        return {"recv": m}
    # The FP8 combine of the same rows: bit for bit the reference's (quantisation exact, the sum in its order; across
    # nodes each node's partial quantised once), and its distance from the bf16 combine (DeepEP's calc_diff) reported.
    c8 = buf.combine(to_torch(y_local), d.handle, topk_weights=d.topk_weights, bias=bias_t,
                     config=small_config(R, sms) if sms else None, use_fp8=True)
    c8_ref = reference.combine(ys, [h.handle for h in ref], topk_weights=[h.topk_weights for h in ref],
                               bias=biases, num_nvl_ranks=NVL_RANKS, use_fp8=True)
    same("combined_x (use_fp8)", to_numpy(c8.x), c8_ref[rank].x)
    same("combined_topk_weights (use_fp8)", to_numpy(c8.topk_weights), c8_ref[rank].topk_weights)
    return {"recv": m, "fp8_calc_diff": reference.calc_diff(to_numpy(c8.x), to_numpy(c.x))}


def fp8_combine_refusal(buf, group) -> None:
    """What use_fp8=True refuses: hidden % 128 != 0 (2056), inside one node and across nodes."""
    x = torch.randn(64, 2056, device="cuda").to(torch.bfloat16)
    d = buf.dispatch(x, topk_idx=torch.randint(0, 64, (64, 4), device="cuda"), num_experts=64)
    buf.combine(d.x, d.handle, use_fp8=True)


def check_rdma_pairs(handle, idxs: list[np.ndarray], num_experts: int, rank: int, R: int) -> None:
    """Each token crossed to each node once: the tokens this rank forwarded from each node's rail peer are that
    peer's (token, this node) pairs, so the RDMA leg carried pairs x message bytes (and a meta message a stream)."""
    V = NVL_RANKS
    node, local = rank // V, rank % V
    got = cupy.asnumpy(handle.array("recv_rdma_channel"))[:, :, 1].sum(axis=1).tolist()
    want = [int(reference.get_dispatch_layout(idxs[n * V + local], num_experts, R, V).num_tokens_per_rdma_rank[node])
            for n in range(R // V)]
    if got != want:
        raise Mismatch(f"tokens forwarded from each node {got} != their (token, node {node}) pairs {want}")


def run_ahead_counts(buf, rank: int, R: int) -> None:
    """A worst-token dispatch (the host does not wait for its counts), then one that reads its counts, both queued
    while the GPU is busy: the second must get its own received rows and per-expert counts, not the first's."""
    xs, idxs, ws = make_inputs(77, [30 + 9 * r for r in range(R)], 2048, 4, 64, 0.1)
    ref = reference.dispatch(xs, idxs, ws, 64)
    x_a = torch.randn(64, 2048, device="cuda").to(torch.bfloat16)
    idx_a = torch.rand(64, 64, device="cuda").argsort(dim=1)[:, :8].contiguous()  # top-8: more rows than b's
    x_b, idx_b, w_b = to_torch(xs[rank]), to_torch(idxs[rank]), to_torch(ws[rank])
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # ~25 ms: the host queues both calls before the first notify runs
    buf.dispatch(x_a, topk_idx=idx_a, num_experts=64, num_worst_tokens=64 * R)
    d = buf.dispatch(x_b, topk_idx=idx_b, topk_weights=w_b, num_experts=64)
    same("run-ahead recv_x", to_numpy(d.x), ref[rank].x)
    same("run-ahead recv_topk_idx", to_numpy(d.topk_idx), ref[rank].topk_idx)
    if d.num_recv_tokens_per_expert != list(ref[rank].num_recv_tokens_per_expert):
        raise Mismatch(f"run-ahead num_recv_tokens_per_expert: {d.num_recv_tokens_per_expert} != reference "
                       f"{list(ref[rank].num_recv_tokens_per_expert)}")
    buf.synchronize()


CHANNEL_ROWS_AT = 4096  # kNvlChannelBarrierOffset


def unbalanced_barriers(buf, group) -> list[str]:
    """The NVLink buffer's barrier signals that are not back to 0 once every rank's kernels are done: a barrier one
    rank took and a peer did not (each arrival adds to the peer's row what the peer's own arrival takes away), so
    their calls no longer pair up. The header (cuda_src/peers.cuh) holds notify's row at 0 and a row a channel
    (combine's) from CHANNEL_ROWS_AT, each MAX_NVL_RANKS signals."""
    buf.synchronize()
    group.barrier()
    memory = cupy.cuda.UnownedMemory(buf.mem.nvl.base, NVL_HEADER_BYTES, buf)
    ints = cupy.ndarray((NVL_HEADER_BYTES // 4,), cupy.int32, cupy.cuda.MemoryPointer(memory, 0)).get()
    group.barrier()  # nobody's next kernel may move a signal before every rank read its own
    rows = ints[CHANNEL_ROWS_AT // 4:].reshape(-1, MAX_NVL_RANKS)[:MAX_CHANNELS]
    bad = [f"notify[{t}]={ints[t]}" for t in range(group.size) if ints[t]]
    return bad + [f"channel {c}[{t}]={rows[c, t]}" for c in range(MAX_CHANNELS) for t in range(group.size)
                  if rows[c, t]]


def check_barriers(buf, group, where: str, result: dict) -> None:
    bad = unbalanced_barriers(buf, group)
    if bad and "unbalanced" not in result:
        result["unbalanced"] = f"after {where}: {bad[:6]}"
        print(f"[rank {group.rank}] barrier signals unbalanced after {where} ({buf._normal.ops.estimate.retries} "
              f"retries so far): {bad[:12]}", file=sys.stderr, flush=True)


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(to_numpy(t).tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--loops", type=int, default=200)
    parser.add_argument("--warp-roles", default="", help="Config's warp-role fields for every call, e.g. "
                                                         "dispatch_phased=1,combine_send_warps=3")
    parser.add_argument("--num-nvl-ranks", type=int, default=None, help="ranks a node (below the ranks: internode)")
    args = parser.parse_args()
    group = epjit.init(num_nvl_ranks=args.num_nvl_ranks)
    global NVL_RANKS
    NVL_RANKS = group.num_nvl_ranks if group.num_nvl_ranks < group.size else None
    torch.cuda.set_device(group.device)
    R, rank = group.size, group.rank
    buf = normal_buffer(group)
    if args.warp_roles:  # what a call without a config gets: these roles, with the chunks a call of them gets
        roles = bench.parse_roles(args.warp_roles)
        buf._normal.dispatch_config = bench.case_config("dispatch", R, 24, 0, 256, roles)
        buf._normal.combine_config = bench.case_config("combine", R, 24, 0, 256, roles)
    normal = buf._normal  # the normal-mode front: its default configs and their kernels
    result: dict = {"rank": rank, "size": R, "cases": 0, "kernels": normal._spec_of(normal.dispatch_config).family,
                    "symmetric": type(buf.mem.sym).__name__ if buf.mem.sym is not None else None}
    start = time.perf_counter()
    try:
        cases = []
        for hidden in (2048, 4096, 7168):
            for topk, experts in ((1, R), (4, 64), (8, 256)):
                for fp8 in (False, True):
                    cases.append(
                        dict(
                            counts=[0] + [127] * (R - 1),
                            hidden=hidden,
                            topk=topk,
                            num_experts=experts,
                            fp8=fp8,
                            holes=0.2,
                        )
                    )
        cases += [
            dict(counts=[1] * R, hidden=4096, topk=8, num_experts=64, fp8=False, holes=0.0),
            dict(
                counts=[4096 - 7 * r for r in range(R)],
                hidden=7168,
                topk=8,
                num_experts=256,
                fp8=False,
                holes=0.1,
                bias=True,
            ),
            # (the FP8 combine's reference takes every rank ~10-20 s a 4096-token case in NumPy: the case above, with
            # its ring wraps and biases, checks it at this size)
            dict(counts=[4096] * R, hidden=7168, topk=8, num_experts=256, fp8=True, holes=0.0, fp8_combine=False),
            dict(
                counts=[300, 0] + [17] * (R - 2),
                hidden=2048,
                topk=4,
                num_experts=64,
                fp8=False,
                holes=0.3,
                alignment=128,
            ),
            dict(counts=[200] * R, hidden=2048, topk=4, num_experts=64, fp8=False, holes=0.3, replay=True),
            dict(counts=[150] * R, hidden=4096, topk=8, num_experts=256, fp8=True, holes=0.2, worst=150 * R),
            dict(counts=[1000, 333] + [77] * (R - 2), hidden=2048, topk=8, num_experts=64, fp8=False, holes=0.2,
                 sms=5),
        ]
        if args.quick:
            cases = cases[::3] + cases[-6:]
        result["fp8_combine"] = {"cases": 0, "max_calc_diff": 0.0}
        for i, case in enumerate(cases):
            try:
                out = run_case(buf, rank, R, seed=1000 + i, **case)
            except Mismatch as e:
                raise Mismatch(f"case {i} {case}: {e}") from None
            result["cases"] += 1
            if "fp8_calc_diff" in out:
                fp8_combine = result["fp8_combine"]
                fp8_combine["cases"] += 1
                fp8_combine["max_calc_diff"] = max(fp8_combine["max_calc_diff"], out["fp8_calc_diff"])
            check_barriers(buf, group, f"case {i}", result)

        # What users run: outputs not poisoned, so torch allocates every output itself and the layout kernel runs on
        # the caller's stream (with poisoning it runs where the poison is written).
        os.environ["EPJIT_POISON_OUTPUTS"] = "0"  # read when a Buffer is made
        try:
            with normal_buffer(group) as plain:
                for i, case in enumerate(cases[:2] + cases[-2:]):
                    run_case(plain, rank, R, seed=2000 + i, **case)
                    result["cases"] += 1
        finally:
            os.environ["EPJIT_POISON_OUTPUTS"] = "1"

        # Arguments that differ across ranks: refused on every rank, and the Buffer still works afterwards.
        hidden = 2048 if rank == 0 else 4096
        x = torch.randn(64, hidden, device="cuda").to(torch.bfloat16)
        idx = torch.randint(0, 64, (64, 4), device="cuda")
        try:
            buf.dispatch(x, topk_idx=idx, num_experts=64)
            result["mismatch_error"] = None
        except epjit.ArgumentError as e:
            result["mismatch_error"] = str(e)[:200]
        check_barriers(buf, group, "the refused mismatch", result)
        run_case(buf, rank, R, seed=7, counts=[50] * R, hidden=2048, topk=4, num_experts=64, fp8=False, holes=0.1)

        # An expert id out of range on one rank: caught by the layout kernel, refused by notify on every rank.
        idx = torch.randint(0, 64, (64, 4), device="cuda")
        if rank == R - 1:
            idx[5, 2] = 64
        x = torch.randn(64, 2048, device="cuda").to(torch.bfloat16)
        try:
            buf.dispatch(x, topk_idx=idx, layout=buf.get_dispatch_layout(idx, 64))
            result["invalid_ids_error"] = None
        except epjit.ArgumentError as e:
            result["invalid_ids_error"] = str(e)[:200]
        check_barriers(buf, group, "the refused invalid ids", result)

        # Bad input: a clear exception before any kernel runs (each rank raises the same, so no one waits).
        x = torch.randn(64, 2048, device="cuda").to(torch.bfloat16)
        idx = torch.randint(0, 64, (64, 4), device="cuda")
        refused = {}
        buf.dispatch(x, topk_idx=idx, num_experts=64)  # a plan that 64.0 or 1.0 (== 64, 1) must not find
        for name, call in [
            ("experts_not_int", lambda: buf.dispatch(x, topk_idx=idx, num_experts=64.0)),
            ("alignment_not_int", lambda: buf.dispatch(x, topk_idx=idx, num_experts=64, expert_alignment=1.0)),
            ("worst_not_int", lambda: buf.dispatch(x, topk_idx=idx, num_experts=64, num_worst_tokens="512")),
            ("layout_experts_not_int", lambda: buf.get_dispatch_layout(idx, "64")),
            ("non_contiguous", lambda: buf.dispatch(x.t().contiguous().t(), topk_idx=idx, num_experts=64)),
            ("wrong_dtype", lambda: buf.dispatch(x.float(), topk_idx=idx, num_experts=64)),
            ("idx_rows", lambda: buf.dispatch(x, topk_idx=idx[:63], num_experts=64)),
            ("experts_not_divisible", lambda: buf.dispatch(x, topk_idx=idx % 63, num_experts=63)),
            ("buffer_too_small", lambda: buf.dispatch(x, topk_idx=idx, num_experts=64,
                                                      config=epjit.Config(128, 6, 4096))),
            ("combine_fp8", lambda: fp8_combine_refusal(buf, group)),
        ]:
            try:
                call()
                refused[name] = None
            except (ValueError, TypeError) as e:
                refused[name] = f"{type(e).__name__}: {e}"[:160]
        result["refused"] = refused
        check_barriers(buf, group, "the arguments refused on the host", result)
        # num_worst_tokens smaller than what arrives: the kernels do nothing, the next call raises on every rank.
        try:
            buf.dispatch(x, topk_idx=idx, num_experts=64, num_worst_tokens=8)
            buf.synchronize()
            result["worst_too_small"] = None
        except epjit.ArgumentError as e:
            result["worst_too_small"] = str(e)[:200]
        check_barriers(buf, group, "worst too small", result)
        run_case(buf, rank, R, seed=8, counts=[40] * R, hidden=2048, topk=4, num_experts=64, fp8=False, holes=0.1)
        # The same refusal with the host ahead of the GPU (a step's usual state): a later worst-token call, queued
        # before the refused one's notify ran, must not hide it.
        # Its handle's combine, queued before the refusal is known, must do nothing (its receipts were never
        # written): not wait on them until EPJIT_TIMEOUT_S, nor read past the rows.
        torch.cuda._sleep(50_000_000)  # ~25 ms on the caller's stream
        refused = buf.dispatch(x, topk_idx=idx, num_experts=64, num_worst_tokens=8)
        buf.combine(refused.x, refused.handle)
        buf.dispatch(x, topk_idx=idx, num_experts=64, num_worst_tokens=64 * R)  # fits
        try:
            buf.synchronize()
            result["run_ahead_refusal"] = None
        except epjit.ArgumentError as e:
            result["run_ahead_refusal"] = str(e)[:200]
        check_barriers(buf, group, "the run-ahead refusal", result)
        run_ahead_counts(buf, rank, R)
        check_barriers(buf, group, "the run-ahead counts", result)
        # A refusal nothing raised before the Buffer is closed: close raises it, after releasing everything.
        spare = normal_buffer(group, 2048, 4, 64)
        spare.dispatch(x, topk_idx=idx, num_experts=64, num_worst_tokens=8)
        try:
            spare.close()
            result["close_refusal"] = None
        except epjit.ArgumentError as e:
            result["close_refusal"] = str(e)[:200]

        # Back-to-back dispatch + combine with fresh routings, twice with the same seeds: bit-identical.
        runs = []
        for _ in range(2):
            h = hashlib.sha256()
            for it in range(args.loops):
                g = torch.Generator(device="cuda").manual_seed(it * 31 + rank)
                n = 1 + (it * 37 + rank * 11) % 512
                x = torch.randn(n, 4096, device="cuda", generator=g).to(torch.bfloat16)
                idx = torch.randint(-1, 64, (n, 8), device="cuda", generator=g)
                w = torch.rand(n, 8, device="cuda", generator=g)
                d = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=64)
                c = buf.combine(d.x, d.handle, topk_weights=d.topk_weights)
                h.update(digest(d.x, d.topk_idx, c.x, c.topk_weights).encode())
                if it % 50 == 49:
                    check_barriers(buf, group, f"loop {it}", result)
            runs.append(h.hexdigest()[:16])
        result["loops_identical"] = runs[0] == runs[1]
        result["retries"] = buf._normal.ops.estimate.retries
        result["loops"] = args.loops
        result["modules"] = sorted(module.spec.family.split(".")[0] for module in buf._normal.ops._modules.values())
        result["nvshmem_initialised"] = live_resources()["nvshmem_initialised"]
    finally:
        buf.close()
    result["seconds"] = round(time.perf_counter() - start, 1)
    print("RESULT " + json.dumps(result), flush=True)
    group.close()
    ok = ("unbalanced" not in result and result["loops_identical"]
          and "hidden differs" in (result["mismatch_error"] or "")
          and all(result["refused"].values()) and "too small for what arrives" in (result["worst_too_small"] or "")
          and "too small for what arrives" in (result["run_ahead_refusal"] or "")
          and "too small for what arrives" in (result["close_refusal"] or "")
          and f"outside [-1, num_experts=64) on rank(s) {R - 1}" in (result["invalid_ids_error"] or ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
