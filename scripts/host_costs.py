"""Microseconds of the host-side steps a dispatch is made of, on this machine's GPU (a tuning aid).

    python3 scripts/host_costs.py

Each line times one step on its own; the pairs show what the normal-mode calls used to do (DLPack round trips,
CuPy's launch with NumPy scalars) next to what they do now (addresses read directly, torch's own allocator, one
packed parameter block).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import cupy
import torch

from epjit import arrays, jit
from epjit.kernels import LayoutSpec


def cost(name: str, fn: Callable[[], object], n: int = 2000) -> None:
    for _ in range(100):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    print(f"{name:<48} {1e6 * (time.perf_counter() - start) / n:8.1f} us")


def main() -> None:
    x = torch.randn(4096, 7168, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, 256, (4096, 8), device="cuda")
    xc = arrays.to_cupy(x, "x")
    stream = cupy.cuda.Stream(non_blocking=True)
    info = arrays.check(x, "x", dtype="bfloat16", ndim=2, device=0)
    cost("arrays.check(x)", lambda: arrays.check(x, "x", dtype="bfloat16", ndim=2, device=0))
    cost("arrays.check(topk_idx, shape=...)", lambda: arrays.check(idx, "topk_idx", dtype="int64",
                                                                  shape=(("N", 4096), "K"), device=0))
    cost("arrays.check(cupy x)", lambda: arrays.check(xc, "x", dtype="bfloat16", ndim=2, device=0))
    cost("old: arrays.to_cupy(torch bf16)", lambda: arrays.to_cupy(x, "x"))
    cost("new: arrays.kernel_arg(torch bf16)", lambda: arrays.kernel_arg(x, info, "x"))
    cost("cupy.from_dlpack(torch)", lambda: cupy.from_dlpack(x))
    cost("old: cupy.empty + arrays.from_cupy(-> torch)",
         lambda: arrays.from_cupy(cupy.empty((128, 7168), dtype=xc.dtype), "torch"))
    cost("new: arrays.empty('torch', bf16)", lambda: arrays.empty("torch", (128, 7168), "bfloat16", 0))
    cost("torch.from_dlpack(cupy)", lambda: torch.from_dlpack(xc))
    cost("cupy.empty((4096, 7168), bf16)", lambda: cupy.empty((4096, 7168), dtype=xc.dtype))
    cost("stream.record() + wait_event", lambda: cupy.cuda.get_current_stream().wait_event(stream.record()))
    cost("cupy.cuda.get_current_stream()", cupy.cuda.get_current_stream)
    cost("torch.cuda.current_stream()", torch.cuda.current_stream)

    # One launch of a real kernel with nothing to do (num_tokens = 0), 11 arguments.
    module = jit.load(LayoutSpec(), 0)
    counts = cupy.zeros(512, dtype=cupy.int32)
    p = counts.data.ptr
    args = (idx.data_ptr(), 0, 8, 256, 2, 2, p, 0, p + 1024, p + 1536, p + 2000)
    cost("new: Module.launch (11 args, addresses)",
         lambda: module.launch("dispatch_layout", 1, 256, *args, shared_mem=2048, stream=stream))
    fn = module._functions["dispatch_layout"]
    spec = module.spec
    cost("old: spec.pack + CuPy launch (11 args)",
         lambda: fn((1,), (256,), spec.pack("dispatch_layout", args), shared_mem=2048, stream=stream))
    stream.synchronize()


if __name__ == "__main__":
    main()
