// Warp-wide copies of 16-byte words: the one place that decides how many loads a lane keeps in flight.
#pragma once

#include "ptx.cuh"
#include "wait.cuh"

namespace epjit {

// n int4 from src to dst with one warp, kInFlight 16-byte loads per lane issued before their stores: bytes in
// flight are what keeps NVLink busy (one warp: 32 x 16 x kInFlight bytes). Load is the (read-only or
// ring) load wrapper: `.nc` for inputs nobody writes during the kernel, volatile for ring slots a peer wrote.
template <int kInFlight, bool kHalfBatches, typename Load>
__device__ __forceinline__ void warp_copy_with(int4* dst, const int4* src, int n, int lane, Load load) {
    int i = lane;
    for (; i + 32 * (kInFlight - 1) < n; i += 32 * kInFlight) {
        int4 v[kInFlight];
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) v[j] = load(src + i + 32 * j);
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) ptx::st_global_L1_no_allocate_v4(dst + i + 32 * j, v[j]);
    }
    // The remainder (fewer than kInFlight words a lane) in half batches, then singly: each batch costs a memory
    // round trip, and word by word an FP8 row of 7168 took 1 + 6 of them, a bf16 row 3 + 4.
    constexpr int kHalf = kInFlight / 2;
    for (; kHalfBatches && i + 32 * (kHalf - 1) < n; i += 32 * kHalf) {
        int4 v[kHalf];
#pragma unroll
        for (int j = 0; j < kHalf; ++j) v[j] = load(src + i + 32 * j);
#pragma unroll
        for (int j = 0; j < kHalf; ++j) ptx::st_global_L1_no_allocate_v4(dst + i + 32 * j, v[j]);
    }
    for (; i < n; i += 32) ptx::st_global_L1_no_allocate_v4(dst + i, load(src + i));
}

// kHalfBatches = false keeps the word-by-word remainder, for kernels at their register limit where the half
// batch's registers spill (the combine sender).
template <bool kHalfBatches = true>
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int n, int lane) {
    warp_copy_with<8, kHalfBatches>(dst, src, n, lane,
                                    [](const int4* p) { return ptx::ld_global_nc_L1_no_allocate_v4(p); });
}

// One warp's share of a row that `slices` warps copy together (slice 0..slices-1): the int4 columns
// 32 * slice + lane, stepping 32 * slices, kInFlight loads a lane in flight. A row of one warp is a chain of
// memory round trips (a bf16 row of 7168 is 4); split among idle warps it is one.
template <int kInFlight = 8>
__device__ __forceinline__ void warp_copy_slice(int4* dst, const int4* src, int n, int lane, int slice, int slices) {
    const int step = 32 * slices;
    for (int i = 32 * slice + lane; i < n; i += step * kInFlight) {
        int4 v[kInFlight];
#pragma unroll
        for (int j = 0; j < kInFlight; ++j)  // past the end: the last word again (no predicate held to the stores)
            v[j] = ptx::ld_global_nc_L1_no_allocate_v4(src + min(i + step * j, n - 1));
#pragma unroll
        for (int j = 0; j < kInFlight; ++j)
            if (i + step * j < n) ptx::st_global_L1_no_allocate_v4(dst + i + step * j, v[j]);
    }
}

// From memory another GPU writes during this kernel (ring slots, receive slots): the non-coherent path must not
// serve it.
__device__ __forceinline__ void warp_copy_peer_written(int4* dst, const int4* src, int n, int lane) {
    warp_copy_with<8, true>(dst, src, n, lane, [](const int4* p) { return ptx::ld_volatile_global_v4(p); });
}

// One thread's pipeline of bulk (TMA) copies through kStages shared-memory stages: push(dst, src, bytes) loads
// src into the next stage and, once kStages - kStoreLag loads are in flight, stores the oldest landed stage to
// its dst. A stage is refilled only after the store from it has read it (wait_group.read<kStoreLag>), so up to
// kStages - kStoreLag loads and kStoreLag stores are in flight at once, with no registers holding the bytes.
// flush() stores what is left and waits until every store is done. dst, src and bytes are 16-byte multiples.
template <int kStages, int kStoreLag>
struct BulkCopier {
    static_assert(kStoreLag >= 0 && kStoreLag < kStages, "the lag must leave a stage to load into");
    char* stages;      // kStages x stage_bytes of shared memory
    uint64_t* bars;    // kStages mbarriers in shared memory, initialised by init()
    int stage_bytes;
    const PeersTable* peers;  // for the timeout report of a load that never lands
    void* dst[kStages];
    int bytes[kStages];
    int loaded = 0, stored = 0;

    __device__ BulkCopier(char* stages_, uint64_t* bars_, int stage_bytes_, const PeersTable* peers_)
        : stages(stages_), bars(bars_), stage_bytes(stage_bytes_), peers(peers_) {
        for (int s = 0; s < kStages; ++s) ptx::mbarrier_init_shared_cta_b64(bars + s, 1);
        ptx::fence_mbarrier_init_release_cluster();
    }

    __device__ void push(void* to, const void* from, int n) {
        if (loaded - stored == kStages - kStoreLag) store_oldest();
        const int s = loaded % kStages;
        if (loaded >= kStages) ptx::cp_async_bulk_wait_group_read<kStoreLag>();  // stage s's last store has read it
        dst[s] = to, bytes[s] = n;
        ptx::mbarrier_arrive_expect_tx_shared_cta_b64(bars + s, n);
        ptx::cp_async_bulk_shared_global_mbarrier(stages + static_cast<int64_t>(s) * stage_bytes, from, n, bars + s);
        ++loaded;
    }

    __device__ void store_oldest() {
        const int s = stored % kStages, parity = (stored / kStages) & 1;
        timeout_while(peers, WaitSite{"bulk copy: a load into shared memory to land", -1, -1, parity},
                      [&](int64_t& seen) {
                          const bool landed = ptx::mbarrier_try_wait_parity_shared_cta_b64(bars + s, parity);
                          seen = landed;
                          return !landed;
                      });
        ptx::cp_async_bulk_global_shared_bulk_group(dst[s], stages + static_cast<int64_t>(s) * stage_bytes, bytes[s]);
        ptx::cp_async_bulk_commit_group();
        ++stored;
    }

    __device__ void flush() {
        while (stored < loaded) store_oldest();
        ptx::cp_async_bulk_wait_group<0>();
    }
};

__device__ __forceinline__ float ld_volatile_f32(const float* p) {
    return __int_as_float(ptx::ld_volatile_s32(reinterpret_cast<const int*>(p)));
}

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

}  // namespace epjit
