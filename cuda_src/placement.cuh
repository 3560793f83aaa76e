// Which channel a block of a normal-mode kernel serves: one block a TPC where the grid allows it.
//
// The hardware puts a grid's first blocks two to a TPC (on every H200 seen, blocks 0-7, and the next ones one to a
// TPC), and a combine block sharing its TPC moved its bytes markedly slower than one alone: those blocks set the
// kernel's time (bench --profile's per-block rows; docs/history.md). So the host launches
// more blocks than channels and each block claims its TPC (SMs 2k and 2k + 1) before a channel: a block alone on
// its TPC takes the next channel at once; a block whose TPC is taken waits up to kSpareWaitNs for lone blocks to
// take every channel, then takes one left over itself, so a grid that finds too few free TPCs (beside other
// kernels, or on another chip's SM numbering) still serves every channel. Blocks left without a channel return.
// The last block to finish claiming zeroes the words for the next launch (launches on one stream run in order).
#pragma once

#include "peers.cuh"
#include "ptx.cuh"
#include "wait.cuh"

namespace epjit {

constexpr int kMaxTpcs = 128;
constexpr uint64_t kSpareWaitNs = 4000;  // a few times the spread of a launch's block starts on an idle GPU

struct ChannelClaims {
    int next;                 // channels handed out
    int arrived;              // blocks done claiming
    int tpc_taken[kMaxTpcs];  // 1: a block of this launch sits on the TPC
};

// Every thread of the block calls it (it synchronises the block); -1: no channel for this block.
__device__ __forceinline__ int claim_channel(ChannelClaims* claims, const PeersTable* peers, int num_channels) {
    __shared__ int s_channel, s_last;
    if (threadIdx.x == 0) {
        const int tpc = static_cast<int>(ptx::smid() / 2) % kMaxTpcs;
        int channel = num_channels;
        if (atomicExch(&claims->tpc_taken[tpc], 1) == 0) {
            channel = atomicAdd(&claims->next, 1);
        } else {
            const uint64_t deadline = ptx::globaltimer_ns() + kSpareWaitNs;
            timeout_while(peers, WaitSite{"claim_channel: lone blocks to take every channel", -1, -1, num_channels},
                          [&](int64_t& seen) {
                              seen = ptx::ld_volatile_s32(&claims->next);
                              return seen < num_channels && ptx::globaltimer_ns() < deadline;
                          });
            channel = atomicAdd(&claims->next, 1);  // num_channels or more: none left
        }
        s_channel = channel < num_channels ? channel : -1;
        // This block's claims come before its arrival, and the last arrival sees every block's before it resets.
        __threadfence();
        s_last = atomicAdd(&claims->arrived, 1) == static_cast<int>(gridDim.x) - 1;
        __threadfence();
    }
    __syncthreads();
    if (s_last) {
        for (int i = static_cast<int>(threadIdx.x); i < kMaxTpcs; i += static_cast<int>(blockDim.x))
            claims->tpc_taken[i] = 0;
        if (threadIdx.x == 0) claims->next = 0, claims->arrived = 0;
    }
    return s_channel;
}

}  // namespace epjit
