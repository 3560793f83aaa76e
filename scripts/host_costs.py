"""Microseconds of the host-side operations an eager call is made of, on this machine's GPU (a tuning aid).

    python3 scripts/host_costs.py

Each line times one operation on its own (median of 2000 after 200 warm-up): the torch and CuPy calls a call may
make (allocations, views, stream and event calls, attribute reads) and epjit's own steps (argument checks, packing,
a launch). What a call's host time is made of is the sum of the lines it uses.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import cupy
import torch

from epjit import arrays


def cost(name: str, fn: Callable[[], object], n: int = 2000) -> None:
    for _ in range(200):
        fn()
    times = []
    for _ in range(n // 100):
        start = time.perf_counter()
        for _ in range(100):
            fn()
        times.append((time.perf_counter() - start) * 1e4)
    print(f"{name:<56} {statistics.median(times):8.2f} us", flush=True)


@dataclass
class _Five:
    a: object
    b: object
    c: object
    d: object
    e: object


def main() -> None:
    dev = torch.cuda.current_device()
    x = torch.randn(128, 7168, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, 256, (128, 8), device="cuda")
    rt = cupy.cuda.runtime
    comm = cupy.cuda.Stream(non_blocking=True)
    event = cupy.cuda.Event(disable_timing=True)
    raw = torch._C._cuda_getCurrentRawStream
    cost("torch.empty((32, 256, 7168), uint8)", lambda: torch.empty((32, 256, 7168), dtype=torch.uint8, device=dev))
    cost("torch.empty((32, 256), int32)", lambda: torch.empty((32, 256), dtype=torch.int32, device=dev))
    big = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    cost("uint8[a:b].view(int32).view(shape)", lambda: big[4096:8192].view(torch.int32).view(32, 32))
    cost("torch.empty(...).view(float8)",
         lambda: torch.empty((32, 256, 7168), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn))
    cost("x.new_empty((32, 256))", lambda: x.new_empty((32, 256)))
    rows = torch.empty((128, 7168), dtype=torch.bfloat16, device=dev)
    cost("t.resize_((64, 7168)) and back", lambda: rows.resize_((64, 7168)).resize_((128, 7168)))
    cost("t.narrow(0, 0, 64)", lambda: rows.narrow(0, 0, 64))
    cost("t[:64]", lambda: rows[:64])
    cost("t.as_strided_((64, 7168), (7168, 1)) and back",
         lambda: rows.as_strided_((64, 7168), (7168, 1)).as_strided_((128, 7168), (7168, 1)))
    cost("torch._C._cuda_getCurrentRawStream(dev)", lambda: raw(dev))
    cost("torch.cuda.current_device()", torch.cuda.current_device)
    cost("cupy.cuda.get_current_stream()", cupy.cuda.get_current_stream)
    cost("with cupy stream (enter+exit)", lambda: comm.__exit__(*(comm.__enter__() and (None, None, None))))
    cost("cupy.cuda.Event(disable_timing=True)", lambda: cupy.cuda.Event(disable_timing=True))
    cost("rt.eventRecord(event.ptr, comm.ptr)", lambda: rt.eventRecord(event.ptr, comm.ptr))
    cost("rt.streamWaitEvent(comm.ptr, event.ptr)", lambda: rt.streamWaitEvent(comm.ptr, event.ptr, 0))
    cost("event.record(comm)", lambda: event.record(comm))
    cost("comm.wait_event(event)", lambda: comm.wait_event(event))
    cost("rt.streamIsCapturing(ptr)", lambda: rt.streamIsCapturing(comm.ptr))
    cost("rt.memsetAsync(ptr, 0, 1024, stream)", lambda: rt.memsetAsync(big.data_ptr(), 0, 1024, comm.ptr))
    cost("x.data_ptr()", x.data_ptr)
    cost("(x.shape, x.dtype, x.is_contiguous(), x.get_device())",
         lambda: (x.shape, x.dtype, x.is_contiguous(), x.get_device()))
    cost("x.shape", lambda: x.shape)
    cost("x.stride()", x.stride)
    cost("x.is_cuda", lambda: x.is_cuda)
    cost("type(x).__module__.startswith('torch')", lambda: type(x).__module__.startswith("torch"))
    cost("arrays.check(x, bf16, ndim=2)", lambda: arrays.check(x, "x", dtype="bfloat16", ndim=2, device=dev))
    cost("arrays.check(idx, shape=((N, 128), K))",
         lambda: arrays.check(idx, "topk_idx", dtype="int64", shape=(("N", 128), "K"), device=dev))
    cost("dataclass of five fields", lambda: _Five(1, 2, 3, 4, 5))
    cost("cupy.empty(4096, int32) on comm", lambda: cupy.empty(4096, dtype=cupy.int32))
    with comm:
        cost("cupy.empty(4096, int32) inside `with comm`", lambda: cupy.empty(4096, dtype=cupy.int32))
    import struct

    fmt = struct.Struct("=" + "Q" * 20 + "i4x" * 8)
    block = bytearray(fmt.size)
    values = list(range(20)) + list(range(8))
    cost("struct.pack_into 28 arguments", lambda: fmt.pack_into(block, 0, *values))


if __name__ == "__main__":
    main()
