"""The kernel lab, epjit.lab: users' own CUDA C++ compiled for sm_90 without a GPU, kernels and their parameters
read from the source (lines, comments, several kernels; templates and C++ linkage refused), launches checked by
parameter name with the user's line in every message, compile errors quoting the user's lines, and the cache
(an unchanged source is a hit, an edited one a new entry). One GPU test launches a kernel and reads its output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import epjit
from epjit import jit
from epjit.errors import ArgumentError, ArgumentTypeError, CompileError, SetupError

from .gpu import require_gpus

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")
ROOT = Path(__file__).resolve().parents[1]

FILL = """\
#include "ptx.cuh"

// One value a thread; `scale` is a float so a launch has every kind to check.
extern "C" __global__ void fill(int* __restrict__ out,   // where the values go
                                int value,
                                float scale) {
    out[blockIdx.x * blockDim.x + threadIdx.x] = value + static_cast<int>(scale);
}
"""


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EPJIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EPJIT_ARCH", raising=False)


def _cubins(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache").rglob("*.cubin"))


def test_a_kernel_compiles_for_sm_90_without_a_gpu(tmp_path):
    module = epjit.lab.compile(FILL, arch="sm_90")
    assert module.arch == "sm_90" and not module.from_cache
    assert module.cubin_path.is_file() and module.cubin_path.stat().st_size > 0
    assert module.cubin_path.parent.name == "sm_90" and module.cubin_path.name.startswith("lab.fill.")
    assert list(module.kernels) == ["fill"] and module.fill is module.kernels["fill"]
    assert str(module.fill.signature) == 'extern "C" __global__ void fill(int* out, int value, float scale)'
    assert "fill" in dir(module) and "fill" in repr(module)
    with pytest.raises(AttributeError, match=r"no kernel 'fil'; it has \['fill'\]"):
        module.fil  # noqa: B018 - the attribute lookup is the test


def test_without_a_gpu_the_arch_must_be_given(monkeypatch):
    def no_gpu(*_: object) -> str:
        raise RuntimeError("cudaErrorNoDevice")

    monkeypatch.setattr(jit, "device_arch", no_gpu)
    with pytest.raises(SetupError, match="arch='sm_90'"):
        epjit.lab.compile(FILL)
    monkeypatch.setenv("EPJIT_ARCH", "sm_90")  # the setting serves as well
    assert epjit.lab.compile(FILL).arch == "sm_90"


def test_signatures_come_from_the_source_with_their_lines():
    from epjit.jit.signature import parse_kernels

    source = """\
#include "types.cuh"
// extern "C" __global__ void commented_out(int x);
/* extern "C" __global__ void
   also_commented_out(int y); */
extern "C" __global__ void __launch_bounds__(128, 1)
first(const float* __restrict__ in,  // a comment with a comma, and (parentheses)
      unsigned long long n /* count */,
      bool flag)
{ }
extern "C" {
__global__ void second(void) {}
__global__ void third(double d, int64_t q, uint8_t small, const epjit_t::Table* table) {}
}
extern "C" __global__ void first(const float* in, unsigned long long n, bool flag);
"""
    kernels = parse_kernels(source)
    assert list(kernels) == ["first", "second", "third"]
    first = kernels["first"]
    assert first.line == 5
    assert [(p.name, p.ctype, p.pointer, p.line) for p in first.parameters] == [
        ("in", "float*", True, 6), ("n", "unsigned long long", False, 7), ("flag", "bool", False, 8)]
    assert kernels["second"].parameters == ()
    third = kernels["third"].parameters
    assert [(p.ctype, p.code) for p in third] == [("double", "d"), ("int64_t", "q"), ("uint8_t", "B"),
                                                  ("epjit_t::Table*", "Q")]


@pytest.mark.parametrize("source, said", [
    ("\n\ntemplate <int kN>\n__global__ void tiled(int* x) {}", r"<source>:4: kernel tiled is a template"),
    ('#include "types.cuh"\n__global__ void mangled(int x) {}', r'<source>:2: kernel mangled is not extern "C"'),
    ('extern "C" __global__ void k(int a,\n  Config c) {}', r"<source>:2: kernel k: parameter c has type 'Config'"),
    ('extern "C" __global__ void k(int& a) {}', r"<source>:1: kernel k: parameter 'int& a' cannot be passed"),
    ('extern "C" __global__ void k(int a, float a) {}', r"<source>:1: kernel k names a parameter twice"),
])
def test_kernels_a_launch_cannot_fill_are_refused_with_their_line(source, said):
    with pytest.raises(CompileError, match=said):
        epjit.lab.compile(source, arch="sm_90")


def test_arguments_are_checked_by_name_with_the_users_line():
    fill = epjit.lab.compile(FILL, arch="sm_90").fill
    ok = {"out": 0x7F0000000000, "value": 3, "scale": 2}
    values = fill.arguments(ok)
    assert [type(v) for v in values] == [np.uint64, np.int32, np.float32] and int(values[0]) == ok["out"]
    assert fill.arguments({**ok, "out": None})[0] == 0
    cases = [
        ({**ok, "vlaue": 1}, ArgumentError, r"fill has no parameter 'vlaue'; its parameters: out \(<source>:4\), "
                                            r"value \(<source>:5\), scale \(<source>:6\)"),
        ({"out": 0}, ArgumentError, r"fill: no value for value \(int, declared at <source>:5\), scale"),
        ({**ok, "value": 1.5}, ArgumentTypeError, r"parameter value \(int, declared at <source>:5\) must be an "
                                                  r"integer, got float"),
        ({**ok, "out": 1.5}, ArgumentTypeError, r"parameter out \(int\*, declared at <source>:4\) must be a device"),
        ({**ok, "out": np.zeros(4)}, ArgumentTypeError, r"out .* must be device memory, got host memory"),
        ({**ok, "scale": np.zeros(4)}, ArgumentTypeError, r"scale \(float, declared at <source>:6\) must be a number"),
        ({**ok, "value": 1 << 40}, ArgumentError, r"value .*: 1099511627776 is outside \[-2147483648, 2147483647\]"),
        ({**ok, "value": True}, ArgumentTypeError, r"must be an integer, got bool"),
    ]
    for named, error, said in cases:
        with pytest.raises(error, match=said):
            fill.arguments(named)


def test_a_launch_is_refused_before_any_gpu_is_touched():
    module = epjit.lab.compile(FILL, arch="sm_90")
    with pytest.raises(ArgumentError, match="has no kernel 'fil'"):
        module.launch("fil", 1, 32, out=0, value=1, scale=1.0)
    with pytest.raises(ArgumentError, match="fill has no parameter 'valu'"):
        module.fill(grid=1, block=32, out=0, valu=1, scale=1.0)
    with pytest.raises(ArgumentError, match=r"fill: grid must be a positive int or up to 3 of them, got 0"):
        module.fill(grid=0, block=32, out=0, value=1, scale=1.0)
    # A parameter named like a launch keyword goes through args=.
    grid_kernel = epjit.lab.compile('extern "C" __global__ void g(int grid) {}', arch="sm_90").g
    assert grid_kernel.arguments({"grid": 4}) == (np.int32(4),)


def test_a_compile_error_quotes_the_users_own_lines(tmp_path):
    broken = FILL.replace("value + ", "valu + ")
    with pytest.raises(CompileError) as info:
        epjit.lab.compile(broken, arch="sm_90")
    message = str(info.value)
    assert '<source>(7): error: identifier "valu" is undefined' in message, message
    assert "> 7 |     out[blockIdx.x * blockDim.x + threadIdx.x] = valu + static_cast<int>(scale);" in message
    assert "  6 |" in message and "  8 | }" in message
    path = tmp_path / "mine.cu"
    path.write_text(broken)
    with pytest.raises(CompileError, match=rf"{path}\(7\): error: identifier \"valu\""):
        epjit.lab.compile(path, arch="sm_90")


def test_the_cache_compiles_an_unchanged_source_once(tmp_path):
    first = epjit.lab.compile(FILL, arch="sm_90")
    again = epjit.lab.compile(FILL, arch="sm_90")
    assert not first.from_cache and again.from_cache and again.cubin_path == first.cubin_path
    assert _cubins(tmp_path) == [first.cubin_path]
    edited = epjit.lab.compile(FILL.replace("value +", "value * 2 +"), arch="sm_90")
    assert not edited.from_cache and len(_cubins(tmp_path)) == 2
    assert epjit.lab.compile(FILL, arch="sm_90").from_cache  # the first entry is still there
    defined = epjit.lab.compile(FILL, arch="sm_90", defines={"WIDTH": 4, "FAST": True, "OFF": False})
    assert not defined.from_cache and len(_cubins(tmp_path)) == 3
    assert epjit.lab.compile(FILL, arch="sm_90", defines=["WIDTH=4", "FAST"]).from_cache  # the same, spelt so
    with pytest.raises(ArgumentError, match="define '4X' is not a C identifier"):
        epjit.lab.compile(FILL, arch="sm_90", defines={"4X": 1})


def test_a_file_and_its_own_headers_are_keyed_by_content(tmp_path):
    folder = tmp_path / "kernels"
    folder.mkdir()
    (folder / "mine.cuh").write_text("#pragma once\nconstexpr int kValue = 1;\n")
    (folder / "mine.cu").write_text('#include "mine.cuh"\n#include "ptx.cuh"\n'
                                    'extern "C" __global__ void put(int* out) { out[0] = kValue; }\n')
    first = epjit.lab.compile(folder / "mine.cu", arch="sm_90")
    assert first.cubin_path.name.startswith("lab.mine.") and list(first.kernels) == ["put"]
    assert epjit.lab.compile(str(folder / "mine.cu"), arch="sm_90").from_cache
    (folder / "mine.cuh").write_text("#pragma once\nconstexpr int kValue = 2;\n")
    assert not epjit.lab.compile(folder / "mine.cu", arch="sm_90").from_cache
    with pytest.raises(ArgumentError, match="is not a file"):
        epjit.lab.compile(folder / "missing.cu", arch="sm_90")


def test_epjit_headers_compile_in_a_users_kernel():
    """A named PTX one-liner, the timed wait on a flag another GPU writes, a copy and the bf16 helpers."""
    source = """\
#include "ptx.cuh"
#include "wait.cuh"
#include "bf16.cuh"

extern "C" __global__ void wait_then_copy(const epjit::PeersTable* peers, const int* flag, int expected,
                                          const int4* in, int4* out, int num_int4) {
    if (threadIdx.x == 0) {
        const epjit::WaitSite site{"wait_then_copy: flag < expected", -1, static_cast<int>(blockIdx.x), expected};
        epjit::timeout_while(peers, site, [&](int64_t& observed) {
            observed = epjit::ptx::ld_acquire_sys_s32(flag);
            return observed < expected;
        });
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_int4; i += blockDim.x)
        epjit::ptx::st_global_L1_no_allocate_v4(out + i, epjit::ptx::ld_global_nc_L1_no_allocate_v4(in + i));
}
"""
    module = epjit.lab.compile(source, arch="sm_90")
    assert [p.ctype for p in module.wait_then_copy.signature.parameters] == [
        "epjit::PeersTable*", "int*", "int", "int4*", "int4*", "int"]


def test_a_kernel_linked_with_nvshmem_compiles():
    source = ('#include "nvshmem.cuh"\n'
              'extern "C" __global__ void my_pe(int* out) { out[0] = nvshmem_my_pe(); }\n')
    try:
        module = epjit.lab.compile(source, arch="sm_90", nvshmem=True)
    except SetupError as e:
        pytest.skip(f"NVSHMEM is not installed here: {e}")
    assert module.cubin_path.stat().st_size > 0 and list(module.kernels) == ["my_pe"]


def test_importing_the_lab_touches_no_gpu_or_compiler():
    probe = ("import sys, epjit; epjit.lab; bad = [m for m in ('cupy', 'mpi4py', 'nvshmem', 'torch', "
             "'cuda.bindings.nvrtc', 'cuda.bindings.runtime') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_peers_need_a_gpu_and_a_size():
    from types import SimpleNamespace

    with pytest.raises(ArgumentError, match="num_nvl_bytes must be an int >= 1, got 0"):
        epjit.lab.Peers(SimpleNamespace(device=0, num_nvl_ranks=1, size=1), 0)
    with pytest.raises(SetupError, match="peer memory needs a GPU"):
        epjit.lab.Peers(SimpleNamespace(device=None, num_nvl_ranks=1, size=1), 1 << 20)


def test_the_peers_kernels_of_the_gpu_check_compile():
    """The user's kernels the GPU check runs (tests/ranks/lab_peers.py): epjit's in-kernel barrier and timed wait
    over the PeersTable, the node's rank count a define."""
    text = (ROOT / "tests" / "ranks" / "lab_peers.py").read_text()
    source = text.split('SOURCE = r"""', 1)[1].split('"""', 1)[0]
    for ranks in (1, 2, 8):
        module = epjit.lab.compile(source, arch="sm_90", defines={"NUM_NVL_RANKS": ranks})
        assert list(module.kernels) == ["all_gather_row", "wait_forever"]


@pytest.mark.gpu
def test_a_users_kernel_runs_on_a_gpu():
    require_gpus(1)
    import cupy

    module = epjit.lab.compile(FILL)
    out = cupy.full(4 * 64, -1, dtype=cupy.int32)
    module.fill(grid=4, block=64, out=out, value=40, scale=2.0)
    module.launch("fill", (2, 1), (64,), out=out[128:], value=7, scale=0.0, stream=cupy.cuda.Stream.null)
    cupy.cuda.Device().synchronize()
    host = out.get()
    assert (host[:128] == 42).all() and (host[128:] == 7).all()


@pytest.mark.gpu
@pytest.mark.parametrize("wait_forever", [False, True], ids=["all-gather", "timeout"])
def test_a_users_kernel_over_peers(wait_forever):
    """tests/ranks/lab_peers.py on 2 ranks: a user's all-gather over epjit.lab.Peers is exact; a timed wait nobody
    ends becomes EpjitTimeoutError naming the rank and the wait."""
    from .gpu import run_ranks, two_ranks

    env = {**two_ranks(), "EPJIT_TIMEOUT_S": "3" if wait_forever else "60"}
    code, output, results = run_ranks("launch", 2, "tests/ranks/lab_peers.py",
                                      *(["--wait-forever"] if wait_forever else []), env=env, timeout=180)
    assert [r["rank"] for r in results] == [0, 1], output[-4000:]
    assert all(r["gather_errors"] == 0 for r in results), output[-4000:]
    if wait_forever:
        assert code != 0 and "EpjitTimeoutError" in output and "in wait_forever: flag < 1" in output, output[-4000:]
    else:
        assert code == 0, output[-4000:]
