"""Spec of the low-latency kernels (cuda_src/low_latency.cu) and the host mirror of their symmetric-heap layout
(cuda_src/low_latency.cuh). Pure Python: testable without a GPU."""

from __future__ import annotations

from dataclasses import dataclass

from ..jit.spec import KernelSpec, build_with

PEERS = ("peers", "const PeersTable*")
LOW_LATENCY_THREADS = 1024
LOW_LATENCY_MAX_TOPK = 16  # kLowLatencyMaxTopk: combine slots per token
LOW_LATENCY_HEADER_BYTES = 16 + 8 * LOW_LATENCY_MAX_TOPK  # kLowLatencyHeaderBytes: int4 + an int2 entry a slot
SYNC_BYTES = 32  # sizeof(LowLatencySync); int32 expert_sent[num_experts] follow it
SHRINK_BYTES = 24  # sizeof(LowLatencyShrink): after expert_sent, 8-byte aligned; int32 mask[num_ranks] follows it
# The flagged path of small dispatches (cuda_src/low_latency.cuh): its region's size and the format word's bit.
FLAGGED_MESSAGES = 160  # kFlaggedMessages: messages leaving a flagged source, at most
FLAGGED_TOKENS = 64  # kFlaggedTokens: a flagged source's tokens, and its region's stride
FORMAT_FLAGGED_DISPATCH = 1 << 16
MAX_DYNAMIC_SHARED_BYTES = 227 * 1024  # sm_90's opt-in limit per block
# EPJIT_PROFILE: enum TimelinePoint of cuda_src/low_latency.cu, in order (stamps per block, timeline.cuh)
TIMELINE_POINTS = ("start", "acks", "sent", "counted", "counts", "received", "end")
COMBINE_ARGS = (
    PEERS, ("y", "const int4*"), ("src_info", "const int*"), ("topk_slot", "const int*"),
    ("layout_range", "const int64_t*"), ("topk_idx", "const int64_t*"), ("topk_weights", "const float*"),
    ("out", "int4*"), ("num_tokens", "int"), ("num_topk", "int"), ("hidden", "int"), ("num_experts", "int"),
    ("max_tokens", "int"), ("set", "int"), ("phases", "int"), ("force_puts", "int"),
    ("sync", "LowLatencySync*"), ("host_status", "int*"), ("timeline", "uint64_t*"), ("wait_stats", "int64_t*"))
LOGFMT_CHANNELS = 128  # kLogfmtChannels: the channels one LogFMT group covers


@dataclass(frozen=True)
class LowLatencySpec(KernelSpec):
    """cuda_src/low_latency.cu: dispatch and combine halves (send, receive or both per launch), built without
    NVSHMEM's device library: every peer through its NVLink pointer (LowLatencyPutsSpec where one has none)."""

    SOURCE = "low_latency.cu"
    KERNELS = {
        "ll_dispatch": (
            PEERS, ("x", "const int4*"), ("topk_idx", "const int64_t*"), ("num_tokens", "int"), ("num_topk", "int"),
            ("hidden", "int"), ("num_experts", "int"), ("max_tokens", "int"), ("set", "int"), ("phases", "int"),
            ("flags", "int"), ("force_puts", "int"), ("sync", "LowLatencySync*"),
            ("host_status", "int*"), ("recv_x", "int4*"), ("recv_scales", "void*"), ("recv_src_info", "int*"),
            ("recv_topk_slot", "int*"), ("layout_range", "int64_t*"), ("recv_count", "int*"),
            ("cumulative_stats", "int*"), ("timeline", "uint64_t*"), ("wait_stats", "int64_t*")),
        "ll_combine": COMBINE_ARGS,
        # The LogFMT-10 combine (launched on this build only: it has no put path, and its group words take the
        # staging region's place, cuda_src/low_latency.cuh).
        "ll_combine_logfmt": COMBINE_ARGS,
    }


@dataclass(frozen=True)
class LowLatencyPutsSpec(LowLatencySpec):
    """cuda_src/low_latency.cu built with its put path (EPJIT_LL_PUTS) and linked with NVSHMEM's device library
    (-rdc), for a peer without an NVLink pointer or forced puts. LowLatencySpec's build has no put path and no
    library, and every launch of it is cheaper, with a smaller stack (docs/history.md, "The NVSHMEM-free build")."""

    DEFINES = ("EPJIT_LL_PUTS",)
    BUILD = "low_latency_puts"
    USES_NVSHMEM = True


@dataclass(frozen=True)
class LowLatencyStoresSpec(LowLatencySpec):
    """cuda_src/low_latency.cu built with its put path as NVLink stores (EPJIT_RDMA_BY_STORES, no NVSHMEM library),
    for forced puts on a symmetric region of CUDA IPC memory (the setting EPJIT_RDMA_BY_STORES with
    EPJIT_LL_FORCE_PUTS): the put path's staging and ordering run, and compute-sanitizer can check them."""

    DEFINES = ("EPJIT_RDMA_BY_STORES",)
    BUILD = "low_latency_stores"


# Shrink mode (a Buffer made with enable_shrink): each build again with EPJIT_LL_SHRINK, which masks a rank that
# does not answer in time instead of trapping, and skips masked ranks. A build of its own, so the kernels of a
# Buffer without it are the code they were (cuda_src/low_latency.cu: kShrink).
SHRINK_KERNELS = {
    **LowLatencySpec.KERNELS,
    "ll_clean_barrier": (
        PEERS, ("sync", "LowLatencySync*"), ("num_experts", "int"), ("max_tokens", "int"), ("hidden", "int"),
        ("round", "int"), ("force_puts", "int")),
}


LowLatencyShrinkSpec = build_with(LowLatencySpec, "EPJIT_LL_SHRINK", "Shrink", __name__, KERNELS=SHRINK_KERNELS)
LowLatencyPutsShrinkSpec = build_with(LowLatencyPutsSpec, "EPJIT_LL_SHRINK", "Shrink", __name__, KERNELS=SHRINK_KERNELS)
LowLatencyStoresShrinkSpec = build_with(LowLatencyStoresSpec, "EPJIT_LL_SHRINK", "Shrink", __name__,
                                        KERNELS=SHRINK_KERNELS)
SHRINK_BUILDS: dict[type[LowLatencySpec], type[LowLatencySpec]] = {
    LowLatencySpec: LowLatencyShrinkSpec, LowLatencyPutsSpec: LowLatencyPutsShrinkSpec,
    LowLatencyStoresSpec: LowLatencyStoresShrinkSpec}

# The wait-stats build of each (a call given DeepEP's dispatch_wait_recv_cost_stats or combine_wait_recv_cost_stats):
# EPJIT_LL_WAIT_STATS times each receive wait into the caller's int64 a rank; the other builds read no clock for it.
WAIT_STATS = "EPJIT_LL_WAIT_STATS"
LowLatencyWaitStatsSpec = build_with(LowLatencySpec, WAIT_STATS, "WaitStats", __name__)
LowLatencyPutsWaitStatsSpec = build_with(LowLatencyPutsSpec, WAIT_STATS, "WaitStats", __name__)
LowLatencyStoresWaitStatsSpec = build_with(LowLatencyStoresSpec, WAIT_STATS, "WaitStats", __name__)
LowLatencyShrinkWaitStatsSpec = build_with(LowLatencyShrinkSpec, WAIT_STATS, "WaitStats", __name__)
LowLatencyPutsShrinkWaitStatsSpec = build_with(LowLatencyPutsShrinkSpec, WAIT_STATS, "WaitStats", __name__)
LowLatencyStoresShrinkWaitStatsSpec = build_with(LowLatencyStoresShrinkSpec, WAIT_STATS, "WaitStats", __name__)
WAIT_STATS_BUILDS: dict[type[LowLatencySpec], type[LowLatencySpec]] = {
    LowLatencySpec: LowLatencyWaitStatsSpec, LowLatencyPutsSpec: LowLatencyPutsWaitStatsSpec,
    LowLatencyStoresSpec: LowLatencyStoresWaitStatsSpec, LowLatencyShrinkSpec: LowLatencyShrinkWaitStatsSpec,
    LowLatencyPutsShrinkSpec: LowLatencyPutsShrinkWaitStatsSpec,
    LowLatencyStoresShrinkSpec: LowLatencyStoresShrinkWaitStatsSpec}


def _align(n: int) -> int:
    return (n + 255) // 256 * 256


def message_bytes(hidden: int) -> int:
    """Stride of one dispatch message: header (with its entries) + the larger payload (bf16), 16-byte aligned."""
    return (LOW_LATENCY_HEADER_BYTES + 2 * hidden + 15) // 16 * 16


def dispatch_shared_bytes(hidden: int, num_tokens: int, num_topk: int, num_experts: int, num_ranks: int) -> int:
    """ll_dispatch's dynamic shared memory: two staged tokens (bf16 size), topk_idx as int32, then the receive
    half's count and first row of every (local expert, source) pair (num_experts of each), each source's format
    and the first of its flagged messages and of its message slots (and their totals)."""
    return 2 * 2 * hidden + 4 * num_tokens * num_topk + 2 * 4 * num_experts + 4 * (3 * num_ranks + 2)


def low_latency_set_bytes(num_ranks: int, num_experts: int, max_tokens: int, hidden: int) -> int:
    """Bytes of one buffer set (the mirror of LowLatencyLayout's constructor)."""
    r, e, m = num_ranks, num_experts, max_tokens
    local = e // r
    msg = message_bytes(hidden)
    sizes = [local * r * 8, e * 8, r * 8, r * m * msg, m * LOW_LATENCY_MAX_TOPK * 2 * hidden, m * msg,
             m * r * LOW_LATENCY_HEADER_BYTES, r * 8, r * FLAGGED_TOKENS * 2 * msg]
    return sum(_align(s) for s in sizes)


def clean_words_offset(num_ranks: int, num_experts: int, max_tokens: int, hidden: int) -> int:
    """Where shrink mode's clean words (uint64 [num_ranks]) begin in the heap: after the two sets."""
    return 2 * low_latency_set_bytes(num_ranks, num_experts, max_tokens, hidden)


def low_latency_size_hint(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Symmetric-heap bytes per rank for low-latency mode: two sets, then shrink mode's clean words (so one size
    serves a Buffer with or without enable_shrink, as DeepEP's hint does)."""
    return clean_words_offset(num_ranks, num_experts, max_tokens, hidden) + _align(8 * num_ranks)


def shrink_offset(num_experts: int) -> int:
    """Byte offset of LowLatencyShrink in a Buffer's sync words (cuda_src/low_latency.cuh: shrink_state)."""
    return SYNC_BYTES + (4 * num_experts + 7) // 8 * 8


def deepep_low_latency_size_hint(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """DeepEP's get_low_latency_rdma_size_hint (its LowLatencyLayout, FP8 scales as floats), for comparison."""
    num_scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + num_scales * 4)
    combine_msg = num_scales * 4 + hidden * 2
    send = max(max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    recv = max(num_experts * max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    signaling = num_experts * 4
    per_set = send + recv + 2 * signaling
    return 2 * per_set
