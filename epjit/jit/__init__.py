"""The JIT layer: NVRTC compile (+ nvJitLink for NVSHMEM), disk cache, CuPy load and launch.

It knows kernel specs (template parameters and argument C types) and nothing about MoE.
``python -m epjit.jit --check [--arch sm_90]`` compiles and links every module without a GPU.
"""

from __future__ import annotations

from .compiler import CompiledModule, compile_spec, normalize_arch
from .module import Module, device_arch, load, unload_all
from .spec import KernelSpec, camel_param

__all__ = [
    "CompiledModule",
    "KernelSpec",
    "Module",
    "camel_param",
    "compile_spec",
    "device_arch",
    "load",
    "normalize_arch",
    "unload_all",
]
