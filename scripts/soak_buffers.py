"""Leak soak: create a Buffer, use it once, close it, many times over, for each kind of Buffer, and report what the
process holds before and after. Everything must come back: a server that makes a Buffer per request batch, or a
training job that remakes them when the parallel layout changes, would otherwise run out.

    python -m epjit.launch -n 2 scripts/soak_buffers.py [--cycles 1000] [--warmup 20] [--kinds normal,low_latency]
                                                          [--num-nvl-ranks V] [--json FILE] [--check] [--explain]

For each kind, after ``--warmup`` cycles (first loads, CUDA's lazy allocations, allocator pools growing to their
working size), it reads on every rank: the GPU's free memory (after emptying torch's and CuPy's caches), epjit's
pinned host memory, peer mappings through CUDA IPC, NVLink buffer and NVSHMEM heap bytes
(``epjit.memory.live_resources``), the process's open file descriptors, threads and memory maps backed by
something (a file, a device, shared memory), its anonymous memory maps and its resident memory; then runs
``--cycles`` more and reads them again. Prints a table of the changes (rank 0), and with ``--check`` exits 1 when
any of them but the anonymous maps and resident memory changed: those two move with the process's allocators
(Python's arenas of 1 MiB are anonymous maps), so they are reported, not judged. ``--explain`` says where
Python's own memory grew over the measured cycles (tracemalloc), which types have more live objects and what holds
them, and which memory maps came or went: where to look when resident memory climbs with the cycles.

Kinds: ``normal`` (get_dispatch_layout, dispatch, combine on a normal-mode Buffer inside one NVLink node),
``internode`` (the same across NVLink nodes: a normal-mode Buffer with its NVSHMEM heap, on a group made with
``--num-nvl-ranks V`` smaller than the rank count, e.g. 2 ranks as 2 nodes of 1) and ``low_latency``
(low_latency_dispatch and low_latency_combine), 128 tokens x 2048, top-4 of 32 experts with 10% holes, torch
tensors, bf16 on even cycles and FP8 on odd ones: two cycles run every kernel of a family (what scripts/sanitize.sh
runs under compute-sanitizer). Without ``--num-nvl-ranks`` the kinds are normal and low_latency; with it, internode
and low_latency (a normal-mode Buffer of a group across nodes is an internode one).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import tracemalloc
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cupy
import torch

import epjit
from epjit.memory import live_resources

TOKENS, HIDDEN, TOPK, EXPERTS = 128, 2048, 4, 32
PROGRESS = {"on": False, "start": time.perf_counter()}  # --progress: each step printed as it ends (a slow tool's log)


def step(what: str) -> None:
    if PROGRESS["on"]:
        print(f"[{time.perf_counter() - PROGRESS['start']:8.1f} s] {what}", flush=True)
JUDGED = ("gpu_free_bytes", "mapped_host_bytes", "ipc_mappings", "nvl_buffer_bytes", "heap_bytes",
          "nvshmem_initialised", "open_fds", "threads", "file_maps")
# Reported, not judged: both move with the process's allocators (an obmalloc arena or a malloc'd block past the
# mmap threshold is an anonymous map of its own), not with what a Buffer holds.
REPORTED = ("anonymous_maps", "resident_bytes")


def _count(path: str) -> int:
    try:
        return len(os.listdir(path))
    except OSError:
        return -1


def _map_lines() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _is_file_map(line: str) -> bool:
    """A map with something behind it (a file, a device such as /dev/nvidia*, shared memory): what a leaked IPC
    handle, shared-memory segment or device mapping leaves. Anonymous maps ([heap], [stack], none) are not."""
    fields = line.split(maxsplit=5)
    return len(fields) > 5 and not fields[5].startswith("[")


def _map_change(before: list[str], after: list[str]) -> list[str]:
    """The memory maps that came or went (a few): "+" or "-", size in KiB, permissions and what backs it."""
    def describe(sign: str, line: str) -> str:
        fields = line.split(maxsplit=5)
        start, end = (int(a, 16) for a in fields[0].split("-"))
        return f"{sign}{(end - start) >> 10} KiB {fields[1]} {fields[5] if len(fields) > 5 else '[anonymous]'}"
    old, new = set(before), set(after)
    return ([describe("+", m) for m in after if m not in old] + [describe("-", m) for m in before if m not in new])[:8]


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return -1


def snapshot(group: epjit.Group) -> tuple[dict[str, int], list[str]]:
    """What this rank holds now, every rank at the same point (the GPU may be shared by several ranks), and its
    memory maps (the lines of /proc/self/maps)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    group.barrier()
    maps = _map_lines()
    found = {"gpu_free_bytes": int(cupy.cuda.runtime.memGetInfo()[0]), **live_resources(),
             "open_fds": _count("/proc/self/fd"), "threads": _count("/proc/self/task"),
             "file_maps": sum(map(_is_file_map, maps)),
             "anonymous_maps": sum(not _is_file_map(m) for m in maps), "resident_bytes": _resident_bytes()}
    group.barrier()
    return found, maps


def _inputs(group: epjit.Group, cycle: int) -> tuple[Any, Any, Any]:
    g = torch.Generator(device="cuda").manual_seed(1000 * cycle + group.rank)
    idx = torch.rand(TOKENS, EXPERTS, device="cuda", generator=g).topk(TOPK, dim=1).indices
    idx[torch.rand(TOKENS, TOPK, device="cuda", generator=g) < 0.1] = -1  # holes
    w = torch.rand(TOKENS, TOPK, device="cuda", generator=g)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    return x, idx, w


def normal_cycle(group: epjit.Group, cycle: int) -> None:
    """Layout, dispatch (bf16 on even cycles, FP8 with scales on odd ones), combine with weights; across NVLink
    nodes (the group's num_nvl_ranks below its size) the Buffer also has its symmetric heap: the internode kind."""
    x, idx, w = _inputs(group, cycle)
    if cycle % 2:
        blocks = x.float().view(TOKENS, HIDDEN // 128, 128)
        scales = blocks.abs().amax(dim=2).clamp(min=1e-4) / 448.0
        x = ((blocks / scales[:, :, None]).view(TOKENS, HIDDEN).to(torch.float8_e4m3fn), scales)
    R, V = group.size, group.num_nvl_ranks
    kind = "normal" if V == R else "internode"
    rdma = epjit.Buffer.get_rdma_size_hint(R, HIDDEN, TOPK, EXPERTS, num_nvl_ranks=V) if V < R else 0
    with epjit.Buffer(group, num_nvl_bytes=epjit.Buffer.get_normal_size_hint(R, HIDDEN, TOPK, EXPERTS,
                                                                             num_nvl_ranks=V),
                      num_rdma_bytes=rdma) as buf:
        step(f"{kind} {cycle}: Buffer made")
        layout = buf.get_dispatch_layout(idx, EXPERTS)
        d = buf.dispatch(x, topk_idx=idx, topk_weights=w, layout=layout)
        step(f"{kind} {cycle}: dispatched")
        y = d.x if not cycle % 2 else torch.ones(d.x.shape, dtype=torch.bfloat16, device="cuda")
        buf.combine(y, d.handle, topk_weights=d.topk_weights)
        torch.cuda.synchronize()
        step(f"{kind} {cycle}: combined")


def low_latency_cycle(group: epjit.Group, cycle: int) -> None:
    """Low-latency dispatch (bf16 on even cycles, FP8 on odd ones) and combine."""
    x, idx, w = _inputs(group, cycle)
    hint = epjit.Buffer.get_low_latency_size_hint(TOKENS, HIDDEN, group.size, EXPERTS)
    with epjit.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_max_dispatch_tokens_per_rank=TOKENS,
                      hidden=HIDDEN, num_experts=EXPERTS) as buf:
        step(f"low_latency {cycle}: Buffer made")
        d = buf.low_latency_dispatch(x, idx, TOKENS, EXPERTS, use_fp8=bool(cycle % 2))
        torch.cuda.synchronize()
        step(f"low_latency {cycle}: dispatched")
        y = d.x if not cycle % 2 else torch.ones(d.x.shape, dtype=torch.bfloat16, device="cuda")
        buf.low_latency_combine(y, idx, w, d.handle)
        torch.cuda.synchronize()
        step(f"low_latency {cycle}: combined")


KINDS: dict[str, Callable[[epjit.Group, int], None]] = {"normal": normal_cycle, "internode": normal_cycle,
                                                         "low_latency": low_latency_cycle}


def _python_growth(start: tracemalloc.Snapshot) -> list[str]:
    """Where Python's own allocations grew since ``start`` (the largest few, each with the line that made them,
    then its callers)."""
    stats = tracemalloc.take_snapshot().compare_to(start, "traceback")
    return [f"{s.size_diff:+d} B in {s.count_diff:+d} blocks at " + " <- ".join(
        f"{Path(f.filename).name}:{f.lineno}" for f in reversed(s.traceback)) for s in stats[:6] if s.size_diff > 0]


def _type_name(o: object) -> str:
    return f"{type(o).__module__}.{type(o).__qualname__}"


def _live_objects() -> dict[int, str]:
    """Live objects the garbage collector tracks: id -> type (a type whose count grows with the cycles is retained)."""
    return {id(o): _type_name(o) for o in gc.get_objects()}


def _object_growth(start: dict[int, str]) -> list[str]:
    """The types with more live objects than at ``start``, and for the objects new since then of the type that grew
    most, what holds them (and what a weak reference among them points at)."""
    grown = Counter(_live_objects().values())
    grown.subtract(Counter(start.values()))
    lines = [f"{n:+d} live {name}" for name, n in grown.most_common(6) if n > 0]
    if not lines:
        return lines
    top = grown.most_common(1)[0][0]
    new = [o for o in gc.get_objects() if id(o) not in start and _type_name(o) == top]
    holders = [h for o in new[:200] for h in gc.get_referrers(o) if h is not new and isinstance(h, (dict, list, set))]
    by_type = Counter(_type_name(h) for h in holders)
    lines.append(f"new {top} held by: " + ", ".join(f"{n} {name}" for name, n in by_type.most_common(4)))
    # the largest dict among the holders (else the largest holder): how big, and what its first entries look like
    biggest = max(holders, key=lambda h: (isinstance(h, dict), len(h)), default=None)
    if biggest is not None:
        sample = list(biggest.items())[:3] if isinstance(biggest, dict) else list(biggest)[:3]
        lines.append(f"largest holder: {_type_name(biggest)} of {len(biggest)}, e.g. {str(sample)[:200]}")
    targets = Counter(_type_name(o()) for o in new[:200] if isinstance(o, weakref.ref))
    if targets:
        lines.append(f"new {top} point at: " + ", ".join(f"{n} {name}" for name, n in targets.most_common(4)))
    return lines


def soak(group: epjit.Group, kind: str, cycles: int, warmup: int, explain: bool = False) -> dict[str, Any]:
    run = KINDS[kind]
    for cycle in range(warmup):
        run(group, cycle)
    before, maps_before = snapshot(group)
    if explain:
        start_types = _live_objects()
        tracemalloc.start(4)
        start_trace = tracemalloc.take_snapshot()
    start = time.perf_counter()
    for cycle in range(warmup, warmup + cycles):
        run(group, cycle)
    seconds = time.perf_counter() - start
    after, maps_after = snapshot(group)
    found = {"kind": kind, "rank": group.rank, "cycles": cycles, "ms_per_cycle": round(1e3 * seconds / cycles, 2),
             "before": before, "change": {name: after[name] - before[name] for name in before},
             "maps_changed": _map_change(maps_before, maps_after)}
    if explain:
        found["python_growth"] = _python_growth(start_trace)
        tracemalloc.stop()
        found["python_growth"] += _object_growth(start_types)
    return found


def _table(results: list[dict[str, Any]]) -> str:
    names = [*JUDGED, *REPORTED]
    lines = [f"{'kind':<12}{'rank':>5}{'cycles':>7}{'ms/cycle':>9}  " + " ".join(f"{n:>19}" for n in names)]
    for r in results:
        lines.append(f"{r['kind']:<12}{r['rank']:>5}{r['cycles']:>7}{r['ms_per_cycle']:>9}  "
                     + " ".join(f"{r['change'][n]:>19}" for n in names))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--kinds", help="default: normal,low_latency, or internode,low_latency across nodes")
    parser.add_argument("--num-nvl-ranks", type=int, help="ranks a NVLink node (default: the ranks a host); fewer "
                                                          "than the ranks makes the group span nodes")
    parser.add_argument("--json", help="write every rank's figures here (rank 0)")
    parser.add_argument("--check", action="store_true", help="exit 1 when anything judged did not come back")
    parser.add_argument("--progress", action="store_true", help="print each step as it ends, with the time")
    parser.add_argument("--explain", action="store_true", help="trace Python's allocations over the measured cycles "
                        "and print, for each kind and rank, where they grew, which types have more live objects and "
                        "which memory maps came or went")
    args = parser.parse_args()
    PROGRESS["on"] = args.progress
    group = epjit.init(num_nvl_ranks=args.num_nvl_ranks)
    several = group.num_nvl_ranks < group.size
    normal = "internode" if several else "normal"
    kinds = args.kinds.split(",") if args.kinds else [normal, "low_latency"]
    wrong = [k for k in kinds if k not in KINDS or k in {"normal", "internode"} - {normal}]
    if wrong:
        parser.error(f"kinds {wrong} cannot run on {group.size} ranks in nodes of {group.num_nvl_ranks}; these "
                     f"can: {normal}, low_latency")
    torch.cuda.set_device(group.device)
    results: list[dict[str, Any]] = []
    for kind in kinds:
        results += group.allgather_object(soak(group, kind, args.cycles, args.warmup, args.explain))
    leaks = [f"{r['kind']} rank {r['rank']}: {n} {r['change'][n]:+d}" for r in results for n in JUDGED
             if r["change"][n] != 0]
    if group.rank == 0:
        print(_table(results), flush=True)
        for r in results:
            for line in r["maps_changed"] + r.get("python_growth", []):
                print(f"{r['kind']} rank {r['rank']}: {line}", flush=True)
        print("RESULT " + json.dumps({"rank": 0, "leaks": leaks, "results": results}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    group.close()
    return 1 if args.check and leaks else 0


if __name__ == "__main__":
    sys.exit(main())
