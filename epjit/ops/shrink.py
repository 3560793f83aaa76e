"""Shrink mode of the low-latency family (a Buffer made with enable_shrink, docs/reliability.md): the mask, int32 [R]
in the sync words' device memory after LowLatencySync and expert_sent, which names the ranks neither sent to nor
waited for; the records the kernels leave of the waits that masked a rank (mapped host memory, WaitRecord [R]); and
the host's reports of them (status bit STATUS_RANK_MASKED of epjit.ops.low_latency: a warning, not an error)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..errors import with_rank
from ..kernels.low_latency import SHRINK_BYTES, SYNC_BYTES, shrink_offset
from ..memory import WAIT_RECORD_BYTES, MappedHostArray, PeerMemory, WaitRecord
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

    def __init__(self, sync: Any, num_experts: int, num_ranks: int, timeout_s: float, mem: PeerMemory,
                 streams: Streams, device: int) -> None:
        start = shrink_offset(num_experts) // 4
        self.num_ranks, self.mem, self.streams, self.device = num_ranks, mem, streams, device
        self.records = MappedHostArray(WAIT_RECORD_BYTES * num_ranks)
        self.mask = sync[start + SHRINK_BYTES // 4:start + SHRINK_BYTES // 4 + num_ranks]
        # LowLatencyShrink {arrived, generation, records, timeout_ns}: the host writes the last two, once.
        words = np.array([self.records.device_ptr, int(timeout_s * 1e9)], dtype=np.uint64).view(np.int32)
        sync[start + 2:start + 6].set(words)
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
                f"in {rec['site']} (expected {rec['expected']}, last saw {rec['observed']}); the low-latency "
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


__all__ = ["ShrinkMask", "sync_ints"]
