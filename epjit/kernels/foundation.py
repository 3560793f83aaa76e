"""Specs of the foundation kernels: the NVLink barrier (+ its exchange self-check) and the NVSHMEM self-check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..jit.spec import KernelSpec

PEERS = ("peers", "const PeersTable*")
TIMELINE_SLOTS = 8  # kTimelineSlots of cuda_src/timeline.cuh: EPJIT_PROFILE stamps per block
TIMELINE_SM_SLOT = TIMELINE_SLOTS - 1  # kTimelineSmSlot: the block's SM id + 1
TIMELINE_TAG_SLOT = TIMELINE_SLOTS - 2  # kTimelineTagSlot: its channel + 1, for kernels with fewer points
TIMELINE_ROLE_TAG_STRIDE = 256  # kTimelineRoleTagStride: a role row's tag is role * 256 + channel (+ 1)


class TimelineRole(NamedTuple):
    """One role of a kernel that stamps a row a (channel, role) (timeline.cuh's timeline_row_*, e.g. internode.cu):
    its name, its points in slot order (a name ending in ``_ns`` sums the nanoseconds its waiters spun, not a
    moment) and its waiters a channel (the warps or group leaders whose waits a row sums)."""

    name: str
    points: tuple[str, ...]
    waiters: int


@dataclass(frozen=True)
class BarrierSpec(KernelSpec):
    """cuda_src/barrier.cu: one block per GPU synchronises every rank of an NVLink node."""

    num_nvl_ranks: int

    SOURCE = "barrier.cu"
    KERNELS = {
        "nvl_barrier": (PEERS,),
        "nvl_exchange_check": (PEERS, ("num_rounds", "int"), ("num_ints", "int"), ("skip_rank", "int"),
                               ("errors", "int*")),
    }

    def __post_init__(self) -> None:
        if not 1 <= self.num_nvl_ranks <= 8:
            raise ValueError(f"num_nvl_ranks={self.num_nvl_ranks} must be in [1, 8]")


@dataclass(frozen=True)
class PutSignalCheckSpec(KernelSpec):
    """cuda_src/nvshmem_check.cu: put + signal to every PE, wait for all, check (NVSHMEM or direct pointers)."""

    direct: bool

    SOURCE = "nvshmem_check.cu"
    KERNELS = {
        "put_signal_check": (PEERS, ("round", "int"), ("num_ints", "int"), ("skip_rank", "int"), ("errors", "int*")),
    }
    USES_NVSHMEM = True
