"""Specs of the internode normal-mode kernels (cuda_src/internode.cu), the host mirror of their layouts
(cuda_src/internode.cuh) and their config rules and heuristics. Pure Python: testable without a GPU."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..jit.spec import KernelSpec, build_with, same_fields
from .foundation import TimelineRole
from .intranode import CLAIMS, PEERS

NUM_THREADS = 768  # 24 warps a block, as intranode's
MAX_NODES = 32  # kMaxNodes: a lane a node in the coordinators
MAX_INTERNODE_CHANNELS = 64  # kMaxInternodeChannels: two blocks a channel, num_sms <= 128
CHUNK_FLAGS = 64  # kChunkFlags: at most this many chunks in an RDMA ring
META_INTS = 8  # kInternodeMetaInts: {hidden, E, K, flags, recv_capacity, fwd_capacity, num_tokens, config}
RDMA_RING_BYTES = 544  # sizeof(RdmaRing): 64 flags, head_seen, tail, head, pad
NVL_RING_BYTES = 528  # sizeof(NvlRing): dispatch tail, head, combine tail[32], head[32]
HEAP_RINGS_OFFSET = 2 * MAX_NODES * 8 + 128  # kHeapRingsOffset: notify signals, the epoch
EXPERT_CAP = 4096  # notify areas hold this many experts' counts, or the Buffer's num_experts if larger
DISPATCH_BATCH = 32  # messages a forwarding group takes at once (and senders stage at once)
TIMELINE = ("timeline", "uint64_t*")  # EPJIT_PROFILE's stamps (0: none; only the profile build reads it)

# EPJIT_PROFILE: cuda_src/internode.cu's enums, in order. Notify stamps a row a block (InternodeNotifyPoint);
# dispatch and combine a row a (channel, role), the roles in DispatchRole / CombineRole order, each with its points
# (RdmaSenderPoint, ...): a point ending in _ns sums the nanoseconds the role's waiters spun, starved (for what it
# consumes) or blocked (for room where it produces).
NOTIFY_TIMELINE_POINTS = ("start", "sent", "rail", "folded", "node", "end")
DISPATCH_ROLE_POINTS = {
    "rdma_sender": ("start", "first_put", "last_put", "done", "blocked_ns"),
    "nvl_receiver": ("start", "first_tail", "last_tail", "done", "starved_ns"),
    "forwarder": ("start", "first_chunk", "last_forwarded", "done", "starved_ns", "blocked_ns"),
}
COMBINE_ROLE_POINTS = {
    "nvl_sender": ("start", "first_chunk", "last_chunk", "done", "blocked_ns"),
    "forwarder": ("start", "first_put", "last_put", "done", "starved_ns", "blocked_ns"),
    "reader": ("start", "first_token", "last_token", "done", "starved_ns"),
}


@dataclass(frozen=True)
class InternodeNotifySpec(KernelSpec):
    """cuda_src/internode.cu's notify: counts and meta over RDMA to the rail, then over NVLink to the node."""

    num_nodes: int
    num_nvl_ranks: int

    SOURCE = "internode.cu"
    USES_NVSHMEM = True
    KERNELS = {
        "internode_notify": (
            PEERS, ("num_tokens_per_rank", "const int*"), ("num_tokens_per_rdma_rank", "const int*"),
            ("num_tokens_per_expert", "const int*"), ("is_token_in_rank", "const bool*"), ("num_tokens", "int"),
            ("num_channels", "int"), ("hidden", "int"), ("num_topk", "int"), ("num_experts", "int"),
            ("expert_cap", "int"), ("flags", "int"), ("expert_alignment", "int"), ("recv_capacity", "int"),
            ("fwd_capacity", "int"), ("config_tag", "int"), ("layout_fits", "int"), ("invalid_ids", "const int*"),
            ("saved_counts", "int*"), ("channel_prefix_matrix", "int*"), ("rdma_channel_prefix", "int*"),
            ("recv_rank_prefix", "int*"), ("fwd_node_prefix", "int*"), ("host_out", "int*"),
            ("call_status", "int*"), TIMELINE),
    }

    def __post_init__(self) -> None:
        check_topology(self.num_nodes, self.num_nvl_ranks)


@dataclass(frozen=True)
class InternodeSpec(KernelSpec):
    """cuda_src/internode.cu's dispatch and combine: two blocks a channel, warps in roles (the fields past the
    block size; :func:`internode_spec` gives the defaults).

    Dispatch, sending block: dispatch_send_warps senders (each stages and puts its own chunks) and
    dispatch_recv_warps receivers for each other rank of the node; forwarding block: forward_warps for each
    destination rank of the node and a coordinator. Combine, sending block: combine_send_warps NVLink senders for
    each other rank of the node, a coordinator, readers the rest; forwarding block: combine_forward_groups groups
    of the warps, a home node each (in turn)."""

    num_nodes: int
    num_nvl_ranks: int
    num_threads: int
    dispatch_send_warps: int
    dispatch_recv_warps: int
    forward_warps: int
    combine_send_warps: int
    combine_forward_groups: int

    SOURCE = "internode.cu"
    USES_NVSHMEM = True
    KERNELS = {
        "internode_dispatch": (
            PEERS, CLAIMS, ("x", "const int4*"), ("x_scales", "const float*"), ("topk_idx", "const int64_t*"),
            ("topk_weights", "const float*"), ("is_token_in_rank", "const bool*"),
            ("channel_prefix_matrix", "const int*"), ("rdma_channel_prefix", "const int*"),
            ("recv_rank_prefix", "const int*"), ("fwd_node_prefix", "const int*"), ("call_status", "const int*"),
            ("recv_x", "int4*"), ("recv_x_scales", "float*"), ("recv_src_idx", "int*"), ("recv_topk_idx", "int64_t*"),
            ("recv_topk_weights", "float*"), ("recv_channel_offset", "int*"), ("recv_channel_count", "int*"),
            ("send_rdma_head", "int*"), ("recv_rdma_channel", "int*"), ("send_nvl_head", "int*"),
            ("num_tokens", "int"), ("hidden", "int"), ("num_scales", "int"), ("num_topk", "int"),
            ("num_experts", "int"), ("expert_cap", "int"), ("num_channels", "int"), ("rdma_slots", "int"),
            ("rdma_chunk", "int"), ("nvl_slots", "int"), ("num_worst_tokens", "int"), TIMELINE),
        "internode_combine": (
            PEERS, CLAIMS, ("y", "const int4*"), ("y_topk_weights", "const float*"), ("bias0", "const int4*"),
            ("bias1", "const int4*"), ("rdma_channel_prefix", "const int*"), ("recv_channel_offset", "const int*"),
            ("recv_channel_count", "const int*"), ("send_rdma_head", "const int*"),
            ("recv_rdma_channel", "const int*"), ("send_nvl_head", "const int*"), ("dispatch_status", "const int*"),
            ("out_x", "int4*"), ("out_topk_weights", "float*"), ("num_tokens", "int"), ("hidden", "int"),
            ("num_topk", "int"), ("expert_cap", "int"), ("num_channels", "int"), ("rdma_slots", "int"),
            ("rdma_chunk", "int"), ("nvl_slots", "int"), ("nvl_chunk", "int"), TIMELINE),
    }
    PROGRAMMATIC = frozenset({"internode_dispatch"})

    def __post_init__(self) -> None:
        check_topology(self.num_nodes, self.num_nvl_ranks)
        warps, peers = self.num_threads // 32, self.num_nvl_ranks - 1
        if self.num_threads % 32:
            raise ValueError(f"InternodeSpec: {self.num_threads} threads is not whole warps")
        if self.dispatch_send_warps < 1 or self.dispatch_send_warps + peers * self.dispatch_recv_warps > warps \
                or (peers and self.dispatch_recv_warps < 1) or peers > 14:
            raise ValueError(f"{warps} warps cannot hold {self.dispatch_send_warps} senders and "
                             f"{self.dispatch_recv_warps} receivers for each of {peers} node peers")
        if self.forward_warps < 1 or self.num_nvl_ranks * self.forward_warps + 1 > warps:
            raise ValueError(f"{warps} warps cannot hold {self.forward_warps} forwarders for each of "
                             f"{self.num_nvl_ranks} ranks of the node and a coordinator")
        if (peers and self.combine_send_warps < 1) or peers * self.combine_send_warps + 2 > warps:
            raise ValueError(f"{warps} warps cannot hold {self.combine_send_warps} combine senders for each of "
                             f"{peers} node peers, a coordinator and a reader")
        if not 1 <= self.combine_forward_groups <= min(15, warps, self.num_nodes):
            raise ValueError(f"combine_forward_groups={self.combine_forward_groups} must be in [1, "
                             f"{min(15, warps, self.num_nodes)}] (named barriers, warps, nodes)")

    @property
    def combine_group_warps(self) -> int:
        """Warps of one combine forwarding group (its tokens in flight: the NVLink sub-rings must hold them)."""
        return self.num_threads // 32 // self.combine_forward_groups


@dataclass(frozen=True)
class InternodeNotifyStoresSpec(InternodeNotifySpec):
    """cuda_src/internode.cu's notify built with the RDMA leg as NVLink stores (EPJIT_RDMA_BY_STORES:
    cuda_src/rdma.cuh), for virtual nodes on one host whose symmetric region is CUDA IPC memory. No NVSHMEM
    library."""

    DEFINES = ("EPJIT_RDMA_BY_STORES",)
    BUILD = "internode_stores"
    USES_NVSHMEM = False


@dataclass(frozen=True)
class InternodeStoresSpec(InternodeSpec):
    """cuda_src/internode.cu's dispatch and combine: InternodeSpec's kernels built with the RDMA leg as NVLink
    stores (EPJIT_RDMA_BY_STORES). No NVSHMEM library."""

    DEFINES = ("EPJIT_RDMA_BY_STORES",)
    BUILD = "internode_stores"
    USES_NVSHMEM = False


@dataclass(frozen=True)
class InternodeCombineFp8Spec(KernelSpec):
    """cuda_src/internode.cu's FP8 combine (Buffer.combine(..., use_fp8=True) across nodes): the bf16 combine's
    rings, receipts and warp roles, but each forwarder quantises its float32 partial to e4m3 with a float32 scale a
    128 channels for the RDMA leg (slots of fp8_combine_slot_bytes) and the readers sum the dequantised partials in
    float32. A build of its own, so the bf16 combine's module stays as it is and this one compiles only where it
    runs; :func:`internode_combine_fp8_spec` gives the one of an
    InternodeSpec."""

    num_nodes: int
    num_nvl_ranks: int
    num_threads: int
    combine_send_warps: int
    combine_forward_groups: int

    SOURCE = "internode.cu"
    BUILD = "internode_combine_fp8"
    USES_NVSHMEM = True
    KERNELS = {"internode_combine_fp8": InternodeSpec.KERNELS["internode_combine"]}


@dataclass(frozen=True)
class InternodeCombineFp8StoresSpec(InternodeCombineFp8Spec):
    """The FP8 combine built with the RDMA leg as NVLink stores (EPJIT_RDMA_BY_STORES). No NVSHMEM library."""

    DEFINES = ("EPJIT_RDMA_BY_STORES",)
    BUILD = "internode_combine_fp8_stores"
    USES_NVSHMEM = False


def internode_combine_fp8_spec(spec: InternodeSpec) -> InternodeCombineFp8Spec:
    """The FP8 combine with the topology and combine warp roles of ``spec`` (its stores build: ``spec``'s)."""
    fp8 = InternodeCombineFp8StoresSpec if isinstance(spec, InternodeStoresSpec) else InternodeCombineFp8Spec
    return fp8(spec.num_nodes, spec.num_nvl_ranks, spec.num_threads, spec.combine_send_warps,
               spec.combine_forward_groups)


_STORES: dict[type, type] = {InternodeNotifySpec: InternodeNotifyStoresSpec, InternodeSpec: InternodeStoresSpec,
                             InternodeCombineFp8Spec: InternodeCombineFp8StoresSpec}


def by_stores(spec: InternodeNotifySpec | InternodeSpec | InternodeCombineFp8Spec) -> KernelSpec:
    """The same kernels at the same instantiation, built with the RDMA leg as NVLink stores."""
    stores = next(stores for family, stores in _STORES.items() if isinstance(spec, family))
    return same_fields(spec, stores)


# The profile build (a Buffer made with EPJIT_PROFILE=1): each build again with EPJIT_INTERNODE_PROFILE, the only one
# whose kernels stamp the timeline they take (and time their waits). A build of its own, so the production kernels
# ignore the argument and are the code they were without stamps (cuda_src/internode.cu: kInternodeProfile).
PROFILE = "EPJIT_INTERNODE_PROFILE"


InternodeNotifyProfileSpec = build_with(InternodeNotifySpec, PROFILE, "Profile", __name__)
InternodeProfileSpec = build_with(InternodeSpec, PROFILE, "Profile", __name__)
InternodeCombineFp8ProfileSpec = build_with(InternodeCombineFp8Spec, PROFILE, "Profile", __name__)
InternodeNotifyStoresProfileSpec = build_with(InternodeNotifyStoresSpec, PROFILE, "Profile", __name__)
InternodeStoresProfileSpec = build_with(InternodeStoresSpec, PROFILE, "Profile", __name__)
InternodeCombineFp8StoresProfileSpec = build_with(InternodeCombineFp8StoresSpec, PROFILE, "Profile", __name__)
PROFILE_BUILDS: dict[type, type] = {
    InternodeNotifySpec: InternodeNotifyProfileSpec, InternodeSpec: InternodeProfileSpec,
    InternodeCombineFp8Spec: InternodeCombineFp8ProfileSpec,
    InternodeNotifyStoresSpec: InternodeNotifyStoresProfileSpec, InternodeStoresSpec: InternodeStoresProfileSpec,
    InternodeCombineFp8StoresSpec: InternodeCombineFp8StoresProfileSpec}


def profile_spec(spec: InternodeNotifySpec | InternodeSpec | InternodeCombineFp8Spec) -> KernelSpec:
    """The same kernels at the same instantiation (and RDMA leg) in the profile build; a profile build is returned
    as it is."""
    build = PROFILE_BUILDS.get(type(spec))
    return spec if build is None else same_fields(spec, build)


@functools.cache
def timeline_roles(spec: InternodeSpec | InternodeCombineFp8Spec, kernel: str) -> tuple[TimelineRole, ...]:
    """EPJIT_PROFILE's rows of a channel of ``kernel`` (internode_dispatch, or a combine) built from ``spec``: its
    roles in the kernel's order, with their waiters a channel (internode.cu's stamp_wait sites: a dispatch sender
    warp, a receiver or forwarding group's leader; a combine sender group's leader, a forwarding or reading warp)."""
    warps, peers = spec.num_threads // 32, spec.num_nvl_ranks - 1
    if kernel == "internode_dispatch":
        assert isinstance(spec, InternodeSpec)
        points = DISPATCH_ROLE_POINTS
        waiters = {"rdma_sender": spec.dispatch_send_warps, "nvl_receiver": peers, "forwarder": spec.num_nvl_ranks}
    else:
        groups = spec.combine_forward_groups
        points = COMBINE_ROLE_POINTS
        waiters = {"nvl_sender": peers, "forwarder": groups * (warps // groups),
                   "reader": warps - peers * spec.combine_send_warps - 1}
    return tuple(TimelineRole(name, role_points, waiters[name]) for name, role_points in points.items())


def check_topology(num_nodes: int, num_nvl_ranks: int) -> None:
    if not 2 <= num_nodes <= MAX_NODES or not 1 <= num_nvl_ranks <= 8:
        raise ValueError(f"internode kernels take 2 to {MAX_NODES} nodes of 1 to 8 ranks, got {num_nodes} nodes "
                         f"of {num_nvl_ranks}")


def default_roles(num_nodes: int, num_nvl_ranks: int, num_threads: int = NUM_THREADS) -> dict[str, int]:
    """The warp roles by node size: receivers and combine senders a node peer shrink as the peers grow (a few warps
    drain or fill an NVLink ring), the senders and forwarders take the rest; a combine forwarding group a node."""
    warps, peers = num_threads // 32, num_nvl_ranks - 1
    recv = {0: 0, 1: 6, 2: 4, 3: 3}.get(peers, 2)
    combine_send = 0 if peers == 0 else min(4, 8 // peers)
    return {"dispatch_send_warps": warps - peers * recv, "dispatch_recv_warps": recv,
            "forward_warps": (warps - 1) // num_nvl_ranks, "combine_send_warps": combine_send,
            "combine_forward_groups": min(num_nodes, 12)}


def internode_spec(num_nodes: int, num_nvl_ranks: int, num_threads: int = NUM_THREADS) -> InternodeSpec:
    return InternodeSpec(num_nodes, num_nvl_ranks, num_threads, **default_roles(num_nodes, num_nvl_ranks,
                                                                                 num_threads))


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def slot_bytes(hidden: int, num_topk: int) -> int:
    """One message slot (slot_bytes of internode.cuh): a 16-byte header, a bf16 row, top-k ids and weights."""
    return _align(16 + 2 * hidden + 8 * num_topk, 16)


def fp8_combine_slot_bytes(hidden: int, num_topk: int) -> int:
    """One RDMA slot of the FP8 combine (fp8_combine_slot_bytes of internode.cuh): the header, e4m3 [H], float
    scales [H / 128], weights [K]: what crosses between nodes a forwarded token."""
    return _align(16 + hidden + hidden // 32 + 4 * num_topk, 16)


def notify_rdma_ints(num_ranks: int, num_nodes: int, expert_cap: int) -> int:
    return _align(META_INTS + num_ranks + num_nodes + expert_cap // num_nodes, 4)


def notify_nvl_ints(num_ranks: int, num_nodes: int, expert_cap: int) -> int:
    return _align(10 * num_nodes + num_ranks + expert_cap // num_ranks, 4)


def heap_fixed_bytes(num_ranks: int, num_nodes: int, expert_cap: int) -> int:
    """Symmetric heap bytes before the rings (InternodeHeap): signals, epoch, ring words, notify areas, staging."""
    off = _align(HEAP_RINGS_OFFSET + MAX_INTERNODE_CHANNELS * num_nodes * RDMA_RING_BYTES, 128)
    area = 2 * num_nodes * notify_rdma_ints(num_ranks, num_nodes, expert_cap) * 4
    return _align(off + 2 * area, 128)


def internode_rdma_bytes(num_ranks: int, num_nodes: int, expert_cap: int, num_channels: int, rdma_slots: int,
                         hidden: int, num_topk: int) -> int:
    """Symmetric heap bytes a call addresses: the fixed part, then send and receive halves of [C][N][T] slots."""
    return heap_fixed_bytes(num_ranks, num_nodes, expert_cap) + \
        2 * num_channels * num_nodes * rdma_slots * slot_bytes(hidden, num_topk)


def nvl_fixed_bytes(num_ranks: int, num_nodes: int, expert_cap: int) -> int:
    """NVLink payload bytes before the rings (InternodeNvl): ring counters and notify areas."""
    nvl_ranks = num_ranks // num_nodes
    off = _align(MAX_INTERNODE_CHANNELS * nvl_ranks * NVL_RING_BYTES, 128)
    return _align(off + 2 * nvl_ranks * notify_nvl_ints(num_ranks, num_nodes, expert_cap) * 4, 128)


def internode_nvl_bytes(num_ranks: int, num_nodes: int, expert_cap: int, num_channels: int, nvl_slots: int,
                        hidden: int, num_topk: int) -> int:
    """NVLink buffer payload bytes a call addresses: the fixed part, then [C][V][Tn] slots (none with one rank a
    node: a forwarder writes its own rank's rows straight into the outputs, so no NVLink ring is ever used)."""
    nvl_ranks = num_ranks // num_nodes
    rings = num_channels * nvl_ranks * nvl_slots * slot_bytes(hidden, num_topk) if nvl_ranks > 1 else 0
    return nvl_fixed_bytes(num_ranks, num_nodes, expert_cap) + rings


def deepep_rdma_size_hint(num_channels: int, num_nodes: int, rdma_slots: int, hidden: int) -> int:
    """DeepEP's num_rdma_bytes for the same config (its get_rdma_buffer_size_hint: a slot holds the row, 8 bytes of
    source meta, 128 int64 ids, 128 weights, 128 scales and an int4; send and receive halves; rounded to 128)."""
    return _align(2 * num_channels * num_nodes * (72 + rdma_slots * (2 * hidden + 2072)), 128)


def config_problems(num_sms: int, nvl_chunk_send: int, nvl_chunk_recv: int, rdma_chunk_send: int,
                    rdma_chunk_recv: int, num_nodes: int, spec: InternodeSpec) -> list[str]:
    """What an internode call cannot run with, from its Config's numbers (empty: it can)."""
    problems = []
    if num_sms % 2 or not 2 <= num_sms <= 2 * MAX_INTERNODE_CHANNELS:
        problems.append(f"num_sms={num_sms} must be even and in [2, {2 * MAX_INTERNODE_CHANNELS}] (two blocks a "
                        "channel across nodes)")
    chunks = rdma_chunk_recv // rdma_chunk_send
    least = 2 + -(-DISPATCH_BATCH // rdma_chunk_send)
    if not least <= chunks <= CHUNK_FLAGS:
        problems.append(f"rdma_chunk_recv // rdma_chunk_send = {rdma_chunk_recv} // {rdma_chunk_send} = {chunks} "
                        f"chunks must be in [{least}, {CHUNK_FLAGS}] (a ring holds a window of {DISPATCH_BATCH} "
                        f"tokens beyond two chunks, and one flag a chunk)")
    if nvl_chunk_recv < DISPATCH_BATCH + 1:
        problems.append(f"nvl_chunk_recv={nvl_chunk_recv} must be >= {DISPATCH_BATCH + 1} (a forwarding batch and "
                        "a meta message)")
    sub, round_rows = nvl_chunk_recv // num_nodes, spec.combine_group_warps * rdma_chunk_send
    if spec.num_nvl_ranks > 1 and sub < nvl_chunk_send + round_rows:  # (one rank a node uses no NVLink ring)
        problems.append(f"nvl_chunk_recv // nodes = {nvl_chunk_recv} // {num_nodes} = {sub} must be >= "
                        f"nvl_chunk_send + {round_rows} (a combine sub-ring holds a chunk beyond the rows a "
                        f"forwarding group's round takes: {spec.combine_group_warps} warps x rdma_chunk_send)")
    return problems
