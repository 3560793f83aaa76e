"""Helpers of the GPU tier: how many GPUs there are (without importing CuPy into pytest's process), and how to
run N ranks of a script under either launcher with a hard timeout, collecting their RESULT lines."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_count() -> int:
    """GPUs the CUDA runtime sees, asked in a child process so pytest's own process never holds a context."""
    probe = "from cuda.bindings import runtime as r; e, n = r.cudaGetDeviceCount(); print(n if e == 0 else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        return int(out.stdout.strip() or 0)
    except (subprocess.SubprocessError, ValueError, OSError):
        return 0


_GPUS: int | None = None


def require_gpus(n: int) -> None:
    global _GPUS
    if _GPUS is None:
        _GPUS = gpu_count()
    if _GPUS < n:
        pytest.skip(f"needs {n} GPU{'s' if n > 1 else ''}, this machine has {_GPUS}")


# The rank counts of the multi-rank tests. A "-shared" case runs where the machine has fewer GPUs than ranks (at least
# one): several ranks a GPU (EPJIT_SHARE_GPUS; the driver time-slices their kernels, rank i on GPU i % GPUs). It
# checks the 2-, 4- and 8-rank code paths (prefix sums over 4 or 8 sources, acks to 3 or 7 peers, 8-way barriers)
# on machines with 1 or 2 GPUs, 8 ranks through each script's quick cases. Only a case without "-shared", one rank a
# GPU, proves them on NVLink as users run them, and only it may be reported as a run on that many GPUs. So a 1-GPU
# machine runs 2-, 4- and 8-shared; a 2-GPU one 2, 4-shared and 8-shared; a 4-GPU one 2, 4 and 8-shared.
RANKS = [pytest.param(2, False, id="2"), pytest.param(2, True, id="2-shared"), pytest.param(4, False, id="4"),
         pytest.param(4, True, id="4-shared"), pytest.param(8, True, id="8-shared")]


def placement(n: int, shared: bool) -> dict[str, str]:
    """Skip unless this machine can run `n` ranks as asked; the environment that places them."""
    if not shared:
        require_gpus(n)
        return {}
    require_gpus(1)
    assert _GPUS is not None
    if _GPUS >= n:
        pytest.skip(f"{_GPUS} GPUs here: the {n}-rank case runs one rank a GPU")
    return {"EPJIT_SHARE_GPUS": "1"}


def two_ranks() -> dict[str, str]:
    """The environment of a 2-rank run: one rank a GPU, or both on the one GPU of a 1-GPU machine (shared)."""
    require_gpus(1)
    return placement(2, _GPUS is not None and _GPUS < 2)


def quick(n: int, shared: bool) -> tuple[str, ...]:
    """The rank scripts' arguments: their quick cases where more than four ranks share the GPUs (8 ranks)."""
    return ("--quick",) if shared and n > 4 else ()


def mpirun() -> str | None:
    return shutil.which("mpirun") or shutil.which("mpiexec")


def rank_command(launcher: str, n: int, script: str, *args: str, env: dict[str, str] | None = None,
                 timeout: float = 240) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``script`` on ``n`` ranks under ``launcher`` ("launch": epjit.launch
    with ``--timeout``, "torchrun", or "mpirun"); skips the test where there is no mpirun."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full_env.get("PYTHONPATH", "")) if p)
    if launcher == "launch":
        cmd = [sys.executable, "-m", "epjit.launch", "-n", str(n), "--timeout", str(int(timeout)), script, *args]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), script, *args]
    elif launcher == "mpirun":
        runner = mpirun()
        if runner is None:
            pytest.skip("no mpirun on PATH")
        cmd = [runner, "-np", str(n)]
        version = subprocess.run([runner, "--version"], capture_output=True, text=True)
        # Open MPI passes only the variables -x names, and refuses root without being told; MPICH's Hydra passes
        # the whole environment and knows neither option.
        if "open mpi" in (version.stdout + version.stderr).lower():
            if os.geteuid() == 0:
                cmd.append("--allow-run-as-root")
            for var in ("PYTHONPATH", "PYTHONUNBUFFERED", "NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE",
                        "EPJIT_TIMEOUT_S", "EPJIT_CACHE_DIR", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "EPJIT_SHARE_GPUS"):
                if var in full_env:
                    cmd += ["-x", var]
        cmd += [sys.executable, script, *args]
    else:
        raise ValueError(launcher)
    return cmd, full_env


_RANK_PREFIX = re.compile(r"^(\[rank \d+\] )?(.*)$")
_DEALLOC_NOISE = "Exception ignored in: 'cupy.cuda.function.Module.__dealloc__'"


def without_unload_noise(output: str) -> str:
    """``output`` without the tracebacks CuPy prints for every module it fails to unload once a kernel has lost the
    CUDA context (a timeout trap): dozens a rank, they push the first error out of an assertion's tail. Followed rank
    by rank (the launcher's ``[rank i]`` prefix), since the ranks' lines interleave."""
    kept: list[tuple[int, str]] = []
    open_blocks: dict[str, list[tuple[int, str]]] = {}  # per rank prefix: the traceback being read
    dropped = 0
    for i, line in enumerate(output.splitlines()):
        prefix, body = _RANK_PREFIX.match(line).groups()
        block = open_blocks.get(prefix or "")
        if block is not None:
            block.append((i, line))
            if body.startswith(" "):
                continue  # a frame of the traceback
            frames = [b for _, b in block[1:-1] if b.strip()]
            if body.startswith("cupy_backends.cuda.api.driver.CUDADriverError") and all("driver.pyx" in f
                                                                                        for f in frames):
                dropped += 1
            else:
                kept += block
            del open_blocks[prefix or ""]
        elif body.startswith("Traceback (most recent call last):"):
            open_blocks[prefix or ""] = [(i, line)]
        elif body != _DEALLOC_NOISE:
            kept.append((i, line))
    for block in open_blocks.values():
        kept += block
    note = [f"({dropped} CuPy module-unload tracebacks after a lost CUDA context left out)"] if dropped else []
    return "\n".join([line for _, line in sorted(kept)] + note)


def _save_log(script: str, n: int, launcher: str, output: str) -> None:
    """The whole output of a run, under $OUT/ranks/ where $OUT is set (what a GPU machine's runner brings back)."""
    folder = os.environ.get("OUT")
    if not folder:
        return
    path = Path(folder) / "ranks"
    path.mkdir(parents=True, exist_ok=True)
    stem = f"{Path(script).stem}-{n}-{launcher}"
    index = sum(1 for _ in path.glob(f"{stem}-*.log"))
    (path / f"{stem}-{index}.log").write_text(output)


def run_ranks(launcher: str, n: int, script: str, *args: str, env: dict[str, str] | None = None,
              timeout: float = 240) -> tuple[int, str, list[dict]]:
    """Run ``script`` on ``n`` ranks; returns (exit code, combined output without CuPy's unload noise, the RESULT
    dicts). The whole output is also saved under $OUT/ranks/ where $OUT is set."""
    cmd, full_env = rank_command(launcher, n, script, *args, env=env, timeout=timeout)
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout + 60)
    _save_log(script, n, launcher, proc.stdout + proc.stderr)
    output = without_unload_noise(proc.stdout + proc.stderr)
    return proc.returncode, output, sorted(result_dicts(proc.stdout), key=lambda r: r["rank"])


def run_shrink_loop(script: str, mode: str) -> tuple[int, str, list[dict]]:
    """A shrink-mode loop (tests/ranks/shrink_loop.py's, in ``script``) on 4 ranks, 2 where there are fewer GPUs, one
    a GPU, rank 1 leaving it as ``mode`` says, with a 3 s shrink timeout: (ranks, output, RESULT dicts), once the
    launcher ended with code 0."""
    require_gpus(2)
    n = 4 if gpu_count() >= 4 else 2
    pytest.importorskip("torch")
    code, output, results = run_ranks("launch", n, script, "--mode", mode,
                                      env={"EPJIT_TIMEOUT_S": "60", "EPJIT_SHRINK_TIMEOUT_S": "3",
                                           **placement(n, False)}, timeout=300)
    assert code == 0, output[-8000:]
    return n, output, results


def result_dicts(stdout: str) -> list[dict]:
    """Every ``RESULT {json}`` the ranks printed. mpirun forwards the ranks' output in pieces, so two ranks' results
    can share a line ("...}RESULT {...") or lack the newline between them: each is decoded where it starts."""
    decoder = json.JSONDecoder()
    results = []
    for piece in stdout.split("RESULT ")[1:]:
        results.append(decoder.raw_decode(piece.lstrip())[0])
    return results


def torchrun_ranks(script: str, n: int, *args: str, env: dict[str, str], timeout: float) -> list[dict]:
    """``script args`` on ``n`` ranks under torchrun (``env`` from two_ranks() or placement()): asserts the job
    passed and every rank printed its RESULT, and returns those in rank order."""
    pytest.importorskip("torch")
    code, output, results = run_ranks("torchrun", n, script, *args, env={"EPJIT_TIMEOUT_S": "60", **env},
                                      timeout=timeout)
    assert code == 0, output[-8000:]
    assert len(results) == n, output[-4000:]
    return results
