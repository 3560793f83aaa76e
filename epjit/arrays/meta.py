"""Reading an array's metadata without touching its data or importing its framework: :func:`describe` (for
validation and messages), :func:`fingerprint` (for a plan's key, fast) and :func:`address` (what a kernel takes).

Frameworks are never imported to *inspect* an object: the object's type names its module, and that module is
already in ``sys.modules`` if the object exists.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError, with_rank

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


def _location(info: ArrayInfo) -> str:
    kind, ordinal = info.device
    return "the CPU" if kind == "cpu" else f"the {kind}:{ordinal} device"


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
    """The device address of the first element of a kernel array (0 for None): a torch tensor, or a CuPy array (a
    JAX array's view, :func:`~epjit.arrays.dlpack.kernel_array`). Every array reaches a kernel through here, the
    arrays a call was given and the outputs it allocated alike: the array is the handle that carries its own
    address and framework, and no (array, address) pairs travel. Plain tensors and CuPy arrays, the cached calls',
    are told apart by their exact type; a subclass (torch.nn.Parameter) by its methods."""
    if obj is None:
        return 0
    cls = type(obj)
    if cls is _TORCH_TENSOR:
        return obj.data_ptr()
    if cls is _CUPY_NDARRAY:
        return obj.data.ptr
    data_ptr = getattr(obj, "data_ptr", None)
    return data_ptr() if data_ptr is not None else obj.data.ptr
