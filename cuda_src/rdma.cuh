// The internode kernels' RDMA leg: a warp's put of a span of the symmetric region with a signal that lands after
// it, and a lone signal. Addresses are my own copy's (NVSHMEM's symmetric addressing: the same offset on `pe`).
//
// Two builds of the same kernels:
//   NVSHMEM (internode.cu)                the device library's put-with-signal and signal operations: the path a
//                                         cluster's nodes take (IBGDA or NVSHMEM's proxy).
//   stores (internode_stores.cu, with     every rank of the group is on one host and maps every other's symmetric
//   EPJIT_RDMA_BY_STORES defined)         region through CUDA IPC (epjit.memory.IpcHeap): the warp stores the bytes
//                                         through the peer's pointer, then one lane releases the signal. The order
//                                         NVSHMEM guarantees (the data, then the signal) is kept: the lanes' stores
//                                         -> __syncwarp -> a release by lane 0, as every NVLink ring here is
//                                         published. No NVSHMEM library: compute-sanitizer can check it (NVSHMEM
//                                         does not start under it), and a host without NVSHMEM can run virtual nodes.
#pragma once

#include "copy.cuh"
#include "peers.cuh"
#include "ptx.cuh"
#ifndef EPJIT_RDMA_BY_STORES
#include "nvshmem.cuh"
#endif

namespace epjit {

enum class SignalOp { kSet, kAdd };

#ifdef EPJIT_RDMA_BY_STORES
// `local` (in my copy of the symmetric region) as mapped from pe's copy.
template <typename T>
__device__ __forceinline__ T* sym_remote(const PeersTable* peers, T* local, int pe) {
    const int64_t offset = reinterpret_cast<char*>(local) - static_cast<char*>(peers->sym_base);
    return reinterpret_cast<T*>(static_cast<char*>(peers->sym_peer[pe]) + offset);
}
#endif

// Set or add `value` to pe's copy of `word`, after everything this thread wrote before (release).
__device__ __forceinline__ void rdma_signal(const PeersTable* peers, uint64_t* word, uint64_t value, SignalOp op,
                                            int pe) {
#ifdef EPJIT_RDMA_BY_STORES
    uint64_t* remote = sym_remote(peers, word, pe);
    if (op == SignalOp::kAdd)
        ptx::red_add_release_sys_u64(remote, value);
    else
        ptx::st_release_sys_u64(remote, value);
#else
    (void)peers;
    nvshmemx_signal_op(word, value, op == SignalOp::kAdd ? NVSHMEM_SIGNAL_ADD : NVSHMEM_SIGNAL_SET, pe);
#endif
}

// `bytes` (a multiple of 16; both ends 16-byte aligned) from my `src` to pe's copy of `dst`, then the signal on
// pe's copy of `signal`. The whole warp calls it; src was written before the call by threads the caller ordered.
__device__ __forceinline__ void rdma_put_signal_warp(const PeersTable* peers, void* dst, const void* src,
                                                     size_t bytes, uint64_t* signal, uint64_t value, SignalOp op,
                                                     int pe, int lane) {
#ifdef EPJIT_RDMA_BY_STORES
    // Coherent loads: src was written during this kernel (by this block's other threads).
    warp_copy_peer_written(sym_remote(peers, static_cast<int4*>(dst), pe), static_cast<const int4*>(src),
                           static_cast<int>(bytes / 16), lane);
    __syncwarp();
    if (lane == 0) rdma_signal(peers, signal, value, op, pe);
#else
    (void)peers;
    (void)lane;
    nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, signal, value,
                                    op == SignalOp::kAdd ? NVSHMEM_SIGNAL_ADD : NVSHMEM_SIGNAL_SET, pe);
#endif
}

}  // namespace epjit
