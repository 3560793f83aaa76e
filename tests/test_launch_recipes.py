"""launch/'s recipes (CPU tier): every script parses (`bash -n`); those that take arguments print their usage and exit 2
without them; launch/mpirun.sh, launch/mpirun_multinode.sh and launch/slurm_multinode.sbatch build the right command
line for Open MPI, MPICH and Slurm, checked with a fake `mpirun` or `srun` first on PATH that prints its arguments;
and docs/running.md's "Across nodes" names every file of launch/."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from .ranks.procs import clean_env

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
SCRIPTS = sorted(p.name for p in LAUNCH.iterdir() if p.is_file())
# The scripts that take arguments, and what their usage line says.
USAGE = {
    "mpirun.sh": "NUM_RANKS script.py [args...]",
    "mpirun_multinode.sh": "HOSTFILE RANKS_PER_NODE script.py [args...]",
    "slurm_multinode.sbatch": "usage: sbatch launch/slurm_multinode.sbatch script.py [args...]",
}
PYTHON = "/opt/venv/bin/python"  # what the recipes are told to start (PYTHON); never run here
IS_ROOT = os.geteuid() == 0

# A stand-in for mpirun and srun: names the MPI it plays when asked (FAKE_MPI), otherwise prints the settings the
# ranks would get and then one argument a line.
FAKE = """#!/usr/bin/env bash
if [ "${1:-}" = --version ]; then
  if [ "$FAKE_MPI" = openmpi ]; then echo "mpirun (Open MPI) 5.0.3"; else echo "HYDRA build details:"; fi
  exit 0
fi
echo "ENV NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
for a in "$@"; do echo "ARG $a"; done
"""


@pytest.fixture
def fake_bin(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("mpirun", "srun"):
        (folder / name).write_text(FAKE)
        (folder / name).chmod(0o755)
    return folder


def _run(fake_bin: Path, script: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
    """bash launch/SCRIPT ARGS with the fakes first on PATH and no NVSHMEM, NCCL or torch setting from outside."""
    env = {k: v for k, v in clean_env().items() if not re.match(r"(NVSHMEM|NCCL|TORCH|MPIRUN)_", k)}
    env.update(PATH=os.pathsep.join([str(fake_bin), env.get("PATH", "")]), PYTHON=PYTHON, **extra)
    return subprocess.run(["bash", str(LAUNCH / script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=30)


def _called(res: subprocess.CompletedProcess) -> tuple[str, list[str]]:
    """(the settings line, the arguments) the fake was called with."""
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("ENV "), res.stdout
    return lines[0], [line[4:] for line in lines[1:]]


def _exported(args: list[str]) -> list[str]:
    """The names Open MPI is told to pass on (-x NAME)."""
    return [args[i + 1] for i, a in enumerate(args) if a == "-x"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_parses(script):
    res = subprocess.run(["bash", "-n", str(LAUNCH / script)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def test_the_new_recipes_are_executable_and_say_how_to_use_them():
    for script in ("mpirun_multinode.sh", "slurm_multinode.sbatch"):
        path = LAUNCH / script
        assert os.access(path, os.X_OK), f"{script} is not executable"
        lines = path.read_text().splitlines()
        header = lines[1:next(i for i, line in enumerate(lines) if i and not line.startswith("#"))]
        assert len(header) >= 3 and f"launch/{script}" in "\n".join(header), header  # how to run it, in its header


@pytest.mark.parametrize("script", sorted(USAGE))
def test_usage_and_exit_2_without_arguments(fake_bin, script):
    res = _run(fake_bin, script)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "usage:" in res.stderr and USAGE[script] in res.stderr
    assert res.stdout == ""  # neither mpirun nor srun was started


def _hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hosts"
    path.write_text(text)
    return str(path)


def test_multinode_mpirun_under_open_mpi(fake_bin, tmp_path):
    hosts = _hostfile(tmp_path, "# two nodes\nnode-a slots=4\n\nnode-b slots=4  # the second\n")
    res = _run(fake_bin, "mpirun_multinode.sh", hosts, "4", "script.py", "a", "b c", FAKE_MPI="openmpi",
               NVSHMEM_IB_ENABLE_IBGDA="1", NCCL_NVLS_ENABLE="1", EPJIT_TIMEOUT_S="60",
               MPIRUN_ARGS="--mca btl ^openib")
    settings, args = _called(res)
    # NVLink multicast off unless set; a value the user set is kept
    assert settings == "ENV NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=1"
    head = ["--bind-to", "none", "--hostfile", hosts, "--map-by", "ppr:4:node"] + (
        ["--allow-run-as-root"] if IS_ROOT else [])
    assert args[:len(head)] == head, args
    assert args[-9:] == ["--mca", "btl", "^openib", "-np", "8", PYTHON, "script.py", "a", "b c"], args
    exported = _exported(args)
    for name in ("NVSHMEM_IB_ENABLE_IBGDA", "NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE", "EPJIT_TIMEOUT_S",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES"):
        assert name in exported, (name, exported)
    assert all(re.match(r"(EPJIT_|NVSHMEM_|NCCL_|TORCH_|CUDA_|PYTHON)", n) for n in exported), exported
    assert len(args) == len(head) + 2 * len(exported) + 9, args


def test_multinode_mpirun_under_mpich(fake_bin, tmp_path):
    hosts = _hostfile(tmp_path, "node-a:8\nnode-b:8\nnode-c\n# node-d:8\n")
    res = _run(fake_bin, "mpirun_multinode.sh", hosts, "2", "-m", "epjit.bench", FAKE_MPI="mpich")
    settings, args = _called(res)
    assert settings == "ENV NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0"
    # Hydra passes the whole environment: no -x; three hosts of 2 ranks
    assert args == ["-f", hosts, "-ppn", "2", "-np", "6", PYTHON, "-m", "epjit.bench"], args


@pytest.mark.parametrize(
    "hosts, per_node, message",
    [
        ("node-a slots=8\n", "0", "RANKS_PER_NODE must be a positive integer, got '0'"),
        ("node-a slots=8\n", "eight", "RANKS_PER_NODE must be a positive integer, got 'eight'"),
        ("# nothing\n\n", "8", "no hosts in"),
        (None, "8", "cannot read the hostfile"),
    ],
)
def test_multinode_mpirun_refuses_bad_arguments(fake_bin, tmp_path, hosts, per_node, message):
    path = _hostfile(tmp_path, hosts) if hosts is not None else str(tmp_path / "missing")
    res = _run(fake_bin, "mpirun_multinode.sh", path, per_node, "script.py", FAKE_MPI="openmpi")
    assert res.returncode == 2 and message in res.stderr, res.stdout + res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize("flavour", ["openmpi", "mpich"])
def test_single_host_mpirun_command_line(fake_bin, flavour):
    res = _run(fake_bin, "mpirun.sh", "4", "script.py", "x", FAKE_MPI=flavour, MPIRUN_ARGS="--hostfile hosts")
    settings, args = _called(res)
    assert settings == "ENV NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0"
    assert args[-7:] == ["--hostfile", "hosts", "-np", "4", PYTHON, "script.py", "x"], args
    if flavour == "openmpi":
        assert args[:2] == ["--bind-to", "none"] and "NVSHMEM_DISABLE_NVLS" in _exported(args), args
    else:
        assert len(args) == 7, args


def test_multinode_slurm_job(fake_bin):
    res = _run(fake_bin, "slurm_multinode.sbatch", "script.py", "--tokens", "64", NCCL_NVLS_ENABLE="1")
    settings, args = _called(res)
    assert settings == "ENV NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=1"
    assert args == ["--mpi=pmix", "--cpu-bind=none", "--distribution=block", PYTHON, "script.py", "--tokens",
                    "64"], args
    # One task a GPU on each of several nodes, and no per-task GPU binding (epjit.init binds the local rank's GPU).
    directives = dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)$", (LAUNCH / "slurm_multinode.sbatch").read_text(),
                                 re.MULTILINE))
    assert int(directives["nodes"]) >= 2
    assert directives["ntasks-per-node"] == directives["gpus-per-node"]
    assert not {"gpus-per-task", "gpu-bind"} & set(directives)


def test_across_nodes_section_names_every_launch_file():
    text = (ROOT / "docs" / "running.md").read_text()
    match = re.search(r"^## Across nodes\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, "docs/running.md has no '## Across nodes' section"
    missing = [name for name in SCRIPTS if f"launch/{name}" not in match.group(1)]
    assert not missing, f"docs/running.md's 'Across nodes' does not name {missing}"
