"""Ranks: who is who, which GPU is mine, and the few host-side collectives that set-up needs.

``epjit.init()`` picks one of three backends:

- ``"mpi"``: under ``mpirun``/``mpiexec``/``srun`` (or with ``comm=`` an mpi4py communicator). mpi4py is imported
  here and only here. The local rank comes from ``Split_type(COMM_TYPE_SHARED)``; nodes are numbered by the lowest
  rank of each shared-memory group.
- ``"launcher"``: under ``python -m epjit.launch``, over the launcher's TCP channel (no MPI imported at all).
- ``"torch"``: under ``torchrun`` (torch.distributed's default group, or a gloo one epjit creates when the script
  has none), or with ``torch_group=`` any torch ProcessGroup, gloo or NCCL (``epjit/_torch_transport.py``).
- ``"single"``: a plain ``python script.py``: one rank.

The collectives move bytes between host processes (IPC handles, the NVSHMEM unique id, sizes to check); they are
not meant for tensors. They are called by every rank in the same order, from one thread. A rank whose argument is
bad still takes part, so that no rank is left waiting: it raises an argument error, the others a CollectiveError
that names it.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from . import _channel, env
from ._channel import ChannelFailure
from ._torch_transport import is_process_group
from .errors import (
    ArgumentError,
    ArgumentTypeError,
    CollectiveError,
    SetupError,
    as_int,
    check_int,
    set_rank,
    with_rank,
)

__all__ = ["Group", "current", "init"]

_T = TypeVar("_T")

# Variables that MPI launchers set in every rank: seeing one means "use MPI".
_MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK")
# Where the kernel driver says it is loaded (a GPU machine, even when the CUDA runtime cannot use it).
_DRIVER_FILE = "/proc/driver/nvidia/version"


# ----------------------------------------------------------------------------------------------------------------
# Transports: the raw collectives of each backend. They raise ChannelFailure; Group turns it into CollectiveError.
# ----------------------------------------------------------------------------------------------------------------


class _Transport(Protocol):
    def allgather(self, data: bytes | None) -> list[bytes | None]: ...  # None in: my input was bad; None out: theirs

    def bcast(self, data: bytes | None, root: int) -> bytes | None: ...  # None out: the root's input was bad

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class _SingleTransport:
    def allgather(self, data: bytes | None) -> list[bytes | None]:
        return [data]

    def bcast(self, data: bytes | None, root: int) -> bytes | None:
        return data

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class _LauncherTransport:
    def __init__(self, client: _channel.Client) -> None:
        self._client = client

    def allgather(self, data: bytes | None) -> list[bytes | None]:
        return self._client.allgather(data)

    def bcast(self, data: bytes | None, root: int) -> bytes | None:
        return self._client.bcast(data, root)

    def barrier(self) -> None:
        self._client.barrier()

    def close(self) -> None:
        self._client.close_group()


class _MpiTransport:
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


# ----------------------------------------------------------------------------------------------------------------
# Group
# ----------------------------------------------------------------------------------------------------------------


def _as_bytes(data: object) -> bytes | None:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    return None


def _short_repr(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except (ValueError, TypeError):
        # e.g. NumPy arrays, whose == is elementwise: compare what was sent instead
        return pickle.dumps(a) == pickle.dumps(b)


def _ranks_text(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def _differs(what: str, values: list[Any]) -> str:
    """'hidden differs across ranks: rank 0: 7168, rank 1: 4096' (runs of equal values are merged)."""
    parts = []
    start = 0
    for r in range(1, len(values) + 1):
        if r == len(values) or not _same(values[r], values[start]):
            parts.append(f"{_ranks_text(start, r - 1)}: {_short_repr(values[start])}")
            start = r
    return f"{what} differs across ranks: " + ", ".join(parts)


class Group:
    """The ranks of one epjit job, from :func:`init`. Close it (or use ``with``) when done; ``close`` is collective.

    Attributes: ``rank, size`` (in the communicator), ``local_rank, local_size`` (on this host), ``node,
    num_nodes`` (hosts, numbered by their lowest rank), ``num_nvl_ranks`` (ranks per NVLink node), ``nvl_rank =
    rank % num_nvl_ranks``, ``nvl_node = rank // num_nvl_ranks``, ``backend`` ('mpi' | 'launcher' | 'torch' |
    'single'),
    ``device`` (the CUDA ordinal this process uses, or None on the CPU tier), ``hosts`` (host name of each rank).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    node: int
    num_nodes: int
    num_nvl_ranks: int
    nvl_rank: int
    nvl_node: int
    backend: str
    device: int | None

    def __init__(
        self,
        *,
        transport: _Transport,
        backend: str,
        rank: int,
        size: int,
        local_rank: int,
        local_size: int,
        node: int,
        num_nodes: int,
        num_nvl_ranks: int,
        device: int | None,
        hosts: list[str],
        comm: Any = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.local_size = local_size
        self.node = node
        self.num_nodes = num_nodes
        self.num_nvl_ranks = num_nvl_ranks
        self.nvl_rank = rank % num_nvl_ranks
        self.nvl_node = rank // num_nvl_ranks
        self.backend = backend
        self.device = device
        self.hosts = hosts  # host name of every rank
        self._comm = comm  # the communicator the user passed (or COMM_WORLD), for init()'s second-call check
        self._transport: _Transport | None = transport
        self._broken: str | None = None
        self._lock = threading.Lock()
        self._on_close: list[Callable[[], None]] = []  # what layers above release with the group (NVSHMEM)

    def __repr__(self) -> str:
        return (
            f"Group(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, local_size={self.local_size}, "
            f"node={self.node}, num_nodes={self.num_nodes}, num_nvl_ranks={self.num_nvl_ranks}, "
            f"backend={self.backend!r}, device={self.device}{', closed' if self.closed else ''})"
        )

    @property
    def closed(self) -> bool:
        return self._transport is None

    def _run(self, op: str, fn: Callable[[_Transport], _T]) -> _T:
        with self._lock:
            transport = self._transport
            if transport is None:
                raise CollectiveError(with_rank(f"{op}: the group is closed"))
            if self._broken is not None:
                raise CollectiveError(
                    with_rank(f"{op}: the group is unusable since an earlier failure: {self._broken}")
                )
            try:
                return fn(transport)
            except ChannelFailure as e:
                if e.fatal:
                    self._broken = str(e)
                failure = str(e)
        # Raised outside the handler, so its context is what the caller was handling when it called (a Buffer closed
        # in a `finally` after an error): that error is printed with this one, not hidden behind the socket's.
        raise CollectiveError(with_rank(f"{op} failed: {failure}"))

    @staticmethod
    def _check_inputs(op: str, entries: list[bytes | None], my_problem: str | None) -> None:
        bad = [r for r, e in enumerate(entries) if e is None]
        if not bad:
            return
        if my_problem is not None:
            raise ArgumentTypeError(with_rank(f"{op}: {my_problem}"))
        who = ", ".join(map(str, bad))
        raise CollectiveError(with_rank(f"{op}: rank(s) {who} passed invalid input (see the error on that rank)"))

    # -- collectives --------------------------------------------------------------------------------------------

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (lengths may differ)."""
        payload = _as_bytes(data)
        out = self._run("allgather_bytes", lambda t: t.allgather(payload))
        problem = None if payload is not None else f"data must be bytes, got {type(data).__name__}"
        self._check_inputs("allgather_bytes", out, problem)
        return cast("list[bytes]", out)  # no None left after the check

    def bcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """The root's ``data`` on every rank (the other ranks' ``data`` is ignored; pass None)."""
        root = check_int(root, "bcast_bytes: root", None)
        if not 0 <= root < self.size:
            raise ArgumentError(with_rank(f"bcast_bytes: root={root!r} is not a rank of a group of {self.size}"))
        payload = _as_bytes(data) if self.rank == root else None
        out = self._run("bcast_bytes", lambda t: t.bcast(payload, root))
        if out is None:
            if self.rank == root:
                raise ArgumentTypeError(with_rank(f"bcast_bytes: the root must pass bytes, got {type(data).__name__}"))
            raise CollectiveError(with_rank(f"bcast_bytes: root rank {root} passed no bytes (see the error there)"))
        return out

    def barrier(self) -> None:
        """Return once every rank has called it."""
        self._run("barrier", lambda t: t.barrier())

    def allgather_object(self, obj: object) -> list[Any]:
        """Every rank's ``obj`` (pickled; small objects only), in rank order."""
        return self._allgather_object("allgather_object", obj)

    def _allgather_object(self, op: str, obj: object) -> list[Any]:
        problem = None
        try:
            payload: bytes | None = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError, ValueError, RecursionError) as e:
            payload, problem = None, f"cannot pickle a {type(obj).__name__}: {e}"
        out = self._run(op, lambda t: t.allgather(payload))
        self._check_inputs(op, out, problem)
        return [pickle.loads(b) for b in cast("list[bytes]", out)]

    def check_same(self, what: str, value: object) -> None:
        """Raise ArgumentError on every rank unless every rank passed an equal ``value``.

        The message lists each rank's value: ``hidden differs across ranks: rank 0: 7168, rank 1: 4096 (rank 0)``.
        """
        values = self._allgather_object(f"check_same({what!r})", value)
        if not all(_same(values[0], v) for v in values[1:]):
            raise ArgumentError(with_rank(_differs(what, values)))

    # -- lifetime -----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the group's communicator or channel. Collective: every rank calls it (or leaves the ``with``).

        A rank that closes while others wait in another collective makes them raise CollectiveError. Closing
        itself does not raise when the other ranks are already gone.
        """
        hooks, self._on_close = self._on_close, []
        try:
            for hook in hooks:
                hook()
        finally:
            self._close_transport()

    @property
    def broken(self) -> str | None:
        """Why a collective of this group failed (a peer gone, a timeout), or None while it works."""
        return self._broken

    def on_close(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` first thing when the group closes (every rank at once: closing is collective)."""
        self._on_close.append(hook)

    def _close_transport(self) -> None:
        global _current
        with self._lock:
            transport, self._transport = self._transport, None
        with _init_lock:
            if _current is self:
                _current = None
        if transport is not None and self._broken is None:
            try:
                transport.close()
            except ChannelFailure:
                pass  # the peers are gone or disagree; they learn it from their own call, and this group is over

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_reinit(self, comm: Any, num_nvl_ranks: int | None, bind_device: bool | None,
                      torch_group: Any = None) -> None:
        def refuse(what: str) -> ArgumentError:
            return ArgumentError(
                with_rank(f"epjit.init() was already called ({self!r}) and now {what}; close() that group first")
            )

        if comm is not None and (self.backend != "mpi" or not _same_comm(comm, self._comm)):
            raise refuse("with a different communicator")
        if torch_group is not None and (self.backend != "torch" or torch_group is not self._comm):
            raise refuse("with a different torch process group")
        as_number = as_int(num_nvl_ranks)
        if num_nvl_ranks is not None and as_number is None:  # 2.0 == 2: not a reason to accept it
            raise ArgumentTypeError(with_rank(f"num_nvl_ranks must be an int or None, got {num_nvl_ranks!r} "
                                              f"({type(num_nvl_ranks).__name__})"))
        if num_nvl_ranks is not None and as_number != self.num_nvl_ranks:
            raise refuse(f"with num_nvl_ranks={num_nvl_ranks!r} (the group has {self.num_nvl_ranks})")
        if bind_device is True and self.device is None:
            raise refuse("with bind_device=True (the group uses no GPU)")
        if bind_device is False and self.device is not None:
            raise refuse(f"with bind_device=False (the group uses GPU {self.device})")


def _same_comm(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


# ----------------------------------------------------------------------------------------------------------------
# Finding the ranks
# ----------------------------------------------------------------------------------------------------------------


def _int_var(environ: Mapping[str, str], name: str) -> int | None:
    try:
        return int(environ.get(name, ""))
    except ValueError:
        return None


def _size_hint(environ: Mapping[str, str], names: tuple[str, ...] | None = None) -> tuple[str, int] | None:
    """The first variable that gives the number of ranks of this job, as (NAME, value)."""
    for name in names or ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE"):
        if name == "SLURM_NTASKS" and "SLURM_PROCID" not in environ:
            continue  # set in the batch script too; only srun's tasks have SLURM_PROCID
        n = _int_var(environ, name)
        if n is not None:
            return name, n
    return None


def _choose_backend(environ: Mapping[str, str], comm_given: bool, mpi_initialized: bool,
                    torch_given: bool = False) -> str:
    """'launcher' | 'mpi' | 'torch' | 'single'."""
    if torch_given:
        return "torch"
    if comm_given:
        return "mpi"
    if environ.get(env.LAUNCH_ADDR):
        return "launcher"
    if mpi_initialized or any(environ.get(m) for m in _MPI_MARKERS):
        return "mpi"
    hint = _size_hint(environ, ("SLURM_NTASKS",))
    if hint is not None and hint[1] > 1:
        return "mpi"  # srun: mpi4py may work (PMI through Slurm); init checks that MPI sees the same size
    hint = _size_hint(environ, ("WORLD_SIZE",))
    if hint is not None and hint[1] > 1:
        return "torch"  # torchrun, or anything else that sets torch.distributed's env:// variables
    return "single"


def _how_to_start(n: int) -> str:
    return (
        f"start it with `mpirun -np {n} python ...` (the mpirun of the MPI that mpi4py is built with) "
        f"or with `python -m epjit.launch -n {n} ...`"
    )


def _mpi_initialized() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return False
    return bool(mpi.Is_initialized() and not mpi.Is_finalized())


@dataclass(frozen=True)
class _Placement:
    rank: int
    size: int
    local_rank: int
    local_size: int
    node_key: int | None  # MPI: lowest rank of my shared-memory group; None: group ranks by host name


def _launcher_transport(environ: Mapping[str, str], timeout: float | None) -> tuple[_Transport, _Placement]:
    global _client

    def need_int(name: str) -> int:
        value = _int_var(environ, name)
        if value is None or value < 0:
            raise SetupError(
                f"{env.LAUNCH_ADDR} is set but {name}={environ.get(name)!r} is not a rank number: "
                "was this process started by `python -m epjit.launch`?"
            )
        return value

    rank, size = need_int(env.RANK), need_int(env.WORLD_SIZE)
    local_rank, local_size = need_int(env.LOCAL_RANK), need_int(env.LOCAL_SIZE)
    addr, token = environ[env.LAUNCH_ADDR], environ.get(env.LAUNCH_TOKEN, "")
    if not (0 <= rank < size and 0 <= local_rank < local_size):
        raise SetupError(
            f"the launcher's variables are inconsistent: {env.RANK}={rank}, {env.WORLD_SIZE}={size}, "
            f"{env.LOCAL_RANK}={local_rank}, {env.LOCAL_SIZE}={local_size}"
        )
    client = _client
    if client is None or not client.usable or (client.addr, client.rank, client.size) != (addr, rank, size):
        try:
            client = _channel.Client(addr, token, rank, size, timeout)
        except (ChannelFailure, ValueError) as e:
            raise SetupError(f"rank {rank} cannot join the launcher's channel: {e}") from None
        _client = client  # kept for the life of the process: a later init() after close() reuses it
    return _LauncherTransport(client), _Placement(rank, size, local_rank, local_size, None)


def _mpi_transport(comm: Any, environ: Mapping[str, str], timeout: float | None) -> tuple[_Transport, _Placement, Any]:
    hint = _size_hint(environ, ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"))
    try:
        from mpi4py import MPI
    except ImportError as e:
        if hint is not None and hint[1] > 1:
            raise SetupError(
                f"{hint[0]}={hint[1]} says this process is one of {hint[1]} ranks, but mpi4py cannot be imported "
                f"({e}): pip install 'epjit[mpi]', or {_how_to_start(hint[1])}"
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
                + _how_to_start(hint[1])
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
    placement = _Placement(dup.Get_rank(), dup.Get_size(), local_rank, local_size, node_key)
    if dup.Get_size() > 1:
        _abort_job_on_uncaught_exception(MPI)
    return _MpiTransport(MPI, dup, timeout), placement, base


def _torch_transport(group: Any, environ: Mapping[str, str], timeout: float | None) -> tuple[_Transport, _Placement,
                                                                                              Any]:
    hint = _size_hint(environ, ("WORLD_SIZE",))
    try:
        from . import _torch_transport as tt

        transport, rank, size, group = tt.join(group, timeout)
    except ImportError as e:
        n = hint[1] if hint is not None else 2
        raise SetupError(
            f"WORLD_SIZE={n} says this process is one of {n} ranks (torchrun?), but torch.distributed cannot be "
            f"imported ({e}): install torch, or {_how_to_start(n)}"
        ) from None
    except (ValueError, RuntimeError) as e:  # no MASTER_ADDR / MASTER_PORT, a rendezvous that failed
        n = hint[1] if hint is not None else 2
        raise SetupError(
            f"WORLD_SIZE={n} says this process is one of {n} ranks, but it cannot join torch.distributed's default "
            f"process group ({e}): start it with `torchrun --nproc-per-node {n} ...`, or {_how_to_start(n)}"
        ) from None
    import torch.distributed as dist

    try:
        local_rank, local_size = tt.local_placement(transport, rank, group is dist.group.WORLD, environ,
                                                    socket.gethostname())
    except ChannelFailure as e:
        raise CollectiveError(f"init failed: {e}") from None
    return transport, _Placement(rank, size, local_rank, local_size, None), group


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


# ----------------------------------------------------------------------------------------------------------------
# Set-up decisions (pure functions of what every rank reported, so that every rank decides the same)
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RankInfo:
    host: str
    node_key: int | None
    local_rank: int
    local_size: int
    nvl_arg: Any  # num_nvl_ranks as passed (an int or None; otherwise its repr)
    bind_arg: Any  # bind_device as passed (True, False or None; otherwise its repr)
    gpus: int  # GPUs the CUDA runtime of this process sees (CUDA_VISIBLE_DEVICES applied)
    gpu_note: str | None  # why it sees none
    driver: bool  # an NVIDIA kernel driver is loaded on this host
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES
    share_gpus: bool = False  # EPJIT_SHARE_GPUS (tests only): more local ranks than GPUs allowed


def _visible_gpus() -> tuple[int, str | None]:
    """(count, why none) as this process's CUDA runtime sees them; cuda.bindings only, no CuPy import."""
    try:
        from cuda.bindings import runtime
    except ImportError as e:
        return 0, f"cuda-bindings is not importable ({e})"
    try:
        err, count = runtime.cudaGetDeviceCount()
    except (RuntimeError, OSError) as e:  # the driver library itself cannot be loaded
        return 0, f"no CUDA driver ({e})"
    if err == runtime.cudaError_t.cudaSuccess:
        return (int(count), None) if count else (0, "no CUDA device")
    if err == runtime.cudaError_t.cudaErrorNoDevice:  # e.g. CUDA_VISIBLE_DEVICES="" on a GPU machine
        return 0, "no CUDA device (cudaErrorNoDevice)"
    return 0, f"cudaGetDeviceCount: {getattr(err, 'name', err)}"


def _topology(infos: list[_RankInfo]) -> tuple[list[int], list[str]]:
    """(node of each rank, host of each node): nodes are numbered in the order of their lowest rank."""
    first_on_host: dict[str, int] = {}
    for r, info in enumerate(infos):
        first_on_host.setdefault(info.host, r)
    keys = [info.node_key if info.node_key is not None else first_on_host[info.host] for info in infos]
    order = sorted(set(keys))
    index = {k: i for i, k in enumerate(order)}
    return [index[k] for k in keys], [infos[k].host for k in order]


def _nvl_problem(num_nvl_ranks: int, node_of: list[int], local_size_of: list[int], host_of: list[str]) -> str | None:
    """Why num_nvl_ranks cannot work with this placement, or None."""
    size = len(node_of)
    if num_nvl_ranks < 1:
        return f"num_nvl_ranks must be >= 1, got {num_nvl_ranks}"
    for r in range(size):
        if local_size_of[r] < num_nvl_ranks:
            return (
                f"num_nvl_ranks={num_nvl_ranks} but host {host_of[r]} has only {local_size_of[r]} rank(s): "
                "an NVLink node cannot span hosts"
            )
    if size % num_nvl_ranks:
        return f"num_nvl_ranks={num_nvl_ranks} does not divide the {size} ranks into NVLink nodes"
    for first in range(0, size, num_nvl_ranks):
        last = first + num_nvl_ranks - 1
        nodes = sorted({node_of[r] for r in range(first, last + 1)})
        if len(nodes) > 1:
            hosts = sorted({host_of[r] for r in range(first, last + 1)})
            return (
                f"num_nvl_ranks={num_nvl_ranks}: NVLink node {first // num_nvl_ranks} (ranks {first}-{last}) spans "
                f"hosts {', '.join(hosts)}; place consecutive ranks on one host (e.g. mpirun --map-by slot)"
            )
    return None


def _gpu_plan(infos: list[_RankInfo], bind: bool | None, node_of: list[int]) -> tuple[list[int | None], str | None]:
    """The CUDA ordinal of every rank (None: no GPU), or why there cannot be one."""
    plan: list[int | None] = [None] * len(infos)
    if bind is False:
        return plan, None
    problems = []
    with_gpus, without = [], []
    for node in sorted(set(node_of)):
        ranks = [r for r in range(len(infos)) if node_of[r] == node]
        host = infos[ranks[0]].host
        counts = [infos[r].gpus for r in ranks]
        local = len(ranks)
        cvds = [infos[r].visible_devices for r in ranks]
        if max(counts) == 0:
            notes = "; ".join(sorted({infos[r].gpu_note or "no GPU" for r in ranks}))
            if bind is True:
                problems.append(f"bind_device=True but no GPU is visible on host {host} ({notes})")
            elif any(infos[r].driver for r in ranks) and "no CUDA device" not in notes:
                problems.append(
                    f"host {host} has an NVIDIA driver ({_DRIVER_FILE}) but the CUDA runtime cannot use it "
                    f"({notes}): install the CUDA wheels that match the driver, or pass bind_device=False"
                )
            without.append(host)
            continue
        with_gpus.append(host)
        if min(counts) >= local:
            for r in ranks:
                plan[r] = infos[r].local_rank
        elif all(c == 1 for c in counts) and all(cvds) and len(set(cvds)) == local:
            # A wrapper gave each local rank its own GPU through CUDA_VISIBLE_DEVICES: each uses its ordinal 0.
            for r in ranks:
                plan[r] = 0
        elif all(infos[r].share_gpus for r in ranks):
            # Tests only: ranks share the GPUs round robin; their kernels are time-sliced (correctness, not speed).
            for r in ranks:
                plan[r] = infos[r].local_rank % min(counts)
        else:
            seen = f" (CUDA_VISIBLE_DEVICES={cvds[0]})" if cvds[0] is not None else ""
            problems.append(f"{local} local ranks but only {min(counts)} GPU(s) on host {host}{seen}")
    if not problems and with_gpus and without:
        problems.append(
            f"hosts {', '.join(with_gpus)} have GPUs but {', '.join(without)} none: every rank needs a GPU, "
            "or pass bind_device=False"
        )
    if problems:
        return [None] * len(infos), "; ".join(problems)
    return plan, None


def _bind(ordinal: int) -> str | None:
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not importable ({e}): pip install 'epjit[cuda13]' (or [cuda12])"
    try:
        cupy.cuda.Device(ordinal).use()
    except RuntimeError as e:  # cupy's CUDARuntimeError
        return f"cannot use GPU {ordinal}: {e}"
    return None


def _arg(value: object, ok: Callable[[object], bool]) -> Any:
    """What is sent of an argument: the value itself when it is of the right kind, else its repr (an error)."""
    return value if ok(value) else ("bad", repr(value), type(value).__name__)


def _is_nvl(v: object) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool))


def _is_bind(v: object) -> bool:
    return v is None or isinstance(v, bool)


def _setup(
    transport: _Transport,
    backend: str,
    place: _Placement,
    num_nvl_ranks: object,
    bind_device: object,
    comm: Any,
) -> Group:
    if (as_number := as_int(num_nvl_ranks)) is not None:
        num_nvl_ranks = as_number  # a NumPy integer is sent, compared and kept as the int it is
    gpus, note = (0, "bind_device=False") if bind_device is False else _visible_gpus()
    mine = _RankInfo(
        host=socket.gethostname(),
        node_key=place.node_key,
        local_rank=place.local_rank,
        local_size=place.local_size,
        nvl_arg=_arg(num_nvl_ranks, _is_nvl),
        bind_arg=_arg(bind_device, _is_bind),
        gpus=gpus,
        gpu_note=note,
        driver=os.path.exists(_DRIVER_FILE),
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        share_gpus=env.settings().share_gpus,
    )
    try:
        infos: list[_RankInfo] = [pickle.loads(cast(bytes, b)) for b in transport.allgather(pickle.dumps(mine))]
    except ChannelFailure as e:
        raise CollectiveError(with_rank(f"init failed: {e}")) from None

    # Every decision below is a function of `infos`, the same on every rank: all raise, or none does.
    for what, values, ok in (
        ("num_nvl_ranks", [i.nvl_arg for i in infos], _is_nvl),
        ("bind_device", [i.bind_arg for i in infos], _is_bind),
    ):
        if not all(_same(values[0], v) for v in values[1:]):
            shown = [v[1] if isinstance(v, tuple) else v for v in values]
            raise ArgumentError(with_rank(_differs(what, shown)))
        if not ok(values[0]):
            kind = "an int or None" if what == "num_nvl_ranks" else "True, False or None"
            raise ArgumentTypeError(with_rank(f"{what} must be {kind}, got {values[0][1]} ({values[0][2]})"))

    node_of, node_hosts = _topology(infos)
    host_of = [i.host for i in infos]
    local_size_of = [i.local_size for i in infos]
    if num_nvl_ranks is None:
        sizes = sorted(set(local_size_of))
        if len(sizes) > 1:
            per_host = ", ".join(f"{h}: {local_size_of[host_of.index(h)]}" for h in node_hosts)
            raise ArgumentError(
                with_rank(f"hosts run different numbers of ranks ({per_host}): pass num_nvl_ranks explicitly")
            )
        nvl = sizes[0]
    else:
        nvl = cast(int, num_nvl_ranks)
    problem = _nvl_problem(nvl, node_of, local_size_of, host_of)
    if problem is not None:
        raise ArgumentError(with_rank(problem))

    plan, problem = _gpu_plan(infos, cast("bool | None", bind_device), node_of)
    if problem is not None:
        raise SetupError(with_rank(problem))
    device = plan[place.rank]
    if any(p is not None for p in plan):
        # Binding can fail on one rank only (CuPy missing there, a GPU in a bad state): agree before anyone goes on.
        error = _bind(device) if device is not None else None
        try:
            errors = [pickle.loads(cast(bytes, b)) for b in transport.allgather(pickle.dumps(error))]
        except ChannelFailure as e:
            raise CollectiveError(with_rank(f"init failed: {e}")) from None
        failed = [f"rank {r} on {host_of[r]}: {err}" for r, err in enumerate(errors) if err is not None]
        if failed:
            raise SetupError(with_rank("cannot bind GPUs: " + "; ".join(failed)))

    return Group(
        transport=transport,
        backend=backend,
        rank=place.rank,
        size=place.size,
        local_rank=place.local_rank,
        local_size=place.local_size,
        node=node_of[place.rank],
        num_nodes=len(node_hosts),
        num_nvl_ranks=nvl,
        device=device,
        hosts=host_of,
        comm=comm,
    )


# ----------------------------------------------------------------------------------------------------------------
# init
# ----------------------------------------------------------------------------------------------------------------

_init_lock = threading.RLock()
_current: Group | None = None
_client: _channel.Client | None = None  # this process's connection to epjit.launch, kept across close()/init()


def _configure_logging(level: str, rank: int) -> None:
    """EPJIT_LOG: quiet by default (epjit's loggers pass warnings on to the application's handlers); ``debug``
    prints every epjit log line to stderr, prefixed with the rank."""
    import logging

    logger = logging.getLogger("epjit")
    if level != "debug":
        return
    logger.setLevel(logging.DEBUG)
    if not any(getattr(h, "epjit_rank_handler", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(name)s: %(message)s"))
        handler.epjit_rank_handler = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


def current() -> Group | None:
    """The group of the last :func:`init` that is not closed yet, or None."""
    return _current


def init(comm: Any = None, num_nvl_ranks: int | None = None, *, bind_device: bool | None = None,
         torch_group: Any = None) -> Group:
    """Find the ranks of this job, bind this process to its GPU, and return the :class:`Group`.

    - ``comm``: an mpi4py intracommunicator to run over (default: MPI.COMM_WORLD under mpirun, the launcher's
      channel under ``python -m epjit.launch``, or a group of one rank for a plain ``python script.py``).
    - ``num_nvl_ranks``: how many consecutive ranks form one NVLink node (default: the ranks per host). Smaller
      values make one host act as several nodes (the internode path, testable on one machine).
    - ``bind_device``: None binds GPU ``local_rank`` when the host has GPUs and runs without one otherwise; True
      requires a GPU; False never touches CUDA.
    - ``torch_group``: a torch ProcessGroup (gloo or NCCL) to run over. Under ``torchrun`` without it, the default
      group (epjit creates a gloo one, and destroys it with this group, when the script has none).

    Collective: every rank calls it with the same arguments. A second call returns the same group (an explicit
    argument that disagrees with it raises ArgumentError). Raises SetupError when the job is not startable as is
    (e.g. launched as several ranks by something epjit cannot join, or more local ranks than GPUs), ArgumentError
    for bad or disagreeing arguments, on every rank alike.
    """
    global _current
    with _init_lock:
        if torch_group is None and comm is not None and is_process_group(comm):
            comm, torch_group = None, comm  # a torch group passed where an MPI communicator goes
        if torch_group is not None and not is_process_group(torch_group):
            raise ArgumentTypeError(with_rank(f"torch_group must be a torch.distributed ProcessGroup, got "
                                              f"{type(torch_group).__name__}"))
        if _current is not None:
            _current._check_reinit(comm, num_nvl_ranks, bind_device, torch_group)
            return _current
        environ = os.environ
        timeout = env.settings().collective_timeout_s
        backend = _choose_backend(environ, comm is not None, _mpi_initialized(), torch_group is not None)
        user_comm = None
        transport: _Transport
        if backend == "launcher":
            transport, place = _launcher_transport(environ, timeout)
        elif backend == "mpi":
            transport, place, user_comm = _mpi_transport(comm, environ, timeout)
        elif backend == "torch":
            transport, place, user_comm = _torch_transport(torch_group, environ, timeout)
        else:
            transport, place = _SingleTransport(), _Placement(0, 1, 0, 1, None)
        set_rank(place.rank if place.size > 1 else None)
        _configure_logging(env.settings().log, place.rank)
        try:
            group = _setup(transport, backend, place, num_nvl_ranks, bind_device, user_comm)
        except BaseException:
            try:
                transport.close()
            except ChannelFailure:
                pass  # the error being raised says more
            raise
        _current = group
        return group
