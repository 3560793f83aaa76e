"""A program written by hand, compiled as it is: CUDA C++ text (not a spec's template instantiations) whose
``extern "C" __global__`` functions are its kernels, through the same options, cache and NVSHMEM link as the specs.

The text is NVRTC's program itself, under its own name (its file's path, or ``<source>``), so NVRTC's log speaks
of the writer's own lines; a failed compile quotes those lines with their numbers. The cache key is the text, its
defines, the arch, every header it includes (its own folder's and the sources' folder's, by content), the
compiler's and NVSHMEM's versions: an unchanged text is a hit, an edited one compiles only itself.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .compiler import (
    _INCLUDE,
    CompiledModule,
    _read_cached,
    hash_toolchain_and_files,
    included_files,
    normalize_arch,
    nvjitlink_nvshmem,
    nvrtc_compile,
    program_options,
    write_entry,
)
from .config import JitConfig
from .signature import KernelSignature, parse_kernels
from .spec import KernelSpec


@dataclass(frozen=True)
class Program:
    """text: the CUDA C++ source; name: what NVRTC's log calls it (a file's path, or ``<source>``); stem: its name
    in cache files; defines: ``NAME`` or ``NAME=VALUE``; include_dirs: searched before the sources' folder (a
    file's own folder); uses_nvshmem: compiled relocatable and linked with NVSHMEM's device library."""

    text: str
    name: str = "<source>"
    stem: str = "program"
    defines: tuple[str, ...] = ()
    include_dirs: tuple[Path, ...] = ()
    uses_nvshmem: bool = False


@dataclass(frozen=True)
class CompiledProgram:
    program: Program
    kernels: dict[str, KernelSignature]
    arch: str
    cubin_path: Path
    from_cache: bool
    seconds: float


def program_headers(program: Program, config: JitConfig) -> list[Path]:
    """Every file the text includes with quotes, recursively, where the compile would find it (its own folders
    first, then the sources' folder); system headers are keyed by the compiler's version."""
    files: list[Path] = []
    seen: set[Path] = set()
    for name in _INCLUDE.findall(program.text):
        for folder in (*program.include_dirs, config.source_dir):
            candidate = (folder / name).resolve()
            if candidate.is_file():
                files += included_files(candidate, config.source_dir, seen)
                break
    return files


def program_key(program: Program, arch: str, options: list[str], config: JitConfig,
                in_place_of: KernelSpec | None = None) -> str:
    """The cache key of ``program`` (``in_place_of``: the spec whose kernels it builds, for an edited copy of a
    spec's source, whose name expressions are the spec's)."""
    h = hashlib.sha256()
    h.update(f"version {config.version}\nprogram {program.name}\n{arch}\n".encode())
    if in_place_of is not None:
        h.update(f"in place of {type(in_place_of).__name__} {in_place_of!r}\n".encode())
    h.update(program.text.encode())
    return hash_toolchain_and_files(h, options, config, program.uses_nvshmem, program_headers(program, config))


def quote_lines(log_text: str, program: Program, context: int = 1) -> str:
    """NVRTC's log, then the program's own lines around each error, numbered as in the text (``>`` marks the line
    an error names)."""
    pattern = re.compile(rf"^{re.escape(program.name)}\((\d+)\): (?:catastrophic )?error", re.MULTILINE)
    marked = sorted({int(n) for n in pattern.findall(log_text)})
    if not marked:
        return log_text
    lines = program.text.splitlines()
    shown = sorted({n for m in marked for n in range(m - context, m + context + 1) if 1 <= n <= len(lines)})
    width = len(str(shown[-1])) if shown else 1
    quoted = [f"{'>' if n in marked else ' '} {n:>{width}} | {lines[n - 1]}" for n in shown]
    return f"{log_text}\nin {program.name}:\n" + "\n".join(quoted)


def compile_program(program: Program, arch: str, config: JitConfig, *, force: bool = False) -> CompiledProgram:
    """The cubin of ``program`` for ``arch`` (no GPU needed): from the cache when present, else compiled (and linked
    with NVSHMEM's device library where it uses NVSHMEM) now. Its kernels are read from the text first, so a
    signature no launch could fill is refused before NVRTC runs."""
    arch = normalize_arch(arch)
    start = time.perf_counter()
    kernels = parse_kernels(program.text, program.name)
    options = program_options(arch, config, program.defines, program.uses_nvshmem, program.include_dirs)
    key = program_key(program, arch, options, config)
    folder = config.cache_dir / config.version / arch
    cubin_path, meta_path = folder / f"{program.stem}.{key}.cubin", folder / f"{program.stem}.{key}.json"
    if not force and cubin_path.is_file() and cubin_path.stat().st_size > 0 and meta_path.is_file():
        return CompiledProgram(program, kernels, arch, cubin_path, True, time.perf_counter() - start)
    cubin, _, _ = nvrtc_compile(program.text, program.name, program.name, {}, options, cubin_path,
                                explain=lambda log_text: quote_lines(log_text, program))
    if program.uses_nvshmem:
        cubin = nvjitlink_nvshmem(program.stem, arch, cubin)
    meta = {"program": program.name, "kernels": [str(k) for k in kernels.values()], "arch": arch, "options": options}
    write_entry(cubin_path, meta_path, cubin, meta)
    return CompiledProgram(program, kernels, arch, cubin_path, False, time.perf_counter() - start)



def compile_variant(program: Program, spec: KernelSpec, arch: str, config: JitConfig, *,
                    force: bool = False) -> CompiledModule:
    """``spec``'s kernels built from ``program``'s text (an edited copy of the spec's SOURCE) in place of the
    source: the spec's name expressions and defines (the program's defines after them), its NVSHMEM link, and a
    cache entry of its own, keyed by the text as any program is. The module it gives launches the spec's
    arguments; that the text's kernels still take them is the caller's to check first (epjit.lab does)."""
    arch = normalize_arch(arch)
    start = time.perf_counter()
    options = program_options(arch, config, (*spec.DEFINES, *program.defines), spec.USES_NVSHMEM,
                              program.include_dirs)
    key = program_key(program, arch, options, config, in_place_of=spec)
    folder = config.cache_dir / config.version / arch
    stem = f"{program.stem}.{spec.family}.{key}"
    cubin_path, meta_path = folder / f"{stem}.cubin", folder / f"{stem}.json"
    names = None if force else _read_cached(cubin_path, meta_path, spec)
    if names is not None:
        return CompiledModule(spec, arch, cubin_path, names, True, time.perf_counter() - start)
    cubin, names, _ = nvrtc_compile(program.text, program.name, program.name, spec.name_expressions(), options,
                                    cubin_path, explain=lambda log_text: quote_lines(log_text, program))
    if spec.USES_NVSHMEM:
        cubin = nvjitlink_nvshmem(stem, arch, cubin)
    meta = {"lowered_names": names, "spec": repr(spec), "program": program.name, "arch": arch, "options": options}
    write_entry(cubin_path, meta_path, cubin, meta)
    return CompiledModule(spec, arch, cubin_path, names, False, time.perf_counter() - start)
