"""``python -m epjit.jit --check [--arch sm_90] [--force] [--resources]``: compile and link every kernel module,
print the times.

Needs no GPU: the arch comes from --arch, the configuration's arch (EPJIT_ARCH) or the current device. With
--resources it also prints what ptxas reports for every kernel (registers per thread, stack frame, spill stores and
loads): spills in a hot kernel cost local-memory traffic.

The modules to build and the configuration come from the caller (``epjit/jit/__main__.py`` passes epjit's):
this layer knows no kernel family of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

from .compiler import compile_spec, normalize_arch, ptxas_resources
from .config import JitConfig
from .errors import JitError
from .spec import KernelSpec


def main(argv: list[str] | None, specs: Callable[[], Sequence[KernelSpec]], config: JitConfig) -> int:
    parser = argparse.ArgumentParser(prog="python -m epjit.jit", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compile and link every module")
    parser.add_argument("--arch", help="target, e.g. sm_90 (default: EPJIT_ARCH or the current GPU)")
    parser.add_argument("--force", action="store_true", help="ignore the disk cache (compile everything again)")
    parser.add_argument("--resources", action="store_true",
                        help="print ptxas's registers, stack frame and spills per kernel (no GPU needed)")
    args = parser.parse_args(argv)
    if not args.check:
        parser.print_help()
        return 2
    if args.arch:
        arch = normalize_arch(args.arch)
        config = dataclasses.replace(config, arch=arch)
    else:
        from .module import device_arch

        try:
            arch = device_arch(None, config.arch)
        except Exception as e:  # noqa: BLE001 - any failure to find a GPU means: ask for --arch
            print(f"no GPU to read the arch from ({type(e).__name__}: {e}); pass --arch sm_90", file=sys.stderr)
            return 2
    failures = 0
    total = time.perf_counter()
    print(f"{'module':<48} {'arch':<7} {'seconds':>8}  source")
    for spec in specs():
        try:
            result = compile_spec(spec, arch, config, force=args.force)
        except JitError as e:
            failures += 1
            print(f"{spec.family:<48} {arch:<7} {'FAILED':>8}\n{e}", file=sys.stderr)
            continue
        where = "cache" if result.from_cache else "compiled" + (" + linked" if spec.USES_NVSHMEM else "")
        print(f"{spec.family:<48} {arch:<7} {result.seconds:8.2f}  {where}")
        if args.resources:
            print_resources(spec, arch, config)
    print(f"{'total':<48} {arch:<7} {time.perf_counter() - total:8.2f}  {failures} failed")
    return 1 if failures else 0


def print_resources(spec: KernelSpec, arch: str, config: JitConfig) -> None:
    linked = " (before linking NVSHMEM)" if spec.USES_NVSHMEM else ""
    for kernel, r in ptxas_resources(spec, arch, config).items():
        spills = "  SPILLS" if r.spill_stores or r.spill_loads else ""
        print(f"    {kernel:<44} {r.registers:>3} registers, {r.stack_bytes:>4} B stack, {r.spill_stores:>4} B spill "
              f"stores, {r.spill_loads:>4} B spill loads{linked}{spills}")
