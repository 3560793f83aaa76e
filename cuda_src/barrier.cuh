// Cross-GPU barrier of one block per GPU over the NVLink buffers (DeepEP's barrier_block).
//
// Every rank owns a row of kNumNvlRanks signal words in its NVLink buffer's header, at `row_offset`: the start
// for the whole GPU's barrier, a channel's row (kNvlChannelBarrierOffset) for the blocks of one channel.
// Entering, rank r adds kTag to its own row's slot t and subtracts kTag from slot r of rank t's row, for every t.
// Slot t of r's row then returns to <= 0 exactly when t has entered too (its -kTag cancels r's +kTag), so r waits
// until every slot of its own row is <= 0. All rows are back to 0 once everyone is through, so the barrier needs
// no reset and a rank one barrier ahead only drives a slot negative, which still reads as "arrived".
#pragma once

#include "peers.cuh"
#include "ptx.cuh"
#include "wait.cuh"

namespace epjit {

constexpr int kBarrierTag = 1 << 20;

// Entering: with kFenceFirst, everything this block wrote before the barrier (to any GPU) is made visible
// system-wide before a peer can see our arrival: each thread fences its own writes, bar.sync orders them before the
// releases of nvl_barrier_arrive.
template <bool kFenceFirst>
__device__ __forceinline__ void nvl_barrier_enter() {
    if (kFenceFirst) {
        ptx::fence_acq_rel_sys();
        __syncthreads();
    }
}

// Thread t's arrival for nvl rank t: +kBarrierTag in slot t of this rank's (`me`'s) row, -kBarrierTag in slot `me`
// of t's row. Returns this rank's row, whose slot t the caller then waits to see <= 0.
__device__ __forceinline__ int* nvl_barrier_arrive(const PeersTable* peers, int me, int t, int64_t row_offset) {
    int* my_row = nvl_ptr<int>(peers, me, row_offset);
    int* peer_row = nvl_ptr<int>(peers, t, row_offset);
    ptx::red_add_release_sys_s32(my_row + t, kBarrierTag);
    ptx::red_add_release_sys_s32(peer_row + me, -kBarrierTag);
    return my_row;
}

// `channel` names the wait in a timeout report (-1: the block's index). kFenceFirst = false is for a caller whose
// only writes a peer must see are thread t's, for peer t: thread t's own releases below carry them, and the
// block-wide system fence is skipped.
template <int kNumNvlRanks, bool kFenceFirst = true>
__device__ __forceinline__ void nvl_barrier_block(const PeersTable* peers, const char* site,
                                                  int64_t row_offset = kNvlBarrierOffset, int channel = -1) {
    static_assert(kNumNvlRanks <= kMaxNvlRanks, "too many NVLink ranks");
    const int t = static_cast<int>(threadIdx.x);
    const int me = peers->nvl_rank;
    nvl_barrier_enter<kFenceFirst>();
    if (t < kNumNvlRanks) {
        const int* my_row = nvl_barrier_arrive(peers, me, t, row_offset);
        // The acquire load pairs with the peer's release subtraction: once we see it, the peer's earlier
        // writes (into our buffer, say) are visible to this thread, and bar.sync below extends that to the block.
        const int peer_rank = peers->rank - me + t;
        const int where = channel >= 0 ? channel : static_cast<int>(blockIdx.x);
        timeout_while(peers, WaitSite{site, peer_rank, where, 0}, [&](int64_t& seen) {
            seen = ptx::ld_acquire_sys_s32(my_row + t);
            return seen > 0;
        });
    }
    __syncthreads();
}

// nvl_barrier_block of shrink mode: a rank masked in m.mask, or named in `skip` (bit t: nvl rank t; a call's mask),
// is neither signalled nor waited for, and a wait that passes m.timeout_ns masks its peer (timeout_while_unmasked)
// instead of trapping. A slot of a rank masked mid-barrier keeps what it left there; later barriers skip it, and a
// rank unmasked again starts from rows the host zeroed (clean_mask, on every rank).
template <int kNumNvlRanks, bool kFenceFirst = true>
__device__ __forceinline__ void nvl_barrier_block_live(const PeersTable* peers, const PeerMask& m, const char* site,
                                                       int skip, int64_t row_offset = kNvlBarrierOffset,
                                                       int channel = -1) {
    static_assert(kNumNvlRanks <= kMaxNvlRanks, "too many NVLink ranks");
    const int t = static_cast<int>(threadIdx.x);
    const int me = peers->nvl_rank;
    nvl_barrier_enter<kFenceFirst>();
    const int peer_rank = peers->rank - me + t;
    if (t < kNumNvlRanks && (t == me || (!(skip >> t & 1) && ptx::ld_volatile_s32(m.mask + peer_rank) == 0))) {
        const int* my_row = nvl_barrier_arrive(peers, me, t, row_offset);
        const int where = channel >= 0 ? channel : static_cast<int>(blockIdx.x);
        bool masked_now;
        timeout_while_unmasked(peers, m, WaitSite{site, peer_rank, where, 0}, masked_now, [&](int64_t& seen) {
            seen = ptx::ld_acquire_sys_s32(my_row + t);
            return seen > 0;
        });
    }
    __syncthreads();
}

}  // namespace epjit
