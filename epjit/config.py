"""Config: how many SMs and how large the chunks of the normal-mode kernels are, and buffer size hints.

Pure Python (no GPU): the heuristics are unit-tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ArgumentError, with_rank
from .kernels.intranode import NUM_THREADS, intranode_nvl_bytes

# Reader warps of a combine receiver block (one of the block's warps coordinates): a ring must hold a whole chunk
# beyond the rows those readers may be waiting on at once, or the sender could wait for room that never frees.
COMBINE_READERS = NUM_THREADS // 32 - 1


@dataclass(frozen=True)
class Config:
    """SMs (two per channel: a sender and a receiver block) and chunk sizes in tokens.

    nvl_chunk_send: tokens a sender pushes between tail updates; nvl_chunk_recv: ring slots per (channel, rank).
    rdma_chunk_*: for the internode kernels (unused inside one NVLink node).
    """

    num_sms: int = 24
    nvl_chunk_send: int = 6
    nvl_chunk_recv: int = 256
    rdma_chunk_send: int = 6
    rdma_chunk_recv: int = 128

    def __post_init__(self) -> None:
        if self.num_sms < 2 or self.num_sms % 2:
            raise ArgumentError(with_rank(f"Config.num_sms={self.num_sms} must be an even number >= 2 "
                                          "(each channel takes a sender and a receiver SM)"))
        if self.nvl_chunk_send < 1:
            raise ArgumentError(with_rank(f"Config.nvl_chunk_send={self.nvl_chunk_send} must be >= 1"))
        if self.nvl_chunk_recv < self.nvl_chunk_send + COMBINE_READERS:
            raise ArgumentError(with_rank(
                f"Config.nvl_chunk_recv={self.nvl_chunk_recv} must be >= nvl_chunk_send + {COMBINE_READERS} "
                f"= {self.nvl_chunk_send + COMBINE_READERS}: a ring holds a chunk beyond what every combine "
                "reader warp may wait on"))

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def nvl_bytes(self, num_ranks: int, hidden: int, num_topk: int, num_experts: int, fp8: bool) -> int:
        """Bytes of NVLink buffer payload a normal-mode call with these sizes needs."""
        return intranode_nvl_bytes(num_ranks, self.num_channels, self.nvl_chunk_recv, hidden, num_topk,
                                   hidden // 128 if fp8 else 0, num_experts // num_ranks)


def _warps_per_peer(num_ranks: int) -> int:
    """Warps a sender block gives each other rank (cuda_src/intranode.cu: WarpRoles<..., true>::kPerGroup)."""
    return max(1, NUM_THREADS // 32 // max(1, num_ranks - 1))


def get_dispatch_config(num_ranks: int) -> Config:
    """Defaults for dispatch, by rank count. A sender's warps for one rank copy a chunk's tokens one each, so a
    chunk of two tokens per warp keeps them all busy between tail updates (first measured on 2 x H200)."""
    return Config(24, 2 * _warps_per_peer(num_ranks), 256)


def get_combine_config(num_ranks: int) -> Config:
    """Defaults for combine, by rank count: the same channels as dispatch (combine replays its channels)."""
    return Config(24, 2 * _warps_per_peer(num_ranks), 256)


def normal_size_hint(num_ranks: int, hidden: int, num_topk: int = 8, num_experts: int = 256,
                     config: Config | None = None) -> int:
    """num_nvl_bytes a Buffer needs for normal-mode dispatch (bf16 or FP8) and combine with these sizes."""
    configs = [config] if config is not None else [get_dispatch_config(num_ranks), get_combine_config(num_ranks)]
    return max(c.nvl_bytes(num_ranks, hidden, num_topk, num_experts, fp8) for c in configs for fp8 in (False, True))
