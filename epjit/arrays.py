"""User arrays in and out: PyTorch, JAX and CuPy through DLPack with no copies, NumPy for the CPU reference path.

Every array argument of a public call goes through :func:`check` first, so a bad input gets a ``TypeError`` or
``ValueError`` that names the argument, the values and the rank before any kernel runs. CuPy launches epjit's
kernels, so "in" means a ``cupy.ndarray`` view of the caller's memory (:func:`to_cupy`) and "out" means the caller's
framework viewing CuPy's memory (:func:`from_cupy`).

The hot path of a call describes each array once: :func:`check` returns the :class:`ArrayInfo` that
:func:`kernel_arg` then turns into what a kernel takes, the raw device address for torch tensors and CuPy arrays (no
DLPack exchange: tens of microseconds a call saved) and a CuPy view for JAX. Outputs for torch and CuPy callers are
allocated by their own framework (:func:`empty`), so nothing crosses DLPack on the way out either.

Frameworks are never imported to *inspect* an object: the object's type names its module, and that module is
already in ``sys.modules`` if the object exists. Only :func:`to_cupy` / :func:`from_cupy` import what they convert
to (CuPy, or the framework the caller asked for).

FP8 cannot cross DLPack into CuPy (CuPy has no float8 dtype and refuses DLPack type code 10), so FP8 travels as
uint8 storage of the same shape: torch reinterprets it in place (``.view``); for JAX, which has no views, the DLPack
capsule itself is retyped (see ``_retype_capsule``), so JAX FP8 crosses without a copy too.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args

import numpy as np

from .errors import ArgumentError, ArgumentTypeError, with_rank
from .jit.module import cupy_stream  # CuPy's stream object for a stream address (the launcher needs it too)

__all__ = [
    "DTYPES",
    "ArrayInfo",
    "DType",
    "Dim",
    "Framework",
    "address",
    "check",
    "check_same_framework",
    "cupy_stream",
    "describe",
    "empty",
    "fingerprint",
    "from_cupy",
    "kernel_arg",
    "to_cupy",
]

DType = Literal["bfloat16", "float8_e4m3fn", "float32", "float16", "int64", "int32", "uint8", "bool"]
"""The dtype names epjit uses; every framework's dtype is reported under these names (NumPy's spelling)."""

DTYPES: tuple[str, ...] = get_args(DType)

Framework = Literal["torch", "jax", "cupy", "numpy"]
FRAMEWORKS: tuple[str, ...] = get_args(Framework)

Dim = Union[int, str, None, tuple[str, int]]
"""One entry of a shape spec for :func:`check`: ``128`` (must be 128), ``"K"`` (any size, shown as K), ``None``
(any size, shown as ``*``) or ``("N", 128)`` (must be 128, shown as ``N=128``)."""

# How messages name an object of each framework ("got a torch tensor on the CPU").
_NOUN = {"torch": "torch tensor", "jax": "JAX array", "cupy": "CuPy array", "numpy": "NumPy array"}


@dataclass(frozen=True)
class ArrayInfo:
    """What epjit needs to know about an array, read without touching its data.

    ``dtype`` is a name from :data:`DTYPES` when the array has one of those dtypes, otherwise the framework's own
    name (``"float64"``) so that errors can say what was passed. ``strides`` are in elements. ``device`` is
    ``("cuda", ordinal)`` or ``("cpu", 0)`` (other kinds, e.g. torch's ``"meta"``, pass through as named).
    ``contiguous`` means C order, judged as torch does: size-1 dimensions may have any stride and an array with a
    size-0 dimension is contiguous.
    """

    framework: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    device: tuple[str, int]
    contiguous: bool

    @property
    def ndim(self) -> int:
        return len(self.shape)


_new_object = object.__new__


def _info(framework: str, dtype: str, shape: tuple[int, ...], strides: tuple[int, ...], device: tuple[str, int],
          contiguous: bool) -> ArrayInfo:
    # The same object ArrayInfo(...) makes, built faster: a frozen dataclass's __init__ sets each field through
    # object.__setattr__, and describe() runs for every array a call validates.
    info = _new_object(ArrayInfo)
    fields = info.__dict__
    fields["framework"] = framework
    fields["dtype"] = dtype
    fields["shape"] = shape
    fields["strides"] = strides
    fields["device"] = device
    fields["contiguous"] = contiguous
    return info


# --------------------------------------------------------------------------------------------------------------------
# Reading metadata


def _type_name(obj: object) -> str:
    if obj is None:
        return "None"
    cls = type(obj)
    module = cls.__module__ or ""
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _loaded(module_name: str) -> Any:
    # An object whose type lives in `torch.*` can only exist once torch is imported, so looking the module up in
    # sys.modules is enough and never imports a framework the caller did not use. A lookalike type whose package
    # is not loaded is simply not an array.
    return sys.modules.get(module_name)


# Framework of each array type seen so far. Which framework an object belongs to depends on its type only (the
# checks below are isinstance checks), so a type is classified once; types that are not arrays are never stored.
_FRAMEWORK_OF_TYPE: dict[type, str] = {}


def _framework(obj: object, name: str) -> str:
    """Which framework `obj` belongs to, or ArgumentTypeError naming what it is instead."""
    framework = _FRAMEWORK_OF_TYPE.get(type(obj))
    if framework is None:
        framework = _classify(obj, name)
        _FRAMEWORK_OF_TYPE[type(obj)] = framework
    return framework


def _classify(obj: object, name: str) -> str:
    if isinstance(obj, np.ndarray):
        return "numpy"
    root = (type(obj).__module__ or "").partition(".")[0]
    if root == "torch":
        torch = _loaded("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return "torch"
    elif root in ("jax", "jaxlib"):
        jax = _loaded("jax")
        if jax is not None:
            tracer = getattr(getattr(jax, "core", None), "Tracer", None)
            if tracer is not None and isinstance(obj, tracer):
                raise ArgumentTypeError(
                    with_rank(
                        f"{name} is a JAX tracer ({type(obj).__name__}): epjit moves data between GPUs and cannot be "
                        "traced by jax.jit/vmap/grad; call it with concrete arrays, outside the traced function"
                    )
                )
            if isinstance(obj, jax.Array):
                return "jax"
    elif root == "cupy":
        cupy = _loaded("cupy")
        if cupy is not None and isinstance(obj, cupy.ndarray):
            return "cupy"
    raise ArgumentTypeError(with_rank(f"{name} must be a torch/JAX/CuPy array, got {_type_name(obj)}"))


def _is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """C-order contiguity with torch's rules: size-1 dims are free, any size-0 dim makes the array contiguous."""
    if len(shape) == 2 and strides[1] == 1 and strides[0] == shape[1]:
        return True  # the common case: exactly C strides
    if any(size == 0 for size in shape):
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def _c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


_DTYPE_NAMES: dict[Any, str] = {}  # NumPy/CuPy dtype -> name, and torch dtype -> name (both hashable)


def _dtype_name(dtype: Any) -> str:
    # NumPy, CuPy and JAX dtypes are numpy dtypes (ml_dtypes provides bfloat16/float8 names); anything else
    # (a JAX extended dtype such as a PRNG key) keeps its own spelling so the error can show it.
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def _strided_info(obj: Any, name: str, framework: str, device: tuple[str, int]) -> ArrayInfo:
    """NumPy and CuPy: strides come in bytes."""
    shape = tuple(int(s) for s in obj.shape)
    dtype = obj.dtype
    itemsize = dtype.itemsize
    byte_strides = tuple(int(s) for s in obj.strides)
    if itemsize == 0 or any(s % itemsize for s in byte_strides):
        raise ArgumentError(
            with_rank(f"{name} has byte strides {byte_strides} that are not multiples of its itemsize {itemsize}")
        )
    strides = byte_strides if itemsize == 1 else tuple(s // itemsize for s in byte_strides)
    dtype_name = _DTYPE_NAMES.get(dtype)
    if dtype_name is None:
        dtype_name = _DTYPE_NAMES[dtype] = _dtype_name(dtype)
    return _info(framework, dtype_name, shape, strides, device, _is_contiguous(shape, strides))


def _torch_info(obj: Any) -> ArrayInfo:
    shape = tuple(obj.shape)  # torch.Size holds ints
    strides = obj.stride()
    if obj.is_cuda:
        device = ("cuda", obj.get_device())  # get_device() is the ordinal, without building a torch.device
    else:
        dev = obj.device
        device = (dev.type, 0 if dev.index is None else int(dev.index))
    dtype = _DTYPE_NAMES.get(obj.dtype)
    if dtype is None:  # torch.bfloat16 -> bfloat16, torch.bool -> bool
        dtype = _DTYPE_NAMES[obj.dtype] = str(obj.dtype).removeprefix("torch.")
    return _info("torch", dtype, shape, strides, device, _is_contiguous(shape, strides))


def _jax_info(obj: Any, name: str) -> ArrayInfo:
    devices = obj.devices()
    if len(devices) != 1:
        raise ArgumentError(
            with_rank(
                f"{name} is a JAX array sharded over {len(devices)} devices; epjit needs each rank's array on that "
                "rank's GPU only (pass the local shard, e.g. x.addressable_data(0))"
            )
        )
    (dev,) = devices
    platform = dev.platform
    if platform in ("gpu", "cuda"):
        hw = getattr(dev, "local_hardware_id", None)  # the CUDA ordinal in this process, as CuPy and torch count
        device = ("cuda", int(dev.id if hw is None else hw))
    elif platform == "cpu":
        device = ("cpu", 0)
    else:
        device = (platform, int(dev.id))
    shape = tuple(int(s) for s in obj.shape)
    # JAX exposes no strides: its arrays are dense, row-major buffers (to_cupy re-checks what DLPack reports).
    return ArrayInfo("jax", _dtype_name(obj.dtype), shape, _c_strides(shape), device, True)


def describe(obj: Any, name: str) -> ArrayInfo:
    """Read framework, dtype, shape, strides, device and contiguity of `obj` without moving data or using a GPU.

    Accepts torch tensors (any device), JAX arrays on one device, CuPy arrays and NumPy arrays (the CPU reference
    path). Anything else raises :class:`~epjit.errors.ArgumentTypeError` naming `name` and the object's type.
    """
    framework = _framework(obj, name)
    if framework == "torch":
        return _torch_info(obj)
    if framework == "cupy":
        return _strided_info(obj, name, "cupy", ("cuda", int(obj.data.device_id)))
    if framework == "numpy":
        return _strided_info(obj, name, "numpy", ("cpu", 0))
    return _jax_info(obj, name)


# --------------------------------------------------------------------------------------------------------------------
# Plans: what a call's validation depends on, read fast

_TORCH_TENSOR: Any = None  # torch.Tensor, once torch is imported
_CUPY_NDARRAY: Any = None  # cupy.ndarray, once CuPy is imported


def fingerprint(obj: Any) -> tuple[Any, ...] | None:
    """Everything :func:`check` judges about ``obj`` (framework, dtype, shape, contiguity, device), read in under a
    microsecond for a torch tensor or CuPy array: two arrays with equal fingerprints pass or fail every check alike,
    so a call validated once for one is valid for the other. ``()`` for None; a tuple of fingerprints for a pair;
    None for anything else (a JAX array, a subclass, a wrong type), whose every call is checked in full."""
    global _TORCH_TENSOR, _CUPY_NDARRAY
    cls = type(obj)
    if cls is _TORCH_TENSOR:
        return (obj.dtype, obj.shape, obj.is_contiguous(), obj.get_device())
    if cls is _CUPY_NDARRAY:
        return (cls, obj.dtype, obj.shape, obj.strides, obj.data.device_id)
    if obj is None:
        return ()
    if cls is tuple or cls is list:
        parts = tuple(fingerprint(o) for o in obj)
        return None if None in parts else (cls, parts)
    torch, cupy = sys.modules.get("torch"), sys.modules.get("cupy")
    if torch is not None and _TORCH_TENSOR is None and cls is torch.Tensor:
        _TORCH_TENSOR = cls
        return fingerprint(obj)
    if cupy is not None and _CUPY_NDARRAY is None and cls is cupy.ndarray:
        _CUPY_NDARRAY = cls
        return fingerprint(obj)
    return None


def address(obj: Any) -> int:
    """The device address of a torch tensor or CuPy array that :func:`fingerprint` accepted (0 for None)."""
    if obj is None:
        return 0
    return obj.data_ptr() if type(obj) is _TORCH_TENSOR else obj.data.ptr


# --------------------------------------------------------------------------------------------------------------------
# Validation


def _fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _fmt_dtypes(names: Sequence[str]) -> str:
    if len(names) == 1:
        return names[0]
    if len(names) == 2:
        return f"{names[0]} or {names[1]}"
    return "one of " + ", ".join(names)


def _fmt_dim(dim: Dim) -> str:
    if dim is None:
        return "*"
    if isinstance(dim, tuple):
        return f"{dim[0]}={dim[1]}"
    return str(dim)


def _dim_size(dim: Dim) -> int | None:
    """The size a spec entry requires, or None for any size."""
    kind = type(dim)
    if kind is int:
        return dim  # type: ignore[return-value]
    if kind is str or dim is None:
        return None
    if kind is tuple and len(dim) == 2 and type(dim[0]) is str and type(dim[1]) is int:  # type: ignore[arg-type]
        return dim[1]  # type: ignore[index,return-value]
    if isinstance(dim, bool) or not isinstance(dim, (int, str, tuple, type(None))):
        raise TypeError(f"shape spec entries are int, str, None or (name, int), got {dim!r}")
    if isinstance(dim, tuple):
        if len(dim) != 2 or not isinstance(dim[0], str) or not isinstance(dim[1], int):
            raise TypeError(f"shape spec entries are int, str, None or (name, int), got {dim!r}")
        return dim[1]
    return dim if isinstance(dim, int) else None


def _location(info: ArrayInfo) -> str:
    kind, ordinal = info.device
    return "the CPU" if kind == "cpu" else f"the {kind}:{ordinal} device"


def _contiguous_hint(info: ArrayInfo, name: str) -> str:
    return {
        "torch": f"; pass {name}.contiguous()",
        "numpy": f"; pass numpy.ascontiguousarray({name})",
        "cupy": f"; pass cupy.ascontiguousarray({name})",
    }.get(info.framework, "")


_WANTED_DTYPES: dict[Any, tuple[str, ...]] = {}  # check()'s dtype argument -> the validated names


def check(
    obj: Any,
    name: str,
    *,
    dtype: str | tuple[str, ...],
    ndim: int | None = None,
    shape: Sequence[Dim] | None = None,
    shape_note: str = "",
    device: int | Literal["any"] | None = None,
    contiguous: bool = True,
) -> ArrayInfo:
    """Validate one array argument and return its :class:`ArrayInfo`; raise with a message that names it.

    Args:
        obj: the user's array.
        name: the argument name as the user wrote it (``"topk_idx"``); every message starts with it.
        dtype: one name from :data:`DTYPES`, or a tuple of accepted names.
        ndim: required number of dimensions (implied by `shape` when that is given).
        shape: one :data:`Dim` per dimension. ``shape=(("N", 128), "K"), shape_note="with N matching x"`` gives
            ``topk_idx must have shape [N=128, K] with N matching x, got [127, 8]``.
        shape_note: words appended to the shape description, saying where the sizes come from.
        device: a CUDA ordinal the array must live on (this rank's GPU); ``None``: any CUDA device; ``"any"``:
            no requirement (the CPU reference path, NumPy arrays).
        contiguous: require C-order contiguity (size-1 and size-0 dimensions judged as torch does).

    Raises:
        ArgumentTypeError: not an array, wrong dtype, wrong device (``TypeError``).
        ArgumentError: wrong rank or shape, not contiguous (``ValueError``).

    Checks run in this order: type, dtype, shape, device, contiguity.
    """
    try:
        wanted = _WANTED_DTYPES[dtype]
    except (KeyError, TypeError):  # not seen yet (or unhashable): validate the spec itself
        wanted = (dtype,) if isinstance(dtype, str) else tuple(dtype)
        unknown = [d for d in wanted if d not in DTYPES]
        if not wanted or unknown:
            raise ValueError(f"check(dtype=...) takes names from {DTYPES}, got {dtype!r}") from None
        if isinstance(dtype, (str, tuple)):
            _WANTED_DTYPES[dtype] = wanted
    if shape is not None and ndim is not None and ndim != len(shape):
        raise ValueError(f"check() got ndim={ndim} and a shape spec of {len(shape)} dimensions")

    info = describe(obj, name)

    if info.dtype not in wanted:
        raise ArgumentTypeError(with_rank(f"{name} must be {_fmt_dtypes(wanted)}, got {info.dtype}"))

    if shape is not None:
        sizes = [_dim_size(d) for d in shape]  # every entry, so that a bad spec always raises
        got = info.shape
        mismatch = len(sizes) != len(got)
        if not mismatch:
            for size, got_size in zip(sizes, got, strict=True):
                if size is not None and size != got_size:
                    mismatch = True
                    break
        if mismatch:
            desc = "[" + ", ".join(_fmt_dim(d) for d in shape) + "]"
            note = f" {shape_note}" if shape_note else ""
            raise ArgumentError(with_rank(f"{name} must have shape {desc}{note}, got {_fmt_shape(info.shape)}"))
    elif ndim is not None and info.ndim != ndim:
        raise ArgumentError(with_rank(f"{name} must be {ndim}-D, got {info.ndim}-D shape {_fmt_shape(info.shape)}"))

    if device != "any":
        kind, ordinal = info.device
        if kind != "cuda":
            noun = _NOUN.get(info.framework, "array")
            raise ArgumentTypeError(with_rank(f"{name} must be on a CUDA device, got a {noun} on {_location(info)}"))
        if device is not None and ordinal != device:
            raise ArgumentTypeError(with_rank(f"{name} is on cuda:{ordinal} but this rank's GPU is cuda:{device}"))

    if contiguous and not info.contiguous:
        raise ArgumentError(
            with_rank(
                f"{name} must be contiguous (strides {info.strides} for shape {info.shape})"
                + _contiguous_hint(info, name)
            )
        )
    return info


def check_same_framework(named_arrays: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> str | None:
    """Raise ArgumentTypeError if the arrays of one call come from different frameworks; return the framework.

    `named_arrays` maps argument names to arrays (or is a sequence of ``(name, array)`` pairs); ``None`` values
    (optional arguments not given) are skipped. Returns ``None`` when nothing was given. Outputs go back in the
    framework returned here, so a call mixing torch and JAX inputs would have no single answer.
    """
    items = named_arrays.items() if isinstance(named_arrays, Mapping) else named_arrays
    first: tuple[str, str] | None = None
    for name, obj in items:
        if obj is None:
            continue
        framework = _framework(obj, name)
        if first is None:
            first = (name, framework)
        elif framework != first[1]:
            raise ArgumentTypeError(
                with_rank(
                    f"{first[0]} is a {_NOUN[first[1]]} but {name} is a {_NOUN[framework]}; "
                    "pass every array of one call from the same framework"
                )
            )
    return None if first is None else first[1]


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


def kernel_arg(obj: Any, info: ArrayInfo, name: str) -> Any:
    """What a kernel launch takes for `obj`, which :func:`check` described as `info`: the device address of its
    first element (an ``int``) for torch tensors and CuPy arrays, read directly (no DLPack exchange, no view; FP8
    needs no reinterpreting either); a CuPy view (:func:`to_cupy`) for JAX arrays, whose DLPack export is what
    orders JAX's pending work before CuPy's current stream.

    Streams: a torch tensor's address comes with no synchronisation. ``to_cupy`` would have made CuPy's current
    stream wait for torch's current stream; epjit's Buffer makes them the same stream for torch callers, so that
    wait is a no-op there. Other callers must order the work that produces `obj` themselves. The address is valid
    while `obj` lives: keep `obj` referenced until the kernels that read it are queued.

    Raises ArgumentTypeError for arrays not on a CUDA device (NumPy arrays, CPU tensors).
    """
    framework = info.framework
    if info.device[0] != "cuda":
        _refuse_host_array(info, name)
    if framework == "torch":
        return obj.data_ptr()
    if framework == "cupy":
        return obj.data.ptr
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
