// Layout of the NVLink buffer for normal-mode intranode dispatch/combine, shared by every kernel of intranode.cu.
// The host mirror is epjit/kernels/intranode.py:intranode_nvl_bytes (a CPU test holds the two; docs/layouts.md).
//
// payload of each rank's NVLink buffer (R ranks, C channels, T ring slots, K top-k, S = hidden/128 FP8 scales,
// L local experts). Offsets up to the rings depend only on R, C, T, hidden and K, so combine (which has no L and
// no S) addresses the same control words and rings as dispatch.
//
//   control   dispatch      int32 [4][C][R src]      start, end (as -v-1, so 0 reads "not yet"), head, tail
//             combine       int32 [2][C][R src]      head, tail
//   notify    counts        int32 [R src][R dst]     row `src` written by rank src: tokens it sends to each rank
//             meta          int32 [R src][8]         {hidden, num_experts, num_topk, flags, recv_capacity,
//                                                     mask bits (shrink mode), 0, 0} as each rank called (the first
//                                                     kMetaCompared must agree)
//   rings     x             [C][R src][T][hidden*2 bytes]   one row a slot (bf16 size; FP8 dispatch rows use
//                                                            half; an FP8 combine row is hidden e4m3 bytes, then
//                                                            its hidden/128 float scales)
//             src_idx       int32 [C][R src][T]
//             topk_idx      int32 [C][R src][T][K]          local expert ids, -1 elsewhere
//             topk_weights  float [C][R src][T][K]
//             scales        float [C][R src][T][S]
//   notify    expert_counts int32 [R dst][L]         tokens I send to rank dst's local expert l (top-k slots),
//                                                     written by me, read by rank dst after notify's barrier
//
// Every queue (channel c, source s) lives in the receiver's buffer: the receiver polls its tail locally and
// publishes its head locally; the sender reads the head and writes data + tail over NVLink.
#pragma once

#include "channels.cuh"
#include "peers.cuh"
#include "wait.cuh"

namespace epjit {

__host__ __device__ constexpr int64_t align128(int64_t n) { return (n + 127) / 128 * 128; }

// Every Buffer's header holds a barrier row for each channel a call may use (channels.cuh: kMaxChannels).
static_assert(kNvlChannelBarrierOffset + kMaxChannels * kMaxNvlRanks * 4 <= kNvlHeaderBytes,
              "the channel barrier rows must fit the NVLink buffer's header");

// Where channel c's barrier row starts in an NVLink buffer (peers.cuh: the header).
__host__ __device__ constexpr int64_t channel_barrier_offset(int channel) {
    return kNvlChannelBarrierOffset + static_cast<int64_t>(channel) * kMaxNvlRanks * 4;
}
// Shrink mode (the EPJIT_NORMAL_SHRINK build, a normal-mode Buffer made with enable_shrink): its state sits in the
// reserved part of this rank's own NVLink buffer header (peers.cuh), written by the host (epjit/ops/shrink.py:
// NormalShrinkMask): the records at creation, the mask by the mask calls, and by the kernels' waits that mask a peer.
// (Enumerators, not constexpr variables: NVRTC emits a namespace-scope variable into every module, and the other
// builds would no longer be the code they were.)
#ifdef EPJIT_NORMAL_SHRINK
enum : bool { kShrink = true };
#else
enum : bool { kShrink = false };
#endif
enum : int { kNvlShrinkOffset = 1024 };
struct NormalShrink {
    WaitRecord* records;              // mapped host memory [R]: the wait that masked each rank (wait.cuh: PeerMask)
    uint64_t timeout_ns;              // how long a wait on a peer polls before it masks the peer
    int32_t mask[kMaxNvlRanks];       // nonzero: masked, neither sent to nor waited for (zero at creation)
};
static_assert(sizeof(NormalShrink) == 48, "NormalShrink layout is shared with epjit/kernels/intranode.py");
static_assert(kNvlBarrierOffset + kMaxNvlRanks * 4 <= kNvlShrinkOffset &&
              kNvlShrinkOffset + static_cast<int64_t>(sizeof(NormalShrink)) <= kNvlChannelBarrierOffset,
              "NormalShrink must sit in the header's reserved words");

// This rank's mask, records and timeout as the waits take them (the ranks of one node: rank = nvl rank).
__device__ __forceinline__ PeerMask normal_shrink_mask(const PeersTable* peers) {
    NormalShrink* s = nvl_ptr<NormalShrink>(peers, peers->nvl_rank, kNvlShrinkOffset);
    return PeerMask{s->mask, s->records, s->timeout_ns};
}

// Ints of meta per rank and how many must agree across ranks (epjit/kernels/intranode.py: META_INTS, META_COMPARED).
constexpr int kMetaInts = 8;
constexpr int kMetaCompared = 4;

struct IntranodeLayout {
    int32_t* dispatch_ctrl;
    int32_t* combine_ctrl;
    int32_t* counts;
    int32_t* meta;
    char* ring_x;
    int32_t* ring_src;
    int32_t* ring_topk_idx;
    float* ring_topk_weights;
    float* ring_scales;
    int32_t* expert_counts;
    int64_t end;  // bytes used from the payload start

    int num_ranks, num_channels, num_slots, num_topk, num_scales;
    int64_t row_bytes;

    __device__ IntranodeLayout(void* payload, int num_ranks_, int num_channels_, int num_slots_, int hidden,
                               int num_topk_, int num_scales_, int num_local_experts)
        : num_ranks(num_ranks_), num_channels(num_channels_), num_slots(num_slots_), num_topk(num_topk_),
          num_scales(num_scales_), row_bytes(static_cast<int64_t>(hidden) * 2) {
        char* base = static_cast<char*>(payload);
        int64_t off = 0;
        const int64_t R = num_ranks, C = num_channels, T = num_slots, K = num_topk;
        dispatch_ctrl = reinterpret_cast<int32_t*>(base + off), off += align128(4 * C * R * 4);
        combine_ctrl = reinterpret_cast<int32_t*>(base + off), off += align128(2 * C * R * 4);
        counts = reinterpret_cast<int32_t*>(base + off), off += align128(R * R * 4);
        meta = reinterpret_cast<int32_t*>(base + off), off += align128(R * kMetaInts * 4);
        ring_x = base + off, off += align128(C * R * T * row_bytes);
        ring_src = reinterpret_cast<int32_t*>(base + off), off += align128(C * R * T * 4);
        ring_topk_idx = reinterpret_cast<int32_t*>(base + off), off += align128(C * R * T * K * 4);
        ring_topk_weights = reinterpret_cast<float*>(base + off), off += align128(C * R * T * K * 4);
        ring_scales = reinterpret_cast<float*>(base + off), off += align128(C * R * T * num_scales * 4);
        expert_counts = reinterpret_cast<int32_t*>(base + off), off += align128(R * num_local_experts * 4);
        end = off;
    }

    __device__ int queue(int channel, int src) const { return channel * num_ranks + src; }
    __device__ int32_t* start(int q) const { return dispatch_ctrl + q; }
    __device__ int32_t* finish(int q) const { return dispatch_ctrl + num_channels * num_ranks + q; }
    __device__ int32_t* dispatch_head(int q) const { return dispatch_ctrl + 2 * num_channels * num_ranks + q; }
    __device__ int32_t* dispatch_tail(int q) const { return dispatch_ctrl + 3 * num_channels * num_ranks + q; }
    __device__ int32_t* combine_head(int q) const { return combine_ctrl + q; }
    __device__ int32_t* combine_tail(int q) const { return combine_ctrl + num_channels * num_ranks + q; }

    __device__ int4* x_slot(int q, int slot) const {
        return reinterpret_cast<int4*>(ring_x + (static_cast<int64_t>(q) * num_slots + slot) * row_bytes);
    }
    __device__ int32_t* src_slot(int q, int slot) const {
        return ring_src + static_cast<int64_t>(q) * num_slots + slot;
    }
    __device__ int32_t* topk_idx_slot(int q, int slot) const {
        return ring_topk_idx + (static_cast<int64_t>(q) * num_slots + slot) * num_topk;
    }
    __device__ float* topk_weights_slot(int q, int slot) const {
        return ring_topk_weights + (static_cast<int64_t>(q) * num_slots + slot) * num_topk;
    }
    __device__ float* scales_slot(int q, int slot) const {
        return ring_scales + (static_cast<int64_t>(q) * num_slots + slot) * num_scales;
    }
};

}  // namespace epjit
