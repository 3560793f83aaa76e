"""Host time of each eager call, one rank on one GPU: what the Python between the caller and the kernels costs.

    python scripts/host_path.py [--tokens 128] [--hidden 7168] [--calls 300] [--profile] [--json FILE]

The GPU is drained before every timed call, so a figure is the host's alone (validation, allocation, launches),
except for a normal dispatch, which waits for its counts: there the figure is the host's time after the counts
arrived (the call's EPJIT_PROFILE marks "host_synced" to "returned", on a Buffer of its own made with profiling
on). Rows: get_dispatch_layout, combine, dispatch with a handle (the whole call: a replay waits for no counts),
dispatch (after the counts), low_latency_dispatch (FP8) and low_latency_combine, torch tensors in and out, 128
tokens x 7168, top-8 of 256.
Medians of --calls calls after 50 warm-up calls. With --profile it also prints cProfile's top functions a row.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
from collections.abc import Callable
from typing import Any

import torch

import epjit
from epjit.bench import host_us


def _median_us(call: Callable[[], Any], calls: int) -> float:
    """Median wall time the host spends inside one call (epjit.bench.host_us: the GPU is drained before each, so no
    call waits for an earlier one's kernels), after 50 calls to warm the plans and caches."""
    for _ in range(50):
        call()
    return host_us(call, calls)


def _after_counts_us(buf: Any, call: Callable[[], Any], calls: int, detail: dict[str, float],
                     name: str) -> float:
    """Median host microseconds from a normal dispatch seeing its counts to returning (profile marks); the marks
    between them, where the Buffer sets any, go to ``detail`` (median microseconds from the previous mark)."""
    for _ in range(50):
        call()
    times, steps = [], {}
    for _ in range(calls):
        torch.cuda.synchronize()
        call()
        marks = buf.profile()
        times.append(marks["host:returned"] - marks["host:host_synced"])
        names = [k for k in marks if k.startswith("host:")]
        after = names[names.index("host:host_synced"):]
        for before, mark in zip(after, after[1:], strict=False):
            steps.setdefault(f"{name}: {before[5:]} -> {mark[5:]}", []).append(marks[mark] - marks[before])
    detail.update({k: statistics.median(v) for k, v in steps.items()})
    return statistics.median(times)


def _cprofile(name: str, call: Callable[[], Any], calls: int) -> None:
    prof = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        prof.enable()
        call()
        prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(f"---- cProfile {name}, {calls} calls (tottime)")
    print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top functions of each call")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    os.environ.pop("EPJIT_PROFILE", None)
    group = epjit.init()
    torch.cuda.set_device(group.device)
    experts, topk, n, hidden = 256, 8, args.tokens, args.hidden
    g = torch.Generator(device="cuda").manual_seed(7)
    idx = torch.rand(n, experts, device="cuda", generator=g).topk(topk, dim=1).indices
    w = torch.rand(n, topk, device="cuda", generator=g)
    x = torch.randn(n, hidden, device="cuda").to(torch.bfloat16)
    hint = epjit.Buffer.get_normal_size_hint(group.size, hidden, topk, experts)
    rows: dict[str, float] = {}
    detail: dict[str, float] = {}
    with epjit.Buffer(group, num_nvl_bytes=hint) as buf:
        layout = buf.get_dispatch_layout(idx, experts)
        d = buf.dispatch(x, topk_idx=idx, topk_weights=w, layout=layout)
        calls: dict[str, Callable[[], Any]] = {
            "layout": lambda: buf.get_dispatch_layout(idx, experts),
            "combine": lambda: buf.combine(d.x, d.handle),
            # a replay whose handle knows its rows waits for no counts: its whole call is the host's
            "dispatch(handle)": lambda: buf.dispatch(x, handle=d.handle),
        }
        for name, call in calls.items():
            rows[name] = _median_us(call, args.calls)
            if args.profile:
                _cprofile(name, call, args.calls)
        os.environ["EPJIT_PROFILE"] = "1"  # read when a Buffer is made: this one's calls keep marks
        with epjit.Buffer(group, num_nvl_bytes=hint) as marked:
            marked_layout = marked.get_dispatch_layout(idx, experts)
            marked.dispatch(x, topk_idx=idx, topk_weights=w, layout=marked_layout)
            rows["dispatch after counts"] = _after_counts_us(
                marked, lambda: marked.dispatch(x, topk_idx=idx, topk_weights=w, layout=marked_layout), args.calls,
                detail, "dispatch")
        os.environ.pop("EPJIT_PROFILE")
        if args.profile:
            _cprofile("dispatch (whole call, counts included)",
                      lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, layout=layout), args.calls)
    ll_hint = epjit.Buffer.get_low_latency_size_hint(n, hidden, group.size, experts)
    with epjit.Buffer(group, num_rdma_bytes=ll_hint, low_latency_mode=True, num_max_dispatch_tokens_per_rank=n,
                      hidden=hidden, num_experts=experts) as ll:
        local = experts // group.size
        y = torch.randn(local, group.size * n, hidden, device="cuda").to(torch.bfloat16)
        handle = ll.low_latency_dispatch(x, idx, n, experts, use_fp8=True).handle
        calls = {
            "low_latency_dispatch": lambda: ll.low_latency_dispatch(x, idx, n, experts, use_fp8=True),
            "low_latency_combine": lambda: ll.low_latency_combine(y, idx, w, handle),
        }
        for name, call in calls.items():
            rows[name] = _median_us(call, args.calls)
            if args.profile:
                _cprofile(name, call, args.calls)
    if group.rank == 0:
        print(f"host microseconds a call, median of {args.calls}, {n} tokens x {hidden}, "
              f"{torch.cuda.get_device_name()}:")
        for name, us in rows.items():
            print(f"  {name:<32} {us:8.1f}")
        for name, us in detail.items():
            print(f"    {name:<46} {us:8.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tokens": n, "hidden": hidden, "device": torch.cuda.get_device_name(),
                           "host_us": rows, "detail_us": detail}, f, indent=1)


if __name__ == "__main__":
    main()
