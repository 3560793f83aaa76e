"""``init()``: find the ranks of this job (the backend and its transport), decide the topology and the GPU of each
rank alike on every rank, bind this process to its GPU, and make the :class:`Group`."""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Callable, Mapping
from typing import Any, cast

from .. import env
from ..errors import ArgumentError, ArgumentTypeError, CollectiveError, SetupError, as_int, set_rank, with_rank
from . import channel, mpi, torch_dist
from .group import Group, current, differs, init_lock, make_current, same
from .topology import DRIVER_FILE, RankInfo, bind_gpu, gpu_plan, number_nodes, nvl_problem, visible_gpus
from .transport import ChannelFailure, Placement, SingleTransport, Transport, size_hint

# Variables that MPI launchers set in every rank: seeing one means "use MPI".
_MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK")


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
    hint = size_hint(environ, ("SLURM_NTASKS",))
    if hint is not None and hint[1] > 1:
        return "mpi"  # srun: mpi4py may work (PMI through Slurm); init checks that MPI sees the same size
    hint = size_hint(environ, ("WORLD_SIZE",))
    if hint is not None and hint[1] > 1:
        return "torch"  # torchrun, or anything else that sets torch.distributed's env:// variables
    return "single"


def _arg(value: object, ok: Callable[[object], bool]) -> Any:
    """What is sent of an argument: the value itself when it is of the right kind, else its repr (an error)."""
    return value if ok(value) else ("bad", repr(value), type(value).__name__)


def _is_nvl(v: object) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool))


def _is_bind(v: object) -> bool:
    return v is None or isinstance(v, bool)


def _setup(
    transport: Transport,
    backend: str,
    place: Placement,
    num_nvl_ranks: object,
    bind_device: object,
    comm: Any,
) -> Group:
    if (as_number := as_int(num_nvl_ranks)) is not None:
        num_nvl_ranks = as_number  # a NumPy integer is sent, compared and kept as the int it is
    gpus, note = (0, "bind_device=False") if bind_device is False else visible_gpus()
    mine = RankInfo(
        host=socket.gethostname(),
        node_key=place.node_key,
        local_rank=place.local_rank,
        local_size=place.local_size,
        nvl_arg=_arg(num_nvl_ranks, _is_nvl),
        bind_arg=_arg(bind_device, _is_bind),
        gpus=gpus,
        gpu_note=note,
        driver=os.path.exists(DRIVER_FILE),
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        share_gpus=env.settings().share_gpus,
    )
    try:
        infos: list[RankInfo] = [pickle.loads(cast(bytes, b)) for b in transport.allgather(pickle.dumps(mine))]
    except ChannelFailure as e:
        raise CollectiveError(with_rank(f"init failed: {e}")) from None

    # Every decision below is a function of `infos`, the same on every rank: all raise, or none does.
    for what, values, ok in (
        ("num_nvl_ranks", [i.nvl_arg for i in infos], _is_nvl),
        ("bind_device", [i.bind_arg for i in infos], _is_bind),
    ):
        if not all(same(values[0], v) for v in values[1:]):
            shown = [v[1] if isinstance(v, tuple) else v for v in values]
            raise ArgumentError(with_rank(differs(what, shown)))
        if not ok(values[0]):
            kind = "an int or None" if what == "num_nvl_ranks" else "True, False or None"
            raise ArgumentTypeError(with_rank(f"{what} must be {kind}, got {values[0][1]} ({values[0][2]})"))

    node_of, node_hosts = number_nodes(infos)
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
    problem = nvl_problem(nvl, node_of, local_size_of, host_of)
    if problem is not None:
        raise ArgumentError(with_rank(problem))

    plan, problem = gpu_plan(infos, cast("bool | None", bind_device), node_of)
    if problem is not None:
        raise SetupError(with_rank(problem))
    device = plan[place.rank]
    if any(p is not None for p in plan):
        # Binding can fail on one rank only (CuPy missing there, a GPU in a bad state): agree before anyone goes on.
        error = bind_gpu(device) if device is not None else None
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
    with init_lock:
        if torch_group is None and comm is not None and torch_dist.is_process_group(comm):
            comm, torch_group = None, comm  # a torch group passed where an MPI communicator goes
        if torch_group is not None and not torch_dist.is_process_group(torch_group):
            raise ArgumentTypeError(with_rank(f"torch_group must be a torch.distributed ProcessGroup, got "
                                              f"{type(torch_group).__name__}"))
        existing = current()
        if existing is not None:
            existing._check_reinit(comm, num_nvl_ranks, bind_device, torch_group)
            return existing
        environ = os.environ
        timeout = env.settings().collective_timeout_s
        backend = _choose_backend(environ, comm is not None, mpi.initialized(), torch_group is not None)
        user_comm = None
        transport: Transport
        if backend == "launcher":
            transport, place = channel.join(environ, timeout)
        elif backend == "mpi":
            transport, place, user_comm = mpi.join(comm, environ, timeout)
        elif backend == "torch":
            transport, place, user_comm = torch_dist.join(torch_group, environ, timeout)
        else:
            transport, place = SingleTransport(), Placement(0, 1, 0, 1, None)
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
        make_current(group)
        return group
