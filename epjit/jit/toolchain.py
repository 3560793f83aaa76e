"""Where the compiler's inputs are: NVRTC, the CUDA and CCCL headers, NVSHMEM's headers and device library.

Everything is found through ``cuda.pathfinder`` (pip wheels first, then CUDA_HOME), never hard-coded paths.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ToolchainError

MIN_NVSHMEM = (3, 8)  # older device headers do not compile under NVRTC


@dataclass(frozen=True)
class Toolchain:
    nvrtc_version: tuple[int, int]
    include_dirs: tuple[Path, ...]  # the CUDA runtime's and CCCL's headers


@dataclass(frozen=True)
class Nvshmem:
    version: tuple[int, int, int]
    include_dir: Path
    device_library: Path


def _find_header_dir(name: str) -> Path | None:
    from cuda import pathfinder

    found = pathfinder.find_nvidia_header_directory(name)
    return Path(found) if found else None


@functools.cache
def toolchain() -> Toolchain:
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise ToolchainError(f"epjit needs NVRTC through cuda-bindings: pip install 'epjit[cuda13]' ({e})") from None
    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ToolchainError(f"NVRTC could not be loaded ({err}); install nvidia-cuda-nvrtc matching cuda-bindings")
    includes = []
    cudart = _find_header_dir("cudart")
    if cudart is None:
        raise ToolchainError("CUDA runtime headers not found: pip install nvidia-cuda-runtime (or set CUDA_HOME)")
    includes.append(cudart)
    cccl = _find_header_dir("cccl")
    if cccl is None and (cudart / "cccl").is_dir():
        cccl = cudart / "cccl"
    if cccl is None:
        raise ToolchainError("CCCL headers not found: pip install nvidia-cuda-cccl (or set CUDA_HOME)")
    includes.append(cccl)
    return Toolchain(nvrtc_version=(int(major), int(minor)), include_dirs=tuple(includes))


def parse_nvshmem_version(header: str) -> tuple[int, int, int]:
    parts = []
    for which in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"#define\s+NVSHMEM_VENDOR_{which}_VERSION\s+(\d+)", header)
        if m is None:
            raise ToolchainError(f"cannot read NVSHMEM_VENDOR_{which}_VERSION from nvshmem_version.h")
        parts.append(int(m.group(1)))
    return parts[0], parts[1], parts[2]


def check_nvshmem_version(version: tuple[int, int, int], where: str) -> None:
    if version[:2] < MIN_NVSHMEM:
        have = ".".join(map(str, version))
        raise ToolchainError(
            f"NVSHMEM {have} found at {where}, but epjit needs >= {MIN_NVSHMEM[0]}.{MIN_NVSHMEM[1]} "
            "(older device headers do not compile under NVRTC): pip install 'nvidia-nvshmem-cu13>=3.8'"
        )


@functools.cache
def nvshmem() -> Nvshmem:
    include = _find_header_dir("nvshmem")
    if include is None:
        raise ToolchainError("NVSHMEM headers not found: pip install 'nvidia-nvshmem-cu13>=3.8'")
    version_h = include / "non_abi" / "nvshmem_version.h"
    if not version_h.is_file():
        raise ToolchainError(f"{version_h} is missing: the NVSHMEM installation at {include} is incomplete or too old")
    version = parse_nvshmem_version(version_h.read_text())
    check_nvshmem_version(version, str(include))
    # pathfinder does not list the static device library: it sits in ../lib beside the headers.
    library = include.parent / "lib" / "libnvshmem_device.a"
    if not library.is_file():
        raise ToolchainError(f"libnvshmem_device.a not found at {library} (NVSHMEM {'.'.join(map(str, version))})")
    return Nvshmem(version=version, include_dir=include, device_library=library)
