"""The JIT layer: NVRTC compile (+ nvJitLink for NVSHMEM), disk cache, CuPy load and launch by argument name.

It knows kernel specs (template parameters, argument names and C types) and nothing about MoE, and it imports
nothing else of epjit: where the sources are, where the cache lives and the version come in a :class:`JitConfig`.
``python -m epjit.jit --check [--arch sm_90]`` compiles and links without a GPU every module the packages above
register as a :class:`KernelSet` (entry-point group ``epjit.jit.specs``). A :class:`Program` written by hand is
compiled as it is (:func:`compile_program`), its kernels read from its own text (:func:`parse_kernels`); an edited
copy of a spec's source is compiled in place of it with the spec's name expressions (:func:`compile_variant`).
"""

from __future__ import annotations

from .compiler import CompiledModule, compile_spec, normalize_arch
from .config import JitConfig
from .errors import CompileError, JitError, ToolchainError
from .module import Module, device_arch, load, unload_all
from .program import CompiledProgram, Program, compile_program, compile_variant
from .registry import KernelSet
from .signature import KernelSignature, Parameter, SignatureError, parse_globals, parse_kernels
from .spec import KernelArgs, KernelSpec, build_with, camel_param, same_fields

__all__ = [
    "CompileError",
    "CompiledModule",
    "CompiledProgram",
    "JitConfig",
    "JitError",
    "KernelArgs",
    "KernelSet",
    "KernelSignature",
    "KernelSpec",
    "Module",
    "Parameter",
    "Program",
    "SignatureError",
    "ToolchainError",
    "build_with",
    "camel_param",
    "compile_program",
    "compile_variant",
    "compile_spec",
    "device_arch",
    "load",
    "normalize_arch",
    "parse_globals",
    "parse_kernels",
    "same_fields",
    "unload_all",
]
