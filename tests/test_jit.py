"""CPU tier of the JIT layer: specs against their .cu signatures (names, order, types), launches by argument name,
argument packing, the cache key and its atomic writes under racing processes, compile errors that show NVRTC's
file:line, and the house rules on PTX and waits."""

from __future__ import annotations

import dataclasses
import glob
import multiprocessing as mp
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from epjit import jit
from epjit.bench.kernels import bench_specs
from epjit.jit import KernelSpec, camel_param, compile_spec, normalize_arch, registry
from epjit.jit.compiler import cache_key, compile_options, included_files
from epjit.jit.toolchain import check_nvshmem_version, parse_nvshmem_version
from epjit.kernels import BarrierSpec, check_specs, cuda_sources, jit_config

ROOT = Path(__file__).resolve().parents[1]
CUDA_SRC = cuda_sources()
ALL_SPECS = check_specs() + bench_specs()
nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")


def _signature(source: str, kernel: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(template parameter names, (C type, name) of each argument) of `kernel` as declared in a .cu file."""
    m = re.search(
        r"(?:template\s*<([^>]*)>\s*)?__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?"
        + kernel
        + r"\s*\(([^)]*)\)",
        source,
    )
    assert m, f"{kernel} not found as a __global__ function"
    params = [p.split()[-1] for p in (m.group(1) or "").split(",") if p.strip()]
    args = []
    for arg in filter(str.strip, m.group(2).split(",")):
        words = arg.split()
        stars = len(words[-1]) - len(words[-1].lstrip("*"))  # `int *p` declares the same as `int* p`
        args.append((" ".join(words[:-1]) + "*" * stars, words[-1].lstrip("*")))
    return params, args


def _signature_problems(spec: KernelSpec, source: str) -> list[str]:
    """Where the spec and the .cu disagree: template parameters, or argument names, order and C types."""
    fields = [camel_param(f.name) for f in dataclasses.fields(spec)]
    problems = []
    for kernel, declared in spec.KERNELS.items():
        params, args = _signature(source, kernel)
        if params != fields:
            problems.append(f"{kernel}: template <{params}> but spec fields {fields}")
        if args != [(ctype, name) for name, ctype in declared]:
            problems.append(f"{kernel}: .cu {args} vs spec {[(c, n) for n, c in declared]}")
    return problems


def _source_of(spec: KernelSpec) -> str:
    """The family's one source (a build variant is its spec's defines on it, not another file)."""
    return (CUDA_SRC / spec.SOURCE).read_text()


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.family)
def test_spec_matches_cu_signature(spec):
    """The spec declares each kernel's arguments by the .cu's own names, in its order, with its C types: every
    launch fills them by name, so a parameter renamed, moved or retyped in the .cu fails here."""
    assert _signature_problems(spec, _source_of(spec)) == []


def test_build_variants_are_defines_of_one_source():
    """A build variant is its spec's defines on the family's one source, never a .cu that includes another .cu; each
    define reaches NVRTC as an option (so the cache key sees it) and is one the source's files test."""
    including = [f"{p.relative_to(CUDA_SRC)}: {name}" for p in CUDA_SRC.rglob("*.cu*")
                 for name in re.findall(r'#\s*include\s*"([^"]+\.cu)"', p.read_text())]
    assert not including, f"a .cu included as a header: {including}"
    variants = [spec for spec in ALL_SPECS if spec.DEFINES]
    assert {spec.family.split(".")[0] for spec in variants} == {
        "low_latency_puts", "low_latency_stores", "internode_stores", "internode_combine_fp8_stores",
        "low_latency_shrink", "low_latency_puts_shrink", "low_latency_stores_shrink",
        "intranode_notify_shrink", "intranode_shrink", "intranode_combine_fp8_shrink",
        "internode_profile", "internode_stores_profile", "internode_combine_fp8_profile",
        "internode_combine_fp8_stores_profile", "low_latency_wait_stats", "low_latency_puts_wait_stats",
        "low_latency_stores_wait_stats", "low_latency_shrink_wait_stats", "low_latency_puts_shrink_wait_stats",
        "low_latency_stores_shrink_wait_stats"}
    for spec in variants:
        options = compile_options(spec, "sm_90", jit_config())
        assert [o for o in options if o.startswith("-D") and o != "-DNDEBUG"] == [f"-D{d}" for d in spec.DEFINES]
        text = "".join(p.read_text() for p in included_files(CUDA_SRC / spec.SOURCE, CUDA_SRC))
        for name in spec.DEFINES:
            assert re.search(rf"defined\(\s*{name}\s*\)|#\s*ifn?def\s+{name}\b", text), (spec.family, name)
    plain = [spec for spec in ALL_SPECS if not spec.DEFINES]
    assert all(not o.startswith("-D") or o == "-DNDEBUG" for o in compile_options(plain[0], "sm_90", jit_config()))


def test_build_with_names_the_build_after_its_spec_and_keeps_its_fields():
    import pickle

    from epjit.kernels.intranode import IntranodeShrinkSpec, IntranodeSpec, intranode_spec, shrink_spec

    spec = intranode_spec(4)
    built = jit.build_with(IntranodeSpec, "EPJIT_TEST_DEFINE", "TestBuild", __name__)
    assert built.__name__ == "IntranodeTestBuildSpec" and issubclass(built, IntranodeSpec)
    assert built.BUILD == "intranode_test_build" and built.DEFINES == ("EPJIT_TEST_DEFINE",)
    assert built.KERNELS is IntranodeSpec.KERNELS and built.SOURCE == IntranodeSpec.SOURCE
    moved = jit.same_fields(spec, built)
    assert type(moved) is built and dataclasses.astuple(moved) == dataclasses.astuple(spec)
    assert moved.family == spec.family.replace("intranode.", "intranode_test_build.", 1)
    assert repr(moved).startswith("IntranodeTestBuildSpec(")  # the cache key's type name and repr
    with pytest.raises(dataclasses.FrozenInstanceError):
        moved.num_ranks = 8  # type: ignore[misc]
    shrink = shrink_spec(spec)  # a build assigned under its name where it is made pickles (ranks compare specs)
    assert type(shrink) is IntranodeShrinkSpec and pickle.loads(pickle.dumps(shrink)) == shrink


def test_swapped_arguments_of_one_type_are_caught():
    """Two int parameters swapped in a .cu signature are invisible to a type check; the names catch them."""
    spec = next(s for s in check_specs() if s.family == "barrier.num_nvl_ranks=4")
    source = _source_of(spec)
    swapped = source.replace("int num_rounds, int num_ints", "int num_ints, int num_rounds")
    assert swapped != source, "update this test: nvl_exchange_check's signature changed"
    problems = _signature_problems(spec, swapped)
    assert len(problems) == 1 and "nvl_exchange_check" in problems[0], problems


def test_kernel_args_by_name():
    spec = next(s for s in check_specs() if s.family == "barrier.num_nvl_ranks=4")
    args = spec.args("nvl_exchange_check", num_ints=5, peers=0x7F00_0000_1000)
    with pytest.raises(TypeError, match="no value given for num_rounds, skip_rank, errors"):
        spec.pack(args.kernel, args.values)
    args.set(skip_rank=-1, errors=None, num_rounds=3)
    assert [type(v) for v in spec.pack(args.kernel, args.values)] == [np.uint64, np.int32, np.int32, np.int32,
                                                                      np.uint64]
    assert args["num_ints"] == 5 and args.values[1:4] == [3, 5, -1]  # placed by name, in signature order
    later = args.copy().set(num_rounds=9)
    assert args["num_rounds"] == 3 and later["num_rounds"] == 9
    with pytest.raises(TypeError, match="nvl_exchange_check has no parameter 'rounds'"):
        args.set(rounds=1)
    with pytest.raises(KeyError, match="has no kernel"):
        spec.args("nope")


def test_name_expression_and_family():
    spec = next(s for s in check_specs() if s.family == "barrier.num_nvl_ranks=4")
    assert spec.name_expression("nvl_barrier") == "epjit::nvl_barrier<4>"
    direct = next(s for s in check_specs() if s.family == "nvshmem_check.direct=true")
    assert direct.name_expression("put_signal_check") == "epjit::put_signal_check<true>"
    with pytest.raises(KeyError, match="has no kernel"):
        spec.name_expression("nope")


def test_pack_casts_to_exact_c_types():
    spec = next(s for s in check_specs() if s.family == "barrier.num_nvl_ranks=4")
    packed = spec.pack("nvl_exchange_check", (0x7F00_0000_1000, 5, 1 << 16, -1, None))
    assert [type(p) for p in packed] == [np.uint64, np.int32, np.int32, np.int32, np.uint64]
    assert int(packed[0]) == 0x7F00_0000_1000 and int(packed[3]) == -1
    with pytest.raises(OverflowError, match="num_rounds=4294967296 does not fit in int"):
        spec.pack("nvl_exchange_check", (0, 1 << 32, 1, 1, None))
    with pytest.raises(TypeError, match="takes 5 arguments"):
        spec.pack("nvl_exchange_check", (0, 1))
    with pytest.raises(TypeError, match="must be an integer"):
        spec.pack("nvl_exchange_check", (0, 1.5, 1, 1, None))
    assert camel_param("num_nvl_ranks") == "kNumNvlRanks"


def test_normalize_arch():
    assert normalize_arch("sm_90") == normalize_arch("90") == normalize_arch((9, 0)[0] * 10) == "sm_90"
    assert normalize_arch("sm_90a") == "sm_90a"
    with pytest.raises(ValueError):
        normalize_arch("hopper")


def test_included_files_follows_local_headers():
    names = {p.name for p in included_files(CUDA_SRC / "barrier.cu", CUDA_SRC)}
    assert {"barrier.cu", "barrier.cuh", "peers.cuh", "ptx.cuh", "wait.cuh", "types.cuh"} <= names


@dataclasses.dataclass(frozen=True)
class _Scratch(KernelSpec):
    """A throwaway kernel family in a temp dir (SOURCE is an absolute path)."""

    width: int
    SOURCE = ""
    KERNELS = {"fill": (("out", "int*"), ("value", "int"))}


def _scratch_spec(tmp_path: Path, body: str, width: int = 4) -> KernelSpec:
    src = tmp_path / "scratch.cu"
    src.write_text('#include "ptx.cuh"\nnamespace epjit {\ntemplate <int kWidth>\n'
                   f"__global__ void fill(int* out, int value) {{ {body} }}\n}}\n")
    spec_cls = dataclasses.make_dataclass("Scratch", [], bases=(_Scratch,), frozen=True,
                                          namespace={"SOURCE": str(src)})
    return spec_cls(width)


def test_cache_hit_and_key_follows_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("EPJIT_CACHE_DIR", str(tmp_path / "cache"))
    spec = _scratch_spec(tmp_path, "out[threadIdx.x % kWidth] = value;")
    config = jit_config()
    first = compile_spec(spec, "sm_90", config)
    assert not first.from_cache and first.cubin_path.is_file() and first.cubin_path.stat().st_size > 0
    assert first.cubin_path.parent.name == "sm_90" and first.cubin_path.name.startswith("scratch.width=4.")
    assert first.cubin_path.parent.parent.name == config.version  # $EPJIT_CACHE_DIR/<version>/<sm_XX>/
    assert first.lowered_names["fill"].startswith("_Z")
    again = compile_spec(spec, "sm_90", config)
    assert again.from_cache and again.cubin_path == first.cubin_path
    key = cache_key(spec, "sm_90", compile_options(spec, "sm_90", config), config)
    assert key != cache_key(spec, "sm_80", compile_options(spec, "sm_80", config), config)
    # Any change to the source (or a header it includes), the version or a code-changing setting is a new entry.
    spec2 = _scratch_spec(tmp_path, "out[threadIdx.x % kWidth] = value + 1;")
    assert cache_key(spec2, "sm_90", compile_options(spec2, "sm_90", config), config) != key
    assert cache_key(type(spec)(8), "sm_90", compile_options(spec, "sm_90", config), config) != key
    for other in (dataclasses.replace(config, version="9.9"), dataclasses.replace(config, key_extra=(("a", "1"),))):
        assert cache_key(spec, "sm_90", compile_options(spec, "sm_90", other), other) != key


def test_corrupt_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("EPJIT_CACHE_DIR", str(tmp_path / "cache"))
    spec = _scratch_spec(tmp_path, "out[0] = value;")
    first = compile_spec(spec, "sm_90", jit_config())
    first.cubin_path.with_suffix(".json").write_text("{not json")
    again = compile_spec(spec, "sm_90", jit_config())
    assert not again.from_cache and again.lowered_names == first.lowered_names


def test_compile_error_shows_file_and_line(tmp_path, monkeypatch):
    monkeypatch.setenv("EPJIT_CACHE_DIR", str(tmp_path / "cache"))
    spec = _scratch_spec(tmp_path, "out[0] = undeclared_thing;")
    with pytest.raises(jit.CompileError) as info:
        compile_spec(spec, "sm_90", jit_config())
    message = str(info.value)
    assert re.search(r"scratch\.cu\(4\): error: identifier \"undeclared_thing\" is undefined", message), message
    dumped = Path(message.rsplit("kept at ", 1)[1].strip())
    assert dumped.is_file() and "undeclared_thing" in dumped.read_text()


def test_a_compile_with_an_empty_log_leaves_pythons_shared_bytes_alone(tmp_path):
    """NVRTC writes its log (one NUL when empty) into the buffer it is given: bytes of length one would be CPython's
    shared b" " object, overwritten for the whole process. Checked in a fresh interpreter, after a clean compile."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")
    code = (
        "import pathlib, sys\n"
        "from epjit.jit.compiler import nvrtc_compile\n"
        "src = 'extern \"C\" __global__ void fill(int* out, int v) { out[threadIdx.x] = v; }'\n"
        f"where = pathlib.Path({str(tmp_path)!r}) / 'x'\n"
        "cubin, _, log = nvrtc_compile(src, 'fill.cu', 'fill', {}, ['-arch=sm_90'], where)\n"
        "print(repr(log), cubin[:4] == b'\\x7fELF', bytes.fromhex('20')[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["''", "True", "32"], out.stdout


def _race_worker(args: tuple[str, str]) -> str:
    cache, src = args
    import os

    os.environ["EPJIT_CACHE_DIR"] = cache
    spec_cls = dataclasses.make_dataclass("Scratch", [], bases=(_Scratch,), frozen=True, namespace={"SOURCE": src})
    return str(compile_spec(spec_cls(4), "sm_90", jit_config()).cubin_path)


def test_ranks_racing_to_compile_agree(tmp_path):
    spec = _scratch_spec(tmp_path, "out[threadIdx.x] = value * kWidth;")
    with mp.get_context("spawn").Pool(4) as pool:
        paths = pool.map(_race_worker, [(str(tmp_path / "cache"), spec.SOURCE)] * 4)
    assert len(set(paths)) == 1
    folder = Path(paths[0]).parent
    assert not list(folder.glob(".*.tmp")), "a temp file was left behind"
    assert Path(paths[0]).stat().st_size > 0


def test_check_cli_compiles_every_module(tmp_path):
    """Every module through the CLI, then all of them from its cache. A cold build of all of them takes minutes on two
    cores, so the cache starts as a copy of what scripts/test.sh's own --check left (where it ran), less two modules
    built again: a plain one and one linked with NVSHMEM (without that cache every module is built)."""
    config = jit_config()
    cache = tmp_path / "cache"
    built, folder = config.cache_dir / config.version / "sm_90", cache / config.version / "sm_90"
    if built.is_dir():
        shutil.copytree(built, folder)
    plain = next(spec for spec in ALL_SPECS if not spec.USES_NVSHMEM)
    linked = next(spec for spec in ALL_SPECS if spec.USES_NVSHMEM)
    for spec in (plain, linked):
        for entry in folder.glob(f"{glob.escape(spec.family)}.*"):
            entry.unlink()
    env = {"EPJIT_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "epjit.jit", "--check", "--arch", "sm_90"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.split()}
    for spec in ALL_SPECS:
        assert spec.family in lines, (spec.family, out.stdout[-2000:])
    assert lines[plain.family].endswith(" compiled") and lines[linked.family].endswith(" compiled + linked"), \
        (lines[plain.family], lines[linked.family])
    assert "0 failed" in out.stdout
    warm = subprocess.run([sys.executable, "-m", "epjit.jit", "--check", "--arch", "sm_90"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert warm.returncode == 0 and warm.stdout.count(" cache") == len(ALL_SPECS), warm.stdout


def test_check_cli_finds_the_kernels_through_the_entry_point_group():
    """The JIT layer imports nothing above it: the product's and the benchmark's kernel sets reach `--check` through
    the entry-point group, in that order, with epjit's configuration (a checkout's pyproject.toml where the installed
    metadata lacks them)."""
    sets = registry.kernel_sets()
    assert [name for name, _ in sets] == ["epjit", "epjit.bench"]
    assert [spec for _, s in sets for spec in s.specs] == ALL_SPECS
    assert all(s.config == jit_config() for _, s in sets)
    with pytest.raises(jit.JitError, match="no kernels are registered"):
        registry.kernel_sets({})
    with pytest.raises(jit.JitError, match="broken = 'no_such_module:f'.*ModuleNotFoundError"):
        registry.kernel_sets({"broken": "no_such_module:f"})


def test_an_installed_package_registers_its_kernels(tmp_path, monkeypatch):
    """An installed distribution's entry points (a wheel's entry_points.txt) add its kernel set to the check."""
    (tmp_path / "ext_kernels.py").write_text(
        "from epjit.jit import KernelSet\nfrom epjit.kernels import BarrierSpec, jit_config\n"
        "def kernel_set():\n    return KernelSet(jit_config(), [BarrierSpec(2)])\n")
    info = tmp_path / "ext_kernels-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ext-kernels\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{registry.GROUP}]\next = ext_kernels:kernel_set\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entries = registry.registered()
    assert entries["ext"] == "ext_kernels:kernel_set" and "epjit" in entries
    assert dict(registry.kernel_sets(entries))["ext"].specs == [BarrierSpec(2)]


def test_check_options_without_check_say_what_they_need(capsys):
    from epjit.jit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--resources"])
    assert info.value.code == 2
    assert "--resources applies to the modules --check builds: add --check" in capsys.readouterr().err
    assert main([]) == 2 and "--check" in capsys.readouterr().out


def test_nvshmem_version_gate():
    header = "#define NVSHMEM_VENDOR_MAJOR_VERSION 3\n#define NVSHMEM_VENDOR_MINOR_VERSION 4\n" \
             "#define NVSHMEM_VENDOR_PATCH_VERSION 5\n"
    assert parse_nvshmem_version(header) == (3, 4, 5)
    with pytest.raises(jit.ToolchainError, match=r"NVSHMEM 3\.4\.5 .* needs >= 3\.8"):
        check_nvshmem_version((3, 4, 5), "somewhere")
    check_nvshmem_version((3, 8, 0), "somewhere")


def test_jit_errors_become_epjit_errors_with_the_rank(monkeypatch):
    """The JIT layer raises its own exceptions; the families' loader hands them on as epjit's, tagged with the
    rank, so ``except epjit.CompileError`` (an EpjitError) catches a kernel that does not compile."""
    import epjit
    from epjit import errors
    from epjit.ops import loader

    monkeypatch.setattr(errors, "_rank", 3)
    for raised, expected in ((jit.CompileError("nvrtc said no"), epjit.CompileError),
                             (jit.ToolchainError("no NVRTC"), epjit.SetupError)):
        def fail(*args, raised=raised):
            raise raised

        monkeypatch.setattr(loader.jit, "load", fail)
        with pytest.raises(expected, match=r"\(rank 3\)$") as info:
            loader.load(check_specs()[0], 0)
        assert isinstance(info.value, epjit.EpjitError)
    assert issubclass(epjit.CompileError, jit.CompileError)


def test_ptx_only_in_ptx_header():
    offenders = [p.name for p in CUDA_SRC.rglob("*.cu*")
                 if p.name != "ptx.cuh" and re.search(r"\basm\b", p.read_text())]
    assert not offenders, f"inline asm outside ptx.cuh: {offenders}"


def test_every_spin_wait_goes_through_timeout_while():
    # A polling loop is a while/for whose condition or body loads memory someone else writes; outside wait.cuh
    # none may exist (the one in wait.cuh's report path parks forever on purpose, behind a trap).
    bare = re.compile(r"while\s*\([^)]*(ld_|volatile|atomic)[^)]*\)|while\s*\(\s*(true|1)\s*\)")
    offenders = []
    for path in CUDA_SRC.rglob("*.cu*"):
        if path.name == "wait.cuh":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if bare.search(line):
                offenders.append(f"{path.name}:{i}: {line.strip()}")
    assert not offenders, "bare polling loops:\n" + "\n".join(offenders)


def test_import_epjit_touches_nothing():
    probe = ("import sys, epjit, epjit.jit, epjit.kernels, epjit.reference, epjit.arrays, epjit.buffer, epjit.ops; "
             "bad = [m for m in ('cupy', 'mpi4py', 'nvshmem', 'torch', 'jax', 'cuda.bindings.runtime') "
             "if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_arg_format_packs_what_pack_casts():
    """The launcher's one-call packing puts each argument, in its C type, in its own 8-byte slot."""
    import struct

    spec = next(s for s in check_specs() if s.family == "barrier.num_nvl_ranks=4")
    fmt = spec.arg_format("nvl_exchange_check")
    args = (0x7F00_0000_1000, 5, 1 << 16, -1, 0)
    block = bytearray(fmt.size)
    fmt.pack_into(block, 0, *args)
    assert fmt.size == 8 * len(args)
    for i, value in enumerate(spec.pack("nvl_exchange_check", args)):
        raw = np.asarray(value).tobytes()
        assert bytes(block[8 * i:8 * i + len(raw)]) == raw, i
    for bad in [(0, 1 << 32, 1, 1, 0), (0, 1.5, 1, 1, 0), (None, 1, 1, 1, 0), (-1, 1, 1, 1, 0), (0, 1)]:
        with pytest.raises(struct.error):  # the launcher then takes pack()'s path, which names the argument
            fmt.pack_into(block, 0, *bad)


def test_ptxas_resources_of_the_intranode_kernels(capsys):
    """`--resources` reads ptxas's report without a GPU; the intranode kernels fit 768 threads and barely spill
    (a fully predicated warp_copy batch once spilled 128-216 bytes in dispatch's hot loop)."""
    from epjit.jit.compiler import ptxas_resources
    from epjit.kernels import intranode_spec

    res = ptxas_resources(intranode_spec(4), "sm_90", jit_config())
    assert set(res) == {"intranode_dispatch", "intranode_combine"}, res
    for r in res.values():
        assert 0 < r.registers <= 65536 // 768 // 8 * 8, r  # __launch_bounds__(768, 1)
    assert res["intranode_dispatch"].spill_stores <= 64, res["intranode_dispatch"]
    from epjit.jit.cli import print_resources  # what `python -m epjit.jit --check --resources` prints

    print_resources(intranode_spec(4), "sm_90", jit_config())
    printed = capsys.readouterr().out
    assert re.search(r"intranode_dispatch\s+\d+ registers, +\d+ B stack", printed), printed


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_intranode_compiles_with_the_fewest_warps_its_spec_accepts(ranks, tmp_path, monkeypatch):
    """intranode_spec accepts one warp a dispatch group (2R - 1 warps); the kernel's DispatchRoles and CombineRoles
    must then still give every role a warp (their static_asserts are what would fail), and one warp fewer is
    refused on the host."""
    from epjit.kernels import intranode_spec

    monkeypatch.setenv("EPJIT_CACHE_DIR", str(tmp_path / "cache"))
    warps = 2 * ranks - 1
    spec = intranode_spec(ranks, 32 * warps)
    assert (spec.dispatch_send_warps, spec.dispatch_drain_warps, spec.combine_send_warps) == (1, 1, 1)
    assert compile_spec(spec, "sm_90", jit_config()).lowered_names["intranode_dispatch"]
    with pytest.raises(ValueError, match="cannot form"):
        intranode_spec(ranks, 32 * (warps - 1))


def test_programmatic_launch_config():
    """launch(programmatic=True) hands the driver the programmatic-stream-serialization attribute (PDL)."""
    from cuda.bindings import driver

    from epjit.jit.module import _programmatic_config

    config = _programmatic_config()
    assert config.numAttrs == 1
    attr = config.attrs[0]
    assert attr.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1


def test_programmatic_launches_wait_for_their_predecessor():
    """A kernel launched programmatically (its spec's PROGRAMMATIC set) may start before the kernel ahead of it ends:
    its source must call griddepcontrol_wait() before it reads what that kernel wrote (without one it would race)."""
    launched = {(spec.SOURCE, kernel) for spec in ALL_SPECS for kernel in spec.PROGRAMMATIC}
    assert ("intranode.cu", "intranode_dispatch") in launched, "update this test: dispatch is launched with PDL"
    for source, kernel in sorted(launched):
        text = (CUDA_SRC / source).read_text()
        start = re.search(rf"__global__[^;{{]*?\b{kernel}\s*\(", text, re.S)
        assert start, kernel
        end = text.find("__global__", start.end())
        body = text[start.end():end if end >= 0 else None]
        assert "griddepcontrol_wait()" in body, f"{kernel} is launched programmatically but never waits"
