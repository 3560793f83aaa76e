"""Validation of one array argument (:func:`check`) and of one call's arrays together (:func:`check_same_framework`):
a bad input gets a ``TypeError`` or ``ValueError`` that names the argument, the values and the rank before any
kernel runs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from ..errors import ArgumentError, ArgumentTypeError, with_rank
from .meta import _NOUN, DTYPES, ArrayInfo, Dim, _framework, _location, describe

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
