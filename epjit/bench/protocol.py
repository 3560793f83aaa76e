"""The benchmark's timing protocol (docs/benchmark.md): every rank starts a timed run together, CUDA events around
the work on the caller's stream, warm-up first, the median of the runs; CUDA graphs of a call and their replays;
the host's own time of an eager call; the NCCL group every case is timed beside, and a case's routing."""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any


def start_together(group: Any) -> None:
    """Make every rank's next timed work start at about the same moment, right behind the host's launches.

    A host barrier; then the GPU spins a fixed wall-clock time, long enough for the host to enqueue everything up
    to the end event behind it (as inside a step, where the host runs ahead of the GPU); then a one-element NCCL
    all_reduce, the last thing before the start event: it ends at about the same moment on every GPU, so no
    rank's launch delay or barrier skew (tens of microseconds on 4 processes) is timed as part of whatever waits
    for a peer first. Without the spin a one-kernel graph timed several times its floor (docs/benchmark.md)."""
    import torch
    import torch.distributed as dist

    from ..ops.loader import load
    from .kernels import SpinSpec

    global _ALIGN, _SPIN
    group.barrier()
    if _ALIGN is None:
        _ALIGN = torch.zeros(1, device="cuda")
        _SPIN = load(SpinSpec(), torch.cuda.current_device())
    _SPIN.launch(_SPIN.spec.args("spin_for_ns", ns=_HIDE_LAUNCH_NS), 1, 1,
                 stream=torch.cuda.current_stream().cuda_stream)
    dist.all_reduce(_ALIGN)


_ALIGN: Any = None
_SPIN: Any = None
# Longer than any host-side launch timed here, with room for slow hosts (docs/benchmark.md); --spin-us sets it.
_HIDE_LAUNCH_NS = 500_000


def set_spin_us(us: int) -> None:
    """How long the GPU spins before each timed run (the benchmark's --spin-us)."""
    global _HIDE_LAUNCH_NS
    _HIDE_LAUNCH_NS = int(us) * 1000


def median_us(fn: Any, group: Any, repeat: int, warmup: int = 5, before: Any = None) -> float:
    """Median microseconds of ``fn`` (docs/benchmark.md's protocol); ``before``, if given, runs before each call,
    untimed (it restores a state the call needs)."""
    import torch

    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        start_together(group)  # every rank starts together, as in a real step
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graph(fn: Any, warmup: Any = None, stream: Any = None) -> Any:
    """``fn`` captured once in a torch CUDA graph, after two eager calls of ``warmup`` (default: ``fn``) on the
    capture stream (CuPy's memory pool is per stream: the capture must find its blocks there): ``stream``, or a new
    one."""
    import torch

    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            (warmup or fn)()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured, stream=stream):
        fn()
    return captured


def graph_us(fn: Any, group: Any, repeat: int, before: Any = None) -> float:
    """Median microseconds of replays of ``fn`` captured in a CUDA graph (``graph``), timed as ``median_us`` times
    a call: this rank's figure (the slowest rank's is the largest of an allgather). How the low-latency rows are
    timed; ``before`` as for median_us, untimed before each replay."""
    return median_us(graph(fn).replay, group, repeat, before=before)


def graph_floor_us(group: Any, repeat: int) -> float:
    """What the timing protocol itself costs: the median of a CUDA graph holding one one-element kernel, timed as
    the low-latency ops are (slowest rank)."""
    import torch

    z = torch.zeros(1, device="cuda")
    return max(group.allgather_object(graph_us(lambda: z.add_(1), group, repeat)))


def _median_halves_us(first: Any, second: Any, group: Any, repeat: int, before: Any = None) -> tuple[float, float]:
    """Medians of two back-to-back steps (a send half, then its receive half), timed separately; ``before`` as for
    median_us, once before each pair."""
    import torch

    for _ in range(3):
        if before is not None:
            before()
        first()
        second()
    torch.cuda.synchronize()
    a, b = [], []
    for _ in range(repeat):
        if before is not None:
            before()
        start_together(group)
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        first()
        e[1].record()
        second()
        e[2].record()
        e[2].synchronize()
        a.append(e[0].elapsed_time(e[1]) * 1e3)
        b.append(e[1].elapsed_time(e[2]) * 1e3)
    return statistics.median(a), statistics.median(b)


def hook_halves_us(send_half: Any, group: Any, repeat: int, before: Any = None) -> tuple[float, float]:
    """Medians of the send and receive halves of a low-latency call: ``send_half`` makes the call with
    return_recv_hook=True and returns its result (with the hook as ``.hook``). Each half in its own CUDA graph: the
    send half's capture leaves its hook pending, the receive half's runs it, both captured on one stream (DeepEP's
    hook launches on the stream its call ran on). ``before`` as for median_us."""
    import torch

    held: list[Any] = []

    def whole_call() -> None:  # the warm-up runs both halves, so no hook is left pending
        send_half().hook()

    stream = torch.cuda.Stream()
    send = graph(lambda: held.append(send_half()), warmup=whole_call, stream=stream)
    recv = graph(lambda: held.pop().hook(), warmup=lambda: None, stream=stream)
    return _median_halves_us(send.replay, recv.replay, group, repeat, before)


def host_us(fn: Any, repeat: int) -> float:
    """Median wall time the host spends inside one eager call (the GPU is drained between calls, not timed)."""
    import torch

    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def routing(num_tokens: int, topk: int, num_experts: int, seed: int) -> tuple[Any, Any]:
    """A case's routing on this rank's GPU: each token's top-k of uniformly random distinct experts and random
    weights, both from ``seed`` (the benchmark gives every rank its own)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device="cuda", generator=g)
    idx = scores.topk(topk, dim=1).indices.to(torch.int64)  # uniform random distinct experts
    w = torch.rand(num_tokens, topk, device="cuda", generator=g)
    return idx, w


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_with_nccl(num_nvl_ranks: int | None = None) -> Any:
    """epjit's group (``num_nvl_ranks``: ranks of one NVLink node, None: a host's), this rank's GPU made torch's
    current device, and torch.distributed's NCCL group over the same ranks: the peer every case is timed beside
    (the tuning scripts start the same way). The caller ends it with torch.distributed.destroy_process_group()."""
    import torch
    import torch.distributed as dist

    import epjit

    group = epjit.init(num_nvl_ranks=num_nvl_ranks)
    torch.cuda.set_device(group.device)
    port = int(group.bcast_bytes(str(_free_port()).encode() if group.rank == 0 else None).decode())
    dist.init_process_group("nccl", init_method=f"tcp://{group.hosts[0]}:{port}", rank=group.rank,
                            world_size=group.size, device_id=torch.device("cuda", group.device))
    return group


def current_cupy_stream() -> Any:
    """CuPy's object for torch's current stream, for launching epjit's kernels where torch's work runs."""
    import torch

    from ..arrays import cupy_stream

    return cupy_stream(torch.cuda.current_stream().cuda_stream, torch.cuda.current_device())
