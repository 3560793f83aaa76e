"""Load compiled cubins with CuPy and launch their kernels.

Loading is per device and cached in the process; NVSHMEM modules are handed to ``cumodule_init`` once after load,
before their first launch (NVSHMEM patches the module's device-side state there).

Launching sits on the path of every call, so it costs a few microseconds: each kernel gets, once, a parameter block
(one 8-byte slot per argument) and the array of pointers to those slots that ``cuLaunchKernel`` takes; a launch
packs all arguments (a :class:`~epjit.jit.spec.KernelArgs`, filled by name) into the block with one
``struct.pack_into`` and calls the driver. Arguments that call cannot pack (None, CuPy arrays, values of the wrong
type or range, an argument never set) take CuPy's launch path after :meth:`~epjit.jit.spec.KernelSpec.pack`, which
casts them or raises naming the argument.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
import time
from pathlib import Path
from typing import Any

from .compiler import CompiledModule, compile_spec, normalize_arch
from .config import JitConfig
from .errors import CompileError, ToolchainError
from .spec import ARG_SLOT_BYTES, KernelArgs, KernelSpec

log = logging.getLogger("epjit.jit")

_FAST_PACK_ERRORS = (struct.error, TypeError, ValueError, OverflowError)


class _Kernel:
    """One kernel's launch state: the CuPy kernel, and the parameter block the fast path packs into."""

    __slots__ = ("fn", "ptr", "packer", "block", "params", "params_ptr", "lock", "max_shared", "ex", "programmatic")

    def __init__(self, fn: Any, packer: struct.Struct | None, num_args: int, programmatic: bool) -> None:
        self.fn = fn  # a cupy.RawKernel
        self.ptr = int(fn.kernel.ptr)  # its CUfunction on the current device (the module's: see load())
        self.packer = packer  # None: a C type the fast path does not know; every launch takes pack()'s path
        self.block = ctypes.create_string_buffer(max(packer.size if packer is not None else 0, 1))
        base = ctypes.addressof(self.block)
        self.params = (ctypes.c_void_p * max(num_args, 1))(*(base + ARG_SLOT_BYTES * i for i in range(num_args)))
        self.params_ptr = ctypes.addressof(self.params)
        # The block is shared by every launch of this kernel: the lock keeps a second thread from repacking it
        # while the driver (which may run without the GIL) reads it. cuLaunchKernel copies the values.
        self.lock = threading.Lock()
        self.max_shared = 48 * 1024  # dynamic shared memory allowed without raising the function's limit
        self.ex: tuple[Any, Any] | None = None  # (CUfunction, CUlaunchConfig) of programmatic launches, made once
        self.programmatic = programmatic  # launched with programmatic stream serialization (KernelSpec.PROGRAMMATIC)


def _programmatic_config() -> Any:
    """A CUlaunchConfig carrying the programmatic-stream-serialization attribute (PDL): the kernel may begin while
    its predecessor on the stream runs, and waits for it with griddepcontrol.wait (cuda_src/ptx.cuh)."""
    from cuda.bindings import driver

    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.attrs = [attr]
    config.numAttrs = 1
    return config


class _StreamAddress:
    """A stream's address under the CUDA stream protocol, which is what CuPy 14 takes a foreign stream through."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def cupy_stream(ptr: int, device: int) -> Any:
    """CuPy's stream object for a stream another library made (torch's), at address ``ptr`` on ``device``.

    Address 0 is the legacy default stream, which is CuPy's null stream. CuPy 14 deprecates ``ExternalStream``
    (a DeprecationWarning on every new stream, an error under ``-W error``) for ``Stream.from_external``, whose
    objects CuPy never destroys (it skips the destroy for them); CuPy 13 has only ``ExternalStream``.
    """
    import cupy

    if ptr == 0:
        return cupy.cuda.Stream.null
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(ptr, device)
    # The stream's device is the current one (CuPy records it as unknown, -1, or reads the current device).
    return from_external(_StreamAddress(ptr))


_loaded: dict[tuple[Path, int], Module] = {}


def device_arch(device: int | None = None, override: str | None = None) -> str:
    """``sm_XY`` of the given (default: current) CUDA device, or ``override`` when given."""
    if override:
        return normalize_arch(override)
    import cupy

    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    return normalize_arch(dev.compute_capability)


class Module:
    """One loaded cubin on one device: its kernels by template name, launched with packed arguments."""

    def __init__(self, compiled: CompiledModule, device: int) -> None:
        import cupy

        self.compiled = compiled
        self.spec = compiled.spec
        self.device = device
        try:
            self.raw = cupy.RawModule(path=str(compiled.cubin_path))
            self._functions = {k: self.raw.get_function(name) for k, name in compiled.lowered_names.items()}
        except cupy.cuda.driver.CUDADriverError as e:
            raise CompileError(f"cannot load {compiled.cubin_path} on cuda:{device}: {e}") from e
        from cupy_backends.cuda.api import driver

        self._launch_kernel = driver.launchKernel
        self._current_stream = cupy.cuda.get_current_stream
        self._kernels = {k: _Kernel(fn, self._arg_format(k), len(self.spec.KERNELS[k]), k in self.spec.PROGRAMMATIC)
                         for k, fn in self._functions.items()}
        self._nvshmem_initialised = False
        if self.spec.USES_NVSHMEM:
            self._init_nvshmem()

    def _arg_format(self, kernel: str) -> struct.Struct | None:
        try:
            return self.spec.arg_format(kernel)
        except TypeError:  # pack() raises it, naming the argument, when the kernel is launched
            return None

    def _init_nvshmem(self) -> None:
        nvshmem_module_init(self.raw, self.spec.family, "is NVSHMEM initialised in this process?")
        self._nvshmem_initialised = True

    def launch(self, args: KernelArgs, grid: int | tuple[int, ...], block: int | tuple[int, ...], *,
               shared_mem: int = 0, stream: Any = None) -> None:
        """Launch ``args.kernel`` with ``args`` on ``stream`` (a CuPy stream, a raw stream address, or None: CuPy's
        current stream). Arguments: ints (addresses for pointer parameters), floats, bools, None (a null pointer)
        or CuPy arrays (their address); a torch tensor is not an argument (pass ``data_ptr()``). A grid or block
        size below 1 is launched as 1, as CuPy does.

        A kernel of the spec's PROGRAMMATIC set launches with programmatic stream serialization (cuLaunchKernelEx):
        it may start before the previous kernel on the stream has ended, and calls griddepcontrol_wait() before it
        touches anything that kernel writes. Arguments only CuPy's path packs launch the plain way (still correct:
        the wait is then a no-op)."""
        k = self._kernels.get(args.kernel)
        if k is None or (args.spec is not self.spec and args.spec != self.spec):
            raise KeyError(f"{self.spec.family} cannot launch {args.kernel!r} of {args.spec.family}; it has "
                           f"{sorted(self._functions)}")
        if shared_mem > k.max_shared:
            k.fn.max_dynamic_shared_size_bytes = shared_mem
            k.max_shared = shared_mem
        if type(grid) is int and type(block) is int:
            gx, gy, gz, bx, by, bz = grid if grid > 1 else 1, 1, 1, block if block > 1 else 1, 1, 1
        else:
            g = (grid if isinstance(grid, tuple) else (int(grid),)) + (1, 1)
            b = (block if isinstance(block, tuple) else (int(block),)) + (1, 1)
            gx, gy, gz = max(1, g[0]), max(1, g[1]), max(1, g[2])
            bx, by, bz = max(1, b[0]), max(1, b[1]), max(1, b[2])
        if type(stream) is int:
            stream_ptr = stream
        else:
            stream_ptr = (stream if stream is not None else self._current_stream()).ptr
        packer = k.packer
        if packer is not None:
            with k.lock:
                try:
                    packer.pack_into(k.block, 0, *args.values)
                except _FAST_PACK_ERRORS:
                    pass  # something only pack() converts (or reports): CuPy's path below
                else:
                    try:
                        if k.programmatic:
                            self._launch_programmatic(k, gx, gy, gz, bx, by, bz, shared_mem, stream_ptr)
                        else:
                            self._launch_kernel(k.ptr, gx, gy, gz, bx, by, bz, shared_mem, stream_ptr,
                                                k.params_ptr, 0)
                        return
                    except Exception:  # noqa: BLE001 - e.g. no current context on this thread: CuPy's path sets
                        pass  # one up, and raises the error again if it is real (a failed launch queued nothing)
        packed = self.spec.pack(args.kernel, args.values)
        if type(stream) is int:
            stream = cupy_stream(stream, self.device)
        k.fn((gx, gy, gz), (bx, by, bz), packed, shared_mem=shared_mem, stream=stream)

    @staticmethod
    def _launch_programmatic(k: _Kernel, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared_mem: int,
                             stream_ptr: int) -> None:
        from cuda.bindings import driver

        if k.ex is None:
            k.ex = (driver.CUfunction(k.ptr), _programmatic_config())
        fn, config = k.ex
        config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
        config.blockDimX, config.blockDimY, config.blockDimZ = bx, by, bz
        config.sharedMemBytes = shared_mem
        config.hStream = driver.CUstream(stream_ptr)
        (err,) = driver.cuLaunchKernelEx(config, fn, k.params_ptr, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernelEx: {err.name}")

    def close(self) -> None:
        if self._nvshmem_initialised:
            nvshmem_module_finalize(self.raw)
            self._nvshmem_initialised = False


def nvshmem_module_init(raw: Any, what: str, hint: str) -> None:
    """Hand a loaded module (a cupy.RawModule) that calls NVSHMEM to nvshmemx_cumodule_init; ToolchainError naming
    ``what`` (and ``hint``: what the caller should check) if nvshmem4py is missing or the init fails."""
    try:
        from nvshmem import bindings as nvshmem_bindings
    except ImportError as e:
        raise ToolchainError(f"{what} calls NVSHMEM but nvshmem4py is missing: pip install 'epjit[cuda13]' "
                             f"({e})") from None
    status = nvshmem_bindings.cumodule_init(int(raw.module.ptr))
    if status not in (None, 0):
        raise ToolchainError(f"nvshmemx_cumodule_init failed ({status}) for {what}: {hint}")


def nvshmem_module_finalize(raw: Any) -> None:
    """The end of nvshmem_module_init's hand-over (before NVSHMEM's own end)."""
    from nvshmem import bindings as nvshmem_bindings

    # nvshmem.core.module_finalize raises AttributeError in nvshmem4py 0.4.1; the binding works.
    nvshmem_bindings.cumodule_finalize(int(raw.module.ptr))


def load(spec: KernelSpec, config: JitConfig, device: int | None = None) -> Module:
    """Compile (or take from the disk cache) and load ``spec`` on ``device`` (default: current); cached per process."""
    import cupy

    device = cupy.cuda.runtime.getDevice() if device is None else device
    compiled = compile_spec(spec, device_arch(device, config.arch), config)
    key = (compiled.cubin_path, device)
    module = _loaded.get(key)
    if module is None:
        start = time.perf_counter()
        with cupy.cuda.Device(device):
            module = Module(compiled, device)
        _loaded[key] = module
        log.debug("loaded %s on cuda:%d in %.3f s (compiled %s)", spec.family, device,
                  time.perf_counter() - start, "earlier" if compiled.from_cache else "now")
    return module


def unload_all() -> None:
    """Finalise NVSHMEM modules (before nvshmem finalize) and forget every loaded module."""
    for module in _loaded.values():
        module.close()
    _loaded.clear()
