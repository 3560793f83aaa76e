"""User arrays in and out: PyTorch, JAX and CuPy through DLPack with no copies, NumPy for the CPU reference path.

Every array argument of a public call goes through :func:`check` first, so a bad input gets a ``TypeError`` or
``ValueError`` that names the argument, the values and the rank before any kernel runs. CuPy launches epjit's
kernels, so "in" means a ``cupy.ndarray`` view of the caller's memory (:func:`to_cupy`) and "out" means the caller's
framework viewing CuPy's memory (:func:`from_cupy`).

The hot path of a call describes each array once: :func:`check` returns the :class:`ArrayInfo` that
:func:`kernel_array` then turns into what a kernel takes, the caller's own torch tensor or CuPy array (whose raw
device address :func:`address` reads: no DLPack exchange, tens of microseconds a call saved) and a CuPy view for
JAX. A call whose plan is cached reads only :func:`fingerprint` and :func:`address`. Outputs for torch and CuPy
callers are allocated by their own framework (:func:`empty`), so nothing crosses DLPack on the way out either.

By concern: :mod:`.meta` reads metadata (describe, fingerprint, address), :mod:`.validate` checks arguments, and
:mod:`.dlpack` crosses into CuPy and back.
"""

from __future__ import annotations

from ..jit.module import cupy_stream  # CuPy's stream object for a stream address (the launcher needs it too)
from .dlpack import cupy_dtype, empty, from_cupy, kernel_array, to_cupy
from .meta import DTYPES, ArrayInfo, Dim, DType, Framework, address, describe, fingerprint
from .validate import check, check_same_framework

__all__ = [
    "DTYPES",
    "ArrayInfo",
    "DType",
    "Dim",
    "Framework",
    "address",
    "check",
    "check_same_framework",
    "cupy_dtype",
    "cupy_stream",
    "describe",
    "empty",
    "fingerprint",
    "from_cupy",
    "kernel_array",
    "to_cupy",
]
