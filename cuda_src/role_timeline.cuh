// EPJIT_PROFILE for kernels whose blocks split into roles (internode.cu's profile build, EPJIT_INTERNODE_PROFILE):
// a row a (channel, role) instead of one a block, timeline[row][point], through the timeline_row_* helpers; a slot of
// such a row may also sum nanoseconds (the role's waits). Only that build includes this header, so the kernels that
// do not stamp this way compile without its helpers (and the globals their atomics bring).
#pragma once

#include "ptx.cuh"
#include "timeline.cuh"

namespace epjit {

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

}  // namespace epjit
