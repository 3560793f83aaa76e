"""One frozen spec per kernel family, the pure heuristics that choose configs (no GPU needed), and where the kernel
sources are: the JIT layer's configuration comes from here."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from .._version import __version__
from ..env import codegen_settings, settings
from ..jit import JitConfig, KernelSet, KernelSpec
from .foundation import BarrierSpec, PutSignalCheckSpec
from .internode import (
    InternodeCombineFp8Spec,
    InternodeCombineFp8StoresSpec,
    InternodeNotifySpec,
    InternodeNotifyStoresSpec,
    InternodeSpec,
    InternodeStoresSpec,
    by_stores,
    internode_combine_fp8_spec,
    internode_spec,
    profile_spec,
)
from .intranode import (
    IntranodeCombineFp8Spec,
    IntranodeNotifySpec,
    IntranodeSpec,
    LayoutSpec,
    combine_fp8_spec,
    intranode_spec,
    shrink_spec,
)
from .low_latency import (
    WAIT_STATS_BUILDS,
    LowLatencyPutsShrinkSpec,
    LowLatencyPutsSpec,
    LowLatencyShrinkSpec,
    LowLatencySpec,
    LowLatencyStoresShrinkSpec,
    LowLatencyStoresSpec,
)

__all__ = [
    "BarrierSpec",
    "InternodeCombineFp8Spec",
    "InternodeCombineFp8StoresSpec",
    "InternodeNotifySpec",
    "InternodeNotifyStoresSpec",
    "InternodeSpec",
    "InternodeStoresSpec",
    "IntranodeCombineFp8Spec",
    "IntranodeNotifySpec",
    "IntranodeSpec",
    "LayoutSpec",
    "LowLatencyPutsShrinkSpec",
    "LowLatencyPutsSpec",
    "LowLatencyShrinkSpec",
    "LowLatencySpec",
    "LowLatencyStoresShrinkSpec",
    "LowLatencyStoresSpec",
    "WAIT_STATS_BUILDS",
    "PutSignalCheckSpec",
    "by_stores",
    "check_specs",
    "combine_fp8_spec",
    "shrink_spec",
    "cuda_sources",
    "internode_combine_fp8_spec",
    "internode_spec",
    "profile_spec",
    "intranode_spec",
    "jit_config",
    "kernel_set",
]


def cuda_sources() -> Path:
    """The folder of the kernel sources: inside the installed package (a wheel ships them as package data,
    epjit/cuda_src/), or cuda_src/ at the top of a source checkout (which is where they are edited)."""
    packaged = importlib.resources.files("epjit") / "cuda_src"
    if packaged.is_dir():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[2] / "cuda_src"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"epjit's kernel sources are neither at {packaged} (an installed wheel) nor at "
                            f"{checkout} (a source checkout): reinstall epjit")


def jit_config() -> JitConfig:
    """The JIT layer's configuration from epjit's settings (read now: tests and launchers may change them)."""
    s = settings()
    return JitConfig(source_dir=cuda_sources(), cache_dir=s.cache_dir, version=__version__, arch=s.arch,
                     key_extra=tuple(sorted(codegen_settings().items())))


def kernel_set() -> KernelSet:
    """The product's modules for `python -m epjit.jit --check`, with epjit's configuration: the entry ``epjit`` of
    the group epjit.jit.specs (pyproject.toml), through which the JIT layer finds them."""
    return KernelSet(jit_config(), check_specs())


def check_specs() -> list[KernelSpec]:
    """Every module of the product `python -m epjit.jit --check` builds: each family at the instantiations epjit
    uses (the benchmark adds its own: epjit.bench.kernels.bench_specs)."""
    specs: list[KernelSpec] = [BarrierSpec(n) for n in (1, 2, 4, 8)]
    specs += [PutSignalCheckSpec(False), PutSignalCheckSpec(True), LayoutSpec()]
    for ranks in (2, 4, 8):
        specs += [IntranodeNotifySpec(ranks), intranode_spec(ranks), combine_fp8_spec(intranode_spec(ranks))]
    # A tuning variant (Config's warp-role fields): the phased dispatch with 3 combine senders a peer.
    specs.append(intranode_spec(4, dispatch_phased=1, combine_send_warps=3))
    # Shrink mode's builds of notify, dispatch/combine and the FP8 combine (a normal-mode Buffer with enable_shrink)
    for ranks in (2, 4, 8):
        specs += [shrink_spec(IntranodeNotifySpec(ranks)), shrink_spec(intranode_spec(ranks)),
                  combine_fp8_spec(shrink_spec(intranode_spec(ranks)))]
    specs += [LowLatencySpec(), LowLatencyPutsSpec(), LowLatencyStoresSpec()]
    specs += [LowLatencyShrinkSpec(), LowLatencyPutsShrinkSpec(), LowLatencyStoresShrinkSpec()]
    specs += [build() for build in WAIT_STATS_BUILDS.values()]  # (a call given wait-stats arrays loads them)
    # Across NVLink nodes: the topologies the GPU tier runs (nodes x ranks a node), through NVSHMEM and with the
    # RDMA leg as NVLink stores (virtual nodes on one host).
    for nodes, nvl_ranks in ((2, 1), (4, 1), (2, 2), (2, 4), (4, 2)):
        spec = internode_spec(nodes, nvl_ranks)
        family = [InternodeNotifySpec(nodes, nvl_ranks), spec, internode_combine_fp8_spec(spec)]
        builds = family + [by_stores(s) for s in family]
        # and each again in its profile build (a Buffer made with EPJIT_PROFILE=1 loads it)
        specs += builds + [profile_spec(s) for s in builds]
    return specs
