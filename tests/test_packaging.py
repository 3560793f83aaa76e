"""CPU tier: packaging. The wheel must ship the kernel sources (cuda_src/, edited at the top of the repository) as
package data, epjit/cuda_src/, or an installed epjit compiles nothing. Static checks of pyproject.toml against the
files on disk, no build and no network (.ci/run builds the wheel, installs it and compiles from it)."""

from __future__ import annotations

import re
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\s\[<>=!~;@]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def package_dir(package: str) -> Path:
    """Where setuptools takes a package from: the longest mapped prefix in package-dir, else its own path."""
    mapping: dict[str, str] = SETUPTOOLS.get("package-dir", {})
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in mapping:
            return ROOT / mapping[prefix] / Path(*parts[n:])
    return ROOT / mapping.get("", ".") / Path(*parts)


def packaged_files() -> dict[str, Path]:
    """What the wheel holds from the configured packages' package-data: its path in the wheel -> the file here."""
    data: dict[str, list[str]] = SETUPTOOLS.get("package-data", {})
    out: dict[str, Path] = {}
    for package in SETUPTOOLS["packages"]:
        src = package_dir(package)
        for key, patterns in data.items():
            if key not in ("", "*") and not fnmatch(package, key):
                continue
            for pattern in patterns:
                for f in src.glob(pattern):
                    if f.is_file():
                        out["/".join([*package.split("."), f.relative_to(src).as_posix()])] = f
    return out


def test_version_is_dynamic_from_the_version_module():
    from epjit import __version__
    from epjit._version import __version__ as written

    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert SETUPTOOLS["dynamic"]["version"] == {"attr": "epjit._version.__version__"}
    assert __version__ == written and re.fullmatch(r"\d+\.\d+\.\d+\S*", written)


def test_every_kernel_source_is_packaged_as_epjit_cuda_src():
    on_disk = {p for p in (ROOT / "cuda_src").rglob("*") if p.suffix in (".cu", ".cuh")}
    assert ROOT / "cuda_src" / "intranode.cu" in on_disk and ROOT / "cuda_src" / "bench" / "ceiling.cu" in on_disk
    shipped = packaged_files()
    expected = {"epjit/" + p.relative_to(ROOT).as_posix(): p for p in on_disk}
    missing = sorted(set(expected) - set(shipped))
    assert not missing, f"not in the wheel (add the folder to pyproject's packages/package-dir/package-data): {missing}"
    assert all(shipped[name] == path for name, path in expected.items())


def test_every_python_package_is_listed():
    """pyproject lists the packages by hand (cuda_src is mapped in): a new subpackage must be added there."""
    listed = set(SETUPTOOLS["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "epjit").rglob("__init__.py")}
    assert not on_disk - listed, f"packages missing from pyproject's [tool.setuptools] packages: {on_disk - listed}"
    for package in listed:
        assert package_dir(package).is_dir(), f"{package}: {package_dir(package)} does not exist"


def test_the_jit_check_finds_the_kernels_through_the_wheels_entry_points():
    """`python -m epjit.jit --check` (and CI's check of the installed wheel) finds what to build in the entry-point
    group epjit.jit.specs: pyproject.toml declares it, so the wheel's entry_points.txt carries it, and each entry
    names a function of a packaged module."""
    from epjit.jit.registry import GROUP

    entries = PROJECT["entry-points"][GROUP]
    assert entries == {"epjit": "epjit.kernels:kernel_set", "epjit.bench": "epjit.bench.kernels:kernel_set"}
    for value in entries.values():
        module, _, function = value.partition(":")
        assert module in SETUPTOOLS["packages"] or module.rpartition(".")[0] in SETUPTOOLS["packages"], module
        path = ROOT / Path(*module.split("."))
        source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        assert f"def {function}(" in source.read_text(), value


def test_cuda_sources_resolve():
    from epjit.kernels import cuda_sources

    src = cuda_sources()
    assert (src / "intranode.cu").is_file() and (src / "bench" / "ceiling.cu").is_file()


def test_mit_license():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 The epjit authors" in text
    assert PROJECT["license"] == "MIT" and "LICENSE" in PROJECT["license-files"]


def test_mpi4py_only_in_the_extras_that_use_mpi():
    extras = PROJECT["optional-dependencies"]
    assert "mpi4py" not in requirement_names(PROJECT["dependencies"])
    assert "mpi4py" in requirement_names(extras["mpi"]) and "mpi4py" in requirement_names(extras["test"])


def test_test_extra_pins_no_cuda_so_it_combines_with_cuda12_and_cuda13():
    extras = PROJECT["optional-dependencies"]
    cuda = {n for n in requirement_names(extras["test"]) if n.startswith(("cuda-", "nvidia-", "cupy", "nvshmem"))}
    assert not cuda, f"the test extra pins CUDA packages: {cuda}"
    compile13 = requirement_names(extras["compile13"])
    assert {"cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-nvjitlink", "nvidia-cuda-cccl", "nvidia-cuda-runtime",
            "nvidia-nvshmem-cu13"} <= compile13
    assert "epjit[compile13]" in extras["cuda13"]
