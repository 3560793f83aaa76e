// Host-launchable NVLink barrier, and the self-check that proves it (and the IPC mapping) on real GPUs.
#include "barrier.cuh"

namespace epjit {

// One block, at least kNumNvlRanks threads: every rank of the NVLink node launches it; none returns before all
// have launched it.
template <int kNumNvlRanks>
__global__ void nvl_barrier(const PeersTable* peers) {
    nvl_barrier_block<kNumNvlRanks>(peers, "nvl_barrier: peer's arrival (signal <= 0)");
}

// num_rounds rounds of: write a round-tagged pattern into every peer's payload (my slot there), barrier,
// check the pattern every peer wrote into mine, barrier (so no one overwrites before everyone checked).
// A rank with skip_rank == its nvl rank stops before the first barrier: the others must time out naming it.
//
// payload of each NVLink buffer:  int32 [kNumNvlRanks sources][num_ints]
template <int kNumNvlRanks>
__global__ void nvl_exchange_check(const PeersTable* peers, int num_rounds, int num_ints, int skip_rank,
                                   int* errors) {
    const int me = peers->nvl_rank;
    if (me == skip_rank) return;
    for (int round = 0; round < num_rounds; ++round) {
        for (int dst = 0; dst < kNumNvlRanks; ++dst) {
            int* slot = nvl_ptr<int>(peers, dst, kNvlHeaderBytes) + static_cast<int64_t>(me) * num_ints;
            for (int i = threadIdx.x; i < num_ints; i += blockDim.x)
                slot[i] = (round << 24) ^ (me << 16) ^ (dst << 12) ^ i;
        }
        nvl_barrier_block<kNumNvlRanks>(peers, "nvl_exchange_check: peer's arrival after writes");
        int bad = 0;
        for (int src = 0; src < kNumNvlRanks; ++src) {
            const int* slot = nvl_ptr<int>(peers, me, kNvlHeaderBytes) + static_cast<int64_t>(src) * num_ints;
            for (int i = threadIdx.x; i < num_ints; i += blockDim.x)
                bad += ptx::ld_volatile_s32(slot + i) != ((round << 24) ^ (src << 16) ^ (me << 12) ^ i);
        }
        if (bad) atomicAdd(errors, bad);
        nvl_barrier_block<kNumNvlRanks>(peers, "nvl_exchange_check: peer's arrival after checks");
    }
}

}  // namespace epjit
