// Per-token FP8 (e4m3) quantisation with one float32 scale per 128 channels, bit-identical to
// epjit/reference/numerics.py:per_token_cast_to_fp8: amax = max(max|x|, 1e-4); scale = amax / 448 (IEEE division), rounded
// up to a power of two with round_scale; q = e4m3_satfinite(x * (1 / scale)) with a float32 multiply (no FMA).
#pragma once

#include "bf16.cuh"
#include "ptx.cuh"
#include "types.cuh"

namespace epjit {

constexpr int kFp8BlockChannels = 128;
constexpr float kFp8Max = 448.0f;
constexpr float kFp8AmaxFloor = 1e-4f;

// Smallest power of two >= a positive normal float, from its bits (as the reference does: no log2 rounding).
__device__ __forceinline__ float pow2_ceil(float v) {
    const uint32_t bits = __float_as_uint(v);
    const int exponent = static_cast<int>((bits >> 23) & 0xffu) + ((bits & 0x7fffffu) != 0 ? 1 : 0);
    return __uint_as_float(static_cast<uint32_t>(exponent) << 23);
}

__device__ __forceinline__ float fp8_scale(float amax, bool round_scale) {
    const float scale = __fdiv_rn(fmaxf(amax, kFp8AmaxFloor), kFp8Max);
    return round_scale ? pow2_ceil(scale) : scale;
}

// fp8_scale(amax, false) and __fdiv_rn(1, that scale), bit for bit, without a division, where amax is the largest
// |x| of bf16 values (a bf16 value itself, before the floor): scale = amax / 448 as amax * RN(1/448) corrected once
// by its FMA residual, and its reciprocal as rcp.approx (within 1 ulp) corrected once by Newton's step in FMAs. Both
// were checked exact against the IEEE divisions for every positive finite bf16 amax >= 1e-4 and the floor itself,
// the reciprocal from any start within 4 ulp (tests/test_combine_fp8.py); a float32 amax (a sum) is not covered.
// The two divisions cost ~25 instructions with two branches to a slow path; these 6 have none.
__device__ __forceinline__ float bf16_block_scale(float amax, float& inverse) {
    constexpr float kInverseMax = 1.0f / kFp8Max;  // RN(1/448), 0x3b124925
    amax = fmaxf(amax, kFp8AmaxFloor);
    const float guess = __fmul_rn(amax, kInverseMax);
    const float scale = __fmaf_rn(__fmaf_rn(-guess, kFp8Max, amax), kInverseMax, guess);
    const float start = ptx::rcp_approx_ftz_f32(scale);
    inverse = __fmaf_rn(__fmaf_rn(-scale, start, 1.0f), start, start);
    return scale;
}

// The biased exponent byte of a power-of-two scale (UE8M0).
__device__ __forceinline__ uint8_t ue8m0_of(float pow2_scale) {
    return static_cast<uint8_t>((__float_as_uint(pow2_scale) >> 23) & 0xffu);
}

// The 8 bf16 of v as floats.
__device__ __forceinline__ void unpack_bf16x8(const int4& v, float* out) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                           static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = bf16_lo(w[i]);
        out[2 * i + 1] = bf16_hi(w[i]);
    }
}

// Eight floats times `inverse`, to eight e4m3 bytes in channel order.
__device__ __forceinline__ uint2 quantize_x8(const float* values, float inverse) {
    uint32_t half[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        half[i] = ptx::cvt_rn_satfinite_e4m3x2_f32(__fmul_rn(values[2 * i + 1], inverse),
                                                   __fmul_rn(values[2 * i], inverse));
    return make_uint2(half[0] | (half[1] << 16), half[2] | (half[3] << 16));
}

// amax over the 16 lanes that hold one 128-channel block (8 channels a lane, lanes 16-aligned). Every lane of the
// warp must call it (lanes without data pass 0).
__device__ __forceinline__ float block128_amax(float lane_amax) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) lane_amax = fmaxf(lane_amax, __shfl_xor_sync(0xffffffffu, lane_amax, o));
    return lane_amax;
}

// acc[0..7] += the 8 e4m3 of q (channel order, as quantize_x8 packs them) times `scale`: each product a float32
// multiply (__fmul_rn, never fused into the add), then the add, as the reference's fp8_to_float and its sum do.
__device__ __forceinline__ void add_fp8x8(float* acc, const uint2& q, float scale) {
    const uint32_t w[2] = {q.x, q.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t halves = ptx::cvt_rn_f16x2_e4m3x2(static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2))));
        acc[2 * i] += __fmul_rn(ptx::cvt_f32_f16(static_cast<uint16_t>(halves & 0xffffu)), scale);
        acc[2 * i + 1] += __fmul_rn(ptx::cvt_f32_f16(static_cast<uint16_t>(halves >> 16)), scale);
    }
}

// The scale of the 128-channel block of this lane's 8 channels `values` (lanes 16-aligned a block, as
// block128_amax), without rounding: every lane of the warp must call it (lanes without data pass zeros).
__device__ __forceinline__ float block128_scale(const float* values) {
    float amax = 0.0f;
#pragma unroll
    for (int c = 0; c < 8; ++c) amax = fmaxf(amax, fabsf(values[c]));
    return fp8_scale(block128_amax(amax), false);
}

// block128_scale of bf16 values (bf16_block_scale: no division), and its reciprocal in `inverse`.
__device__ __forceinline__ float bf16_block128_scale(const float* values, float& inverse) {
    float amax = 0.0f;
#pragma unroll
    for (int c = 0; c < 8; ++c) amax = fmaxf(amax, fabsf(values[c]));
    return bf16_block_scale(block128_amax(amax), inverse);
}

// One bf16 row of row_int4 16-byte words (a multiple of 16: hidden % 128 == 0) quantised by one warp into `dst`:
// the hidden e4m3 bytes, then hidden / 128 float32 scales. kInFlight loads a lane are issued before any is
// converted (a row of 7168 channels is 28 words a lane: one round trip each would leave the warp waiting).
template <int kInFlight>
__device__ __forceinline__ void warp_quantize_row(char* dst, const int4* src, int row_int4, int lane) {
    float* scales = reinterpret_cast<float*>(dst + static_cast<int64_t>(row_int4) * 8);
    for (int i0 = 0; i0 < row_int4; i0 += 32 * kInFlight) {  // the same bounds on every lane
        int4 v[kInFlight];
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) {
            const int i = i0 + 32 * j + lane;
            v[j] = i < row_int4 ? ptx::ld_global_nc_L1_no_allocate_v4(src + i) : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) {
            const int i = i0 + 32 * j + lane;
            float f[8];
            unpack_bf16x8(v[j], f);
            float inverse;
            const float scale = bf16_block128_scale(f, inverse);
            if (i < row_int4) {  // (a whole block of 16 lanes or none: row_int4 % 16 == 0)
                *reinterpret_cast<uint2*>(dst + static_cast<int64_t>(i) * 8) = quantize_x8(f, inverse);
                if (i % 16 == 0) scales[i / 16] = scale;
            }
        }
    }
}

}  // namespace epjit
