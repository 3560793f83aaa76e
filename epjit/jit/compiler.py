"""NVRTC compile (+ nvJitLink for NVSHMEM modules) of one kernel spec into a cubin, through the disk cache.

The generated program is only ``#include "<family>.cu"``; a build variant's defines reach NVRTC as ``-D`` options,
the spec's template instantiations as name expressions, and NVRTC hands back their lowered (mangled) names, which
are stored beside the cubin.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import JitConfig
from .errors import CompileError
from .spec import KernelSpec
from .toolchain import nvshmem, toolchain

log = logging.getLogger("epjit.jit")

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class CompiledModule:
    spec: KernelSpec
    arch: str
    cubin_path: Path
    lowered_names: dict[str, str]  # kernel template name -> mangled symbol
    from_cache: bool
    seconds: float


def normalize_arch(arch: str | int) -> str:
    """``90``, ``"90"``, ``"sm_90"``, ``"sm90"`` -> ``"sm_90"``."""
    text = str(arch).strip().lower().removeprefix("sm_").removeprefix("sm").removeprefix("compute_")
    if not text.rstrip("a").isdigit():
        raise ValueError(f"arch {arch!r} is not of the form sm_90")
    return f"sm_{text}"


def included_files(source: Path, source_dir: Path, seen: set[Path] | None = None) -> list[Path]:
    """The file and every file of source_dir it includes, recursively (system headers are keyed by version)."""
    seen = set() if seen is None else seen
    if source in seen:
        return []
    seen.add(source)
    files = [source]
    for name in _INCLUDE.findall(source.read_text()):
        candidate = (source.parent / name).resolve()
        if not candidate.is_file():
            candidate = (source_dir / name).resolve()
        if candidate.is_file():
            files += included_files(candidate, source_dir, seen)
    return files


def compile_options(spec: KernelSpec, arch: str, config: JitConfig) -> list[str]:
    return program_options(arch, config, spec.DEFINES, spec.USES_NVSHMEM)


def program_options(arch: str, config: JitConfig, defines: tuple[str, ...] | list[str], uses_nvshmem: bool,
                    include_dirs: tuple[Path, ...] = ()) -> list[str]:
    """NVRTC's options for one program: ``include_dirs`` (a program's own folder) are searched before the sources'
    folder, ``defines`` (``NAME`` or ``NAME=VALUE``) reach it as ``-D``."""
    tc = toolchain()
    options = [f"-arch={arch}", "-std=c++17", "-default-device", "-lineinfo", "-DNDEBUG"]
    options += [f"-I{d}" for d in include_dirs] + [f"-I{config.source_dir}"]
    options += [f"-D{name}" for name in defines]
    options += [f"-I{d}" for d in tc.include_dirs]
    if uses_nvshmem:
        options += ["-rdc=true", f"-I{nvshmem().include_dir}"]
    return options


def cache_key(spec: KernelSpec, arch: str, options: list[str], config: JitConfig) -> str:
    h = hashlib.sha256()
    h.update(f"version {config.version}\n{type(spec).__name__} {spec!r}\n{arch}\n".encode())
    files = included_files(config.source_dir / spec.SOURCE, config.source_dir)
    return hash_toolchain_and_files(h, options, config, spec.USES_NVSHMEM, files)


def hash_toolchain_and_files(h: Any, options: list[str], config: JitConfig, uses_nvshmem: bool,
                             files: list[Path]) -> str:
    """The rest of a cache key after what names the program: compiler versions, options, settings that change
    code, and the contents of every file the program includes; its first 16 hex digits."""
    h.update(f"nvrtc {toolchain().nvrtc_version}\n".encode())
    if uses_nvshmem:
        h.update(f"nvshmem {nvshmem().version}\n".encode())
    # Options carry absolute include paths; the header contents are hashed instead, so a moved checkout hits.
    h.update(" ".join(o for o in options if not o.startswith("-I")).encode())
    h.update(json.dumps(sorted(config.key_extra)).encode())
    for path in sorted(files):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_paths(spec: KernelSpec, arch: str, key: str, config: JitConfig) -> tuple[Path, Path]:
    folder = config.cache_dir / config.version / arch
    stem = f"{spec.family}.{key}"
    return folder / f"{stem}.cubin", folder / f"{stem}.json"


def _atomic_write(path: Path, data: bytes) -> None:
    # Many ranks may build the same entry at once: each writes its own temp file and renames it into place,
    # so a reader sees either nothing or a whole file.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # a shared cache: other users of the machine may read it
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_entry(cubin_path: Path, meta_path: Path, cubin: bytes, meta: dict) -> None:
    # Metadata first, cubin last: a cubin on disk means its metadata is already there.
    _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    _atomic_write(cubin_path, cubin)


def _read_cached(cubin: Path, meta: Path, spec: KernelSpec) -> dict[str, str] | None:
    if not (cubin.is_file() and meta.is_file()):
        return None
    try:
        names = json.loads(meta.read_text())["lowered_names"]
    except (ValueError, KeyError, OSError):
        log.warning("corrupt cache entry %s: rebuilding", meta)
        return None
    if set(names) != set(spec.KERNELS) or cubin.stat().st_size == 0:
        log.warning("stale cache entry %s: rebuilding", meta)
        return None
    return names


def compile_spec(spec: KernelSpec, arch: str, config: JitConfig, *, force: bool = False) -> CompiledModule:
    """The cubin of ``spec`` for ``arch``: from the cache when present, else compiled (and linked) now."""
    arch = normalize_arch(arch)
    start = time.perf_counter()
    options = compile_options(spec, arch, config)
    key = cache_key(spec, arch, options, config)
    cubin_path, meta_path = cache_paths(spec, arch, key, config)
    if not force:
        names = _read_cached(cubin_path, meta_path, spec)
        if names is not None:
            return CompiledModule(spec, arch, cubin_path, names, True, time.perf_counter() - start)
    cubin, names, _ = _nvrtc_compile(spec, options, cubin_path)
    if spec.USES_NVSHMEM:
        cubin = nvjitlink_nvshmem(spec.family, arch, cubin)
    meta = {"lowered_names": names, "spec": repr(spec), "arch": arch, "options": options}
    write_entry(cubin_path, meta_path, cubin, meta)
    seconds = time.perf_counter() - start
    log.debug("compiled %s for %s in %.2f s -> %s", spec.family, arch, seconds, cubin_path)
    return CompiledModule(spec, arch, cubin_path, names, False, seconds)


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel: registers per thread, stack frame, spill stores and loads (bytes)."""

    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def ptxas_resources(spec: KernelSpec, arch: str, config: JitConfig) -> dict[str, KernelResources]:
    """Every kernel's resources as ptxas reports them (`-Xptxas=-v` through NVRTC; no GPU needed, nothing is
    cached). For modules that link NVSHMEM these are before nvJitLink's link."""
    arch = normalize_arch(arch)
    options = [*compile_options(spec, arch, config), "-Xptxas=-v"]
    scratch = Path(tempfile.gettempdir()) / f"epjit-ptxas-{os.getpid()}-{spec.family}.cubin"
    _, names, log_text = _nvrtc_compile(spec, options, scratch)
    by_symbol = {symbol: kernel for kernel, symbol in names.items()}
    out: dict[str, KernelResources] = {}
    kernel, stack = None, None
    for line in log_text.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            kernel, stack = by_symbol.get(m.group(1)), None
        elif kernel and (m := _PTXAS_STACK.search(line)) and stack is None:
            stack = tuple(int(g) for g in m.groups())
        elif kernel and stack and (m := _PTXAS_REGS.search(line)):
            out[kernel] = KernelResources(int(m.group(1)), *stack)
            kernel = None
    return out


def _nvrtc_compile(spec: KernelSpec, options: list[str], cubin_path: Path) -> tuple[bytes, dict[str, str], str]:
    source = f'// generated by epjit for {spec!r}\n#include "{spec.SOURCE}"\n'
    program_name = f"{spec.family}.generated.cu"  # not the .cu it includes, or NVRTC sees a self-include
    return nvrtc_compile(source, program_name, spec.family, spec.name_expressions(), options, cubin_path)


def nvrtc_compile(source: str, program_name: str, what: str, expressions: dict[str, str], options: list[str],
                  cubin_path: Path, explain: Callable[[str], str] | None = None
                  ) -> tuple[bytes, dict[str, str], str]:
    """(cubin, kernel -> lowered name of its name expression, NVRTC's log) of one program. On failure the source and
    options are dumped beside ``cubin_path`` and CompileError carries the log (``explain`` may add to it)."""
    from cuda.bindings import nvrtc

    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), program_name.encode(), 0, [], [])
    if err != ok:
        raise CompileError(f"nvrtcCreateProgram failed for {what}: {err}")
    try:
        for expr in expressions.values():
            (err,) = nvrtc.nvrtcAddNameExpression(prog, expr.encode())
            if err != ok:
                raise CompileError(f"nvrtcAddNameExpression({expr}) failed: {err}")
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        _, log_size = nvrtc.nvrtcGetProgramLogSize(prog)
        # NVRTC writes into the buffers it is given: a fresh bytearray each, never bytes. An empty log is one byte,
        # and b" " * 1 is CPython's shared b" " itself: NVRTC's NUL would overwrite that object for the whole
        # process (seen as `import torch` failing to parse "annotate(str tag)" after a user kernel compiled).
        log_bytes = bytearray(log_size)
        nvrtc.nvrtcGetProgramLog(prog, log_bytes)
        log_text = log_bytes.rstrip(b"\x00 ").decode(errors="replace")
        if err != ok:
            dumped = _dump_failed_source(cubin_path, source, options, log_text)
            shown = explain(log_text) if explain is not None else log_text
            raise CompileError(f"NVRTC failed to compile {what} ({err.name}):\n{shown}\n"
                               f"source and options kept at {dumped}")
        if log_text:
            log.debug("NVRTC log for %s:\n%s", what, log_text)
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = bytearray(size)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        if err != ok:
            raise CompileError(f"nvrtcGetCUBIN failed for {what}: {err}")
        names = {}
        for kernel, expr in expressions.items():
            err, lowered = nvrtc.nvrtcGetLoweredName(prog, expr.encode())
            if err != ok:
                raise CompileError(f"nvrtcGetLoweredName({expr}) failed: {err}")
            names[kernel] = lowered.decode()
        return bytes(cubin), names, log_text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _dump_failed_source(cubin_path: Path, source: str, options: list[str], log_text: str) -> Path:
    dump = cubin_path.with_suffix(".failed.cu")
    dump.parent.mkdir(parents=True, exist_ok=True)
    dump.write_text(f"{source}\n/* options: {' '.join(options)}\n\nNVRTC log:\n{log_text}\n*/\n")
    return dump


def nvjitlink_nvshmem(what: str, arch: str, cubin: bytes) -> bytes:
    """``cubin`` (compiled with -rdc) linked with NVSHMEM's device library."""
    from cuda.bindings import nvjitlink

    library = nvshmem().device_library
    handle = nvjitlink.create(1, [f"-arch={arch}"])
    try:
        try:
            nvjitlink.add_data(handle, nvjitlink.InputType.CUBIN, cubin, len(cubin), f"{what}.cubin")
            nvjitlink.add_file(handle, nvjitlink.InputType.LIBRARY, str(library))
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as e:
            size = nvjitlink.get_error_log_size(handle)
            err_log = bytearray(size)
            if size:
                nvjitlink.get_error_log(handle, err_log)
            text = err_log.rstrip(b"\x00").decode(errors="replace")
            raise CompileError(f"nvJitLink failed to link {what} with {library}: {e}\n{text}") from e
        size = nvjitlink.get_linked_cubin_size(handle)
        linked = bytearray(size)
        nvjitlink.get_linked_cubin(handle, linked)
        return bytes(linked)
    finally:
        nvjitlink.destroy(handle)
