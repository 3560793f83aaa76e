"""Specs of the foundation kernels: the NVLink barrier (+ its exchange self-check), the NVSHMEM self-check, and the
wall-clock spin and copy ceilings of the benchmark."""

from __future__ import annotations

from dataclasses import dataclass

from ..jit.spec import KernelSpec

PEERS = ("peers", "const PeersTable*")
TIMELINE_SLOTS = 8  # kTimelineSlots of cuda_src/timeline.cuh: EPJIT_PROFILE stamps per block
TIMELINE_SM_SLOT = TIMELINE_SLOTS - 1  # kTimelineSmSlot: the block's SM id + 1
TIMELINE_TAG_SLOT = TIMELINE_SLOTS - 2  # kTimelineTagSlot: its channel + 1, for kernels with fewer points


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


@dataclass(frozen=True)
class SpinSpec(KernelSpec):
    """cuda_src/clock.cu: one thread spins for a wall-clock time (the benchmark hides host launches behind it)."""

    SOURCE = "clock.cu"
    KERNELS = {"spin_for_ns": (("ns", "uint64_t"),)}


@dataclass(frozen=True)
class CopyCeilingSpec(KernelSpec):
    """cuda_src/ceiling.cu: warp copies into the NVLink buffers of chosen ranks (the benchmark's ceilings)."""

    SOURCE = "ceiling.cu"
    KERNELS = {
        "copy_ceiling": (PEERS, ("dst_mask", "int"), ("schedule", "int"), ("pull", "int"), ("skew", "int"),
                         ("src", "const int4*"), ("n_int4", "int64_t")),
        "copy_ceiling_bulk": (PEERS, ("dst_mask", "int"), ("src", "const char*"), ("n_bytes", "int64_t"),
                              ("stage_bytes", "int")),
    }
