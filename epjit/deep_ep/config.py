"""DeepEP's ``Config`` for normal mode, carried onto epjit's :class:`epjit.Config`.

DeepEP's Config holds five numbers: SMs, and the NVLink and RDMA chunk sizes in tokens. epjit's kernels take the
same numbers under other names, so each DeepEP Config builds (and validates, at construction, as DeepEP's asserts
do) the epjit Config a call runs with. Its buffer-size hints answer for epjit's kernels, whose buffer layout is not
DeepEP's: a Buffer sized by them fits every call they promise.
"""

from __future__ import annotations

import dataclasses
import functools

from ..config import MAX_CHANNELS
from ..config import Config as EpjitConfig
from ..errors import ArgumentError, ArgumentTypeError, check_int, with_rank
from ..kernels.internode import config_problems, internode_spec
from ..kernels.intranode import intranode_min_nvl_bytes

# What get_nvl_buffer_size_hint assumes of the calls it sizes for (it is not told): the most top-k columns epjit's
# normal mode takes, and local experts a rank (their per-expert counts are the only part that grows with them).
HINT_MAX_TOPK = 32
HINT_MAX_LOCAL_EXPERTS = 1024
NVLINK_NODE_RANKS = 8  # DeepEP's NUM_MAX_NVL_PEERS: its static hints assume nodes of this many ranks


class Config:
    """DeepEP's ``Config(num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
    num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)`` with DeepEP's defaults.

    ``num_sms`` is epjit's ``Config.num_sms`` (channels, one SM each); the NVLink chunks are epjit's
    ``nvl_chunk_send`` / ``nvl_chunk_recv`` (epjit needs recv >= send + 23, DeepEP only recv > send); the RDMA
    chunks are epjit's ``rdma_chunk_send`` / ``rdma_chunk_recv`` across NVLink nodes (messages a put, ring slots).
    ``.epjit`` is the epjit Config.
    """

    __slots__ = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                 "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens", "epjit")

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.epjit = EpjitConfig(num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
                                 num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)
        e = self.epjit  # the values as epjit checked them (ints)
        self.num_sms = e.num_sms
        self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens = e.nvl_chunk_send, e.nvl_chunk_recv
        self.num_max_rdma_chunked_send_tokens = e.rdma_chunk_send
        self.num_max_rdma_chunked_recv_tokens = e.rdma_chunk_recv

    @classmethod
    def of(cls, config: EpjitConfig) -> Config:
        """The DeepEP Config with an epjit Config's numbers (its warp-role fields kept in ``.epjit``)."""
        made = cls(config.num_sms, config.nvl_chunk_send, config.nvl_chunk_recv, config.rdma_chunk_send,
                   config.rdma_chunk_recv)
        made.epjit = config
        return made

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}"
                f", num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """num_nvl_bytes that epjit's normal dispatch (bf16 or FP8) and combine of rows of ``hidden_bytes`` bytes
        (2 a bf16 channel) need on ``num_ranks`` ranks with this config, for up to HINT_MAX_TOPK top-k columns and
        HINT_MAX_LOCAL_EXPERTS local experts (DeepEP's own hint assumes an upper bound the same way). Past
        NVLINK_NODE_RANKS ranks, as DeepEP, nodes of that many ranks: what the internode kernels need of it."""
        hidden, num_ranks = _hint_sizes(hidden_bytes, num_ranks)
        experts = HINT_MAX_LOCAL_EXPERTS * num_ranks
        if num_ranks > NVLINK_NODE_RANKS:
            return self.epjit.internode_bytes(num_ranks, NVLINK_NODE_RANKS, hidden, HINT_MAX_TOPK, experts)[0]
        need = max(self.epjit.nvl_bytes(num_ranks, hidden, HINT_MAX_TOPK, experts, fp8) for fp8 in (False, True))
        return max(need, intranode_min_nvl_bytes(num_ranks, MAX_CHANNELS))

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """num_rdma_bytes of epjit's normal mode: 0 inside one NVLink node (as DeepEP's), and past
        NVLINK_NODE_RANKS ranks, as DeepEP, nodes of that many: what the internode kernels need of the symmetric
        heap with this config (under DeepEP's own hint for it: docs/deep_ep.md)."""
        hidden, num_ranks = _hint_sizes(hidden_bytes, num_ranks)
        if num_ranks <= NVLINK_NODE_RANKS:
            return 0
        return self.epjit.internode_bytes(num_ranks, NVLINK_NODE_RANKS, hidden, HINT_MAX_TOPK,
                                          HINT_MAX_LOCAL_EXPERTS * num_ranks)[1]


def _hint_sizes(hidden_bytes: int, num_ranks: int) -> tuple[int, int]:
    """bf16 channels of rows of hidden_bytes (FP8 rows are smaller, and the sizes hold both), and the ranks."""
    hidden_bytes = check_int(hidden_bytes, "hidden_bytes", 1)
    num_ranks = check_int(num_ranks, "num_ranks", 1)
    if num_ranks > NVLINK_NODE_RANKS and num_ranks % NVLINK_NODE_RANKS:
        raise ArgumentError(with_rank(f"num_ranks={num_ranks}: past one node DeepEP's hints assume nodes of "
                                      f"{NVLINK_NODE_RANKS} ranks, which do not divide it"))
    return -(-hidden_bytes // 2), num_ranks


def epjit_config(config: object) -> EpjitConfig | None:
    """The epjit Config a call runs with: a DeepEP Config's, an epjit Config as it is, or None."""
    if config is None or isinstance(config, EpjitConfig):
        return config
    if isinstance(config, Config):
        return config.epjit
    raise ArgumentTypeError(with_rank(f"config must be a deep_ep Config (epjit.deep_ep.Config) or an epjit.Config, "
                                      f"got {type(config).__name__}"))


@functools.lru_cache(maxsize=256)
def fit_internode(config: EpjitConfig, num_ranks: int, num_nvl_ranks: int) -> EpjitConfig:
    """A DeepEP Config's numbers as epjit's internode kernels can run them across nodes of ``num_nvl_ranks``.
    DeepEP's chunk sizes are tuning numbers: its own internode test sweeps RDMA chunks up to 32 tokens in NVLink
    rings of 512, where epjit's combine needs each node's sub-ring (nvl_chunk_recv / nodes) to hold a chunk beyond
    a forwarding group's round of RDMA chunks. So rdma_chunk_send is lowered to the largest that runs; a Config
    that still cannot run is returned as it is, for the call to refuse with the reason."""
    spec = internode_spec(num_ranks // num_nvl_ranks, num_nvl_ranks)
    nodes = num_ranks // num_nvl_ranks
    for send in range(config.rdma_chunk_send, 0, -1):
        if not config_problems(config.num_sms, config.nvl_chunk_send, config.nvl_chunk_recv, send,
                               config.rdma_chunk_recv, nodes, spec):
            return config if send == config.rdma_chunk_send else dataclasses.replace(config, rdma_chunk_send=send)
    return config
