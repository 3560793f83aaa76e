"""The benchmark's own kernels (cuda_src/bench/): a wall-clock spin that hides the host's launches, and the copy
ceilings. They are not part of the product's kernels; ``python -m epjit.jit --check`` builds them too."""

from __future__ import annotations

from dataclasses import dataclass

from ..jit import KernelSpec
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


def bench_specs() -> list[KernelSpec]:
    """The benchmark's modules, for `python -m epjit.jit --check`."""
    return [SpinSpec(), CopyCeilingSpec()]
