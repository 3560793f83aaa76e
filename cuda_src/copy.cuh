// Warp-wide copies of 16-byte words: the one place that decides how many loads a lane keeps in flight.
#pragma once

#include "ptx.cuh"

namespace epjit {

// n int4 from src to dst with one warp, kInFlight 16-byte loads per lane issued before their stores: bytes in
// flight are what keeps NVLink busy (one warp: 32 x 16 x kInFlight bytes). Load is the (read-only or
// ring) load wrapper: `.nc` for inputs nobody writes during the kernel, volatile for ring slots a peer wrote.
template <int kInFlight, typename Load>
__device__ __forceinline__ void warp_copy_with(int4* dst, const int4* src, int n, int lane, Load load) {
    int i = lane;
    for (; i + 32 * (kInFlight - 1) < n; i += 32 * kInFlight) {
        int4 v[kInFlight];
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) v[j] = load(src + i + 32 * j);
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) ptx::st_global_L1_no_allocate_v4(dst + i + 32 * j, v[j]);
    }
    for (; i < n; i += 32) ptx::st_global_L1_no_allocate_v4(dst + i, load(src + i));
}

__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int n, int lane) {
    warp_copy_with<8>(dst, src, n, lane, [](const int4* p) { return ptx::ld_global_nc_L1_no_allocate_v4(p); });
}

// From memory another GPU writes during this kernel (ring slots, receive slots): the non-coherent path must not
// serve it.
__device__ __forceinline__ void warp_copy_peer_written(int4* dst, const int4* src, int n, int lane) {
    warp_copy_with<8>(dst, src, n, lane, [](const int4* p) { return ptx::ld_volatile_global_v4(p); });
}

__device__ __forceinline__ float ld_volatile_f32(const float* p) {
    return __int_as_float(ptx::ld_volatile_s32(reinterpret_cast<const int*>(p)));
}

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

}  // namespace epjit
