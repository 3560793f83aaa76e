"""What a low-latency kernel costs before it does any work (a tuning aid): CUDA-graph replays timed as the
benchmark times them (epjit.bench's protocol, slowest rank's median), from nothing up to a real call.

    python -m epjit.launch -n 4 scripts/ll_overhead.py [--tokens 1 128]

Rows: the protocol floor (one tiny torch kernel); the benchmark's spin kernel at 1 x 1 threads and at the
low-latency grid (blocks x 1024 threads); ll_dispatch and ll_combine launched with no phase (they only check the
layout and run finish_call); each half of a real call at each token count (hook mode, one graph a half).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

import epjit
from epjit import bench
from epjit.bench.kernels import SpinSpec
from epjit.ops.loader import load


def _no_phase(buf: epjit.Buffer, call: Any) -> Any:
    """`call` with every low-latency launch's `phases` argument set to 0."""
    ll = buf._ll
    real = ll.module.launch

    def launch(args: Any, grid: Any, block: Any, **kw: Any) -> None:
        real(args.copy().set(phases=0), grid, block, **kw)

    def wrapped() -> Any:
        ll.module.launch = launch
        try:
            return call()
        finally:
            ll.module.launch = real

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    group = bench.init_with_nccl()
    hidden, experts, topk, m = 7168, 256, 8, max(args.tokens)
    rows: list[tuple[str, float]] = []

    def timed(name: str, graph: Any) -> None:
        t = max(group.allgather_object(bench._median_us(graph.replay, group, args.repeat)))
        rows.append((name, t))
        if group.rank == 0:
            print(f"{name:48s} {t:7.1f} us", flush=True)

    z = torch.zeros(1, device="cuda")
    timed("floor: one tiny torch kernel", bench._graph(lambda: z.add_(1)))
    spin = load(SpinSpec(), group.device)

    with epjit.Buffer(group, low_latency_mode=True, num_max_dispatch_tokens_per_rank=m, hidden=hidden,
                      num_experts=experts) as buf:
        blocks = buf._ll.num_sms

        def spin_graph(grid: int, block: int) -> Any:
            return bench._graph(lambda: spin.launch(spin.spec.args("spin_for_ns", ns=0), grid, block,
                                                    stream=torch.cuda.current_stream().cuda_stream))

        timed("spin_for_ns(0), 1 x 1", spin_graph(1, 1))
        timed(f"spin_for_ns(0), {blocks} x 1024", spin_graph(blocks, 1024))
        for tokens in args.tokens:
            idx, w = bench._routing(tokens, topk, experts, seed=4321 + group.rank)
            x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
            y = torch.randn(experts // group.size, group.size * m, hidden, device="cuda").to(torch.bfloat16)
            d = buf.low_latency_dispatch(x, idx, m, experts)
            handle = d.handle
            if tokens == args.tokens[0]:
                timed("ll_dispatch, no phase", bench._graph(_no_phase(buf, lambda: buf.low_latency_dispatch(
                    x, idx, m, experts))))  # noqa: B023
                timed("ll_combine, no phase", bench._graph(_no_phase(buf, lambda: buf.low_latency_combine(
                    y, idx, w, handle))))  # noqa: B023
            halves = {
                "dispatch": lambda: buf.low_latency_dispatch(x, idx, m, experts, return_recv_hook=True),  # noqa: B023
                "combine": lambda: buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True),  # noqa: B023
            }
            for name, send_half in halves.items():
                a, b = bench.hook_halves_us(send_half, group, args.repeat)
                a, b = (max(v) for v in zip(*group.allgather_object((a, b)), strict=True))
                rows += [(f"ll_{name} send half, {tokens} tokens", a), (f"ll_{name} recv half, {tokens} tokens", b)]
                if group.rank == 0:
                    print(f"{rows[-2][0]:48s} {a:7.1f} us\n{rows[-1][0]:48s} {b:7.1f} us", flush=True)
            for name, call in (("dispatch", lambda: buf.low_latency_dispatch(x, idx, m, experts)),  # noqa: B023
                               ("combine", lambda: buf.low_latency_combine(y, idx, w, handle))):  # noqa: B023
                timed(f"ll_{name}, {tokens} tokens", bench._graph(call))
    group.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
