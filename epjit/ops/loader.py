"""Kernel modules for the families: the JIT layer's load, with epjit's configuration and exceptions."""

from __future__ import annotations

from .. import jit, memory
from ..errors import CompileError, SetupError, with_rank
from ..kernels import jit_config


def load(spec: jit.KernelSpec, device: int) -> jit.Module:
    """Compile (or take from the disk cache) and load ``spec`` on ``device``; cached per process. A module linked
    with NVSHMEM's device library is unloaded before NVSHMEM finalises."""
    try:
        module = jit.load(spec, jit_config(), device)
    except jit.CompileError as e:
        raise CompileError(with_rank(str(e))) from e
    except jit.JitError as e:
        raise SetupError(with_rank(str(e))) from e
    if spec.USES_NVSHMEM:
        memory.before_nvshmem_finalize(jit.unload_all)
    return module
