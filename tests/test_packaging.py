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


# What the sdist leaves out however MANIFEST.in reads: build outputs, caches and the local virtual environments.
NOT_SOURCES = {".git", ".venv", ".device", ".whl", ".ab", "dist", "build", "__pycache__", ".pytest_cache",
               ".ruff_cache"}


def _source_files() -> set[str]:
    """The files of this tree (repository-relative, POSIX), build outputs, caches and virtual environments left out."""
    found = set()
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if path.is_file() and not set(rel.parts) & NOT_SOURCES and not rel.parts[0].endswith(".egg-info"):
            found.add(rel.as_posix())
    return found


def _sdist_files(files: set[str]) -> set[str]:
    """Which of ``files`` the sdist holds: what setuptools adds by itself (the package, README, LICENSE,
    pyproject.toml, MANIFEST.in) and what MANIFEST.in's include, recursive-include, graft and global-exclude lines
    add or take."""
    by_itself = ("README.md", "LICENSE", "pyproject.toml", "MANIFEST.in")
    shipped = {f for f in files if f.startswith("epjit/") or f in by_itself}
    excluded: list[str] = []
    for line in (ROOT / "MANIFEST.in").read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        command, args = words[0], words[1:]
        if command == "include":
            shipped |= {f for f in files if any(fnmatch(f, pattern) for pattern in args)}
        elif command == "graft":
            shipped |= {f for f in files if f.startswith(args[0].rstrip("/") + "/")}
        elif command == "recursive-include":
            shipped |= {f for f in files if f.startswith(args[0].rstrip("/") + "/")
                        and any(fnmatch(f.rsplit("/", 1)[-1], pattern) for pattern in args[1:])}
        elif command == "global-exclude":
            excluded += args
        else:
            pytest.fail(f"MANIFEST.in: {command!r} is not read by this test; teach it, or use the directives it reads")
    return {f for f in shipped if not any(fnmatch(f.rsplit("/", 1)[-1], pattern) for pattern in excluded)}


def _needed_by_tests(files: set[str]) -> set[str]:
    """The files that the tests (and the docs they check) name: every file under tests/, each path a test builds
    from ROOT or names relative to the repository (``"scripts/sanitize.sh"``), whole folders where a folder is named,
    and every relative link of the README and docs/ (a CPU test resolves them)."""
    named: set[str] = set()
    for source in (ROOT / "tests").rglob("*.py"):
        text = source.read_text()
        for parts in re.findall(r'ROOT((?:\s*/\s*"[^"{}]+")+)', text):
            named.add("/".join(re.findall(r'"([^"]+)"', parts)))
        named |= set(re.findall(r'"((?:scripts|examples|launch|docs|cuda_src|bench)/[\w./-]+)"', text))
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                named.add((page.parent / target).resolve().relative_to(ROOT).as_posix())
    needed = {f for f in files if f.startswith("tests/")}
    for name in named:
        needed |= {f for f in files if f == name or f.startswith(name.rstrip("/") + "/")}
    return needed


def test_the_sdist_holds_what_its_tests_need():
    """An unpacked sdist runs its own tests: MANIFEST.in ships every file they read, run or link to (the scripts
    the soak tests load, the launch recipes, the result files the docs cite, ...)."""
    files = _source_files()
    assert {"tests/test_packaging.py", "scripts/soak_routings.py", "launch/mpirun.sh"} <= _needed_by_tests(files)
    missing = sorted(_needed_by_tests(files) - _sdist_files(files))
    assert not missing, f"the tests need these files but MANIFEST.in leaves them out of the sdist: {missing}"
