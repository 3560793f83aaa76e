// Self-check of the NVSHMEM symmetric heap on real GPUs: every PE sends a round-tagged block to every PE and
// sets a per-source signal after it; every PE waits for all signals and checks the data.
//
// symmetric allocation:  [ signals: uint64[kMaxRanks] | inbox: int32[num_pes][num_ints] | outbox: same ]
//                        0                            kSignalBytes
// With kDirect the block stores straight through nvshmem_ptr's pointer (NVLink) and releases the signal with
// st.release.sys; otherwise it uses nvshmemx_putmem_signal_nbi_block, which orders the signal after the data.
#include "nvshmem.cuh"
#include "peers.cuh"
#include "ptx.cuh"
#include "wait.cuh"

namespace epjit {

constexpr int64_t kSignalBytes = static_cast<int64_t>(kMaxRanks) * sizeof(uint64_t);

__device__ __forceinline__ int check_pattern(int round, int src, int dst, int i) {
    return (round << 24) ^ (src << 16) ^ (dst << 8) ^ i;
}

// grid = num_pes blocks: block b sends to PE b, then waits for PE b's block to us.
template <bool kDirect>
__global__ void put_signal_check(const PeersTable* peers, int round, int num_ints, int skip_rank, int* errors) {
    const int me = peers->rank;
    const int num_pes = peers->num_ranks;
    const int pe = static_cast<int>(blockIdx.x);
    auto* signals = sym_local<uint64_t>(peers, 0);
    const int64_t row_bytes = static_cast<int64_t>(num_ints) * sizeof(int);
    const int64_t inbox = kSignalBytes, outbox = kSignalBytes + num_pes * row_bytes;

    if (me != skip_rank) {
        int* out = sym_local<int>(peers, outbox + pe * row_bytes);
        for (int i = threadIdx.x; i < num_ints; i += blockDim.x) out[i] = check_pattern(round, me, pe, i);
        __syncthreads();
        if constexpr (kDirect) {
            auto* remote = static_cast<char*>(peers->sym_peer[pe]);
            auto* dst = reinterpret_cast<int*>(remote + inbox + me * row_bytes);
            for (int i = threadIdx.x; i < num_ints; i += blockDim.x) dst[i] = out[i];
            ptx::fence_acq_rel_sys();
            __syncthreads();
            if (threadIdx.x == 0)
                ptx::st_release_sys_u64(reinterpret_cast<uint64_t*>(remote) + me, static_cast<uint64_t>(round));
        } else {
            nvshmemx_putmem_signal_nbi_block(sym_local<char>(peers, inbox + me * row_bytes), out, row_bytes,
                                             signals + me, static_cast<uint64_t>(round), NVSHMEM_SIGNAL_SET, pe);
        }
    }

    if (threadIdx.x == 0) {
        timeout_while(peers, WaitSite{"put_signal_check: signal == round from peer", pe, pe, round},
                      [&](int64_t& seen) {
                          seen = static_cast<int64_t>(ptx::ld_acquire_sys_u64(signals + pe));
                          return seen != round;
                      });
    }
    __syncthreads();
    const int* in = sym_local<int>(peers, inbox + pe * row_bytes);
    int bad = 0;
    for (int i = threadIdx.x; i < num_ints; i += blockDim.x)
        bad += ptx::ld_volatile_s32(in + i) != check_pattern(round, pe, me, i);
    if (bad) atomicAdd(errors, bad);
    if constexpr (!kDirect) {
        // The nbi put's source (our outbox) must not be reused before the transfer completed.
        if (me != skip_rank && threadIdx.x == 0) nvshmem_quiet();
    }
}

}  // namespace epjit
