// EPJIT_PROFILE: per-block %globaltimer stamps at named points of a kernel, into timeline[block][point]. Each
// kernel family names its points in an enum (the host mirrors it); a null timeline, the default, costs one branch.
// The host reports, per point, the median and the latest block (epjit/ops/profile.py: Profile.report).
// Kernels whose blocks split into roles (internode.cu) stamp a row a (channel, role) instead, timeline[row][point],
// through the timeline_row_* helpers; a slot of such a row may also sum nanoseconds (the role's waits).
#pragma once

#include "ptx.cuh"

namespace epjit {

constexpr int kTimelineSlots = 8;
constexpr int kTimelineSmSlot = kTimelineSlots - 1;  // the block's SM id + 1 (0: no stamp), by timeline_start
constexpr int kTimelineTagSlot = kTimelineSlots - 2;  // what the block worked on + 1 (a channel), by timeline_start
constexpr int kTimelineRoleTagStride = 256;  // a role row's tag: role * 256 + channel (channels < 256)

__device__ __forceinline__ unsigned long long* timeline_slot(uint64_t* timeline, int row, int slot) {
    return reinterpret_cast<unsigned long long*>(timeline + static_cast<int64_t>(row) * kTimelineSlots + slot);
}

// The latest moment any caller reached `point` of row `row`: several warps may each mark it (the max says when the
// last of them got there).
__device__ __forceinline__ void timeline_row_latest(uint64_t* timeline, int row, int point) {
    if (timeline != nullptr)
        atomicMax(timeline_slot(timeline, row, point), static_cast<unsigned long long>(ptx::globaltimer_ns()));
}

// The first caller's moment at `point` of row `row` (the stamp is written once: the earliest, give or take a race
// between SMs that the globaltimer's tick hides).
__device__ __forceinline__ void timeline_row_first(uint64_t* timeline, int row, int point) {
    if (timeline != nullptr)
        atomicCAS(timeline_slot(timeline, row, point), 0ull, static_cast<unsigned long long>(ptx::globaltimer_ns()));
}

// Nanoseconds added to a slot of row `row` that sums durations (e.g. what a role's warps waited).
__device__ __forceinline__ void timeline_row_add(uint64_t* timeline, int row, int slot, uint64_t ns) {
    if (timeline != nullptr && ns != 0)
        atomicAdd(timeline_slot(timeline, row, slot), static_cast<unsigned long long>(ns));
}

// A warp's wait into such a slot: the longest of its lanes' (lanes that wait for different peers wait at once), added
// by lane 0. The whole warp calls it.
__device__ __forceinline__ void timeline_row_add_warp(uint64_t* timeline, int row, int slot, uint64_t ns, int lane) {
    if (timeline == nullptr) return;
    unsigned long long longest = ns;
#pragma unroll
    for (int d = 16; d > 0; d /= 2) longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, d));
    if (lane == 0) timeline_row_add(timeline, row, slot, longest);
}

// A role row's first point: the caller's SM, its tag (role and channel, + 1) and the moment (the first caller's).
__device__ __forceinline__ void timeline_row_start(uint64_t* timeline, int row, int point, int role, int channel) {
    if (timeline != nullptr) {
        *timeline_slot(timeline, row, kTimelineSmSlot) = ptx::smid() + 1;
        *timeline_slot(timeline, row, kTimelineTagSlot) =
            static_cast<unsigned long long>(role * kTimelineRoleTagStride + channel + 1);
        timeline_row_first(timeline, row, point);
    }
}

// The latest moment any caller of this block reached `point`: several warp groups of a block may each mark it
// (the max says when the last of them got there).
__device__ __forceinline__ void timeline_mark_latest(uint64_t* timeline, int point) {
    if (timeline != nullptr)
        atomicMax(reinterpret_cast<unsigned long long*>(timeline + blockIdx.x * kTimelineSlots + point),
                  static_cast<unsigned long long>(ptx::globaltimer_ns()));
}

// Thread 0's moment (points every thread of the block passes together).
__device__ __forceinline__ void timeline_mark(uint64_t* timeline, int point) {
    if (threadIdx.x == 0) timeline_mark_latest(timeline, point);
}

// A kernel's first point: thread 0's moment, the SM the block landed on and what it works on (tag >= 0: a channel).
__device__ __forceinline__ void timeline_start(uint64_t* timeline, int point, int tag = -1) {
    if (threadIdx.x == 0 && timeline != nullptr) {
        timeline[blockIdx.x * kTimelineSlots + kTimelineSmSlot] = ptx::smid() + 1;
        // Only kernels of at most kTimelineTagSlot points tag (the low-latency ones use the slot for a point).
        if (tag >= 0) timeline[blockIdx.x * kTimelineSlots + kTimelineTagSlot] = static_cast<uint64_t>(tag + 1);
        timeline_mark_latest(timeline, point);
    }
}

}  // namespace epjit
