"""torch.distributed as epjit's host transport: the few byte collectives of set-up (IPC handles, the NVSHMEM unique
id, arguments to compare) over a torch ``ProcessGroup``, gloo or NCCL, for jobs started by ``torchrun`` or run
inside a framework that already has its process groups (vLLM, SGLang, Megatron-LM).

torch is imported only when such a group is used: it stays optional. The collectives are tensor all-gathers of the
lengths, then of the padded bytes (an object collective would pickle twice and cannot be timed out); on a group
with a gloo backend they use CPU tensors and wait at most ``EPJIT_COLLECTIVE_TIMEOUT_S``, on an NCCL-only group
CUDA tensors on the current device (set it before, as NCCL itself requires) and NCCL's own watchdog times them out.
"""

from __future__ import annotations

import datetime
import socket
import sys
from collections.abc import Mapping
from typing import Any

from ..errors import CollectiveError, SetupError
from .transport import ChannelFailure, Placement, Transport, how_to_start, size_hint


def is_process_group(obj: object) -> bool:
    """Whether ``obj`` is a torch ProcessGroup, without importing torch where the caller never did."""
    if "torch" not in sys.modules:
        return False
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and isinstance(obj, dist.ProcessGroup)


class TorchTransport:
    """The byte collectives over ``group``. ``owns_default``: epjit created the default process group (a torchrun
    job whose script made none) and destroys it when the epjit group closes."""

    def __init__(self, dist: Any, group: Any, timeout: float | None, owns_default: bool) -> None:
        import torch

        self._torch, self._dist, self._group = torch, dist, group
        self._timeout = datetime.timedelta(seconds=timeout) if timeout is not None else None
        self._owns_default = owns_default
        backend = str(dist.get_backend(group)).lower()
        self._on_cpu = "gloo" in backend or "nccl" not in backend
        self._device = torch.device("cpu") if self._on_cpu else torch.device("cuda", torch.cuda.current_device())
        self.size = dist.get_world_size(group)

    def _wait(self, work: Any) -> None:
        try:
            if self._timeout is not None and self._on_cpu:
                work.wait(timeout=self._timeout)
            else:
                work.wait()
        except RuntimeError as e:  # gloo: a timeout, or a peer whose connection closed
            backend = self._dist.get_backend(self._group)
            raise ChannelFailure(f"torch.distributed ({backend}): {e}", fatal=True) from None

    def _gather(self, tensor: Any) -> list[Any]:
        out = [self._torch.empty_like(tensor) for _ in range(self.size)]
        self._wait(self._dist.all_gather(out, tensor, group=self._group, async_op=True))
        return out

    def allgather(self, data: bytes | None) -> list[bytes | None]:
        torch = self._torch
        mine = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64, device=self._device)
        lengths = [int(t.item()) for t in self._gather(mine)]
        if min(lengths) < 0:
            return [None if n < 0 else b"" for n in lengths]
        width = max(lengths)
        if width == 0:
            return [b""] * self.size
        padded = torch.zeros(width, dtype=torch.uint8, device=self._device)
        if data:
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._device)
        return [bytes(t[:n].cpu().numpy().tobytes()) for t, n in zip(self._gather(padded), lengths, strict=True)]

    def bcast(self, data: bytes | None, root: int) -> bytes | None:
        # An all-gather, not a broadcast: set-up sends a few hundred bytes, and one primitive keeps one code path.
        return self.allgather(data if self._dist.get_rank(self._group) == root else b"")[root]

    def barrier(self) -> None:
        self.allgather(b"")

    def close(self) -> None:
        if self._owns_default and self._dist.is_initialized():
            self._dist.destroy_process_group()


def _join_group(group: Any, timeout: float | None) -> tuple[TorchTransport, int, int, Any]:
    """(transport, rank, size, the group) for ``group``, or for torchrun's default group when ``group`` is None,
    creating a gloo one (env://, what torchrun sets) when the script has none. Raises ImportError without torch."""
    import torch.distributed as dist

    owns_default = False
    if group is None:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout) if timeout else None)
            owns_default = True
        group = dist.group.WORLD
    transport = TorchTransport(dist, group, timeout, owns_default)
    return transport, dist.get_rank(group), dist.get_world_size(group), group


def local_placement(transport: TorchTransport, rank: int, world: bool, environ: Mapping[str, str],
                    host: str) -> tuple[int, int]:
    """(local rank, local size): torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE for its default group, else the rank's
    place among the group's ranks on its host (host names gathered over the group)."""
    if world:
        local_rank, local_size = environ.get("LOCAL_RANK"), environ.get("LOCAL_WORLD_SIZE")
        if local_rank is not None and local_size is not None and local_rank.isdigit() and local_size.isdigit():
            return int(local_rank), int(local_size)
    hosts = [b.decode() if b is not None else "" for b in transport.allgather(host.encode())]
    return hosts[:rank].count(host), hosts.count(host)


def join(group: Any, environ: Mapping[str, str], timeout: float | None) -> tuple[Transport, Placement, Any]:
    """(transport, placement, the group) over ``group``, or over torchrun's default group when it is None."""
    hint = size_hint(environ, ("WORLD_SIZE",))
    try:
        transport, rank, size, group = _join_group(group, timeout)
    except ImportError as e:
        n = hint[1] if hint is not None else 2
        raise SetupError(
            f"WORLD_SIZE={n} says this process is one of {n} ranks (torchrun?), but torch.distributed cannot be "
            f"imported ({e}): install torch, or {how_to_start(n)}"
        ) from None
    except (ValueError, RuntimeError) as e:  # no MASTER_ADDR / MASTER_PORT, a rendezvous that failed
        n = hint[1] if hint is not None else 2
        raise SetupError(
            f"WORLD_SIZE={n} says this process is one of {n} ranks, but it cannot join torch.distributed's default "
            f"process group ({e}): start it with `torchrun --nproc-per-node {n} ...`, or {how_to_start(n)}"
        ) from None
    import torch.distributed as dist

    try:
        local_rank, local_size = local_placement(transport, rank, group is dist.group.WORLD, environ,
                                                 socket.gethostname())
    except ChannelFailure as e:
        raise CollectiveError(f"init failed: {e}") from None
    return transport, Placement(rank, size, local_rank, local_size, None), group
