"""Specs of the normal-mode kernels (cuda_src/layout.cu, cuda_src/intranode.cu), the host mirror of the NVLink
buffer layout (cuda_src/intranode.cuh) and the config heuristics. Pure Python: testable without a GPU."""

from __future__ import annotations

from dataclasses import dataclass

from ..jit.spec import KernelSpec

PEERS = ("peers", "const PeersTable*")
NUM_THREADS = 768  # 24 warps a block: splits evenly among 1, 2, 3, 4, 6 and 8 ranks
# EPJIT_PROFILE: enum IntranodePoint of cuda_src/intranode.cu, in order (stamps per block, timeline.cuh)
TIMELINE_POINTS = ("start", "own_copied", "first_tail", "sent", "received", "last_tail")
NOTIFY_TIMELINE_POINTS = ("start", "written", "barrier", "end")  # enum NotifyPoint
CLAIMS = ("claims", "ChannelClaims*")  # cuda_src/placement.cuh: which block serves which channel
CLAIMS_INTS = 2 + 128  # sizeof(ChannelClaims) / 4: next, arrived, tpc_taken[kMaxTpcs]
META_INTS = 8  # intranode.cuh kMetaInts: {hidden, num_experts, num_topk, flags, recv_capacity, 0, 0, 0} a rank
META_COMPARED = 4  # kMetaCompared: the first four must agree across ranks


@dataclass(frozen=True)
class LayoutSpec(KernelSpec):
    """cuda_src/layout.cu: counts per rank/node/expert and is_token_in_rank from topk_idx."""

    SOURCE = "layout.cu"
    KERNELS = {
        "dispatch_layout": (("topk_idx", "const int64_t*"), ("num_tokens", "int"), ("num_topk", "int"),
                            ("num_experts", "int"), ("num_ranks", "int"), ("num_nvl_ranks", "int"),
                            ("num_tokens_per_rank", "int*"), ("num_tokens_per_rdma_rank", "int*"),
                            ("num_tokens_per_expert", "int*"), ("is_token_in_rank", "bool*"),
                            ("invalid_ids", "int*")),
    }


@dataclass(frozen=True)
class IntranodeNotifySpec(KernelSpec):
    num_ranks: int

    SOURCE = "intranode.cu"
    KERNELS = {
        "intranode_notify": (PEERS, ("num_tokens_per_rank", "const int*"), ("num_tokens_per_expert", "const int*"),
                             ("is_token_in_rank", "const bool*"), ("num_tokens", "int"), ("num_channels", "int"),
                             ("num_slots", "int"), ("hidden", "int"), ("num_topk", "int"), ("num_scales", "int"),
                             ("num_experts", "int"), ("flags", "int"), ("expert_alignment", "int"),
                             ("recv_capacity", "int"), ("cached", "int"), ("invalid_ids", "const int*"),
                             ("rank_prefix_matrix", "int*"),
                             ("channel_prefix_matrix", "int*"), ("host_out", "int*"), ("call_status", "int*"),
                             ("timeline", "uint64_t*")),
    }


@dataclass(frozen=True)
class IntranodeSpec(KernelSpec):
    num_ranks: int
    num_threads: int

    SOURCE = "intranode.cu"
    KERNELS = {
        "intranode_dispatch": (
            PEERS, CLAIMS, ("x", "const int4*"), ("x_scales", "const float*"), ("topk_idx", "const int64_t*"),
            ("topk_weights", "const float*"), ("is_token_in_rank", "const bool*"),
            ("channel_prefix_matrix", "const int*"), ("rank_prefix_matrix", "const int*"),
            ("call_status", "const int*"), ("recv_x", "int4*"), ("recv_x_scales", "float*"),
            ("recv_src_idx", "int*"), ("recv_topk_idx", "int64_t*"), ("recv_topk_weights", "float*"),
            ("recv_channel_offset", "int*"), ("send_head", "int*"), ("num_tokens", "int"), ("hidden", "int"),
            ("x_row_int4", "int"), ("num_scales", "int"), ("num_topk", "int"), ("num_experts", "int"),
            ("num_channels", "int"), ("num_slots", "int"), ("num_max_send_tokens", "int"),
            ("num_worst_tokens", "int"), ("timeline", "uint64_t*")),
        "intranode_combine": (
            PEERS, CLAIMS, ("y", "const int4*"), ("y_topk_weights", "const float*"), ("bias0", "const int4*"),
            ("bias1", "const int4*"), ("rank_prefix_matrix", "const int*"), ("recv_channel_offset", "const int*"),
            ("send_head", "const int*"), ("dispatch_status", "const int*"), ("out_x", "int4*"),
            ("out_topk_weights", "float*"), ("num_tokens", "int"), ("hidden", "int"), ("num_topk", "int"),
            ("num_channels", "int"), ("num_slots", "int"), ("num_max_send_tokens", "int"), ("timeline", "uint64_t*")),
    }

    def __post_init__(self) -> None:
        groups = 2 * (self.num_ranks - 1) + 1  # DispatchRoles: send to and drain each other rank, own copy
        if self.num_threads // 32 < groups or groups > 15:
            raise ValueError(f"{self.num_threads // 32} warps cannot form the {groups} dispatch groups of "
                             f"{self.num_ranks} ranks (one warp and one named barrier each, 15 barriers)")


def normal_grid(num_channels: int, num_device_sms: int) -> int:
    """Blocks a normal-mode kernel launches: twice its channels, at most one a device SM, never fewer than its
    channels. The channels go to blocks alone on their TPC (cuda_src/placement.cuh); the spare blocks return."""
    return max(num_channels, min(2 * num_channels, num_device_sms))


def _align128(n: int) -> int:
    return (n + 127) // 128 * 128


def intranode_nvl_bytes(num_ranks: int, num_channels: int, num_slots: int, hidden: int, num_topk: int,
                        num_scales: int, num_local_experts: int) -> int:
    """Bytes of NVLink payload the intranode kernels address (the mirror of IntranodeLayout's constructor)."""
    r, c, t, k = num_ranks, num_channels, num_slots, num_topk
    sizes = [4 * c * r * 4, 2 * c * r * 4, r * r * 4, r * META_INTS * 4, c * r * t * hidden * 2, c * r * t * 4,
             c * r * t * k * 4, c * r * t * k * 4, c * r * t * num_scales * 4, r * num_local_experts * 4]
    return sum(_align128(s) for s in sizes)


def intranode_min_nvl_bytes(num_ranks: int, max_channels: int) -> int:
    """What every rank's buffer must hold whatever the call: the control words, counts and meta (notify writes
    them before it knows whether this call's rings fit)."""
    return intranode_nvl_bytes(num_ranks, max_channels, 0, 0, 0, 0, 0)
