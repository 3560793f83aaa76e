// bf16 <-> float on raw bits, so kernels need no cuda_bf16.h (and round exactly as NumPy/ml_dtypes do).
#pragma once

#include "ptx.cuh"
#include "types.cuh"

namespace epjit {

__device__ __forceinline__ float bf16_lo(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t pair) { return __uint_as_float(pair & 0xffff0000u); }

// Round to nearest even; NaN stays a quiet NaN.
__device__ __forceinline__ uint32_t float_to_bf16_bits(float f) {
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    return float_to_bf16_bits(lo) | (float_to_bf16_bits(hi) << 16);
}

// acc[0..7] += the 8 bf16 of v.
__device__ __forceinline__ void add_bf16x8(float* acc, const int4& v) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                           static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] += bf16_lo(w[i]);
        acc[2 * i + 1] += bf16_hi(w[i]);
    }
}

__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
    return make_int4(static_cast<int>(pack_bf16(acc[0], acc[1])), static_cast<int>(pack_bf16(acc[2], acc[3])),
                     static_cast<int>(pack_bf16(acc[4], acc[5])), static_cast<int>(pack_bf16(acc[6], acc[7])));
}

// pack_bf16x8's bits through the hardware's round-to-nearest-even conversion: 4 cvt.rn.bf16x2.f32 in place of
// ~60 integer steps. The same bits for every float but NaN, whose bits the hardware chooses: 8 floats with a NaN
// among them (the inputs' own, or inf - inf) take pack_bf16x8, which writes NumPy's 0x7fc0.
__device__ __forceinline__ int4 pack_bf16x8_rn(const float* acc) {
    bool nan = false;
#pragma unroll
    for (int c = 0; c < 8; ++c) nan |= acc[c] != acc[c];
    if (nan) return pack_bf16x8(acc);
    return make_int4(static_cast<int>(ptx::cvt_rn_bf16x2_f32(acc[1], acc[0])),
                     static_cast<int>(ptx::cvt_rn_bf16x2_f32(acc[3], acc[2])),
                     static_cast<int>(ptx::cvt_rn_bf16x2_f32(acc[5], acc[4])),
                     static_cast<int>(ptx::cvt_rn_bf16x2_f32(acc[7], acc[6])));
}

}  // namespace epjit
