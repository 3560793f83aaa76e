"""Crossing into CuPy and back: a ``cupy.ndarray`` view of the caller's memory (:func:`to_cupy`), the caller's
framework viewing CuPy's memory (:func:`from_cupy`), and outputs allocated by the caller's own framework
(:func:`empty`), all without copies. Only these import what they convert to (CuPy, or the framework the caller
asked for).

FP8 cannot cross DLPack into CuPy (CuPy has no float8 dtype and refuses DLPack type code 10), so FP8 travels as
uint8 storage of the same shape: torch reinterprets it in place (``.view``); for JAX, which has no views, the DLPack
capsule itself is retyped (see ``_retype_capsule``), so JAX FP8 crosses without a copy too.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError, with_rank
from .meta import _NOUN, DTYPES, FRAMEWORKS, ArrayInfo, _dtype_name, _is_contiguous, _loaded, _location, describe

# --------------------------------------------------------------------------------------------------------------------
# Crossing into CuPy and back


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(
            "epjit launches its kernels through CuPy: install cupy-cuda13x (or cupy-cuda12x), e.g. "
            "`pip install epjit[cuda13]`"
        ) from exc
    return cupy




# FP8 and JAX. CuPy has no float8 dtype and refuses DLPack type code 10 (kDLFloat8_e4m3fn); JAX has no views, so
# it cannot reinterpret an array as uint8 without a copy (lax.bitcast_convert_type runs an XLA kernel into a new
# buffer). JAX does export and import code 10 (0.11 checked), so epjit retypes the DLPack capsule itself: the
# DLTensor's dtype code is switched between kDLFloat8_e4m3fn and kDLUInt before the consumer reads it. Same
# memory, same shape and strides (both types are 8 bits); stream ordering stays DLPack's.
#
#   DLManagedTensor            { DLTensor dl_tensor; ... }                    capsule "dltensor",           at +0
#   DLManagedTensorVersioned   { u32 major, minor; void *ctx; void (*deleter)(...); u64 flags; DLTensor dl_tensor; }
#                                                                             capsule "dltensor_versioned", at +32
#   DLTensor                   { void *data; i32 device_type, device_id; i32 ndim; u8 code, u8 bits, u16 lanes; ... }
#                                                                             dtype code at +20, bits at +21
_KDL_UINT = 1
_KDL_FLOAT8 = {"float8_e4m3fn": 10}
_CAPSULES = ((b"dltensor_versioned", 32), (b"dltensor", 0))


# Private prototypes (setting argtypes on ctypes.pythonapi's shared function objects could clash with other users).
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


def _retype_capsule(capsule: Any, code: int, name: str) -> None:
    """Rewrite the dtype code of an unconsumed 8-bit DLPack capsule in place."""
    for capsule_name, offset in _CAPSULES:
        if _capsule_is_valid(capsule, capsule_name):
            dtype = (ctypes.c_uint8 * 4).from_address(_capsule_pointer(capsule, capsule_name) + offset + 20)
            if dtype[1] != 8 or (dtype[2], dtype[3]) != (1, 0):
                raise ArgumentTypeError(
                    with_rank(f"{name}: expected an 8-bit DLPack tensor, got code {dtype[0]} with {dtype[1]} bits")
                )
            dtype[0] = code
            return
    raise ArgumentTypeError(with_rank(f"{name}: the exporter returned no unconsumed DLPack capsule"))


class _Retyped:
    """Exports `arr` through DLPack with another 8-bit type code: uint8 CuPy storage reaches JAX as float8."""

    def __init__(self, arr: Any, code: int, name: str) -> None:
        self._arr, self._code, self._name = arr, code, name

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._arr.__dlpack_device__()

    def __dlpack__(self, **kwargs: Any) -> Any:
        capsule = self._arr.__dlpack__(**kwargs)
        _retype_capsule(capsule, self._code, self._name)
        return capsule


def to_cupy(obj: Any, name: str, info: ArrayInfo | None = None) -> Any:
    """A ``cupy.ndarray`` viewing the same GPU memory as `obj` (a torch, JAX or CuPy array); never a copy.

    `info` is what :func:`check` or :func:`describe` returned for `obj`, when the caller has it (saves reading it
    again).

    The view has `obj`'s shape and strides. bfloat16 arrives as ml_dtypes' ``bfloat16``. FP8 arrives as ``uint8``
    of the same shape, because CuPy has no float8 dtype: torch is reinterpreted in place (``.view(torch.uint8)``),
    JAX through a retyped DLPack capsule. A torch tensor that requires grad is detached (same memory): epjit's
    operations are not differentiable themselves; wrap them in an autograd Function.

    JAX arrays are immutable: the view of a JAX array must only be read.

    Streams: the producer is handed CuPy's *current* stream (of `obj`'s device) and makes it wait for the work
    that produces `obj`, so the view is safe to use on that stream. Ordering kernels on any other stream, and
    ordering the caller's later work after epjit's, is the caller's job (events); this module manages no streams.

    Raises ArgumentTypeError for NumPy arrays, CPU tensors and anything not an array.
    """
    if info is None:
        info = describe(obj, name)
    if info.framework == "cupy":
        return obj
    if info.device[0] != "cuda":
        _refuse_host_array(info, name)
    cupy = _import_cupy()
    if info.framework == "torch":
        tensor = obj.detach()  # DLPack refuses tensors that require grad; detach() shares the storage
        if info.dtype.startswith("float8"):
            tensor = tensor.view(_loaded("torch").uint8)  # same storage, same shape and strides
        # copy=False: the exporter must raise rather than hand us a copy.
        return cupy.from_dlpack(tensor, copy=False)

    # JAX
    if info.dtype in _KDL_FLOAT8:
        with cupy.cuda.Device(info.device[1]):
            # What cupy.from_dlpack would pass: the current stream; DLPack spells the legacy default stream 1.
            stream = cupy.cuda.get_current_stream().ptr or 1
            capsule = obj.__dlpack__(stream=stream)
        _retype_capsule(capsule, _KDL_UINT, name)
        view = cupy.from_dlpack(capsule)  # a bare capsule: the handshake above already happened
    else:
        view = cupy.from_dlpack(obj, copy=False)
    if not _is_contiguous(view.shape, tuple(s // view.itemsize for s in view.strides)):
        # describe() assumed JAX's default row-major layout; a custom layout must not reach the kernels silently.
        raise ArgumentError(
            with_rank(
                f"{name} is a JAX array with a non-row-major layout (byte strides {view.strides}); pass one "
                "in the default layout"
            )
        )
    return view


def _refuse_host_array(info: ArrayInfo, name: str) -> None:
    raise ArgumentTypeError(
        with_rank(
            f"{name} must be on a CUDA device to reach epjit's kernels, got a {_NOUN[info.framework]} on "
            f"{_location(info)}"
        )
    )


def kernel_array(obj: Any, info: ArrayInfo, name: str) -> Any:
    """`obj`, which :func:`check` described as `info`, as the kernels take it (:func:`~epjit.arrays.meta.address`
    reads its address): torch tensors and CuPy arrays as they are (no DLPack exchange, no view; FP8 needs no
    reinterpreting either); a CuPy view (:func:`to_cupy`) for JAX arrays, whose DLPack export is what orders JAX's
    pending work before CuPy's current stream, and which keeps the JAX array's memory alive.

    Streams: a torch tensor's address comes with no synchronisation. ``to_cupy`` would have made CuPy's current
    stream wait for torch's current stream; epjit's Buffer makes them the same stream for torch callers, so that
    wait is a no-op there. Other callers must order the work that produces `obj` themselves. The address is valid
    while `obj` lives: keep `obj` referenced until the kernels that read it are queued.

    Raises ArgumentTypeError for arrays not on a CUDA device (NumPy arrays, CPU tensors).
    """
    framework = info.framework
    if info.device[0] != "cuda":
        _refuse_host_array(info, name)
    if framework == "torch" or framework == "cupy":
        return obj
    return to_cupy(obj, name, info)


_TORCH_TYPES: dict[tuple[str, int], tuple[Any, Any]] = {}  # (dtype name, ordinal) -> (torch dtype, torch device)


def empty(framework: str, shape: tuple[int, ...], dtype: str, device: int) -> Any:
    """A new, uninitialised, C-contiguous array of `framework` (``"torch"`` or ``"cupy"``) on CUDA device `device`.

    `dtype` is a name from :data:`DTYPES`; CuPy, which has no float8 dtype, gets FP8 as uint8 storage. torch
    allocates from its caching allocator for its current stream of that device, CuPy from its pool for CuPy's
    current stream: whoever writes the array on another stream orders that stream after the allocating one (and,
    if the array may be freed before that writing is done, tells the allocator; torch: ``record_stream``).
    JAX arrays are immutable and cannot be allocated to be written: use CuPy and :func:`from_cupy`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"empty(dtype=...) takes a name from {DTYPES}, got {dtype!r}")
    if framework == "torch":
        found = _TORCH_TYPES.get((dtype, device))
        if found is None:
            torch = _loaded("torch")
            if torch is None:
                import torch
            found = _TORCH_TYPES[(dtype, device)] = (getattr(torch, dtype), torch.device("cuda", device))
        return _loaded("torch").empty(shape, dtype=found[0], device=found[1])
    if framework == "cupy":
        cupy = _import_cupy()
        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype=cupy_dtype(dtype))
    raise ArgumentError(with_rank(f"empty() allocates torch or CuPy arrays, not {framework!r}"))


def cupy_dtype(name: str) -> Any:
    """The NumPy dtype a CuPy array of :data:`DTYPES`' `name` is stored as: FP8 as uint8 (CuPy has no float8),
    bfloat16 from ml_dtypes."""
    return np.uint8 if name in _KDL_FLOAT8 else _numpy_dtype(name)


def _numpy_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def from_cupy(arr: Any, framework: str, *, dtype: str | None = None, name: str = "output") -> Any:
    """Hand `arr` (a ``cupy.ndarray`` epjit produced) back in the caller's `framework` without copying.

    ``"torch"``: ``torch.from_dlpack``; ``"jax"``: ``jax.dlpack.from_dlpack``; ``"cupy"``: `arr` itself.
    ``"numpy"`` is the CPU reference path: `arr` must then be a ``numpy.ndarray`` and comes back as it is; GPU
    memory is never handed to NumPy (that would be a copy).

    With ``dtype="float8_e4m3fn"`` and a uint8 `arr` (FP8 carried as storage), torch gets
    ``.view(torch.float8_e4m3fn)``, NumPy an ml_dtypes view, JAX the same memory through a retyped DLPack capsule,
    and CuPy, which has no float8 dtype, the uint8 array unchanged.

    JAX canonicalises int64 to int32 (a copy) unless ``jax_enable_x64`` is on; rather than return that, this
    raises. JAX gets row-major arrays only, so that what it holds is the memory epjit wrote, in its default layout.

    Streams: the consumer (torch/JAX) passes its current stream and CuPy makes it wait for CuPy's current stream;
    work epjit queued on any other stream must be ordered by the caller.
    """
    if framework not in FRAMEWORKS:
        raise ArgumentError(with_rank(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}"))
    info = describe(arr, name)
    if info.framework not in ("cupy", "numpy"):
        raise ArgumentTypeError(with_rank(f"from_cupy takes a CuPy array, got a {_NOUN[info.framework]} as {name}"))
    if framework == "numpy" and info.framework == "cupy":
        raise ArgumentTypeError(
            with_rank(
                f"{name} is GPU memory (a CuPy array on cuda:{info.device[1]}) and cannot be handed to NumPy without a "
                "copy; use torch, JAX or CuPy, or call cupy.asnumpy() if a host copy is wanted"
            )
        )
    if info.framework == "numpy" and framework != "numpy":
        raise ArgumentTypeError(
            with_rank(f"{name} is a NumPy array on the CPU and cannot become a {framework} GPU array without a copy")
        )

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"from_cupy(dtype=...) takes a name from {DTYPES}, got {dtype!r}")
    reinterpret = dtype is not None and dtype != info.dtype
    if reinterpret and not (dtype in _KDL_FLOAT8 and info.dtype == "uint8"):
        raise ArgumentTypeError(
            with_rank(f"{name} is {info.dtype}; only uint8 storage can be handed out as float8 (asked for {dtype})")
        )

    if framework == "numpy":
        if not reinterpret:
            return arr
        import ml_dtypes

        return arr.view(getattr(ml_dtypes, dtype))
    if framework == "cupy":
        return arr  # CuPy has no float8 dtype: FP8 stays uint8 storage
    if framework == "torch":
        import torch

        out = torch.from_dlpack(arr)
        return out.view(getattr(torch, dtype)) if reinterpret else out

    # JAX
    import jax.dlpack

    if not info.contiguous:
        raise ArgumentError(
            with_rank(
                f"{name} must be contiguous to become a JAX array (strides {info.strides} for shape {info.shape})"
            )
        )
    out = jax.dlpack.from_dlpack(_Retyped(arr, _KDL_FLOAT8[dtype], name) if reinterpret else arr)
    want, got = (dtype if reinterpret else info.dtype), _dtype_name(out.dtype)
    if got != want:
        hint = "; enable 64-bit types with jax.config.update('jax_enable_x64', True)" if "64" in want else ""
        raise ArgumentTypeError(with_rank(f"JAX turned {name} from {want} into {got} (a copy){hint}"))
    return out
