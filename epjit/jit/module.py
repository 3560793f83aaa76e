"""Load compiled cubins with CuPy and launch their kernels.

Loading is per device and cached in the process; NVSHMEM modules are handed to ``cumodule_init`` once after load,
before their first launch (NVSHMEM patches the module's device-side state there).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from ..env import settings
from ..errors import CompileError, SetupError, with_rank
from .compiler import CompiledModule, compile_spec, normalize_arch
from .spec import KernelSpec

log = logging.getLogger("epjit.jit")

_loaded: dict[tuple[Path, int], Module] = {}


def device_arch(device: int | None = None) -> str:
    """``sm_XY`` of the given (default: current) CUDA device; EPJIT_ARCH overrides it."""
    override = settings().arch
    if override:
        return normalize_arch(override)
    import cupy

    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    return normalize_arch(dev.compute_capability)


class Module:
    """One loaded cubin on one device: its kernels by template name, launched with packed arguments."""

    def __init__(self, compiled: CompiledModule, device: int) -> None:
        import cupy

        self.compiled = compiled
        self.spec = compiled.spec
        self.device = device
        try:
            self.raw = cupy.RawModule(path=str(compiled.cubin_path))
            self._functions = {k: self.raw.get_function(name) for k, name in compiled.lowered_names.items()}
        except cupy.cuda.driver.CUDADriverError as e:
            raise CompileError(with_rank(f"cannot load {compiled.cubin_path} on cuda:{device}: {e}")) from e
        self._nvshmem_initialised = False
        if self.spec.USES_NVSHMEM:
            self._init_nvshmem()

    def _init_nvshmem(self) -> None:
        try:
            from nvshmem import bindings as nvshmem_bindings
        except ImportError as e:
            raise SetupError(with_rank(f"{self.spec.family} calls NVSHMEM but nvshmem4py is missing: "
                                       f"pip install 'epjit[cuda13]' ({e})")) from None
        status = nvshmem_bindings.cumodule_init(int(self.raw.module.ptr))
        if status not in (None, 0):
            raise SetupError(with_rank(f"nvshmemx_cumodule_init failed ({status}) for {self.spec.family}: "
                                       "is NVSHMEM initialised on this rank (epjit.memory.SymmetricHeap)?"))
        self._nvshmem_initialised = True

    def launch(self, kernel: str, grid: int | tuple[int, ...], block: int | tuple[int, ...], *args: Any,
               shared_mem: int = 0, stream: Any = None) -> None:
        fn = self._functions.get(kernel)
        if fn is None:
            raise KeyError(f"{self.spec.family} has no kernel {kernel!r}; it has {sorted(self._functions)}")
        grid = grid if isinstance(grid, tuple) else (int(grid),)
        block = block if isinstance(block, tuple) else (int(block),)
        packed = self.spec.pack(kernel, args)
        if shared_mem > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = shared_mem
        fn(grid, block, packed, shared_mem=shared_mem, stream=stream)

    def close(self) -> None:
        if self._nvshmem_initialised:
            from nvshmem import bindings as nvshmem_bindings

            # nvshmem.core.module_finalize raises AttributeError in nvshmem4py 0.4.1; the binding works.
            nvshmem_bindings.cumodule_finalize(int(self.raw.module.ptr))
            self._nvshmem_initialised = False


def load(spec: KernelSpec, device: int | None = None) -> Module:
    """Compile (or take from the disk cache) and load ``spec`` on ``device`` (default: current); cached per process."""
    import cupy

    device = cupy.cuda.runtime.getDevice() if device is None else device
    compiled = compile_spec(spec, device_arch(device))
    key = (compiled.cubin_path, device)
    module = _loaded.get(key)
    if module is None:
        start = time.perf_counter()
        with cupy.cuda.Device(device):
            module = Module(compiled, device)
        _loaded[key] = module
        log.debug("loaded %s on cuda:%d in %.3f s (compiled %s)", spec.family, device,
                  time.perf_counter() - start, "earlier" if compiled.from_cache else "now")
    return module


def unload_all() -> None:
    """Finalise NVSHMEM modules (before nvshmem finalize) and forget every loaded module."""
    for module in _loaded.values():
        module.close()
    _loaded.clear()
