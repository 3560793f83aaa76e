"""Specs of the normal-mode kernels (cuda_src/layout.cu, cuda_src/intranode.cu), the host mirror of the NVLink
buffer layout (cuda_src/intranode.cuh) and the config heuristics. Pure Python: testable without a GPU."""

from __future__ import annotations

from dataclasses import dataclass

from ..jit.spec import KernelSpec, build_with, same_fields

PEERS = ("peers", "const PeersTable*")
NUM_THREADS = 768  # 24 warps a block: splits evenly among 1, 2, 3, 4, 6 and 8 ranks
# EPJIT_PROFILE: enum IntranodePoint of cuda_src/intranode.cu, in order (stamps per block, timeline.cuh)
TIMELINE_POINTS = ("start", "own_copied", "first_tail", "sent", "received", "last_tail")
NOTIFY_TIMELINE_POINTS = ("start", "written", "barrier", "checked", "pulled", "end")  # enum NotifyPoint
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
    """cuda_src/intranode.cu's dispatch and combine. Past the ranks and the block size, the fields say how a block's
    warps split into roles (DispatchRoles, CombineRoles): the host sizes the default chunks by the same numbers the
    kernel runs. :func:`intranode_spec` gives the measured defaults.

    dispatch_send_warps / dispatch_drain_warps: a peer each (the own copy gets the warps they leave);
    combine_send_warps: a peer (then one coordinator warp, then readers); dispatch_phased: one sending group of
    every sending warp serves the peers one at a time, in turn (NCCL's p2p schedule), instead of a group a peer.
    Config's warp-role fields override the defaults (Config.spec)."""

    num_ranks: int
    num_threads: int
    dispatch_send_warps: int
    dispatch_drain_warps: int
    combine_send_warps: int
    dispatch_phased: bool

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
    # Dispatch may start while notify, ahead of it, still runs: it waits for notify's writes (griddepcontrol.wait).
    PROGRAMMATIC = frozenset({"intranode_dispatch"})
    # The fields a Config may set (the others follow from the Buffer).
    TUNABLE = ("dispatch_send_warps", "dispatch_drain_warps", "combine_send_warps", "dispatch_phased")

    def __post_init__(self) -> None:
        warps, peers = self.num_threads // 32, self.num_ranks - 1
        send, drain, combine = self.dispatch_send_warps, self.dispatch_drain_warps, self.combine_send_warps
        split = f"{send} sending / {drain} draining warps a peer"
        if self.num_threads % 32 or self.num_ranks < 1:
            raise ValueError(f"IntranodeSpec: {self.num_threads} threads / {self.num_ranks} ranks")
        if peers == 0:
            if send or drain or combine or self.dispatch_phased:
                raise ValueError("IntranodeSpec: one rank has no peer to send to or drain (warps must be 0)")
            return
        groups = (1 if self.dispatch_phased else peers) + peers + 1  # DispatchRoles::kGroups
        if send < 1 or drain < 1 or warps - peers * (send + drain) < 1 or groups > 15:
            raise ValueError(f"{warps} warps cannot form the dispatch groups of {self.num_ranks} ranks with {split} "
                             "(every role needs a warp, the own copy what is left; one named barrier a group, 15)")
        if combine < 1 or warps - peers * combine - 1 < 1:
            raise ValueError(f"{warps} warps cannot hold {combine} combine sending warps for each of {peers} peers, "
                             "a coordinator and at least one reader")

    @property
    def dispatch_group_send_warps(self) -> int:
        """Warps of one sending group (DispatchRoles::kSendGroupWarps): the chunks are sized by it."""
        return self.dispatch_send_warps * (self.num_ranks - 1 if self.dispatch_phased else 1)


@dataclass(frozen=True)
class IntranodeCombineFp8Spec(KernelSpec):
    """cuda_src/intranode.cu's FP8 combine (Buffer.combine(..., use_fp8=True)): the bf16 combine's rings, receipts
    and warp roles, each row quantised to e4m3 with a float32 scale a 128 channels on its way out and summed in
    float32 from the dequantised values. A build of its own, so the bf16 combine's module stays as it is and this
    one compiles only where it runs; :func:`combine_fp8_spec` gives the one of an IntranodeSpec."""

    num_ranks: int
    num_threads: int
    combine_send_warps: int

    SOURCE = "intranode.cu"
    BUILD = "intranode_combine_fp8"
    KERNELS = {"intranode_combine_fp8": IntranodeSpec.KERNELS["intranode_combine"]}


# Shrink mode (a normal-mode Buffer made with enable_shrink, inside one node): each build again with
# EPJIT_NORMAL_SHRINK, whose waits on a peer mask it instead of trapping and which leave masked ranks out. A build
# of its own, so the kernels of a Buffer without it are the code they were (cuda_src/intranode.cu: kShrink).
NORMAL_SHRINK_OFFSET = 1024  # kNvlShrinkOffset: NormalShrink in this rank's NVLink buffer header
NORMAL_SHRINK_BYTES = 48  # sizeof(NormalShrink): {records, timeout_ns, int32 mask[kMaxNvlRanks]}
NORMAL_SHRINK_MASK_AT = 16  # the mask's offset in it


IntranodeNotifyShrinkSpec = build_with(IntranodeNotifySpec, "EPJIT_NORMAL_SHRINK", "Shrink", __name__,
                                       BUILD="intranode_notify_shrink")
IntranodeShrinkSpec = build_with(IntranodeSpec, "EPJIT_NORMAL_SHRINK", "Shrink", __name__)
IntranodeCombineFp8ShrinkSpec = build_with(IntranodeCombineFp8Spec, "EPJIT_NORMAL_SHRINK", "Shrink", __name__)
SHRINK_BUILDS: dict[type, type] = {IntranodeNotifySpec: IntranodeNotifyShrinkSpec,
                                   IntranodeSpec: IntranodeShrinkSpec,
                                   IntranodeCombineFp8Spec: IntranodeCombineFp8ShrinkSpec}


def shrink_spec(spec: IntranodeNotifySpec | IntranodeSpec | IntranodeCombineFp8Spec) -> KernelSpec:
    """The same kernels (fields alike) in shrink mode's build; a shrink build is returned as it is."""
    build = SHRINK_BUILDS.get(type(spec))
    return spec if build is None else same_fields(spec, build)


def combine_fp8_spec(spec: IntranodeSpec) -> IntranodeCombineFp8Spec:
    """The FP8 combine with the warp roles of ``spec``'s combine (in shrink mode's build for a shrink build)."""
    fp8 = IntranodeCombineFp8Spec(spec.num_ranks, spec.num_threads, spec.combine_send_warps)
    return shrink_spec(fp8) if isinstance(spec, IntranodeShrinkSpec) else fp8  # type: ignore[return-value]


def default_dispatch_warps(num_ranks: int, num_warps: int) -> tuple[int, int]:
    """(sending, draining) warps a peer of a dispatch block: senders set the pace (a drain copies what has arrived),
    so they get what the own copy (at least one warp, then W / 2R) and one drain group a peer (W / (2R - 1) warps)
    leave: 10 / 8 (own 6) on 2 ranks, 4 / 3 (own 3) on 4, 2 / 1 (own 3) on 8. Equal groups left the own copy done
    long before the senders; the other splits tried were slower (docs/history.md, "Warp roles and channels")."""
    peers = num_ranks - 1
    if peers == 0:
        return 0, 0
    own = 1 if num_warps < 4 * num_ranks else num_warps // (2 * num_ranks)
    drain = num_warps // (2 * peers + 1)
    return (num_warps - own - peers * drain) // peers, drain


def default_combine_send_warps(num_ranks: int, num_warps: int) -> int:
    """Sending warps a peer of a combine block: ~2(R-1) / (2(R-1) + R + 1) of the block (a reader reads R rows and
    writes one for every row a sender copies; copies count a read and a write), split among the peers; 2 ranks: 7
    of 24, the fastest measured (NVLink, not their warps, limits the senders there; docs/history.md, "Warp roles
    and channels"). 4 and 8 ranks keep the formula until measured."""
    if num_ranks == 1:
        return 0
    if num_ranks == 2:
        return max(1, num_warps * 7 // 24)
    return num_warps * 2 * (num_ranks - 1) // (3 * num_ranks - 1) // (num_ranks - 1)


def intranode_spec(num_ranks: int, num_threads: int = NUM_THREADS, /, **overrides: int) -> IntranodeSpec:
    """The dispatch/combine spec for this many ranks: the default warp roles, with ``overrides`` (names from
    IntranodeSpec.TUNABLE) in their place."""
    unknown = set(overrides) - set(IntranodeSpec.TUNABLE)
    if unknown:
        raise ValueError(f"IntranodeSpec has no tunable field {sorted(unknown)}; it has {list(IntranodeSpec.TUNABLE)}")
    send, drain = default_dispatch_warps(num_ranks, num_threads // 32)
    fields: dict[str, int] = {"dispatch_send_warps": send, "dispatch_drain_warps": drain,
                              "combine_send_warps": default_combine_send_warps(num_ranks, num_threads // 32),
                              "dispatch_phased": False}
    fields.update(overrides)
    return IntranodeSpec(num_ranks, num_threads, fields["dispatch_send_warps"], fields["dispatch_drain_warps"],
                         fields["combine_send_warps"], bool(fields["dispatch_phased"]))


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
