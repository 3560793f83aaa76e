"""A normal-mode dispatch timed as the benchmark times it, beside the host's share (a tuning aid).

    python -m epjit.launch -n 2 scripts/host_timed.py [--tokens 128] [--calls 40] [--parts 3]

Each call runs under the benchmark's protocol (bench._start_together: the host's launches hidden behind a GPU spin)
with EPJIT_PROFILE marks on. Rank 0 prints, for each part of --calls calls, the median of the timed microseconds
(CUDA events around the call, on the caller's stream) and of the host's microseconds from seeing notify's counts to
returning: at small batches the GPU is done before the host is, so that host time is what the timed figure holds
beyond the kernels. Parts show whether a lent host is still warming up.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ["EPJIT_PROFILE"] = "1"

import cupy  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import epjit  # noqa: E402
from epjit import bench  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--parts", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=7168)
    args = parser.parse_args()
    group = bench.init_with_nccl()
    experts, topk = 256, 8
    hint = epjit.Buffer.get_normal_size_hint(group.size, args.hidden, topk, experts)
    try:
        with epjit.Buffer(group, num_nvl_bytes=hint) as buf:
            idx, w = bench._routing(args.tokens, topk, experts, seed=1234 + group.rank)
            x = torch.randn(args.tokens, args.hidden, device="cuda").to(torch.bfloat16)
            layout = buf.get_dispatch_layout(idx, experts)
            stream = bench.current_cupy_stream()
            for _ in range(5):
                buf.dispatch(x, topk_idx=idx, topk_weights=w, layout=layout)
            torch.cuda.synchronize()
            parts = []
            for _ in range(args.parts):
                timed, host = [], []
                for _ in range(args.calls):
                    bench._start_together(group)
                    start, end = cupy.cuda.Event(), cupy.cuda.Event()
                    start.record(stream)
                    buf.dispatch(x, topk_idx=idx, topk_weights=w, layout=layout)
                    end.record(stream)
                    end.synchronize()
                    marks = buf.profile()
                    timed.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
                    host.append(marks["host:returned"] - marks["host:host_synced"])
                parts.append(f"{statistics.median(timed):.1f} / {statistics.median(host):.1f}")
            if group.rank == 0:
                print(f"dispatch {args.tokens} tokens, timed / host after the counts (us), medians of "
                      f"{args.calls} calls: {'; '.join(parts)}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
