"""Ranks: who is who, which GPU is mine, and the few host-side collectives that set-up needs.

``epjit.init()`` picks one of these backends:

- ``"mpi"``: under ``mpirun``/``mpiexec``/``srun`` (or with ``comm=`` an mpi4py communicator). mpi4py is imported
  in ``mpi.py`` and only there. The local rank comes from ``Split_type(COMM_TYPE_SHARED)``; nodes are numbered by
  the lowest rank of each shared-memory group.
- ``"launcher"``: under ``python -m epjit.launch``, over the launcher's TCP channel (``channel.py``; no MPI imported
  at all).
- ``"torch"``: under ``torchrun`` (torch.distributed's default group, or a gloo one epjit creates when the script
  has none), or with ``torch_group=`` any torch ProcessGroup, gloo or NCCL (``torch_dist.py``).
- ``"single"``: a plain ``python script.py``: one rank.

The collectives move bytes between host processes (IPC handles, the NVSHMEM unique id, sizes to check); they are
not meant for tensors. They are called by every rank in the same order, from one thread. A rank whose argument is
bad still takes part, so that no rank is left waiting: it raises an argument error, the others a CollectiveError
that names it.

The modules, bottom up: ``transport.py`` (what every backend provides), one module per backend (``channel.py``
with the launcher's server in ``rendezvous.py``, ``mpi.py``, ``torch_dist.py``), ``topology.py`` (nodes, NVLink
nodes and the GPU of each rank, decided alike on every rank), ``group.py`` (the :class:`Group` and its
collectives), ``bootstrap.py`` (:func:`init`).
"""

from __future__ import annotations

from .bootstrap import init
from .group import Group, current

__all__ = ["Group", "current", "init"]
