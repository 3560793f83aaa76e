"""One frozen spec per kernel family, plus the pure heuristics that choose configs (no GPU needed)."""

from __future__ import annotations

from ..jit.spec import KernelSpec
from .foundation import BarrierSpec, CopyCeilingSpec, PutSignalCheckSpec, SpinSpec
from .intranode import IntranodeNotifySpec, IntranodeSpec, LayoutSpec, intranode_spec
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
    "intranode_spec",
]


def check_specs() -> list[KernelSpec]:
    """Every module `python -m epjit.jit --check` builds: each family at the instantiations epjit uses."""
    specs: list[KernelSpec] = [BarrierSpec(n) for n in (1, 2, 4, 8)]
    specs += [PutSignalCheckSpec(False), PutSignalCheckSpec(True), LayoutSpec(), SpinSpec(), CopyCeilingSpec()]
    for ranks in (2, 4, 8):
        specs += [IntranodeNotifySpec(ranks), intranode_spec(ranks)]
    # The variants EPJIT_INTRANODE_VARIANT offers for the 4-rank A/B (scripts/gpu_ab.sh): the phased dispatch,
    # and combine with other than the formula's 4 sending warps a peer.
    specs.append(intranode_spec(4, dispatch_phased=1, combine_send_warps=3))
    specs += [LowLatencySpec(), LowLatencyPutsSpec()]
    return specs
