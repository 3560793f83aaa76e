"""What every backend of the group provides: the raw byte collectives (a :class:`Transport`), where this process
sits (a :class:`Placement`), and how a collective fails (:class:`ChannelFailure`, which the Group turns into a
CollectiveError). The transports themselves are in ``channel.py``, ``mpi.py`` and ``torch_dist.py``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


class ChannelFailure(Exception):
    """A collective over a transport failed; ``fatal`` when the transport can no longer be used."""

    def __init__(self, message: str, *, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


class Transport(Protocol):
    def allgather(self, data: bytes | None) -> list[bytes | None]: ...  # None in: my input was bad; None out: theirs

    def bcast(self, data: bytes | None, root: int) -> bytes | None: ...  # None out: the root's input was bad

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class SingleTransport:
    def allgather(self, data: bytes | None) -> list[bytes | None]:
        return [data]

    def bcast(self, data: bytes | None, root: int) -> bytes | None:
        return data

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Placement:
    rank: int
    size: int
    local_rank: int
    local_size: int
    node_key: int | None  # MPI: lowest rank of my shared-memory group; None: group ranks by host name


def int_var(environ: Mapping[str, str], name: str) -> int | None:
    try:
        return int(environ.get(name, ""))
    except ValueError:
        return None


def size_hint(environ: Mapping[str, str], names: tuple[str, ...] | None = None) -> tuple[str, int] | None:
    """The first variable that gives the number of ranks of this job, as (NAME, value)."""
    for name in names or ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE"):
        if name == "SLURM_NTASKS" and "SLURM_PROCID" not in environ:
            continue  # set in the batch script too; only srun's tasks have SLURM_PROCID
        n = int_var(environ, name)
        if n is not None:
            return name, n
    return None


def how_to_start(n: int) -> str:
    return (
        f"start it with `mpirun -np {n} python ...` (the mpirun of the MPI that mpi4py is built with) "
        f"or with `python -m epjit.launch -n {n} ...`"
    )
