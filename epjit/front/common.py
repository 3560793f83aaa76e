"""What every front shares: the resources of its Buffer, the plan cache, and the stand-in for a family a Buffer does
not have (or no longer has: closed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..env import Settings
from ..errors import ArgumentError, EpjitError, check_int, with_rank
from ..group import Group
from ..memory import PeerMemory
from ..ops.profile import Profile
from ..ops.streams import Outputs, Streams

MAX_PLANS = 512  # plans kept per front (a model has a few shapes; a sweep over many starts again)


@dataclass(eq=False)
class Resources:
    """A Buffer's sizes and what its families share: the group, peer memory, streams, outputs, profile, settings."""

    group: Group
    mem: PeerMemory
    streams: Streams
    outputs: Outputs
    profile: Profile
    settings: Settings
    buffer_id: int  # id() of the Buffer: its handles carry it, so a handle of another Buffer is refused
    num_nvl_bytes: int
    num_rdma_bytes: int
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    enable_shrink: bool = False  # low-latency mode: mask ranks that fail (docs/reliability.md)
    # Of num_rdma_bytes, what low-latency mode's region takes after normal mode's (a Buffer serving both across
    # NVLink nodes: epjit.front.both_modes); 0 where normal mode has the heap to itself.
    low_latency_heap_bytes: int = 0

    @property
    def device(self) -> int:
        device = self.group.device
        assert device is not None  # the Buffer refused a rank without a GPU
        return device


class Plans(dict):  # type: ignore[type-arg]
    """A front's plans by key: what one shape of a call needs, validated and built once."""

    def remember(self, key: tuple[Any, ...], plan: Any) -> Any:
        """Keep ``plan`` for the next call with this key, unless some array of the key had no fingerprint (None:
        a JAX array, say, whose every call is checked in full). Keys hold no other None."""
        if None not in key:
            if len(self) >= MAX_PLANS:
                self.clear()
            self[key] = plan
        return plan


class Absent:
    """Stands for a family a Buffer does not have, or for every family of a closed Buffer: each of its calls raises
    why; the bookkeeping every front does (check, close) does nothing."""

    def __init__(self, why: str) -> None:
        self.why = why

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise EpjitError(with_rank(self.why))

        return refuse


def check_rank_to_mask(rank_to_mask: Any, num_ranks: int) -> int:
    """A shrink-mode mask update's rank, checked: an int naming one of the Buffer's ranks."""
    rank = check_int(rank_to_mask, "rank_to_mask")
    if rank >= num_ranks:
        raise ArgumentError(with_rank(f"rank_to_mask={rank} is not a rank of this Buffer's {num_ranks}"))
    return rank
