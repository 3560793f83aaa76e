"""``python -m epjit.jit --check [--arch sm_90] [--force] [--resources]``: compile and link every kernel module,
print the times.

Needs no GPU: the arch comes from --arch, the configuration's arch (EPJIT_ARCH) or the current device. With
--resources it also prints what ptxas reports for every kernel (registers per thread, stack frame, spill stores and
loads): spills in a hot kernel cost local-memory traffic.

The modules to build and their configuration are the kernel sets the packages above register (registry.py):
this layer knows no kernel family of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence

from .compiler import compile_spec, normalize_arch, ptxas_resources
from .config import JitConfig
from .errors import JitError
from .registry import KernelSet, kernel_sets
from .spec import KernelSpec

# The options that only say how to check: given without --check they would do nothing.
_CHECK_OPTIONS = ("arch", "force", "resources")


def main(argv: list[str] | None = None, sets: Sequence[tuple[str, KernelSet]] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epjit.jit", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compile and link every module")
    parser.add_argument("--arch", help="target, e.g. sm_90 (default: EPJIT_ARCH or the current GPU)")
    parser.add_argument("--force", action="store_true", help="ignore the disk cache (compile everything again)")
    parser.add_argument("--resources", action="store_true",
                        help="print ptxas's registers, stack frame and spills per kernel (no GPU needed)")
    args = parser.parse_args(argv)
    if not args.check:
        given = [f"--{name}" for name in _CHECK_OPTIONS if getattr(args, name)]
        if given:
            parser.error(f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to the modules --check "
                         f"builds: add --check, e.g. python -m epjit.jit --check --arch sm_90"
                         f"{' --resources' if args.resources else ''}")
        parser.print_help()
        return 2
    try:
        sets = kernel_sets() if sets is None else sets
    except JitError as e:
        print(e, file=sys.stderr)
        return 2
    arch = _arch(args.arch, next((s.config.arch for _, s in sets if s.config.arch), None))
    if arch is None:
        return 2
    failures = 0
    total = time.perf_counter()
    print(f"{'module':<48} {'arch':<7} {'seconds':>8}  source")
    for _, kernel_set in sets:
        config = dataclasses.replace(kernel_set.config, arch=arch)
        for spec in kernel_set.specs:
            failures += not _check(spec, arch, config, args.force, args.resources)
    print(f"{'total':<48} {arch:<7} {time.perf_counter() - total:8.2f}  {failures} failed")
    return 1 if failures else 0


def _arch(given: str | None, configured: str | None) -> str | None:
    """--arch, else the configured arch or the current GPU's; None (said on stderr) where there is neither."""
    if given:
        return normalize_arch(given)
    from .module import device_arch

    try:
        return device_arch(None, configured)
    except Exception as e:  # noqa: BLE001 - any failure to find a GPU means: ask for --arch
        print(f"no GPU to read the arch from ({type(e).__name__}: {e}); pass --arch sm_90", file=sys.stderr)
        return None


def _check(spec: KernelSpec, arch: str, config: JitConfig, force: bool, resources: bool) -> bool:
    """Compile (or find in the cache) one module and print its line; False where it failed."""
    try:
        result = compile_spec(spec, arch, config, force=force)
    except JitError as e:
        print(f"{spec.family:<48} {arch:<7} {'FAILED':>8}\n{e}", file=sys.stderr)
        return False
    where = "cache" if result.from_cache else "compiled" + (" + linked" if spec.USES_NVSHMEM else "")
    print(f"{spec.family:<48} {arch:<7} {result.seconds:8.2f}  {where}")
    if resources:
        print_resources(spec, arch, config)
    return True


def print_resources(spec: KernelSpec, arch: str, config: JitConfig) -> None:
    linked = " (before linking NVSHMEM)" if spec.USES_NVSHMEM else ""
    for kernel, r in ptxas_resources(spec, arch, config).items():
        spills = "  SPILLS" if r.spill_stores or r.spill_loads else ""
        print(f"    {kernel:<44} {r.registers:>3} registers, {r.stack_bytes:>4} B stack, {r.spill_stores:>4} B spill "
              f"stores, {r.spill_loads:>4} B spill loads{linked}{spills}")
