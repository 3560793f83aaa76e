"""The main job: random tokens through a small MoE layer, with expert parallelism across ranks.

    router -> top-k experts per token -> dispatch (tokens travel to the ranks owning their experts)
    -> per-expert matmul, scaled by the gate weight -> combine (outputs travel home and are summed)

once as prefill (normal mode: every rank's tokens, exact-sized outputs) and once as a decode step (low-latency
mode: a few tokens per rank into fixed per-expert slots, the gate weights applied by combine), each checked against
the same layer computed on one device. On GPUs (one rank per GPU) the
communication runs on epjit's kernels through ``epjit.Buffer``; without GPUs this says so and runs the NumPy
reference backend (``epjit.reference``) on simulated ranks, which is exactly the semantics the kernels implement.

    python examples/moe_layer.py                  # CPU: simulated ranks
    python -m epjit.launch -n 4 examples/moe_layer.py   # GPUs: one rank per GPU
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import ml_dtypes
import numpy as np

from epjit import reference

BF16 = ml_dtypes.bfloat16


def make_layer(rng: np.random.Generator, hidden: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    router = (rng.standard_normal((hidden, num_experts), dtype=np.float32) / np.sqrt(hidden)).astype(np.float32)
    experts = (rng.standard_normal((num_experts, hidden, hidden), dtype=np.float32) / np.sqrt(hidden)).astype(BF16)
    return router, experts


def route(x: np.ndarray, router: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k experts of each token and their softmax gate weights (over the chosen k)."""
    logits = x.astype(np.float32) @ router
    idx = np.argsort(-logits, axis=1, kind="stable")[:, :topk]
    chosen = np.take_along_axis(logits, idx, axis=1)
    w = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    return idx.astype(np.int64), (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def experts_forward(x: np.ndarray, local_idx: np.ndarray, weights: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """What a rank computes on the tokens it received: sum over its own experts of gate * (x @ W_e)."""
    out = np.zeros(x.shape, dtype=np.float32)
    xf = x.astype(np.float32)
    for e in range(experts.shape[0]):
        rows, slots = np.nonzero(local_idx == e)
        if rows.size:
            out[rows] += weights[rows, slots, None] * (xf[rows] @ experts[e].astype(np.float32))
    return out.astype(BF16)


def single_device(x: np.ndarray, idx: np.ndarray, weights: np.ndarray, experts: np.ndarray) -> np.ndarray:
    out = np.zeros(x.shape, dtype=np.float32)
    xf = x.astype(np.float32)
    for k in range(idx.shape[1]):
        for e in np.unique(idx[:, k]):
            rows = np.nonzero(idx[:, k] == e)[0]
            out[rows] += weights[rows, k, None] * (xf[rows] @ experts[e].astype(np.float32))
    return out


def run_reference(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    num_ranks = args.ranks
    experts_per_rank = args.experts // num_ranks
    router, experts = make_layer(rng, args.hidden, args.experts)
    # Uneven ranks on purpose: rank 0 has no tokens at all, the others different counts.
    counts = [0] + [int(c) for c in rng.integers(args.tokens // 2, args.tokens + 1, size=num_ranks - 1)]
    xs = [rng.standard_normal((n, args.hidden), dtype=np.float32).astype(BF16) for n in counts]
    routed = [route(x, router, args.topk) for x in xs]
    idx, w = [r[0] for r in routed], [r[1] for r in routed]

    start = time.perf_counter()
    d = reference.dispatch(xs, idx, w, args.experts)
    t_dispatch = time.perf_counter() - start
    ys = []
    for r in range(num_ranks):
        local = experts[r * experts_per_rank:(r + 1) * experts_per_rank]
        ys.append(experts_forward(d[r].x, d[r].topk_idx, d[r].topk_weights, local))
    start = time.perf_counter()
    c = reference.combine(ys, [d[r].handle for r in range(num_ranks)])
    t_combine = time.perf_counter() - start

    worst = 0.0
    for r in range(num_ranks):
        expected = single_device(xs[r], idx[r], w[r], experts)
        got = c[r].x.astype(np.float32)
        if counts[r]:
            scale = np.abs(expected).max() + 1e-6
            worst = max(worst, float(np.abs(got - expected).max() / scale))
    received = [int(d[r].handle.num_recv_tokens) for r in range(num_ranks)]
    print(f"{'asked for --cpu' if args.cpu else 'no GPU found'}: ran the NumPy reference backend on {num_ranks} "
          "simulated ranks")
    print(f"tokens per rank {counts}, received per rank {received}, hidden {args.hidden}, "
          f"top-{args.topk} of {args.experts} experts")
    print(f"dispatch {t_dispatch * 1e3:.1f} ms, combine {t_combine * 1e3:.1f} ms (reference, CPU)")
    ok = worst < 2e-2
    print(f"prefill: max relative error vs single-device layer: {worst:.2e} -> {'OK' if ok else 'MISMATCH'}")
    decode_ok = run_reference_decode(args, rng, router, experts)
    return 0 if ok and decode_ok else 1


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float32) - expected).max() / (np.abs(expected).max() + 1e-6)) if got.size else 0.0


def run_reference_decode(args: argparse.Namespace, rng: np.random.Generator, router: np.ndarray,
                         experts: np.ndarray) -> bool:
    """The decode step on the reference backend: low-latency dispatch, experts on [L, R*max, H], combine."""
    num_ranks, per_rank = args.ranks, args.experts // args.ranks
    counts = [int(c) for c in rng.integers(1, args.decode_tokens + 1, size=num_ranks)]
    xs = [rng.standard_normal((n, args.hidden), dtype=np.float32).astype(BF16) for n in counts]
    routed = [route(x, router, args.topk) for x in xs]
    idx, w = [r[0] for r in routed], [r[1] for r in routed]
    d = reference.low_latency_dispatch(xs, idx, args.decode_tokens, args.experts, use_fp8=False)
    ys = []
    for r in range(num_ranks):
        y = np.zeros(d[r].x.shape, dtype=BF16)
        for e in range(per_rank):  # only the received rows: the rest of each expert's slots is garbage
            n = int(d[r].recv_count[e])
            y[e, :n] = (d[r].x[e, :n].astype(np.float32) @ experts[r * per_rank + e].astype(np.float32)).astype(BF16)
        ys.append(y)
    out = [c.x for c in reference.low_latency_combine(ys, idx, w, [d[r].handle for r in range(num_ranks)])]
    worst = max(relative_error(out[r], single_device(xs[r], idx[r], w[r], experts)) for r in range(num_ranks))
    ok = worst < 2e-2
    print(f"decode (low latency): tokens per rank {counts}, max relative error {worst:.2e} -> "
          f"{'OK' if ok else 'MISMATCH'}")
    return ok


def gpu_relative_error(out: Any, x: Any, idx: Any, weights: Any, experts: Any) -> float:
    """Max error of `out` relative to the same layer on this one GPU (torch tensors; 0 without tokens)."""
    import torch

    if x.shape[0] == 0:
        return 0.0
    expected = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(idx.shape[1]):
        for e in idx[:, k].unique().tolist():
            rows = (idx[:, k] == e).nonzero(as_tuple=True)[0]
            expected[rows] += weights[rows, k, None] * (x[rows].float() @ experts[e].float())
    return ((out.float() - expected).abs().max() / (expected.abs().max() + 1e-6)).item()


def run_gpu(args: argparse.Namespace) -> int:
    """One rank per GPU: the same layer (same seed) on every rank, each rank's own tokens, epjit in between."""
    import torch

    import epjit

    group = epjit.init()
    torch.cuda.set_device(group.device)
    num_ranks, rank = group.size, group.rank
    if args.experts % num_ranks:
        raise SystemExit(f"--experts {args.experts} must be divisible by the {num_ranks} ranks")
    per_rank = args.experts // num_ranks
    router_np, experts_np = make_layer(np.random.default_rng(args.seed), args.hidden, args.experts)
    router = torch.from_numpy(router_np).cuda()
    experts = torch.from_numpy(experts_np.view(np.uint16)).cuda().view(torch.bfloat16)  # [E, H, H]
    # Uneven ranks on purpose: rank 0 has no tokens when there are several ranks.
    rng = np.random.default_rng(args.seed + 1 + rank)
    n = 0 if (rank == 0 and num_ranks > 1) else int(rng.integers(args.tokens // 2, args.tokens + 1))
    x = torch.from_numpy(rng.standard_normal((n, args.hidden), dtype=np.float32)).cuda().to(torch.bfloat16)
    logits = x.float() @ router
    chosen, idx = logits.topk(args.topk, dim=1)
    weights = torch.softmax(chosen, dim=1)

    buf = epjit.Buffer(group, num_nvl_bytes=epjit.Buffer.get_normal_size_hint(num_ranks, args.hidden, args.topk,
                                                                                args.experts))
    try:
        for _step in range(3):  # the first step compiles (or loads from the cache) the kernels
            torch.cuda.synchronize()
            group.barrier()
            t0 = time.perf_counter()
            layout = buf.get_dispatch_layout(idx, args.experts)
            d = buf.dispatch(x, topk_idx=idx, topk_weights=weights, layout=layout)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            y = torch.zeros(d.x.shape, dtype=torch.float32, device="cuda")
            for e in range(per_rank):  # the experts this rank owns, on the tokens that chose them
                rows, slots = (d.topk_idx == e).nonzero(as_tuple=True)
                if rows.numel():
                    y.index_add_(0, rows, d.topk_weights[rows, slots, None] * (d.x[rows].float()
                                                                                @ experts[rank * per_rank + e].float()))
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            out = buf.combine(y.to(torch.bfloat16), d.handle).x
            torch.cuda.synchronize()
            t3 = time.perf_counter()
        err = gpu_relative_error(out, x, idx, weights, experts)
        errors = group.allgather_object(err)
        counts = group.allgather_object((n, d.x.shape[0]))
    finally:
        buf.close()
    decode_err = run_gpu_decode(args, group, router, experts)
    worst = max(errors)
    if rank == 0:
        print(f"ran on {num_ranks} GPU(s) ({torch.cuda.get_device_name()}), launched by {group.backend}")
        print(f"tokens per rank {[c[0] for c in counts]}, received per rank {[c[1] for c in counts]}, "
              f"hidden {args.hidden}, top-{args.topk} of {args.experts} experts")
    print(f"rank {rank}: dispatch {1e3 * (t1 - t0):.2f} ms, experts {1e3 * (t2 - t1):.2f} ms, "
          f"combine {1e3 * (t3 - t2):.2f} ms (last of 3 steps)")
    ok = worst < 2e-2 and decode_err < 2e-2
    if rank == 0:
        print(f"prefill: max relative error vs single-device layer: {worst:.2e} -> "
              f"{'OK' if worst < 2e-2 else 'MISMATCH'}")
        print(f"decode (low latency, {args.decode_tokens} tokens a rank at most): max relative error "
              f"{decode_err:.2e} -> {'OK' if decode_err < 2e-2 else 'MISMATCH'}")
    group.close()
    return 0 if ok else 1


def run_gpu_decode(args: argparse.Namespace, group: Any, router: Any, experts: Any) -> float:
    """The decode step on GPUs: low-latency dispatch (bf16 here, so the check is tight; use_fp8=True is the
    usual choice), each local expert's matmul on its received rows, low-latency combine. Returns the worst
    relative error over the ranks."""
    import torch

    import epjit

    num_ranks, rank = group.size, group.rank
    per_rank, m = args.experts // num_ranks, args.decode_tokens
    rng = np.random.default_rng(args.seed + 100 + rank)
    n = int(rng.integers(1, m + 1))
    x = torch.from_numpy(rng.standard_normal((n, args.hidden), dtype=np.float32)).cuda().to(torch.bfloat16)
    chosen, idx = (x.float() @ router).topk(args.topk, dim=1)
    weights = torch.softmax(chosen, dim=1)
    with epjit.Buffer(group, low_latency_mode=True, num_max_dispatch_tokens_per_rank=m, hidden=args.hidden,
                      num_experts=args.experts) as buf:
        d = buf.low_latency_dispatch(x, idx, m, args.experts, use_fp8=False)
        y = torch.zeros_like(d.x)
        for e, count in enumerate(d.recv_count.tolist()):  # only the received rows; the rest is garbage
            y[e, :count] = (d.x[e, :count].float() @ experts[rank * per_rank + e].float()).to(torch.bfloat16)
        out = buf.low_latency_combine(y, idx, weights, d.handle).x
        err = gpu_relative_error(out, x, idx, weights, experts)
    return max(group.allgather_object(err))


def gpus_available() -> int:
    try:
        from cuda.bindings import runtime
    except ImportError:
        return 0
    err, count = runtime.cudaGetDeviceCount()
    return count if err == runtime.cudaError_t.cudaSuccess else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank (uneven around this)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=4, help="simulated ranks on the CPU backend")
    parser.add_argument("--decode-tokens", type=int, default=32,
                        help="most tokens a rank sends in the decode step (num_max_dispatch_tokens_per_rank)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="use the reference backend even if GPUs exist")
    args = parser.parse_args()
    if not args.cpu and gpus_available():
        return run_gpu(args)
    return run_reference(args)


if __name__ == "__main__":
    raise SystemExit(main())
