"""Shrink mode (a Buffer made with enable_shrink, docs/reliability.md): the mask, int32 [R] in device memory, which
names the ranks neither sent to nor waited for; the records the kernels leave of the waits that masked a rank (mapped
host memory, WaitRecord [R]); and the host's reports of them (a warning each, not an error).

Low latency keeps its mask in the sync words' device memory after LowLatencySync and expert_sent (status bit
STATUS_RANK_MASKED of epjit.ops.low_latency tells the host to look); normal mode inside one node in this rank's
NVLink buffer header (cuda_src/intranode.cuh: NormalShrink), read by the host when asked (mask_reports)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..errors import with_rank
from ..kernels.intranode import NORMAL_SHRINK_MASK_AT, NORMAL_SHRINK_OFFSET
from ..kernels.low_latency import SHRINK_BYTES, SYNC_BYTES, shrink_offset
from ..memory import NVL_HEADER_BYTES, WAIT_RECORD_BYTES, MappedHostArray, PeerMemory, WaitRecord
from .streams import Streams, caller_stream

log = logging.getLogger("epjit.low_latency")


def _cupy() -> Any:
    import cupy

    return cupy


def sync_ints(num_experts: int, num_ranks: int, shrink: bool) -> int:
    """int32 words of a Buffer's LowLatencySync allocation: the struct and expert_sent, and in shrink mode
    LowLatencyShrink and the mask after them (cuda_src/low_latency.cuh)."""
    if not shrink:
        return SYNC_BYTES // 4 + num_experts
    return (shrink_offset(num_experts) + SHRINK_BYTES) // 4 + num_ranks


class ShrinkMask:
    """Shrink mode's mask and what the kernels report through it: the mask (an int32 [R] view of the sync words,
    zero at creation), the records of the waits that masked a rank (mapped host memory), and the reports the host
    made of them (each a WaitRecord's fields, read once)."""

    family = "low-latency"  # which calls go on without a masked rank (the warnings say)

    def __init__(self, fields: Any, mask: Any, num_ranks: int, timeout_s: float, mem: PeerMemory,
                 streams: Streams, device: int) -> None:
        """``fields``: int32 [4] device words for {records, timeout_ns} (uint64 each, written once, here); ``mask``:
        the int32 [num_ranks] mask the kernels read."""
        self.num_ranks, self.mem, self.streams, self.device = num_ranks, mem, streams, device
        self.records = MappedHostArray(WAIT_RECORD_BYTES * num_ranks)
        self.mask = mask
        fields.set(np.array([self.records.device_ptr, int(timeout_s * 1e9)], dtype=np.uint64).view(np.int32))
        self.reports: list[dict[str, Any]] = []
        self.reported: set[int] = set()
        self.cleans = 0  # clean_low_latency_buffer calls: the clean barrier's rounds are 2 cleans + 1 and + 2

    def close(self) -> None:
        self.records.close()

    def collect(self) -> None:
        """Report (a warning each, and in ``reports``) every rank a kernel wait masked since the last look."""
        for peer, part in enumerate(self.records.parts(WAIT_RECORD_BYTES)):
            if peer in self.reported or part.ints[0] == 0:
                continue
            rec = WaitRecord.decode(part.bytes)
            self.reported.add(peer)
            self.reports.append(rec)
            log.warning(with_rank(
                f"rank {rec['rank']} masked rank {peer}: it did not answer within {rec['elapsed_ns'] / 1e9:.1f} s "
                f"in {rec['site']} (expected {rec['expected']}, last saw {rec['observed']}); the {self.family} "
                "calls go on without it (EPJIT_SHRINK_TIMEOUT_S sets the limit)"))

    def forget(self) -> None:
        """After the mask was cleared (no kernel runs): the records and reports start again."""
        self.records.bytes[:] = 0
        self.reported.clear()

    def update(self, rank: int, mask: bool) -> None:
        """Mask (or unmask) ``rank``, on the communication stream: every later low-latency call sees it."""
        cupy = _cupy()
        with cupy.cuda.Device(self.device), self.streams.comm:
            self.mask[rank] = 1 if mask else 0

    def query(self, out_address: int, framework: str) -> None:
        """The mask into the int32 [R] array at ``out_address``, ordered after this Buffer's calls and before the
        caller's later work on its stream."""
        cupy = _cupy()
        caller = caller_stream(framework, self.device)
        self.streams.begin(caller)
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.memcpyAsync(out_address, int(self.mask.data.ptr), 4 * self.num_ranks,
                                          cupy.cuda.runtime.memcpyDeviceToDevice, self.streams.comm_ptr)
        self.streams.finish(caller, False)

    def clean(self) -> None:
        """Unmask every rank; the records and reports of earlier masks are forgotten (waits for this Buffer's
        work)."""
        cupy = _cupy()
        with cupy.cuda.Device(self.device), self.streams.comm:
            self.mask.fill(0)
        self.mem.synchronize(self.streams.comm)
        self.forget()

    def mask_reports(self) -> list[dict[str, Any]]:
        """What the waits that masked a rank recorded, oldest first (reads what kernels left since the last look)."""
        self.collect()
        return list(self.reports)


def low_latency_shrink(sync: Any, num_experts: int, num_ranks: int, timeout_s: float, mem: PeerMemory,
                       streams: Streams, device: int) -> ShrinkMask:
    """The low-latency mask: LowLatencyShrink {arrived, generation, records, timeout_ns} in the sync words, the mask
    after it."""
    start = shrink_offset(num_experts) // 4
    mask = sync[start + SHRINK_BYTES // 4:start + SHRINK_BYTES // 4 + num_ranks]
    return ShrinkMask(sync[start + 2:start + 6], mask, num_ranks, timeout_s, mem, streams, device)


class NormalShrinkMask(ShrinkMask):
    """Normal mode's mask inside one node: NormalShrink {records, timeout_ns, mask[8]} in the reserved words of this
    rank's NVLink buffer header (zeroed with the buffer). Its clean is collective: every rank of the group, live,
    unmasks every rank and zeroes its barrier rows (a rank that left may have left its signals there)."""

    family = "normal-mode"

    def __init__(self, mem: PeerMemory, num_ranks: int, timeout_s: float, streams: Streams, device: int) -> None:
        cupy = _cupy()
        assert mem.nvl is not None
        self.header = int(mem.nvl.base)  # the NVLink buffer's own allocation begins with its header
        with cupy.cuda.Device(device):
            words = cupy.ndarray((NVL_HEADER_BYTES // 4,), dtype=cupy.int32, memptr=cupy.cuda.MemoryPointer(
                cupy.cuda.UnownedMemory(self.header, NVL_HEADER_BYTES, mem.nvl), 0))
        start = NORMAL_SHRINK_OFFSET // 4
        mask_at = start + NORMAL_SHRINK_MASK_AT // 4
        self.words = words
        super().__init__(words[start:start + 4], words[mask_at:mask_at + num_ranks], num_ranks, timeout_s, mem,
                         streams, device)

    def clean(self) -> None:
        """Unmask every rank and zero this rank's barrier rows (NVLink header, but for NormalShrink's fields); the
        caller holds every rank of the group between two host barriers."""
        cupy = _cupy()
        start = NORMAL_SHRINK_OFFSET // 4
        with cupy.cuda.Device(self.device), self.streams.comm:
            self.words[:start].fill(0)
            self.words[start + 4:].fill(0)  # the mask, the reserved words and the channel barrier rows
        self.mem.synchronize(self.streams.comm)
        self.forget()


__all__ = ["NormalShrinkMask", "ShrinkMask", "low_latency_shrink", "sync_ints"]
