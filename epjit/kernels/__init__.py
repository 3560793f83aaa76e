"""One frozen spec per kernel family, plus the pure heuristics that choose configs (no GPU needed)."""

from __future__ import annotations

from ..jit.spec import KernelSpec
from .foundation import BarrierSpec, CopyCeilingSpec, PutSignalCheckSpec, SpinSpec
from .intranode import NUM_THREADS, IntranodeNotifySpec, IntranodeSpec, LayoutSpec
from .low_latency import LowLatencyPutsSpec, LowLatencySpec

__all__ = [
    "BarrierSpec",
    "CopyCeilingSpec",
    "IntranodeNotifySpec",
    "IntranodeSpec",
    "LayoutSpec",
    "LowLatencyPutsSpec",
    "LowLatencySpec",
    "PutSignalCheckSpec",
    "SpinSpec",
    "check_specs",
]


def check_specs() -> list[KernelSpec]:
    """Every module `python -m epjit.jit --check` builds: each family at the instantiations epjit uses."""
    specs: list[KernelSpec] = [BarrierSpec(n) for n in (1, 2, 4, 8)]
    specs += [PutSignalCheckSpec(False), PutSignalCheckSpec(True), LayoutSpec(), SpinSpec(), CopyCeilingSpec()]
    for ranks in (2, 4, 8):
        specs += [IntranodeNotifySpec(ranks), IntranodeSpec(ranks, NUM_THREADS)]
    specs += [LowLatencySpec(), LowLatencyPutsSpec()]
    return specs
