// The one spin-wait of epjit. Every loop that polls memory another GPU (or another SM) writes goes through
// timeout_while, so a peer that never arrives turns into an error that names the rank, the peer, the channel
// and the values, instead of a hang (pplx-kernels' silent `while (flag != 0);` is what we never ship).
//
// On expiry the first waiter to claim PeersTable::wait_claim writes a WaitRecord into mapped pinned host
// memory, makes it visible system-wide, and traps. A trap kills the kernel and leaves the CUDA context
// unusable: the host sees a launch failure at its next synchronisation, reads the record (host memory outlives
// the context) and raises EpjitTimeoutError with it. Other waiters that time out meanwhile do not trap
// themselves (that could end the grid before the record is complete): they park until the winner's trap.
#pragma once

#include "types.cuh"

#include "peers.cuh"
#include "ptx.cuh"

namespace epjit {

struct WaitSite {
    const char* what;   // "kernel: what is awaited", e.g. "nvl_barrier: peer's signal <= 0"
    int peer;           // rank waited for, or -1
    int channel;        // channel/block, or -1
    int64_t expected;   // value awaited (the condition is in `what`)
};

// The record of one timed-out wait (report_timeout's, or the one that masked a peer), fields before status.
__device__ __forceinline__ void fill_wait_record(WaitRecord* rec, const PeersTable* peers, const WaitSite& site,
                                                 int64_t observed, uint64_t elapsed_ns) {
    rec->rank = peers->rank;
    rec->peer = site.peer;
    rec->channel = site.channel;
    rec->expected = site.expected;
    rec->observed = observed;
    rec->elapsed_ns = static_cast<int64_t>(elapsed_ns);
    int i = 0;
    for (; i < static_cast<int>(sizeof(rec->site)) - 1 && site.what[i] != '\0'; ++i) rec->site[i] = site.what[i];
    rec->site[i] = '\0';
}

__device__ __noinline__ void report_timeout(const PeersTable* peers, const WaitSite& site, int64_t observed,
                                            uint64_t elapsed_ns) {
    auto* claim = const_cast<int32_t*>(&peers->wait_claim);
    if (atomicCAS(claim, 0, 1) == 0) {
        WaitRecord* rec = peers->wait_record;
        fill_wait_record(rec, peers, site, observed, elapsed_ns);
        // The fields must reach host memory before the status word that tells the host to read them.
        ptx::fence_sc_sys();
        ptx::st_release_sys_s32(&rec->status, 1);
        ptx::fence_sc_sys();
        ptx::trap();
    }
    // Someone else is reporting; its trap ends this grid.
    while (true) __nanosleep(1000);
}

// Spins while keep_waiting(observed) returns true. keep_waiting performs the (acquire) load itself and stores
// what it saw in `observed`, so the report carries the last value. The clock is read only every 256 polls:
// %globaltimer is slow to read and a timeout of seconds needs no finer grain. Returns the nanoseconds it spun when
// kTimed (a profile build's waits, e.g. internode.cu's: the clock is read once more, only by a wait that spun), else
// 0: a wait that is not timed compiles to what it was without the choice.
template <bool kTimed = false, typename KeepWaiting>
__device__ __forceinline__ uint64_t timeout_while(const PeersTable* peers, const WaitSite& site,
                                                  KeepWaiting&& keep_waiting) {
    int64_t observed = 0;
    if (!keep_waiting(observed)) return 0;
    const uint64_t start = ptx::globaltimer_ns();
    for (uint32_t polls = 1;; ++polls) {
        if (!keep_waiting(observed)) {
            if constexpr (kTimed) return ptx::globaltimer_ns() - start;
            return 0;
        }
        if ((polls & 255u) == 0) {
            const uint64_t elapsed = ptx::globaltimer_ns() - start;
            if (elapsed > peers->timeout_ns) report_timeout(peers, site, observed, elapsed);
        }
    }
}

// ------------------------------------------------------------------------------------------ shrink mode

// Where a kernel may drop a peer instead of trapping (a low-latency Buffer made with enable_shrink): the mask,
// int32 [num_ranks] in device memory (nonzero: the rank is neither sent to nor waited for), the records of the
// waits that masked a rank, WaitRecord [num_ranks] in mapped host memory, and how long such a wait may poll.
struct PeerMask {
    int32_t* mask;
    WaitRecord* records;
    uint64_t timeout_ns;
};

// Masks site.peer, and if this thread was first to, leaves the record of its wait at records[peer] (status last,
// released: the host reads the record when it sees the status). Returns whether this thread masked it.
__device__ __noinline__ bool mask_peer(const PeersTable* peers, const PeerMask& m, const WaitSite& site,
                                       int64_t observed, uint64_t elapsed_ns) {
    if (atomicExch(m.mask + site.peer, 1) != 0) return false;  // masked already (another waiter, or the host)
    WaitRecord* rec = m.records + site.peer;
    fill_wait_record(rec, peers, site, observed, elapsed_ns);
    ptx::fence_sc_sys();
    ptx::st_release_sys_s32(&rec->status, 1);
    return true;
}

// timeout_while for a wait on peer site.peer that may drop the peer: true once keep_waiting returns false; false,
// without waiting, for a masked peer, and false once the peer is masked meanwhile (by another waiter) or after
// m.timeout_ns (then this wait masks it: `masked_now` tells the caller whether this thread did). The mask is
// read with the clock, every 256 polls.
template <typename KeepWaiting>
__device__ __forceinline__ bool timeout_while_unmasked(const PeersTable* peers, const PeerMask& m,
                                                       const WaitSite& site, bool& masked_now,
                                                       KeepWaiting&& keep_waiting) {
    masked_now = false;
    if (ptx::ld_volatile_s32(m.mask + site.peer) != 0) return false;
    int64_t observed = 0;
    if (!keep_waiting(observed)) return true;
    const uint64_t start = ptx::globaltimer_ns();
    for (uint32_t polls = 1;; ++polls) {
        if (!keep_waiting(observed)) return true;
        if ((polls & 255u) == 0) {
            if (ptx::ld_volatile_s32(m.mask + site.peer) != 0) return false;
            const uint64_t elapsed = ptx::globaltimer_ns() - start;
            if (elapsed > m.timeout_ns) {
                masked_now = mask_peer(peers, m, site, observed, elapsed);
                return false;
            }
        }
    }
}

}  // namespace epjit
