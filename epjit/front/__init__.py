"""The front objects: between the user API (epjit.Buffer) and the kernel families (epjit.ops), one per family, each
owning that family's argument checks and its plan cache.

- :mod:`epjit.front.normal`: normal mode, inside one NVLink node (``IntranodeFront``) or across nodes
  (``InternodeFront``, which redoes the checks that differ);
- :mod:`epjit.front.low_latency`: low-latency mode;
- :mod:`epjit.front.common`: what every front shares (the resources of a Buffer, the plan cache, the stand-in for
  a family a Buffer does not have).

A front's call validates its arguments once per shape: each array is reduced to a fingerprint
(epjit.arrays.fingerprint), and a call whose fingerprints and arguments were validated before reuses that call's
plan. Either way the call's arrays reach the family as one typed record of inputs (epjit.ops.normal,
epjit.ops.low_latency), built at one place from the arrays as the kernels take them.

:func:`fronts` is where a Buffer's families are chosen: a new mode adds a front here, never a branch in Buffer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config import MAX_CHANNELS, Config, check_normal_sizes, normal_size_hint
from ..group import Group
from ..kernels.intranode import intranode_min_nvl_bytes
from ..kernels.low_latency import low_latency_size_hint
from .common import Absent, Resources
from .low_latency import LowLatencyFront, low_latency_rdma_bytes
from .normal import InternodeFront, IntranodeFront

NO_NORMAL = ("this Buffer has no NVLink buffer (num_nvl_bytes=0): normal-mode calls need one "
             "(Buffer.get_normal_size_hint)")
NO_LOW_LATENCY = "this Buffer was not made with low_latency_mode=True"
CLOSED = "this Buffer is closed"


def checked_sizes(group: Group, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
                  num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> int:
    """Validate a Buffer's sizes for the modes it runs (the same on every rank); returns num_rdma_bytes to reserve
    (low-latency mode's need where it was given none). Across NVLink nodes a Buffer serving both modes needs
    num_rdma_bytes for normal mode's region and then low-latency mode's (both_modes)."""
    both_across = low_latency_mode and bool(num_nvl_bytes) and group.num_nvl_ranks < group.size
    low_latency_bytes = 0
    if low_latency_mode:
        reserved = low_latency_rdma_bytes(group, num_max_dispatch_tokens_per_rank, hidden, num_experts,
                                          0 if both_across else num_rdma_bytes)
        if both_across:
            low_latency_bytes = reserved  # what it needs: normal mode's check below names both
        else:
            num_rdma_bytes = reserved
    if num_nvl_bytes or not low_latency_mode:  # normal mode (a low-latency Buffer may have both)
        check_normal_sizes(group.size, group.num_nvl_ranks, num_nvl_bytes, num_rdma_bytes, num_experts,
                           low_latency_bytes)
    return num_rdma_bytes


def both_modes(res: Resources) -> tuple[Resources, Resources]:
    """A Buffer serving both modes across NVLink nodes has one symmetric heap for both: normal mode's region from
    its start (every offset of the internode kernels as in a normal-mode Buffer), then low-latency mode's, the
    heap's last get_low_latency_size_hint bytes, which low-latency mode reaches through a PeersTable of its own
    (PeerMemory.tail_region: its kernels unchanged, their base moved). The resources of each mode."""
    need = low_latency_size_hint(res.num_max_dispatch_tokens_per_rank, res.hidden, res.group.size, res.num_experts)
    return (replace(res, low_latency_heap_bytes=need),
            replace(res, mem=res.mem.tail_region(need), num_rdma_bytes=need))


def nvl_size_hint(num_ranks: int, hidden: int, num_topk: int, num_experts: int, config: Config | None,
                  num_nvl_ranks: int | None) -> int:
    """Buffer.get_normal_size_hint: what the normal-mode family of these ranks needs of the NVLink buffer."""
    hint = normal_size_hint(num_ranks, hidden, num_topk, num_experts, config, num_nvl_ranks)  # checks sizes
    if num_nvl_ranks is not None and num_nvl_ranks != num_ranks:
        return hint  # across nodes: the internode kernels' layout, control words included
    return max(hint, intranode_min_nvl_bytes(int(num_ranks), MAX_CHANNELS))


def fronts(res: Resources, low_latency_mode: bool) -> tuple[Any, Any]:
    """The normal-mode and low-latency fronts of a Buffer with these resources (Absent where it has none): normal
    mode where it has an NVLink buffer, across nodes where its group spans several; low latency where asked."""
    made: list[Any] = []
    across = res.group.num_nvl_ranks < res.group.size
    normal_res, low_latency_res = both_modes(res) if low_latency_mode and across and res.num_nvl_bytes else (res, res)
    try:
        if res.num_nvl_bytes:
            family = InternodeFront if across else IntranodeFront
            # shrink mode of normal mode: a normal-mode Buffer's (a low-latency one's masks its low-latency calls)
            made.append(family(normal_res, res.enable_shrink and not low_latency_mode))
        else:
            made.append(Absent(NO_NORMAL))
        made.append(LowLatencyFront(low_latency_res) if low_latency_mode else Absent(NO_LOW_LATENCY))
    except BaseException:
        for front in made:
            front.close()
        raise
    return made[0], made[1]


__all__ = ["CLOSED", "Absent", "InternodeFront", "IntranodeFront", "LowLatencyFront", "Resources", "both_modes",
           "checked_sizes", "fronts", "low_latency_rdma_bytes", "nvl_size_hint"]
