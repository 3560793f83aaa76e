// The put and signal operations of the kernels that reach a rank without an NVLink pointer: the internode RDMA leg,
// and low latency's put path. Addresses are my own copy's (symmetric addressing: the same offset on `pe`).
//
// Three builds of the same kernels, chosen by the defines of the spec that builds them (epjit/kernels/):
//   NVSHMEM (internode.cu's default,      the device library's puts and signals: the path a cluster's nodes take
//   low_latency.cu with EPJIT_LL_PUTS)    (IBGDA or NVSHMEM's proxy).
//   stores (EPJIT_RDMA_BY_STORES:         every rank of the group is on one host and maps every other's symmetric
//   internode_stores and                  region through CUDA IPC (epjit.memory.IpcHeap): the warp stores the bytes
//   low_latency_stores builds)            through the peer's pointer; a signal is a release by one thread. The order
//                                         NVSHMEM guarantees (the data, then the signal) is kept the way every
//                                         NVLink ring here is published: the lanes' stores -> the caller's
//                                         __syncwarp or barrier -> a release. No NVSHMEM library: compute-sanitizer
//                                         can check it (NVSHMEM does not start under it), and a host without NVSHMEM
//                                         can run virtual nodes.
//   none (EPJIT_RDMA_NONE: low_latency.cu where every peer has a pointer and puts are not forced): no put path runs
//                                         (epjit/ops/low_latency.py picks the build); one reached traps rather than
//                                         touch memory.
#pragma once

#include "copy.cuh"
#include "peers.cuh"
#include "ptx.cuh"
#if !defined(EPJIT_RDMA_BY_STORES) && !defined(EPJIT_RDMA_NONE)
#define EPJIT_RDMA_NVSHMEM
#include "nvshmem.cuh"
#endif

namespace epjit {

enum class SignalOp { kSet, kAdd };

#ifdef EPJIT_RDMA_NVSHMEM
__device__ __forceinline__ int signal_op_code(SignalOp op) {
    return op == SignalOp::kAdd ? NVSHMEM_SIGNAL_ADD : NVSHMEM_SIGNAL_SET;
}
#endif

// Set or add `value` to pe's copy of `word`, after everything this thread wrote before (release).
__device__ __forceinline__ void rdma_signal(const PeersTable* peers, uint64_t* word, uint64_t value, SignalOp op,
                                            int pe) {
#if defined(EPJIT_RDMA_BY_STORES)
    uint64_t* remote = on_peer(peers, word, pe);
    if (op == SignalOp::kAdd)
        ptx::red_add_release_sys_u64(remote, value);
    else
        ptx::st_release_sys_u64(remote, value);
#elif defined(EPJIT_RDMA_NONE)
    __trap();
#else
    (void)peers;
    nvshmemx_signal_op(word, value, signal_op_code(op), pe);
#endif
}

// `bytes` (a multiple of 16; both ends 16-byte aligned) from my `src` to pe's copy of `dst`, delivered before the
// writer's next rdma_quiet returns. The whole warp calls it; src was written before the call by threads the caller
// ordered (coherent loads: it may have been written during this kernel).
__device__ __forceinline__ void rdma_put_warp(const PeersTable* peers, void* dst, const void* src, size_t bytes,
                                              int pe, int lane) {
#if defined(EPJIT_RDMA_BY_STORES)
    warp_copy_peer_written(on_peer(peers, static_cast<int4*>(dst), pe), static_cast<const int4*>(src),
                           static_cast<int>(bytes / 16), lane);
#elif defined(EPJIT_RDMA_NONE)
    __trap();
#else
    (void)peers;
    (void)lane;
    nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
#endif
}

// Every put this thread issued has landed before what it does next (NVSHMEM's quiet). Stores: they were issued
// in order, and the caller's barrier and release carry them (as on the direct path).
__device__ __forceinline__ void rdma_quiet() {
#if defined(EPJIT_RDMA_NONE)
    __trap();
#elif defined(EPJIT_RDMA_NVSHMEM)
    nvshmem_quiet();
#endif
}

// rdma_put_warp, then the signal on pe's copy of `signal` once the bytes are there (NVSHMEM's put with signal).
__device__ __forceinline__ void rdma_put_signal_warp(const PeersTable* peers, void* dst, const void* src,
                                                     size_t bytes, uint64_t* signal, uint64_t value, SignalOp op,
                                                     int pe, int lane) {
#ifndef EPJIT_RDMA_NVSHMEM
    rdma_put_warp(peers, dst, src, bytes, pe, lane);
    __syncwarp();
    if (lane == 0) rdma_signal(peers, signal, value, op, pe);
#else
    (void)peers;
    (void)lane;
    nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, signal, value, signal_op_code(op), pe);
#endif
}

}  // namespace epjit
