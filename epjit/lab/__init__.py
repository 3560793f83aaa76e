"""Your own kernels on epjit's runtime: compile CUDA C++ with epjit's device headers, launch by parameter name.

    import epjit.lab
    module = epjit.lab.compile(r'''
    #include "ptx.cuh"
    extern "C" __global__ void fill(int* out, int value) { out[threadIdx.x] = value; }
    ''', arch="sm_90")            # compile only: no GPU needed
    module.fill(grid=1, block=32, out=array, value=7)   # loads onto the GPU at the first launch

The kernels are the source's ``extern "C" __global__`` functions; their parameters, C types and lines come from the
source itself, and every launch checks its arguments against them (a name unknown or missing, a float for a
pointer, a pointer for an int) before anything runs, naming the kernel, the parameter and the line. docs/lab.md
has the rules (what a kernel may include, how it waits).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .. import jit, memory
from ..errors import ArgumentError, ArgumentTypeError, CompileError, SetupError, check_int, with_rank
from ..group import Group
from ..jit.module import cupy_stream, nvshmem_module_finalize, nvshmem_module_init
from ..jit.program import CompiledProgram, Program, compile_program
from ..jit.signature import KernelSignature, Parameter, SignatureError, parse_kernels
from ..kernels import BarrierSpec, jit_config
from ..ops.loader import load
from .variants import Variant, combine_problems, dispatch_problems, make_variant, use_variant

__all__ = ["Kernel", "Module", "Peers", "Variant", "combine_problems", "compile", "dispatch_problems", "use_variant",
           "variant"]

# struct code of a C type (epjit.jit.signature.SCALARS) -> the NumPy scalar CuPy passes with the same size
_NUMPY = {"?": np.bool_, "b": np.int8, "B": np.uint8, "h": np.int16, "H": np.uint16, "i": np.int32,
          "I": np.uint32, "q": np.int64, "Q": np.uint64, "f": np.float32, "d": np.float64}
# Keyword arguments of a launch itself: a kernel parameter of one of these names is given through args={...}.
LAUNCH_KEYWORDS = ("grid", "block", "shared_mem", "stream", "args")


def compile(source: str | os.PathLike[str], *, name: str | None = None,
            defines: Mapping[str, object] | Iterable[str] | None = None, arch: str | int | None = None,
            nvshmem: bool = False) -> Module:
    """Compile ``source`` (CUDA C++ text, or the path of a ``.cu`` file) with epjit's device headers on the include
    path; its ``extern "C" __global__`` functions become the module's kernels.

    defines: ``{"NAME": value}`` (True: defined without a value, False or None: not defined) or a list of
    ``"NAME"`` and ``"NAME=VALUE"``; arch: e.g.
    ``"sm_90"`` to compile without a GPU (default: ``EPJIT_ARCH``, else the current GPU's); nvshmem: link NVSHMEM's
    device library (its kernels run on a Buffer's symmetric heap). Compiled cubins are kept in epjit's cache, keyed
    by the source, the defines, the arch, the headers' contents and the compiler's version: compiling an unchanged
    source again is a hit. Raises CompileError with NVRTC's log and the source's own lines."""
    text, program_name, include_dirs = _read_source(source)
    config = jit_config()
    try:
        kernels = parse_kernels(text, program_name)
        stem = name or (Path(program_name).stem if include_dirs else next(iter(kernels), "source"))
        program = Program(text, program_name, "lab." + re.sub(r"[^\w.-]", "_", stem), _defines(defines),
                          include_dirs, bool(nvshmem))
        compiled = compile_program(program, _arch(arch, config), config)
    except (jit.CompileError, SignatureError) as e:
        raise CompileError(with_rank(str(e))) from e
    except jit.JitError as e:
        raise SetupError(with_rank(str(e))) from e
    return Module(compiled, config)


def variant(family: str, *, source: str | os.PathLike[str] | None = None, replace: Mapping[str, str] | None = None,
            defines: Mapping[str, object] | Iterable[str] | None = None, name: str | None = None,
            arch: str | int | None = None) -> Variant:
    """A variant of a built-in family's kernels (``"low_latency"``): its source (or ``source``, an edited copy: text
    or a ``.cu`` path) with each ``replace`` text replaced (every occurrence; a text that does not occur is refused,
    naming it) and compiled with ``defines`` beyond the build's own, for ``arch`` (as :func:`compile`'s) now, so a
    compile error shows here. Its kernels must take the built-in's arguments (names, order, C types), checked before
    the compile. Run it on a Buffer with :func:`use_variant`, beside the built-in with epjit.bench.variant.compare;
    ``name`` names it in cache files and messages."""
    config = jit_config()
    made = make_variant(family, None if source is None else _read_source(source), replace or {}, _defines(defines),
                        name, _arch(arch, config))
    made.compiled()
    return made


def _read_source(source: str | os.PathLike[str]) -> tuple[str, str, tuple[Path, ...]]:
    """(text, the name NVRTC's log gives it, the folders its own includes are searched in first)."""
    is_path = isinstance(source, os.PathLike) or (
        isinstance(source, str) and "\n" not in source and source.strip().endswith((".cu", ".cuh")))
    if not is_path:
        if not isinstance(source, str):
            raise ArgumentTypeError(with_rank(f"source must be CUDA C++ text or the path of a .cu file, got "
                                              f"{type(source).__name__}"))
        return source, "<source>", ()
    path = Path(os.fspath(source)).expanduser()
    if not path.is_file():
        raise ArgumentError(with_rank(f"source {str(path)!r} is not a file"))
    return path.read_text(), str(path), (path.resolve().parent,)


def _defines(defines: Mapping[str, object] | Iterable[str] | None) -> tuple[str, ...]:
    if defines is None:
        return ()
    if isinstance(defines, str):
        raise ArgumentTypeError(with_rank(f"defines must be a mapping or a list of names, got the text {defines!r}"))
    pairs = defines.items() if isinstance(defines, Mapping) else (
        tuple(d.split("=", 1)) if isinstance(d, str) and "=" in d else (d, True) for d in defines)
    out = []
    for key, value in sorted(pairs, key=lambda kv: str(kv[0])):
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_]\w*", key):
            raise ArgumentError(with_rank(f"define {key!r} is not a C identifier"))
        if value is True:
            out.append(key)
        elif value is not None and value is not False:
            out.append(f"{key}={value}")
    return tuple(out)


def _arch(arch: str | int | None, config: jit.JitConfig) -> str:
    if arch is not None or config.arch:
        try:
            return jit.normalize_arch(arch if arch is not None else config.arch)  # type: ignore[arg-type]
        except ValueError as e:
            raise ArgumentError(with_rank(str(e))) from None
    try:
        return jit.device_arch()
    except Exception as e:  # noqa: BLE001 - no CuPy, no driver or no GPU: each means "say the arch"
        raise SetupError(with_rank(f"no GPU to compile for ({type(e).__name__}: {e}): pass arch='sm_90' to "
                                   "compile only")) from None


class Module:
    """A compiled source: its kernels by name (``module.kernels``, or as attributes), loaded onto a GPU at their
    first launch. ``cubin_path``, ``arch`` and ``from_cache`` say what was built."""

    def __init__(self, compiled: CompiledProgram, config: jit.JitConfig) -> None:
        self.compiled = compiled
        self.source = compiled.program.name
        self.arch = compiled.arch
        self.cubin_path = compiled.cubin_path
        self.from_cache = compiled.from_cache
        self.kernels = {name: Kernel(self, sig) for name, sig in compiled.kernels.items()}
        self._config = config
        self._loaded: dict[int, tuple[Any, dict[str, Any]]] = {}  # device -> (cupy.RawModule, kernel -> function)

    def launch(self, kernel: str, grid: int | tuple[int, ...], block: int | tuple[int, ...], *, shared_mem: int = 0,
               stream: Any = None, args: Mapping[str, Any] | None = None, **named: Any) -> None:
        """Launch ``kernel`` by name; the same as ``module.<kernel>(grid=..., block=..., ...)``."""
        found = self.kernels.get(kernel)
        if found is None:
            raise ArgumentError(with_rank(f"{self.source} has no kernel {kernel!r}; it has {sorted(self.kernels)}"))
        found(grid, block, shared_mem=shared_mem, stream=stream, args=args, **named)

    def __getattr__(self, name: str) -> Kernel:
        kernels = self.__dict__.get("kernels", {})
        if name in kernels:
            return kernels[name]
        raise AttributeError(f"{self.__dict__.get('source', 'module')} has no kernel {name!r}; it has "
                             f"{sorted(kernels)}")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.kernels))

    def __repr__(self) -> str:
        return f"<epjit.lab.Module {self.source} for {self.arch}: {', '.join(self.kernels) or 'no kernels'}>"

    def function(self, kernel: str) -> Any:
        """The CuPy kernel of ``kernel`` on the current GPU, loaded now if it is the first time (compiled again
        first where the GPU is not of the arch the module was compiled for)."""
        import cupy

        device = cupy.cuda.runtime.getDevice()
        loaded = self._loaded.get(device)
        if loaded is None:
            compiled = self.compiled
            try:
                arch = jit.device_arch(device)
                if arch != compiled.arch:
                    compiled = compile_program(compiled.program, arch, self._config)
                raw = cupy.RawModule(path=str(compiled.cubin_path))
                functions = {name: raw.get_function(name) for name in self.kernels}
            except jit.JitError as e:
                raise CompileError(with_rank(str(e))) from e
            except cupy.cuda.driver.CUDADriverError as e:
                raise CompileError(with_rank(f"cannot load {compiled.cubin_path} on cuda:{device}: {e}")) from e
            if compiled.program.uses_nvshmem:
                self._init_nvshmem(raw)
            loaded = self._loaded[device] = (raw, functions)
        return loaded[1][kernel]

    def _init_nvshmem(self, raw: Any) -> None:
        try:
            nvshmem_module_init(raw, self.source, "make a Buffer with a symmetric heap (num_rdma_bytes) first, "
                                "which starts NVSHMEM")
        except jit.ToolchainError as e:
            raise SetupError(with_rank(str(e))) from None
        memory.before_nvshmem_finalize(self.close)

    def close(self) -> None:
        """Forget the loaded kernels (NVSHMEM modules are finalised, which must happen before NVSHMEM's end)."""
        if self.compiled.program.uses_nvshmem and self._loaded:
            for raw, _ in self._loaded.values():
                nvshmem_module_finalize(raw)
        self._loaded.clear()


class Kernel:
    """One kernel of a Module: ``kernel(grid, block, shared_mem=0, stream=None, **arguments)``. ``signature``
    holds its parameters, C types and lines; ``str(kernel)`` is its declaration."""

    def __init__(self, module: Module, signature: KernelSignature) -> None:
        self.module = module
        self.signature = signature
        self.name = signature.name
        self._by_name = {p.name: p for p in signature.parameters}

    def __repr__(self) -> str:
        return f"<kernel {self.signature} at {self.module.source}:{self.signature.line}>"

    def __call__(self, grid: int | tuple[int, ...], block: int | tuple[int, ...], *, shared_mem: int = 0,
                 stream: Any = None, args: Mapping[str, Any] | None = None, **named: Any) -> None:
        """Launch on ``stream`` (a CuPy or torch stream, a stream address, or None: CuPy's current stream) with the
        arguments by parameter name; a parameter named like a launch keyword (grid, block, ...) goes in ``args``."""
        values = self.arguments({**(args or {}), **named})
        dims = (_dims(grid, "grid", self.name), _dims(block, "block", self.name))
        function = self.module.function(self.name)
        if shared_mem > 48 * 1024:  # above the default, the function's limit must be raised first
            function.max_dynamic_shared_size_bytes = shared_mem
        function(*dims, values, shared_mem=shared_mem, stream=_stream(stream))

    def arguments(self, named: Mapping[str, Any]) -> tuple[Any, ...]:
        """The arguments of a launch, in signature order and in their exact C types (checked: see the module)."""
        unknown = [n for n in named if n not in self._by_name]
        if unknown:
            have = ", ".join(f"{p.name} ({self._at(p)})" for p in self.signature.parameters) or "none"
            raise ArgumentError(with_rank(f"{self.name} has no parameter {', '.join(map(repr, unknown))}; its "
                                          f"parameters: {have}"))
        missing = [p for p in self.signature.parameters if p.name not in named]
        if missing:
            raise ArgumentError(with_rank(f"{self.name}: no value for " + ", ".join(
                f"{p.name} ({p.ctype}, declared at {self._at(p)})" for p in missing)))
        return tuple(self._convert(p, named[p.name]) for p in self.signature.parameters)

    def _at(self, p: Parameter) -> str:
        return f"{self.module.source}:{p.line}"

    def _convert(self, p: Parameter, value: Any) -> Any:
        what = f"{self.name}: parameter {p.name} ({p.ctype}, declared at {self._at(p)})"
        if p.pointer:
            return np.uint64(_address(value, what))
        kind = type(value).__name__
        if p.code in "fd":
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ArgumentTypeError(with_rank(f"{what} must be a number, got {kind}"))
            return _NUMPY[p.code](value)
        if p.code == "?":
            if not isinstance(value, (bool, np.bool_)):
                raise ArgumentTypeError(with_rank(f"{what} must be True or False, got {kind} {value!r}"))
            return np.bool_(value)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ArgumentTypeError(with_rank(f"{what} must be an integer, got {kind}"))
        info = np.iinfo(_NUMPY[p.code])
        if not info.min <= int(value) <= info.max:
            raise ArgumentError(with_rank(f"{what}: {value} is outside [{info.min}, {info.max}]"))
        return _NUMPY[p.code](int(value))


def _address(value: Any, what: str) -> int:
    """The device address a pointer parameter gets: None (null), an int, or a device array (CuPy, torch, anything
    with ``__cuda_array_interface__``), whose first element's address is taken."""
    if value is None:
        return 0
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        if not 0 <= int(value) < 1 << 64:
            raise ArgumentError(with_rank(f"{what}: address {value} is not a 64-bit address"))
        return int(value)
    kind = type(value).__name__
    if type(value).__module__.startswith("torch"):
        if not getattr(value, "is_cuda", False):
            raise ArgumentTypeError(with_rank(f"{what} must be device memory, got a torch tensor on {value.device}"))
        return int(value.data_ptr())
    interface = getattr(value, "__cuda_array_interface__", None)
    if interface is not None:
        return int(interface["data"][0])
    if hasattr(value, "__array_interface__"):
        raise ArgumentTypeError(with_rank(f"{what} must be device memory, got host memory ({kind})"))
    raise ArgumentTypeError(with_rank(f"{what} must be a device array, an address or None, got {kind} {value!r}"))


def _dims(value: int | tuple[int, ...], name: str, kernel: str) -> tuple[int, int, int]:
    dims = (value,) if not isinstance(value, (tuple, list)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1
                                      for d in dims):
        raise ArgumentError(with_rank(f"{kernel}: {name} must be a positive int or up to 3 of them, got {value!r}"))
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))  # type: ignore[return-value]


def _stream(stream: Any) -> Any:
    if stream is None or hasattr(stream, "ptr"):  # CuPy's current stream, or a CuPy stream
        return stream
    import cupy

    ptr = stream if isinstance(stream, int) else getattr(stream, "cuda_stream", None)  # torch.cuda.Stream
    if not isinstance(ptr, int):
        raise ArgumentTypeError(with_rank(f"stream must be a CuPy or torch stream, an address or None, got "
                                          f"{type(stream).__name__}"))
    return cupy_stream(ptr, cupy.cuda.runtime.getDevice())


class Peers:
    """Peer memory of your own for kernels of your own, over a group's NVLink node: every rank's NVLink buffer of
    ``num_nvl_bytes`` payload (CUDA IPC), the device PeersTable that points a kernel at them (cuda_src/peers.cuh),
    and the wait record that turns a timed wait of that kernel which never ends into EpjitTimeoutError naming the
    rank and what it waited for. Collective: every rank of the group makes it, alike, and closes it.

    A kernel takes ``const epjit::PeersTable* peers`` and is given ``peers=p.table``; it finds nvl rank i's payload
    at ``epjit::nvl_ptr(peers, i, epjit::kNvlHeaderBytes)`` (the header's words are the barriers'). None of it is a
    Buffer's: the built-in kernels never touch it."""

    def __init__(self, group: Group, num_nvl_bytes: int, *, timeout_s: float | None = None) -> None:
        self.num_nvl_bytes = check_int(num_nvl_bytes, "num_nvl_bytes", 1)
        self.group = group
        if group.device is None:
            raise SetupError(with_rank("peer memory needs a GPU, and epjit.init() bound none on this rank"))
        # Loaded (compiled, the first time) before the collective set-up, which then lines the ranks up: a rank
        # compiling it at its first barrier would keep the others waiting in theirs, against the timeout.
        self._barrier = load(BarrierSpec(group.num_nvl_ranks), group.device)
        self._memory: memory.PeerMemory | None = memory.PeerMemory.create(group, self.num_nvl_bytes, 0, timeout_s)

    @property
    def table(self) -> int:
        """The device address of this rank's PeersTable: the argument of a ``const epjit::PeersTable*``."""
        return self._open().table_ptr

    def payload(self, nvl_rank: int | None = None) -> int:
        """The address of nvl rank ``nvl_rank``'s payload (default: this rank's) as mapped in this process."""
        return self._open().nvl_payload_ptr(nvl_rank)

    def barrier(self, stream: Any = None) -> None:
        """Launch epjit's NVLink barrier on ``stream``: every rank of the node launches it, no rank's kernels after
        it start before every rank's kernels before it are done and their writes visible (a timed wait too)."""
        args = self._barrier.spec.args("nvl_barrier", peers=self.table)
        self._barrier.launch(args, 1, 32, stream=_stream(stream))

    def synchronize(self, stream: Any = None) -> None:
        """Wait for ``stream`` (default: the whole GPU); a timed wait of a kernel that expired becomes
        EpjitTimeoutError naming the rank, the peer and the values (the CUDA context is lost then: restart)."""
        self._open().synchronize(_stream(stream))

    def close(self) -> None:
        """Collective: waits until no peer can still touch this rank's buffer, then unmaps and frees."""
        if self._memory is not None:
            self._memory.close()
            self._memory = None

    def __enter__(self) -> Peers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> memory.PeerMemory:
        if self._memory is None:
            raise SetupError(with_rank("these Peers are closed"))
        return self._memory
