"""Microseconds of the host-side steps a dispatch is made of, on this machine's GPU (a tuning aid).

    python3 scripts/host_costs.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import cupy
import torch

from epjit import arrays


def cost(name: str, fn: Callable[[], object], n: int = 2000) -> None:
    for _ in range(100):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    print(f"{name:<40} {1e6 * (time.perf_counter() - start) / n:8.1f} us")


def main() -> None:
    x = torch.randn(4096, 7168, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, 256, (4096, 8), device="cuda")
    xc = arrays.to_cupy(x, "x")
    stream = cupy.cuda.Stream(non_blocking=True)
    cost("arrays.check(x)", lambda: arrays.check(x, "x", dtype="bfloat16", ndim=2, device=0))
    cost("arrays.check(topk_idx, shape=...)", lambda: arrays.check(idx, "topk_idx", dtype="int64",
                                                                  shape=(("N", 4096), "K"), device=0))
    cost("arrays.to_cupy(torch bf16)", lambda: arrays.to_cupy(x, "x"))
    cost("cupy.from_dlpack(torch)", lambda: cupy.from_dlpack(x))
    cost("arrays.from_cupy(-> torch)", lambda: arrays.from_cupy(xc, "torch"))
    cost("torch.from_dlpack(cupy)", lambda: torch.from_dlpack(xc))
    cost("cupy.empty((4096, 7168), bf16)", lambda: cupy.empty((4096, 7168), dtype=xc.dtype))
    cost("stream.record() + wait_event", lambda: cupy.cuda.get_current_stream().wait_event(stream.record()))
    cost("cupy.cuda.get_current_stream()", cupy.cuda.get_current_stream)


if __name__ == "__main__":
    main()
