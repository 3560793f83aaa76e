"""Typed compile-time specs: one frozen dataclass per kernel family.

A spec's fields are the kernel templates' parameters in declaration order (``num_nvl_ranks`` <-> ``kNumNvlRanks``),
so the instantiation string is rendered from the spec, never glued by hand. Each kernel's runtime arguments are
declared by name with their exact C types (``tests/test_jit.py`` holds names, order and types against the ``.cu``
signature), and call sites give them by name through :class:`KernelArgs`: two arguments of one type cannot be
swapped at a call site, and a parameter renamed or moved in the ``.cu`` fails the test. :meth:`KernelSpec.pack`
casts every Python scalar to its C type: CuPy passes a bare ``int`` as int64, which into an ``int`` parameter
silently shifts every later argument. :meth:`KernelSpec.arg_format` gives the same types as one ``struct`` format,
which the launcher's fast path packs every argument with in a single call.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from pathlib import PurePath
from typing import Any, ClassVar, TypeVar

import numpy as np

# C scalar type -> NumPy scalar type CuPy passes by value with the same size.
SCALAR_TYPES: dict[str, type] = {
    "int": np.int32,
    "int32_t": np.int32,
    "unsigned": np.uint32,
    "uint32_t": np.uint32,
    "int64_t": np.int64,
    "long long": np.int64,
    "uint64_t": np.uint64,
    "float": np.float32,
    "double": np.float64,
    "bool": np.bool_,
}


# C scalar type -> struct code of the same size ("=" formats: standard sizes, no implicit alignment). Pointers
# travel as addresses ("Q").
STRUCT_CODES: dict[str, str] = {
    "int": "i",
    "int32_t": "i",
    "unsigned": "I",
    "uint32_t": "I",
    "int64_t": "q",
    "long long": "q",
    "uint64_t": "Q",
    "float": "f",
    "double": "d",
    "bool": "?",
}
ARG_SLOT_BYTES = 8  # arg_format gives every argument its own 8-byte slot: argument i is at byte 8 * i


def camel_param(field_name: str) -> str:
    """``num_nvl_ranks`` -> ``kNumNvlRanks``: how a spec field is named as a template parameter."""
    return "k" + "".join(part[:1].upper() + part[1:] for part in field_name.split("_"))


def render_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    raise TypeError(f"template argument {value!r} is not a bool or int")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Base of every kernel family's spec. Subclasses are frozen dataclasses and set the class variables."""

    SOURCE: ClassVar[str]  # file in cuda_src/ holding the templates
    # A build variant of SOURCE: macros defined for the whole compile (``-DNAME``, which the source tests with
    # ``defined(NAME)``), and the name the build goes by in cache files and logs (default: SOURCE's stem). The
    # variant is the spec's to choose, so one source file serves every build of a family and the cache key sees the
    # defines among the options.
    DEFINES: ClassVar[tuple[str, ...]] = ()
    BUILD: ClassVar[str] = ""
    # kernel template name -> ((argument name, C type), ...) in signature order
    KERNELS: ClassVar[dict[str, tuple[tuple[str, str], ...]]]
    USES_NVSHMEM: ClassVar[bool] = False
    # Kernels launched with programmatic stream serialization (PDL): each may start before the kernel ahead of it on
    # the stream ends, so its source calls griddepcontrol_wait() before it reads what that kernel wrote.
    PROGRAMMATIC: ClassVar[frozenset[str]] = frozenset()
    NAMESPACE: ClassVar[str] = "epjit"

    @property
    def family(self) -> str:
        """Readable module name for cache files and logs: ``barrier.num_nvl_ranks=4``."""
        params = ",".join(f"{f.name}={render_value(getattr(self, f.name))}" for f in dataclasses.fields(self))
        stem = self.BUILD or PurePath(self.SOURCE).stem
        return f"{stem}.{params}" if params else stem

    def template_args(self) -> str:
        return ", ".join(render_value(getattr(self, f.name)) for f in dataclasses.fields(self))

    def name_expression(self, kernel: str) -> str:
        if kernel not in self.KERNELS:
            raise KeyError(f"{type(self).__name__} has no kernel {kernel!r}; it has {sorted(self.KERNELS)}")
        args = self.template_args()
        return f"{self.NAMESPACE}::{kernel}<{args}>" if dataclasses.fields(self) else f"{self.NAMESPACE}::{kernel}"

    def name_expressions(self) -> dict[str, str]:
        return {kernel: self.name_expression(kernel) for kernel in self.KERNELS}

    def arg_format(self, kernel: str) -> struct.Struct:
        """The kernel's arguments as one ``struct`` layout, each in its own 8-byte slot at byte ``8 * i`` (the
        launcher passes the driver a pointer to each slot). Packing with it checks what :meth:`pack` checks for
        ints and addresses (an integer that fits the C type); anything it refuses (None, a CuPy array, a float for
        an int, an overflow) raises ``struct.error``, and the launcher then takes :meth:`pack`'s path, whose
        errors name the argument."""
        return _arg_format(type(self), kernel)

    def pack(self, kernel: str, args: tuple[Any, ...] | list[Any]) -> tuple[Any, ...]:
        """Cast each argument to the exact C type of the kernel's parameter (arrays pass as pointers)."""
        converters = _converters(type(self), kernel)
        if len(args) != len(converters):
            names = ", ".join(n for n, _ in self.KERNELS[kernel])
            raise TypeError(f"{kernel} takes {len(converters)} arguments ({names}), got {len(args)}")
        missing = [name for (name, _), value in zip(self.KERNELS[kernel], args, strict=True) if value is MISSING]
        if missing:
            raise TypeError(f"{kernel}: no value given for {', '.join(missing)}")
        return tuple(convert(value) for convert, value in zip(converters, args, strict=True))

    def args(self, kernel: str, **named: Any) -> KernelArgs:
        """The arguments of one launch of ``kernel``, by parameter name (the rest set later with
        :meth:`KernelArgs.set`; a launch with one still unset raises, naming it)."""
        if kernel not in self.KERNELS:
            raise KeyError(f"{type(self).__name__} has no kernel {kernel!r}; it has {sorted(self.KERNELS)}")
        return KernelArgs(self, kernel, [MISSING] * len(self.KERNELS[kernel])).set(**named)


S = TypeVar("S", bound=KernelSpec)


def build_with(spec: type[S], define: str, name: str, module: str, **class_vars: Any) -> type[S]:
    """``spec``'s kernels built again with the macro ``define`` as well (a build of its own: the source tests
    ``defined(define)``, and the builds without it stay the code they were). A frozen dataclass of the same fields,
    named ``spec``'s name with ``name`` before its "Spec" (``IntranodeSpec``, "Shrink": ``IntranodeShrinkSpec``),
    its BUILD ``spec``'s with ``_<name in snake case>`` (``intranode_shrink``); ``class_vars`` set others (KERNELS).
    ``module`` is where it is assigned to that name: a spec is pickled by its class's module and name."""
    stem = spec.BUILD or PurePath(spec.SOURCE).stem
    class_name = spec.__name__.removesuffix("Spec") + name + "Spec"
    namespace = {"__module__": module, "__qualname__": class_name,
                 "__doc__": f"{spec.__name__}'s kernels built with {define} as well.",
                 "DEFINES": (*spec.DEFINES, define), "BUILD": f"{stem}_{re.sub(r'(?<!^)(?=[A-Z])', '_', name).lower()}",
                 **class_vars}
    return dataclasses.dataclass(frozen=True)(type(class_name, (spec,), namespace))


def same_fields(spec: KernelSpec, build: type[S]) -> S:
    """``spec``'s fields in ``build``, another build of its kernels (:func:`build_with`)."""
    return build(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()  # an argument no one has set (packs as nothing: the launch raises, naming it)


class KernelArgs:
    """One kernel's arguments by parameter name, held in signature order for the launcher. A plan keeps one with
    the arguments that do not change from call to call already set, and each call sets the rest by name."""

    __slots__ = ("spec", "kernel", "values", "_index")

    def __init__(self, spec: KernelSpec, kernel: str, values: list[Any]) -> None:
        self.spec = spec
        self.kernel = kernel
        self.values = values
        self._index = _param_index(type(spec), kernel)

    def set(self, **named: Any) -> KernelArgs:
        index, values = self._index, self.values
        try:
            for name, value in named.items():
                values[index[name]] = value
        except KeyError as e:
            raise TypeError(f"{self.kernel} has no parameter {e.args[0]!r}; it has {', '.join(index)}") from None
        return self

    def on(self, spec: KernelSpec) -> KernelArgs:
        """These arguments, the same list, for another build of the same kernels (build_with), whose module
        launches only arguments of its own spec."""
        return KernelArgs(spec, self.kernel, self.values)

    def copy(self) -> KernelArgs:
        """An independent copy (for a launch that happens later, e.g. a receive hook)."""
        return KernelArgs(self.spec, self.kernel, list(self.values))

    def __getitem__(self, name: str) -> Any:
        return self.values[self._index[name]]

    def __repr__(self) -> str:
        pairs = ", ".join(f"{n}={v!r}" for n, v in zip(self._index, self.values, strict=True))
        return f"{self.kernel}({pairs})"


_CONVERTERS: dict[tuple[type, str], list[Any]] = {}
_ARG_FORMATS: dict[tuple[type, str], struct.Struct] = {}
_PARAM_INDEX: dict[tuple[type, str], dict[str, int]] = {}


def _param_index(spec_type: type, kernel: str) -> dict[str, int]:
    """Parameter name -> position in the kernel's signature, built once per (spec class, kernel)."""
    key = (spec_type, kernel)
    found = _PARAM_INDEX.get(key)
    if found is None:
        found = _PARAM_INDEX[key] = {name: i for i, (name, _) in enumerate(spec_type.KERNELS[kernel])}
    return found


def _arg_format(spec_type: type, kernel: str) -> struct.Struct:
    key = (spec_type, kernel)
    found = _ARG_FORMATS.get(key)
    if found is None:
        codes = []
        for name, ctype in spec_type.KERNELS[kernel]:
            code = "Q" if ctype.endswith("*") else STRUCT_CODES.get(ctype)
            if code is None:
                raise TypeError(f"{kernel}: argument {name} has C type {ctype!r}, which the packer does not know")
            pad = ARG_SLOT_BYTES - struct.calcsize("=" + code)
            codes.append(code + (f"{pad}x" if pad else ""))
        found = _ARG_FORMATS[key] = struct.Struct("=" + "".join(codes))
    return found


def _converters(spec_type: type, kernel: str) -> list[Any]:
    """One converter per parameter, built once per (spec class, kernel): packing sits on every launch's path."""
    key = (spec_type, kernel)
    found = _CONVERTERS.get(key)
    if found is None:
        found = [_converter(kernel, name, ctype) for name, ctype in spec_type.KERNELS[kernel]]
        _CONVERTERS[key] = found
    return found


def _converter(kernel: str, name: str, ctype: str) -> Any:
    def convert(value: Any) -> Any:
        return _pack_one(kernel, name, ctype, value)

    if ctype.endswith("*"):
        null = np.uint64(0)

        def convert_ptr(value: Any) -> Any:
            if value is None:
                return null
            if type(value).__name__ == "ndarray" and hasattr(value, "data"):  # cupy.ndarray: passed as its pointer
                return value
            return _pack_one(kernel, name, ctype, value)

        return convert_ptr
    scalar = SCALAR_TYPES.get(ctype)
    if scalar is None or not np.issubdtype(scalar, np.integer):
        return convert
    info = np.iinfo(scalar)
    lo, hi = int(info.min), int(info.max)

    def convert_int(value: Any) -> Any:
        if type(value) is int and lo <= value <= hi:  # the common case, without the checks' cost
            return scalar(value)
        return _pack_one(kernel, name, ctype, value)

    return convert_int


def _pack_one(kernel: str, name: str, ctype: str, value: Any) -> Any:
    if ctype.endswith("*"):
        if value is None:
            return np.uint64(0)
        if isinstance(value, (int, np.integer)):
            return np.uint64(int(value))
        if hasattr(value, "data") and hasattr(value.data, "ptr"):  # cupy.ndarray: CuPy passes its pointer
            return value
        raise TypeError(f"{kernel}: argument {name} ({ctype}) must be a device array, an address or None, "
                        f"got {type(value).__name__}")
    scalar = SCALAR_TYPES.get(ctype)
    if scalar is None:
        raise TypeError(f"{kernel}: argument {name} has C type {ctype!r}, which the packer does not know")
    if scalar is np.bool_:
        return np.bool_(bool(value))
    if np.issubdtype(scalar, np.integer):
        info = np.iinfo(scalar)
        if not isinstance(value, (int, np.integer, bool, np.bool_)):
            raise TypeError(f"{kernel}: argument {name} ({ctype}) must be an integer, got {type(value).__name__}")
        if not info.min <= int(value) <= info.max:
            raise OverflowError(f"{kernel}: argument {name}={value} does not fit in {ctype}")
        return scalar(int(value))
    return scalar(value)
