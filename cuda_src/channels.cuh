// Which of a rank's tokens each channel of a normal-mode kernel carries, and how many of them go where: shared by
// the intranode and internode families (their notify kernels count, their dispatch and combine kernels walk).
#pragma once

#include "copy.cuh"
#include "types.cuh"

namespace epjit {

// Channels a call may use (epjit/config.py: MAX_CHANNELS).
constexpr int kMaxChannels = 128;

// Channel `channel` of `num_channels` carries tokens [begin, end): equal contiguous shares, the last one short.
__device__ __forceinline__ void channel_range(int num_tokens, int num_channels, int channel, int& begin, int& end) {
    const int per = (num_tokens + num_channels - 1) / num_channels;
    begin = min(channel * per, num_tokens);
    end = min(begin + per, num_tokens);
}

// One block: prefix[c] = tokens of channels 0..c with any of the columns [first, first + num_cols) of
// is_token_in_rank [num_tokens, num_ranks] set (a destination rank: one column; a node: its ranks' columns).
// A warp a channel counts, then one warp sums 32 channels a step (a serial loop through global memory cost a
// memory round trip a channel).
__device__ __forceinline__ void channel_prefix_block(const bool* is_token_in_rank, int num_tokens, int num_ranks,
                                                     int first, int num_cols, int num_channels, int* prefix) {
    __shared__ int s_counts[kMaxChannels];
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    const int num_warps = static_cast<int>(blockDim.x) / 32;
    for (int c = warp; c < num_channels; c += num_warps) {
        int begin, end;
        channel_range(num_tokens, num_channels, c, begin, end);
        int count = 0;
        for (int i = begin + lane; i < end; i += 32) {
            bool any = false;
            for (int j = 0; j < num_cols; ++j) any |= is_token_in_rank[static_cast<int64_t>(i) * num_ranks + first + j];
            count += any ? 1 : 0;
        }
        count = warp_sum(count);
        if (lane == 0) s_counts[c] = count;
    }
    __syncthreads();
    if (warp == 0) {
        int carry = 0;
        for (int base = 0; base < num_channels; base += 32) {
            int v = base + lane < num_channels ? s_counts[base + lane] : 0;
            for (int o = 1; o < 32; o <<= 1) {
                const int up = __shfl_up_sync(0xffffffffu, v, o);
                if (lane >= o) v += up;
            }
            if (base + lane < num_channels) prefix[base + lane] = carry + v;
            carry += __shfl_sync(0xffffffffu, v, 31);
        }
    }
}

}  // namespace epjit
