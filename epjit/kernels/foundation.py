"""Specs of the foundation kernels: the NVLink barrier (+ its exchange self-check), the NVSHMEM self-check and the
wall-clock spin the benchmark starts from."""

from __future__ import annotations

from dataclasses import dataclass

from ..jit.spec import KernelSpec

PEERS = ("peers", "const PeersTable*")


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
