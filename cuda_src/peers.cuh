// The one device-side view of peer memory every kernel gets: a PeersTable in device memory, built by
// epjit/memory.py, holding the CUDA-IPC-mapped NVLink buffers of the ranks of my NVLink node and the
// NVSHMEM symmetric heap with a direct pointer to each PE's copy where NVSHMEM gives one (nvshmem_ptr).
//
// PeersTable (device memory, 8 KiB + 128 B; offsets are fixed: epjit/memory.py packs it with the same
// numbers, tests/test_layouts.py derives them from the struct below, and the size is asserted here; offsetof
// itself is not usable in a static_assert under every NVRTC we meet)
//
//   0   int32  rank            4   int32 num_ranks      8   int32 nvl_rank     12  int32 num_nvl_ranks
//   16  int64  nvl_bytes       24  int64 sym_bytes      32  uint64 timeout_ns
//   40  WaitRecord* wait_record (mapped pinned host memory: the host reads it after a trap)
//   48  void*  sym_base (my copy of the symmetric allocation)
//   56  int32  wait_claim (the first waiter that times out takes it with a CAS) 60 int32 pad
//   64  void*  nvl[kMaxNvlRanks]        IPC pointer to NVLink buffer of nvl rank i (mine included)
//   128 void*  sym_peer[kMaxRanks]      pe's copy as mapped here: nvshmem_ptr(sym_base, pe) on NVSHMEM's heap, the
//                                       IPC mapping inside one node (epjit.memory.IpcHeap), or nullptr where only
//                                       RDMA reaches it
//
// Every NVLink buffer begins with kNvlHeaderBytes of control words (below); payload starts after them. They are
// zeroed once, when the buffer is made, and every barrier leaves its words at zero again.
//
//   nvl buffer:  [ barrier signals: int32[kMaxNvlRanks] | reserved | channel barriers | ][ payload ... ]
//                0                                     kNvlChannelBarrierOffset: one row of kMaxNvlRanks
//                                                      signals a channel (intranode.cuh: kMaxChannels)
//                                                                                     kNvlHeaderBytes
#pragma once

#include "types.cuh"

namespace epjit {

constexpr int kMaxNvlRanks = 8;
constexpr int kMaxRanks = 1024;
constexpr int64_t kNvlHeaderBytes = 8192;
constexpr int64_t kNvlBarrierOffset = 0;
constexpr int64_t kNvlChannelBarrierOffset = 4096;

// What a timed-out spin-wait leaves for the host (epjit/memory.py: WAIT_RECORD_DTYPE).
struct WaitRecord {
    int32_t status;      // 0: nothing happened; 1: a wait timed out (written last)
    int32_t rank;        // the rank that waited
    int32_t peer;        // the rank it waited for (-1: none in particular)
    int32_t channel;     // channel / block it waited in (-1: none)
    int64_t expected;    // what it waited to see
    int64_t observed;    // what it saw last
    int64_t elapsed_ns;  // how long it waited
    char site[88];       // which kernel and which wait
};
static_assert(sizeof(WaitRecord) == 128, "WaitRecord layout is shared with epjit/memory.py");

struct PeersTable {
    int32_t rank;
    int32_t num_ranks;
    int32_t nvl_rank;
    int32_t num_nvl_ranks;
    int64_t nvl_bytes;
    int64_t sym_bytes;
    uint64_t timeout_ns;
    WaitRecord* wait_record;
    void* sym_base;
    int32_t wait_claim;
    int32_t pad;
    void* nvl[kMaxNvlRanks];
    void* sym_peer[kMaxRanks];
};
static_assert(sizeof(PeersTable) == 8320, "PeersTable size");

// The NVLink buffer of nvl rank i, as a T*, `offset` bytes past its start.
template <typename T = void>
__device__ __forceinline__ T* nvl_ptr(const PeersTable* peers, int nvl_rank, int64_t offset) {
    return reinterpret_cast<T*>(static_cast<char*>(peers->nvl[nvl_rank]) + offset);
}

// My copy of the symmetric allocation, `offset` bytes in (the address NVSHMEM put/signal calls take).
template <typename T = void>
__device__ __forceinline__ T* sym_local(const PeersTable* peers, int64_t offset) {
    return reinterpret_cast<T*>(static_cast<char*>(peers->sym_base) + offset);
}

// Where a word of my symmetric allocation sits on rank `pe`, as mapped here (sym_peer), else nullptr.
template <typename T>
__device__ __forceinline__ T* on_peer(const PeersTable* peers, T* mine, int pe) {
    char* peer_base = static_cast<char*>(peers->sym_peer[pe]);
    if (peer_base == nullptr) return nullptr;
    return reinterpret_cast<T*>(peer_base + (reinterpret_cast<char*>(mine) - static_cast<char*>(peers->sym_base)));
}

}  // namespace epjit
