"""The JIT layer's own exceptions (it imports nothing else of epjit; epjit.errors derives its public ones from
these, so ``except epjit.CompileError`` catches what a compile raises)."""

from __future__ import annotations


class JitError(RuntimeError):
    """Base of what the JIT layer raises."""


class CompileError(JitError):
    """NVRTC or nvJitLink refused a kernel, or a cubin would not load; the message carries the compiler log and
    the path of the dumped source."""


class ToolchainError(JitError):
    """The compiler, its headers or NVSHMEM (library, headers, nvshmem4py) are missing or too old."""
