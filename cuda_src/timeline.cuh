// EPJIT_PROFILE: per-block %globaltimer stamps at named points of a kernel, into timeline[block][point]. Each
// kernel family names its points in an enum (the host mirrors it); a null timeline, the default, costs one branch.
// The host reports, per point, the median and the latest block (epjit/ops/profile.py: Profile.report).
#pragma once

#include "ptx.cuh"

namespace epjit {

constexpr int kTimelineSlots = 8;
constexpr int kTimelineSmSlot = kTimelineSlots - 1;  // the block's SM id + 1 (0: no stamp), by timeline_start
constexpr int kTimelineTagSlot = kTimelineSlots - 2;  // what the block worked on + 1 (a channel), by timeline_start

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
