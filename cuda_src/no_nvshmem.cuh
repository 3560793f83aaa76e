// What low_latency.cu calls of NVSHMEM, for its build without the device library: the host launches that build
// only where every peer has an NVLink pointer and puts are not forced (epjit/buffer.py, low_latency_needs_puts), so no
// put path runs in it; were one reached, it stops the kernel rather than touch memory.
#pragma once

#include "types.cuh"

namespace epjit {

constexpr int NVSHMEM_SIGNAL_SET = 0;

__device__ __forceinline__ void nvshmemx_signal_op(uint64_t*, uint64_t, int, int) { __trap(); }
__device__ __forceinline__ void nvshmemx_putmem_nbi_warp(void*, const void*, cuda::std::size_t, int) { __trap(); }
__device__ __forceinline__ void nvshmem_quiet() { __trap(); }

}  // namespace epjit
