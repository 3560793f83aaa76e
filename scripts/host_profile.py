"""Where the host spends a normal-mode call: per-call host microseconds and cProfile's top functions (a tuning aid).

    python -m epjit.launch -n 2 scripts/host_profile.py [--tokens 128 4096] [--calls 300]

Every rank makes the same calls (they are collective); rank 0 prints. The GPU is drained before each timed call,
so the times are the host's alone: validation, allocation, launches, and the wait for notify's counts.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

import epjit


def _steps(buf: epjit.Buffer, x: torch.Tensor, tokens: int) -> None:
    """Rank 0 alone: the host-side steps of a dispatch that host_costs.py does not time, each on its own (no kernel
    runs); host_costs.py's lines (checks, allocations, launches) go with them."""
    from host_costs import cost  # scripts/ is sys.path[0] when this runs as a script

    with buf.comm_stream:  # where dispatch makes them
        handle_ints = buf._dispatch_ints(24, tokens, 2 * tokens, None)
        cost("_dispatch_ints", lambda: buf._dispatch_ints(24, tokens, 2 * tokens, None), 500)
    cost("_dispatch_outputs (3 torch.empty)",
         lambda: buf._dispatch_outputs(True, 2 * tokens, x.shape[1], 0, 8, False, True, True), 500)
    cost("_begin", lambda: buf._begin(None), 500)
    cost("_finish", lambda: buf._finish(buf._begin(None), False), 500)
    cost("a handle's view (cupy slice + reshape)", lambda: handle_ints[3].view(), 500)
    cost("pure Python: 100 additions (this host's speed)", lambda: sum(range(100)), 500)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=7168)
    args = parser.parse_args()
    group = epjit.init()
    torch.cuda.set_device(group.device)
    experts, topk = 256, 8
    hint = epjit.Buffer.get_normal_size_hint(group.size, args.hidden, topk, experts)
    with epjit.Buffer(group, num_nvl_bytes=hint) as buf:
        for tokens in args.tokens:
            g = torch.Generator(device="cuda").manual_seed(7 + group.rank)
            idx = torch.rand(tokens, experts, device="cuda", generator=g).topk(topk, dim=1).indices
            w = torch.rand(tokens, topk, device="cuda", generator=g)
            x = torch.randn(tokens, args.hidden, device="cuda").to(torch.bfloat16)
            d = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts)
            layout = buf.get_dispatch_layout(idx, experts)
            calls = {
                "layout": lambda: buf.get_dispatch_layout(idx, experts),  # noqa: B023
                "dispatch": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, layout=layout),  # noqa: B023
                "dispatch(handle)": lambda: buf.dispatch(x, handle=d.handle),  # noqa: B023
                "combine": lambda: buf.combine(d.x, d.handle),  # noqa: B023
            }
            for name, call in calls.items():
                times = []
                for _ in range(args.calls):
                    torch.cuda.synchronize()
                    group.barrier()
                    start = time.perf_counter()
                    call()
                    times.append((time.perf_counter() - start) * 1e6)
                torch.cuda.synchronize()
                if group.rank == 0:
                    print(f"{tokens:>5} tokens {name:<17} host {statistics.median(times):7.1f} us median, "
                          f"{min(times):7.1f} min", flush=True)
            if group.rank == 0:
                _steps(buf, x, tokens)
            group.barrier()
            for name in ("dispatch", "combine"):
                prof = cProfile.Profile()
                for _ in range(args.calls):
                    torch.cuda.synchronize()
                    group.barrier()
                    prof.enable()
                    calls[name]()
                    prof.disable()
                torch.cuda.synchronize()
                if group.rank == 0:
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
                    print(f"---- cProfile {name}, {tokens} tokens, {args.calls} calls (tottime)")
                    print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()), flush=True)
    group.barrier()


if __name__ == "__main__":
    main()
