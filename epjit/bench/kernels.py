"""The benchmark's own kernels (cuda_src/bench/): a wall-clock spin that hides the host's launches, the copy
ceilings and the NVSHMEM put ceiling. They are not part of the product's kernels; ``python -m epjit.jit --check``
builds them too."""

from __future__ import annotations

from dataclasses import dataclass

from ..jit import KernelSet, KernelSpec
from ..kernels import jit_config
from ..kernels.foundation import PEERS


@dataclass(frozen=True)
class SpinSpec(KernelSpec):
    """cuda_src/bench/clock.cu: one thread spins for a wall-clock time (the benchmark hides host launches behind it)."""

    SOURCE = "bench/clock.cu"
    KERNELS = {"spin_for_ns": (("ns", "uint64_t"),)}


@dataclass(frozen=True)
class CopyCeilingSpec(KernelSpec):
    """cuda_src/bench/ceiling.cu: warp copies into the NVLink buffers of chosen ranks (the benchmark's ceilings)."""

    SOURCE = "bench/ceiling.cu"
    KERNELS = {
        "copy_ceiling": (PEERS, ("dst_mask", "int"), ("schedule", "int"), ("pull", "int"), ("skew", "int"),
                         ("src", "const int4*"), ("n_int4", "int64_t")),
        "copy_ceiling_bulk": (PEERS, ("dst_mask", "int"), ("src", "const char*"), ("n_bytes", "int64_t"),
                              ("stage_bytes", "int")),
    }


# kPutCeilingHeaderBytes of cuda_src/bench/put_ceiling.cu: the signal word's share of the symmetric allocation,
# before the send and receive regions.
PUT_CEILING_HEADER_BYTES = 128


@dataclass(frozen=True)
class PutCeilingSpec(KernelSpec):
    """cuda_src/bench/put_ceiling.cu: every warp puts chunks with signals to the rail peer on the next NVLink node
    and waits for its own rail peer's (the benchmark's ceiling of the internode RDMA leg)."""

    SOURCE = "bench/put_ceiling.cu"
    KERNELS = {
        "put_ceiling": (PEERS, ("dst_pe", "int"), ("src_pe", "int"), ("n_bytes", "int64_t"),
                        ("chunk_bytes", "int64_t"), ("expected", "uint64_t")),
    }
    USES_NVSHMEM = True


def put_ceiling_heap_bytes(n_bytes: int) -> int:
    """Bytes of the symmetric allocation put_ceiling uses for ``n_bytes`` a rank: the signal, then the send and
    the receive regions."""
    return PUT_CEILING_HEADER_BYTES + 2 * n_bytes


def bench_specs() -> list[KernelSpec]:
    """The benchmark's modules, for `python -m epjit.jit --check`."""
    return [SpinSpec(), CopyCeilingSpec(), PutCeilingSpec()]


def kernel_set() -> KernelSet:
    """The benchmark's modules with epjit's configuration: the entry ``epjit.bench`` of the group epjit.jit.specs
    (pyproject.toml), built after the product's."""
    return KernelSet(jit_config(), bench_specs())
