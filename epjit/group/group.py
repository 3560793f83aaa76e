"""The :class:`Group`: the ranks of one job and their host collectives, over whichever transport :func:`init`
chose; and the group of this process (:func:`current`)."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ..errors import ArgumentError, ArgumentTypeError, CollectiveError, as_int, check_int, with_rank
from .transport import ChannelFailure, Transport

_T = TypeVar("_T")

# The group of the last init() that is not closed yet: init() sets it, Group.close() clears it, under this lock.
init_lock = threading.RLock()
_current: Group | None = None


def current() -> Group | None:
    """The group of the last :func:`init` that is not closed yet, or None."""
    return _current


def make_current(group: Group) -> None:
    """What init() does last, under ``init_lock``."""
    global _current
    _current = group


def _as_bytes(data: object) -> bytes | None:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    return None


def _short_repr(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def same(a: object, b: object) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except (ValueError, TypeError):
        # e.g. NumPy arrays, whose == is elementwise: compare what was sent instead
        return pickle.dumps(a) == pickle.dumps(b)


def _ranks_text(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def differs(what: str, values: list[Any]) -> str:
    """'hidden differs across ranks: rank 0: 7168, rank 1: 4096' (runs of equal values are merged)."""
    parts = []
    start = 0
    for r in range(1, len(values) + 1):
        if r == len(values) or not same(values[r], values[start]):
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
        transport: Transport,
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
        self._transport: Transport | None = transport
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

    def _run(self, op: str, fn: Callable[[Transport], _T]) -> _T:
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
        if not all(same(values[0], v) for v in values[1:]):
            raise ArgumentError(with_rank(differs(what, values)))

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
        with init_lock:
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

