"""The MPI transport: the byte collectives over an mpi4py communicator (our own ``Dup`` of it), as non-blocking
collectives polled against ``EPJIT_COLLECTIVE_TIMEOUT_S``. mpi4py is imported here and only here, and only when
:func:`join` runs."""

from __future__ import annotations

import sys
import time
from array import array
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ..errors import ArgumentError, ArgumentTypeError, CollectiveError, SetupError
from .transport import ChannelFailure, Placement, Transport, how_to_start, size_hint

_T = TypeVar("_T")


class MpiTransport:
    def __init__(self, mpi: Any, comm: Any, timeout: float | None) -> None:
        self._mpi = mpi
        self._comm = comm  # our own Dup of the user's communicator: our messages never match theirs
        self._timeout = timeout

    def _wait(self, request: Any) -> None:
        if self._timeout is None:
            request.Wait()
            return
        # MPI cannot time out a blocking collective; a non-blocking one polled against a deadline can.
        deadline = time.monotonic() + self._timeout
        delay = 5e-6
        while not request.Test():
            if time.monotonic() > deadline:
                raise ChannelFailure(
                    f"timed out after {self._timeout:g} s waiting for the other ranks (EPJIT_COLLECTIVE_TIMEOUT_S)",
                    fatal=True,
                )
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)

    def _guard(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except self._mpi.Exception as e:
            raise ChannelFailure(f"MPI error: {e}", fatal=True) from None

    def allgather(self, data: bytes | None) -> list[bytes | None]:
        def run() -> list[bytes | None]:
            mpi, comm = self._mpi, self._comm
            mine = array("q", [-1 if data is None else len(data)])
            lengths = array("q", [0]) * comm.Get_size()
            self._wait(comm.Iallgather([mine, mpi.INT64_T], [lengths, mpi.INT64_T]))
            if min(lengths) < 0:
                return [None if n < 0 else b"" for n in lengths]
            counts = list(lengths)
            displs = [0] * len(counts)
            for i in range(1, len(counts)):
                displs[i] = displs[i - 1] + counts[i - 1]
            recv = bytearray(sum(counts))
            if recv:
                self._wait(comm.Iallgatherv([data, mpi.BYTE], [recv, (counts, displs), mpi.BYTE]))
            view = memoryview(recv)
            return [bytes(view[d : d + c]) for d, c in zip(displs, counts, strict=True)]

        return self._guard(run)

    def bcast(self, data: bytes | None, root: int) -> bytes | None:
        def run() -> bytes | None:
            mpi, comm = self._mpi, self._comm
            me = comm.Get_rank() == root
            length = array("q", [(-1 if data is None else len(data)) if me else 0])
            self._wait(comm.Ibcast([length, mpi.INT64_T], root))
            if length[0] < 0:
                return None
            buf = bytearray(data) if me and data is not None else bytearray(length[0])
            if length[0]:
                self._wait(comm.Ibcast([buf, mpi.BYTE], root))
            return data if me else bytes(buf)

        return self._guard(run)

    def barrier(self) -> None:
        self._guard(lambda: self._wait(self._comm.Ibarrier()))

    def close(self) -> None:
        if not self._mpi.Is_finalized():
            self._guard(self._comm.Free)


def initialized() -> bool:
    """Whether the program has MPI initialised (and not finalised) already: then the job is an MPI job."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return False
    return bool(mpi.Is_initialized() and not mpi.Is_finalized())


def join(comm: Any, environ: Mapping[str, str], timeout: float | None) -> tuple[Transport, Placement, Any]:
    """(transport, placement, base): the transport runs over a Dup of ``base``, which is ``comm`` or MPI.COMM_WORLD."""
    hint = size_hint(environ, ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"))
    try:
        from mpi4py import MPI
    except ImportError as e:
        if hint is not None and hint[1] > 1:
            raise SetupError(
                f"{hint[0]}={hint[1]} says this process is one of {hint[1]} ranks, but mpi4py cannot be imported "
                f"({e}): pip install 'epjit[mpi]', or {how_to_start(hint[1])}"
            ) from None
        raise SetupError(
            f"this looks like an MPI job but mpi4py cannot be imported ({e}): pip install 'epjit[mpi]'"
        ) from None
    if comm is None:
        if MPI.Is_finalized():
            raise SetupError("MPI is already finalized: call epjit.init() before MPI.Finalize()")
        base = MPI.COMM_WORLD
        if hint is not None and base.Get_size() != hint[1]:
            library = " ".join(MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].split())
            srun = " (under Slurm: srun --mpi=pmix, or mpirun inside the allocation)" if "SLURM" in hint[0] else ""
            raise SetupError(
                f"{hint[0]}={hint[1]} says this process is one of {hint[1]} ranks, but MPI.COMM_WORLD has "
                f"{base.Get_size()}: the job was not started by the MPI that mpi4py uses ({library}){srun}; "
                + how_to_start(hint[1])
            )
    else:
        if not isinstance(comm, MPI.Intracomm):
            raise ArgumentTypeError(
                f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), got {type(comm).__name__}"
            )
        if comm == MPI.COMM_NULL:
            raise ArgumentError("comm is MPI.COMM_NULL: this process is not part of that communicator")
        base = comm
    try:
        dup = base.Dup()
        shm = dup.Split_type(MPI.COMM_TYPE_SHARED, key=dup.Get_rank())
        local_rank, local_size = shm.Get_rank(), shm.Get_size()
        node_key = shm.allreduce(dup.Get_rank(), op=MPI.MIN)
        shm.Free()
    except MPI.Exception as e:
        raise CollectiveError(f"init failed: MPI could not split the communicator by host: {e}") from None
    placement = Placement(dup.Get_rank(), dup.Get_size(), local_rank, local_size, node_key)
    if dup.Get_size() > 1:
        _abort_job_on_uncaught_exception(MPI)
    return MpiTransport(MPI, dup, timeout), placement, base


_ABORT_GRACE_S = 0.5


def _abort_job_on_uncaught_exception(mpi: Any) -> None:
    """What ``python -m mpi4py`` does: a rank dying of an exception aborts the whole job. Without it the rank
    blocks in MPI_Finalize at exit and every other rank waits for it forever."""
    previous = sys.excepthook
    if getattr(previous, "epjit_aborts", False):
        return

    def hook(exc_type: Any, exc: Any, tb: Any) -> None:
        previous(exc_type, exc, tb)
        sys.stderr.flush()
        sys.stdout.flush()
        # mpiexec forwards each rank's output through a pipe and stops reading once the job aborts: give it a
        # moment to pass the traceback on (without it the last lines, the error itself, were sometimes lost).
        time.sleep(_ABORT_GRACE_S)
        mpi.COMM_WORLD.Abort(1)

    hook.epjit_aborts = True  # type: ignore[attr-defined]
    sys.excepthook = hook
