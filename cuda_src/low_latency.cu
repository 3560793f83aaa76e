// Low-latency dispatch and combine for decode (DeepEP's low-latency kernels; why this shape: docs/design.md).
//
// No count round trip: every (source rank, token) owns a message slot in the symmetric heap of each rank, and
// every (local expert, source rank) M = num_max_dispatch_tokens_per_rank rows of the receive arrays (layout:
// low_latency.cuh), so a source writes each message, and names each of its rows, at places it computes alone.
//
//   dispatch send   block b takes tokens b, b + grid, ...: the block stages the token (FP8-quantised, or bf16) in
//                   shared memory, then warp w writes it once to the w-th distinct rank among its experts': into
//                   message slot (me, t) of that rank, with one entry per (t, k) there naming its row: slot i of
//                   (local expert, me), where i counts the earlier (token, k) of this rank naming that expert, so
//                   the slot order is the token order and repeated runs are bit-identical (topk_idx is staged in
//                   shared memory for that count). NVLink carries a token once per rank, not once per expert (at
//                   top-8 of 256 experts a chosen rank holds ~2.2 of them on 4 ranks, ~4 on 2). Direct NVLink
//                   stores through nvshmem_ptr's pointer, or NVSHMEM warp puts where there is none (two staging
//                   buffers: the next token is quantised while this one is sent). After its last token each
//                   sending warp bumps the local sent counter of every expert its messages named, behind one
//                   gpu-scope fence (a put path quiets first); a warp per expert counts what this rank sends it,
//                   waits for the counter to reach that, then writes the count as -(n+1) with a system-scope
//                   release (or an NVSHMEM signal), so the count's arrival proves the data landed and no sending
//                   warp pays a system fence of its own (DeepEP's finish counters).
//   dispatch recv   every block waits for the counts of every (local expert, source) (the prefix over sources is
//                   where a source's rows begin; any count of a source proves all its messages landed), then a
//                   warp a message slot: a header stamped with this call's epoch is a message, copied into the
//                   rows of recv_x [L][R*M][H] its entries name, with src_info and the top-k slot; block 0 fills
//                   recv_count and layout_range.
//   combine send    W warps per (local expert, source): each received row of y goes back to slot (token, k) of
//                   its home rank; after the last row of the pair, one flag for the expert.
//   combine recv    each block waits for the flags of its tokens' experts, then sums each token's top-k slots with
//                   the gate weights in float32 (k order, as the reference) and writes bf16.
//   LogFMT combine  ll_combine_logfmt, the same halves: a sending warp encodes each 128-channel group of a row
//                   as DeepEP's LogFMT-10 where the group allows it, with a group word beside the slot; the
//                   receiving threads decode by that word before the same sums (below, and docs/layouts.md).
//
// `phases` selects send, receive or both: with return_recv_hook the host launches the send half now and the
// receive half when the caller runs the hook, so no SM waits while bytes are in flight.
//
// Signals carry the epoch of the call (low_latency.cuh); the last block of a call's receive half advances it and
// acks the call (a dispatch's acks are sent by the next low-latency kernel: finish_call).
#include "bf16.cuh"
#include "copy.cuh"
#include "fp8.cuh"
#include "low_latency.cuh"
// The NVSHMEM device library only where a put path may run through it (EPJIT_LL_PUTS): a -rdc build linked with
// it makes every launch slower (docs/history.md), so the plain build's put path traps (rdma.cuh's "none"), and the
// EPJIT_RDMA_BY_STORES build's puts are NVLink stores.
#if !defined(EPJIT_LL_PUTS) && !defined(EPJIT_RDMA_BY_STORES)
#define EPJIT_RDMA_NONE
#endif
#include "ptx.cuh"
#include "rdma.cuh"
#include "timeline.cuh"
#include "wait.cuh"

namespace epjit {

constexpr int kLowLatencyThreads = 1024;
constexpr int kLowLatencyWarps = kLowLatencyThreads / 32;
constexpr int kPhaseSend = 1;
constexpr int kPhaseRecv = 2;

// The EPJIT_LL_SHRINK build (shrink mode, below).
#if defined(EPJIT_LL_SHRINK)
constexpr bool kShrink = true;
#else
constexpr bool kShrink = false;
#endif

// The EPJIT_LL_WAIT_STATS build (a call given DeepEP's dispatch_wait_recv_cost_stats or
// combine_wait_recv_cost_stats): each receive wait's nanoseconds, added to wait_stats[the rank waited for].
// (An enum, not a constexpr variable: NVRTC may emit a namespace-scope constant as a global of the other builds too.)
#if defined(EPJIT_LL_WAIT_STATS)
enum : bool { kWaitStats = true };
#else
enum : bool { kWaitStats = false };
#endif

// Call flags (epjit/ops/low_latency.py mirrors them).
constexpr int kFlagFp8 = 1;
constexpr int kFlagRoundScale = 2;
constexpr int kFlagUe8m0 = 4;

// Status bits, ORed into the call word (LowLatencySync::call[set], above kCallBlockBits); the call's last block
// counts each raised bit in host_status (epjit/ops/low_latency.py mirrors the layout, see publish_status).
constexpr int kLowLatencyInvalidIds = 1;    // topk_idx entries outside [-1, num_experts): skipped
constexpr int kLowLatencySlotOverflow = 2;  // > M top-k slots of one rank name one expert (repeats): dropped
constexpr int kLowLatencyMetaMismatch = 4;  // a message with another hidden size or FP8 setting arrived
constexpr int kLowLatencyLayoutTooBig = 8;  // the two sets do not fit the heap (host and header disagree): no-op
constexpr int kLowLatencyRankMasked = 16;   // shrink mode: a wait on a peer timed out and masked it (its record)
constexpr int kCallBlockBits = 16;          // the call word's low bits count finished blocks (grids < 65536)

__device__ __forceinline__ void report_status(int32_t* call_word, int status) {
    atomicOr(call_word, status << kCallBlockBits);
}

// host_status (mapped host memory) is written by the GPU only: word 1 + b counts the calls that raised bit b, and
// word 0 counts the reports, released after the counts. The host keeps the last word 0 it read and raises what the
// counts gained since, so a report landing while the host reads an earlier one is seen at the next check instead
// of being lost to a host write (the host never writes the words while a kernel may run).
// The host reads five counts; the builds without shrink mode never raise the last bit, and leave its count alone.
constexpr int kStatusBitCount = 5;
constexpr int kStatusBitsRaised = kShrink ? kStatusBitCount : kStatusBitCount - 1;
static_assert(kLowLatencyRankMasked == 1 << (kStatusBitCount - 1), "publish_status counts every status bit");

__device__ __forceinline__ void publish_status(int* host_status, int status) {
    for (int b = 0; b < kStatusBitsRaised; ++b)
        if (status & (1 << b)) host_status[1 + b] = ptx::ld_volatile_s32(host_status + 1 + b) + 1;
    ptx::st_release_sys_s32(host_status, ptx::ld_volatile_s32(host_status) + 1);
}

// ---------------------------------------------------------------------------------------------- shrink mode

// The EPJIT_LL_SHRINK build (kShrink; a Buffer made with enable_shrink, docs/reliability.md): a masked rank is neither sent
// to nor waited for, and a wait on a peer that times out masks the peer instead of trapping. Every use below is an
// `if constexpr (kShrink)` or a helper that is a constant in the other builds (masked() is false, wait_peer is
// timeout_while), so the builds without it compile to the code they had: the choice costs them nothing.
// A kernel's view of the mask (null pointers outside the shrink build; nothing there reads them).
struct Shrink {
    LowLatencyShrink* state;
    int32_t* mask;
    int32_t* call_word;  // where a wait that masks a peer reports kLowLatencyRankMasked (nullptr: nowhere)
};

__device__ __forceinline__ Shrink shrink_of(LowLatencySync* sync, int num_experts, int32_t* call_word) {
    if constexpr (!kShrink) return {nullptr, nullptr, nullptr};
    LowLatencyShrink* state = shrink_state(sync, num_experts);
    return {state, reinterpret_cast<int32_t*>(state + 1), call_word};
}

// Whether rank `pe` is masked now (a volatile load: the host's update and other blocks' waits write it).
__device__ __forceinline__ bool masked(const Shrink& s, int pe) {
    if constexpr (!kShrink) return false;
    return ptx::ld_volatile_s32(s.mask + pe) != 0;
}

// A wait on peer site.peer: timeout_while (a timeout traps), or in the shrink build one that gives the peer up
// (timeout_while_unmasked). True when the condition held; false when the peer is masked (go on without it).
template <typename KeepWaiting>
__device__ __forceinline__ bool wait_peer(const PeersTable* peers, const Shrink& s, const WaitSite& site,
                                          KeepWaiting&& keep_waiting) {
    if constexpr (kShrink) {
        bool masked_now = false;
        const bool arrived = timeout_while_unmasked(
            peers, PeerMask{s.mask, s.state->records, s.state->timeout_ns}, site, masked_now, keep_waiting);
        if (masked_now && s.call_word != nullptr) report_status(s.call_word, kLowLatencyRankMasked);
        return arrived;
    } else {
        timeout_while(peers, site, keep_waiting);
        return true;
    }
}

// The wait-stats build's clock around a receive wait: wait_stats_since before it, wait_stats_arrived inside its
// condition (a lane's own arrival: a warp's lanes wait for different peers and leave the loop together, so a clock
// read after it would charge every lane's peer with the slowest one's wait), add_wait_stats after. The nanoseconds
// go to wait_stats[pe], an int64 a rank that the caller keeps adding to. The other builds read no clock and add
// nothing: all three compile to nothing there.
__device__ __forceinline__ uint64_t wait_stats_since() {
    if constexpr (kWaitStats) return ptx::globaltimer_ns();
    return 0;
}

__device__ __forceinline__ void wait_stats_arrived(uint64_t& arrived, bool keep_waiting) {
    if constexpr (kWaitStats)
        if (!keep_waiting) arrived = ptx::globaltimer_ns();
}

// `arrived` 0: the condition never held (a shrink build's masked peer): the wait lasted until now.
__device__ __forceinline__ void add_wait_stats(int64_t* wait_stats, int pe, uint64_t since, uint64_t arrived) {
    if constexpr (kWaitStats)
        atomicAdd(reinterpret_cast<unsigned long long*>(wait_stats + pe),
                  static_cast<unsigned long long>((arrived != 0 ? arrived : ptx::globaltimer_ns()) - since));
}

// Shrink build: every block of the grid past this point before any goes on, so every block reads one mask after
// it: a peer is masked only inside a wait, and every wait of the grid is behind. (The blocks are co-resident: one
// an SM, at most one an SM.) Sense by generation: a block reads it before it arrives; the last one to arrive resets
// the count and advances it.
__device__ __forceinline__ void grid_sync(const PeersTable* peers, const Shrink& s) {
    __syncthreads();
    if (threadIdx.x == 0) {
        LowLatencyShrink* state = s.state;
        const int generation = ptx::ld_acquire_gpu_s32(&state->generation);
        ptx::fence_acq_rel_gpu();  // the block's mask stores (ordered here by the bar.sync) before its arrival
        if (ptx::atom_add_acq_rel_gpu_s32(&state->arrived, 1) == static_cast<int>(gridDim.x) - 1) {
            state->arrived = 0;
            ptx::red_add_release_gpu_s32(&state->generation, 1);
        } else {
            timeout_while(peers, WaitSite{"ll shrink: every block of the grid past its waits", -1, -1,
                                          generation + 1},
                          [&](int64_t& seen) {
                              seen = ptx::ld_acquire_gpu_s32(&state->generation);
                              return seen == generation;
                          });
        }
        ptx::fence_acq_rel_gpu();
    }
    __syncthreads();
}

// EPJIT_PROFILE (timeline.cuh): the points a low-latency kernel stamps (epjit/kernels/low_latency.py mirrors them).
enum TimelinePoint {
    kAtStart = 0,      // the block began
    kAtAcks = 1,       // every rank had read this set's previous call
    kAtSent = 2,       // this block's tokens (dispatch) / rows (combine) were written
    kAtCounted = 3,    // dispatch: thread 0's expert count signalled; combine: the flags its tokens need arrived
    kAtCounts = 4,     // dispatch: the counts of thread 0's first (expert, source) pair arrived
    kAtReceived = 5,   // dispatch: this block's received rows copied; combine: its tokens reduced
    kAtEnd = 6,        // every warp of the block finished
};

// What every message carries so a receiver can tell a peer called with other sizes (only the wire format counts).
__device__ __forceinline__ int message_meta(int hidden, int flags) { return (hidden << 1) | (flags & kFlagFp8); }

__device__ __forceinline__ uint64_t epoch_signal(int epoch, uint32_t value) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(epoch)) << 32) | value;
}

__device__ __forceinline__ int signal_epoch(uint64_t word) { return static_cast<int>(word >> 32); }

// ---------------------------------------------------------------------------------------------- the flagged path

// A data int4 as two flagged int4, {x, flag, y, flag} and {z, flag, w, flag} (low_latency.cuh): a reader trusts a
// data word only beside the call's flag, as NCCL's LL protocol does.
__device__ __forceinline__ void st_flagged(int4* dst, const int4& v, int flag) {
    ptx::st_volatile_global_v4(dst, make_int4(v.x, flag, v.y, flag));
    ptx::st_volatile_global_v4(dst + 1, make_int4(v.z, flag, v.w, flag));
}

struct FlaggedPair {
    int4 lo, hi;
};

__device__ __forceinline__ FlaggedPair ld_flagged(const int4* src) {
    return {ptx::ld_volatile_global_v4(src), ptx::ld_volatile_global_v4(src + 1)};
}

__device__ __forceinline__ bool carries(const FlaggedPair& p, int flag) {
    return p.lo.y == flag && p.lo.w == flag && p.hi.y == flag && p.hi.w == flag;
}

// The first flag word of a pair that is not `flag` (what a timed-out wait reports).
__device__ __forceinline__ int64_t stale_flag(const FlaggedPair& seen, int flag) {
    return seen.lo.y != flag ? seen.lo.y : seen.lo.w != flag ? seen.lo.w : seen.hi.y != flag ? seen.hi.y : seen.hi.w;
}

// Polls the flagged pair at src until it carries `flag` (out of line: the waits are rare, and inlined at every
// load of a batch they cost the hot path its registers).
__device__ __noinline__ FlaggedPair wait_flagged(const PeersTable* peers, const int4* src, int flag, const char* what,
                                                 int peer) {
    FlaggedPair seen;
    timeout_while(peers, WaitSite{what, peer, -1, flag}, [&](int64_t& observed) {
        seen = ld_flagged(src);
        observed = stale_flag(seen, flag);
        return !carries(seen, flag);
    });
    return seen;
}

// The shrink build's wait_flagged: a pair from a peer that is (or gets) masked reads as zeros (a header of no
// entries, so the message is skipped; a payload's rows are of a masked source, which the caller disregards).
__device__ __noinline__ FlaggedPair wait_flagged_unmasked(const PeersTable* peers, Shrink s, const int4* src,
                                                          int flag, const char* what, int peer) {
    FlaggedPair seen;
    const bool arrived = wait_peer(peers, s, WaitSite{what, peer, -1, flag}, [&](int64_t& observed) {
        seen = ld_flagged(src);
        observed = stale_flag(seen, flag);
        return !carries(seen, flag);
    });
    if (!arrived) seen.lo = seen.hi = make_int4(0, 0, 0, 0);
    return seen;
}

// The data int4 of the flagged pair at src: `seen` is what a batch of loads in flight together found there; only
// a pair that has not all landed yet is polled again.
__device__ __forceinline__ int4 flagged_data(const PeersTable* peers, const Shrink& s, const int4* src,
                                             FlaggedPair seen, int flag, const char* what, int peer) {
    if (!carries(seen, flag)) {
        if constexpr (kShrink)
            seen = wait_flagged_unmasked(peers, s, src, flag, what, peer);
        else
            seen = wait_flagged(peers, src, flag, what, peer);
    }
    return make_int4(seen.lo.x, seen.lo.z, seen.hi.x, seen.hi.z);
}

// Warps per (local expert, source) pair (combine's send half): a power of two, all in one block; as many as the
// grid allows, but not 2 (16 groups a block would need named barriers 1..16; there are 15).
__device__ __forceinline__ int warps_per_pair(int num_pairs) {
    const int total = static_cast<int>(gridDim.x) * kLowLatencyWarps;
    int w = 1;
    while (w < kLowLatencyWarps && 2 * w * num_pairs <= total) w *= 2;
    return w == 2 ? 1 : w;
}

// The warps that share each row of a pair of n rows given w warps (w a power of two or 1): the largest power of
// two that leaves no row without one, at most the row's 32-int4 steps; it divides w, so a warp keeps one slice.
__device__ __forceinline__ int row_slices(int w, int n, int row_int4) {
    int s = 1;
    while (2 * s <= w && 2 * s * n <= w && 64 * s < row_int4 + 32) s *= 2;
    return s;
}

// Tells every rank (relaxed stores) that this rank has read what the set brought it in call `epoch`; the whole
// warp, lane i to ranks i, i + 32, ...: the peers' addresses load together, and with `fence` before a single
// system-scope fence (a load behind it would wait for it, then take a round trip of its own).
__device__ __forceinline__ void send_acks(const PeersTable* peers, const LowLatencyLayout& lay, int epoch,
                                          int force_puts, bool fence, const Shrink& s, int lane) {
    uint64_t* word = lay.acks + peers->rank;
    const uint64_t ack = epoch_signal(epoch, 0u);
    for (int base = 0; base < peers->num_ranks; base += 32) {
        const int pe = base + lane;
        uint64_t* remote = force_puts || pe >= peers->num_ranks ? nullptr : on_peer(peers, word, pe);
        if (fence && base == 0) {
            __syncwarp();
            ptx::fence_acq_rel_sys();
        }
        if (pe < peers->num_ranks && masked(s, pe)) continue;  // (after the warp's fence: every lane reaches it)
        if (remote != nullptr)
            ptx::st_relaxed_sys_u64(remote, ack);
        else if (pe < peers->num_ranks)
            rdma_signal(peers, word, ack, SignalOp::kSet, pe);
    }
}

// Every block calls this last. The last block to finish (the call word counts them) resets the word and
// publishes the status bits the blocks ORed into it; after a receive half it advances the set's epoch (every
// block has read it by then: each read it first, and its count is a release) and acks the call to every rank:
//  - a dispatch leaves its acks to the next kernel (send_deferred_acks): its reads of the set are over when it
//    ends, so they need no system-scope fence, and the kernel's end waits for no ack to land. The next call on
//    the set (or even the same dispatch replayed from a graph) stages its first token while they fly;
//  - a combine acks at once, behind one system-scope fence: a combine's send half waits for the acks first
//    thing, so a combine replayed alone would wait for its predecessor's deferred acks to be sent and to land.
__device__ __forceinline__ void finish_call(const PeersTable* peers, const LowLatencyLayout& lay,
                                            LowLatencySync* sync, int set, bool receive_half, bool defer_acks,
                                            int epoch, int force_puts, const Shrink& s, int* host_status,
                                            uint64_t* timeline) {
    __syncthreads();
    timeline_mark(timeline, kAtEnd);
    if (threadIdx.x >= 32) return;  // warp 0: thread 0 counts the block, the warp acks
    const int lane = static_cast<int>(threadIdx.x);
    int word = 0;
    if (lane == 0) word = ptx::atom_add_acq_rel_gpu_s32(&sync->call[set], 1);
    word = __shfl_sync(0xffffffffu, word, 0);
    if ((word & ((1 << kCallBlockBits) - 1)) != static_cast<int>(gridDim.x) - 1) return;
    if (receive_half && !defer_acks) send_acks(peers, lay, epoch, force_puts, true, s, lane);
    if (lane != 0) return;
    sync->call[set] = 0;
    if (receive_half) {
        sync->epoch[set] = epoch;
        if (defer_acks) sync->unacked[set] = epoch;
    }
    const int status = word >> kCallBlockBits;
    if (status != 0) publish_status(host_status, status);
}

// Sends the acks the last dispatch receive on each set left (finish_call), from the last warp of the grid's last
// block at the start of the next low-latency kernel on this stream. That kernel runs before any peer can need
// them: a peer's next call on the set follows its call in between, whose receive needs this rank's send of it.
__device__ __forceinline__ void send_deferred_acks(const PeersTable* peers, LowLatencySync* sync, int num_experts,
                                                   int max_tokens, int hidden, int force_puts, const Shrink& s) {
    if (blockIdx.x != gridDim.x - 1 || static_cast<int>(threadIdx.x) / 32 != kLowLatencyWarps - 1) return;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const uint64_t unacked = *reinterpret_cast<volatile uint64_t*>(sync->unacked);  // both sets, one load
    for (int set = 0; set < 2; ++set) {
        const int epoch = static_cast<int>(static_cast<uint32_t>(unacked >> (32 * set)));
        if (epoch == 0) continue;
        if (lane == 0) sync->unacked[set] = 0;
        send_acks(peers, LowLatencyLayout(peers->sym_base, set, peers->num_ranks, num_experts, max_tokens, hidden),
                  epoch, force_puts, false, s, lane);
    }
}

// Before a send half writes into any rank's copy of the set: every rank has read the set's previous call.
__device__ __forceinline__ void wait_for_acks(const PeersTable* peers, const LowLatencyLayout& lay, int epoch,
                                              const char* site, const Shrink& s) {
    for (int pe = static_cast<int>(threadIdx.x); pe < peers->num_ranks; pe += static_cast<int>(blockDim.x)) {
        const uint64_t* word = lay.acks + pe;
        wait_peer(peers, s, WaitSite{site, pe, -1, epoch - 1}, [&](int64_t& seen) {
            seen = signal_epoch(ptx::ld_acquire_sys_u64(word));
            return seen < epoch - 1;
        });
    }
    __syncthreads();
}

// The host sizes the heap with its mirror of LowLatencyLayout; if the two ever disagree, do nothing rather than
// write past the allocation (the host reports the bit; peers waiting on this rank time out naming it).
__device__ __forceinline__ bool layout_fits(const PeersTable* peers, const LowLatencyLayout& lay,
                                            int32_t* call_word) {
    if (2 * lay.set_bytes <= peers->sym_bytes) return true;
    if (threadIdx.x == 0) report_status(call_word, kLowLatencyLayoutTooBig);
    return false;
}

// True when some rank needs NVSHMEM puts (no NVLink pointer), or the caller forces puts.
__device__ __forceinline__ bool needs_puts(const PeersTable* peers, int force_puts) {
    if (force_puts) return true;
    for (int pe = 0; pe < peers->num_ranks; ++pe)
        if (peers->sym_peer[pe] == nullptr) return true;
    return false;
}

// ---------------------------------------------------------------------------------------------------- dispatch

// Stager warp `stager` of `num_stagers` stages one token in shared memory: FP8 (bytes, then one float scale per
// 128 channels) or bf16 as it is. Whole warps walk the row so the 16 lanes of a 128-channel block reduce
// together.
__device__ __forceinline__ void stage_token(const int4* row, int4* payload, int x_int4, int hidden, bool fp8,
                                            int flags, int stager, int num_stagers, int lane) {
    if (!fp8) {
        for (int i = stager * 32 + lane; i < x_int4; i += num_stagers * 32)
            payload[i] = ptx::ld_global_nc_L1_no_allocate_v4(row + i);
        return;
    }
    auto* bytes = reinterpret_cast<uint2*>(payload);
    auto* scales = reinterpret_cast<float*>(reinterpret_cast<char*>(payload) + hidden);
    for (int base = stager * 32; base < x_int4; base += num_stagers * 32) {
        const int i = base + lane;
        float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        float amax = 0.0f;
        if (i < x_int4) {
            unpack_bf16x8(ptx::ld_global_nc_L1_no_allocate_v4(row + i), v);
#pragma unroll
            for (int c = 0; c < 8; ++c) amax = fmaxf(amax, fabsf(v[c]));
        }
        const float scale = fp8_scale(block128_amax(amax), flags & kFlagRoundScale);
        if (i < x_int4) {
            bytes[i] = quantize_x8(v, __fdiv_rn(1.0f, scale));
            if (i % 16 == 0) scales[i / 16] = scale;
        }
    }
}

// The slot of (token t, k) at its expert: how many earlier (token, k) of this rank name the same expert, so the
// slot order is the token order. -1 for no expert (out-of-range ids were staged as -1; block 0 reports them).
__device__ __forceinline__ int message_slot(const int* topk_experts, int t, int k, int num_topk, int lane) {
    const int j = t * num_topk + k;
    const int expert = topk_experts[j];
    if (expert < 0) return -1;
    int slot = 0;
    for (int i = lane; i < j; i += 32) slot += topk_experts[i] == expert;
    return warp_sum(slot);
}

// The rank of a token's w-th distinct destination, in top-k order, or -1 when it has fewer (experts: its top-k,
// -1 for none). Whole warp: lane k looks at the k-th choice; a rank's first lane marks it.
__device__ __forceinline__ int nth_rank(const int* experts, int num_topk, int num_local, int w, int lane) {
    const int expert = lane < num_topk ? experts[lane] : -1;
    const int rank = expert >= 0 ? expert / num_local : -1;
    const unsigned same = __match_any_sync(0xffffffffu, rank);
    unsigned firsts = __ballot_sync(0xffffffffu, rank >= 0 && (same & ((1u << lane) - 1)) == 0);
    if (__popc(firsts) <= w) return -1;
    for (int i = 0; i < w; ++i) firsts &= firsts - 1;
    return __shfl_sync(0xffffffffu, rank, __ffs(firsts) - 1);
}

// Token t's entries in its message to rank dst (lane k: the (t, k) whose expert is on dst, its expert and its slot
// `slots[k]`). An entry whose slot is past max_tokens is dropped and reported. Whole warp.
struct MessageEntries {
    int expert, slot;
    bool entry;         // this lane's (t, k) is an entry of the message
    unsigned entries;   // the lanes that are
};

__device__ __forceinline__ MessageEntries message_entries(const int* experts, const int* slots, int dst, int num_topk,
                                                          int num_local, int max_tokens, int32_t* call_word,
                                                          int lane) {
    MessageEntries e;
    e.expert = lane < num_topk ? experts[lane] : -1;
    const bool on_dst = e.expert >= 0 && e.expert / num_local == dst;
    e.slot = on_dst ? slots[lane] : 0;
    if (on_dst && e.slot >= max_tokens) report_status(call_word, kLowLatencySlotOverflow);
    e.entry = on_dst && e.slot < max_tokens;
    e.entries = __ballot_sync(0xffffffffu, e.entry);
    return e;
}

// A message's entries after its header's first int4: an int2 {local expert, slot << 4 | k} per entry lane, in lane
// order.
__device__ __forceinline__ void write_entries(int4* header, const MessageEntries& e, int num_local, int lane) {
    if (e.entry)
        reinterpret_cast<int2*>(header + 1)[__popc(e.entries & ((1u << lane) - 1))] =
            make_int2(e.expert % num_local, e.slot << 4 | lane);
}

// Warp w of the block sends token t (staged in shared memory) to the w-th distinct rank among its experts': one
// message into slot (me, t) of that rank, with an entry per (t, k) there (`slots`: the token's slot at each k's
// expert). An entry whose slot is past max_tokens is dropped (and reported); a message left with no entry is not
// sent. Nothing waits here: the warp releases its messages once, after its last token (see the dispatch kernel).
__device__ __forceinline__ void send_to_rank(const PeersTable* peers, const LowLatencyLayout& lay,
                                            const int* topk_experts, const int* slots, const int4* payload,
                                            int payload_int4, int t, int w, int num_topk, int num_local,
                                            int max_tokens, int meta, int epoch, int force_puts,
                                            int32_t* call_word, const Shrink& s, int lane) {
    const int* experts = topk_experts + t * num_topk;
    const int dst = nth_rank(experts, num_topk, num_local, w, lane);
    if (dst < 0 || masked(s, dst)) return;
    const MessageEntries e = message_entries(experts, slots, dst, num_topk, num_local, max_tokens, call_word, lane);
    if (e.entries == 0) return;
    int4* mine = lay.dispatch_slot(peers->rank, t);
    int4* remote = force_puts ? nullptr : on_peer(peers, mine, dst);
    int4* header = remote != nullptr ? remote : lay.staging_header(t, dst);  // NVSHMEM puts read the staged one
    if (lane == 0) ptx::st_global_L1_no_allocate_v4(header, make_int4(t, meta, __popc(e.entries), epoch));
    write_entries(header, e, num_local, lane);
    if (remote != nullptr) {
        for (int i = lane; i < payload_int4; i += 32)
            ptx::st_global_L1_no_allocate_v4(remote + kLowLatencyHeaderInt4 + i, payload[i]);
    } else {
        __syncwarp();
        rdma_put_warp(peers, mine, header, kLowLatencyHeaderBytes, dst, lane);
        rdma_put_warp(peers, mine + kLowLatencyHeaderInt4, lay.staging + t * lay.msg_bytes, payload_int4 * 16, dst,
                      lane);
    }
}

// ------------------------------------------------------------------------------------- dispatch: flagged path

// This call's format (low_latency.cuh): the flagged path for a source of few tokens, one block a token, whose
// every peer has a pointer.
__device__ __forceinline__ uint32_t call_format(int num_tokens, int num_topk, int num_ranks, bool puts) {
    const int fan_out = max(1, min(num_ranks - 1, num_topk));  // messages a token sends to other ranks, at most
    if (puts || num_ranks > kFlaggedMaxRanks || num_tokens > kFlaggedTokens ||
        num_tokens > static_cast<int>(gridDim.x) || num_tokens * fan_out > kFlaggedMessages)
        return 0;
    return kFormatFlaggedDispatch;
}

// Bit d: token t has an expert on rank d.
__device__ __forceinline__ uint32_t token_ranks(const int* topk_experts, int t, int num_topk, int num_local) {
    uint32_t ranks = 0;
    for (int k = 0; k < num_topk; ++k) {
        const int expert = topk_experts[t * num_topk + k];
        if (expert >= 0) ranks |= 1u << (expert / num_local);
    }
    return ranks;
}

// Flagged messages to rank `dst` from the tokens before `end` (whole warp; lanes take tokens lane and lane + 32):
// message i of a source is its i-th token with an expert on dst.
__device__ __forceinline__ int messages_before(const uint32_t* token_masks, int end, int dst, int lane) {
    int n = 0;
#pragma unroll
    for (int t = lane; t < kFlaggedTokens; t += 32)
        n += __popc(__ballot_sync(0xffffffffu, t < end && (token_masks[t] >> dst & 1u)));
    return n;
}

// Warp w sends token t (staged) to the w-th distinct rank among its experts' as flagged message i of this rank
// there (send_to_rank's message, entries included; one without entries is sent too: the destination waits for
// every message its format word announced). The header is built in the warp's shared scratch, then every int4
// is stored flagged.
__device__ __forceinline__ void send_flagged(const PeersTable* peers, const LowLatencyLayout& lay,
                                             const int* topk_experts, const uint32_t* token_masks, const int* slots,
                                             const int4* payload, int payload_int4, int t, int w, int num_topk,
                                             int num_local, int max_tokens, int meta, int epoch, int32_t* call_word,
                                             int4* header, const Shrink& s, int lane) {
    const int* experts = topk_experts + t * num_topk;
    const int dst = nth_rank(experts, num_topk, num_local, w, lane);
    if (dst < 0 || masked(s, dst)) return;
    const MessageEntries e = message_entries(experts, slots, dst, num_topk, num_local, max_tokens, call_word, lane);
    if (lane == 0) header[0] = make_int4(t, meta, __popc(e.entries), epoch);  // the warp's shared scratch
    write_entries(header, e, num_local, lane);
    const int i = messages_before(token_masks, t, dst, lane);
    int4* msg = on_peer(peers, lay.flagged_msg(peers->rank, i), dst);
    __syncwarp();
    if (lane < kLowLatencyHeaderInt4) st_flagged(msg + 2 * lane, header[lane], epoch);
    for (int j = lane; j < payload_int4; j += 32) st_flagged(msg + 2 * (kLowLatencyHeaderInt4 + j), payload[j], epoch);
}

// The count of `expert` at its rank: the (token, k) of this rank naming it, at most max_tokens (whole warp). On
// the signal path it goes once every message naming the expert is out (the sending warps' counter), released, so
// its arrival proves those messages landed; on the flagged path at once, relaxed: the data carry their own proof.
__device__ __forceinline__ void send_count(const PeersTable* peers, const LowLatencyLayout& lay,
                                           const int* topk_experts, int num_slots, int expert, int num_local,
                                           int max_tokens, int epoch, int force_puts, int32_t* expert_sent,
                                           bool signal_path, const Shrink& s, int lane) {
    int named = 0;  // (token, k) naming the expert; the slots hold max_tokens of them at most
    for (int j = lane; j < num_slots; j += 32) named += topk_experts[j] == expert;
    named = warp_sum(named);
    if (lane != 0) return;
    if (signal_path) {
        timeout_while(peers, WaitSite{"ll_dispatch: this rank's messages to expert (channel) sent", -1, expert, named},
                      [&](int64_t& seen) {
                          seen = ptx::ld_acquire_gpu_s32(expert_sent + expert);
                          return seen != named;
                      });
        expert_sent[expert] = 0;  // every message of this call is counted; the next call starts at 0
    }
    const int dst = expert / num_local;
    if (masked(s, dst)) return;
    uint64_t* word = lay.counts + static_cast<int64_t>(expert % num_local) * lay.num_ranks + peers->rank;
    const uint64_t signal = epoch_signal(epoch, static_cast<uint32_t>(-(min(named, max_tokens) + 1)));
    uint64_t* remote = force_puts ? nullptr : on_peer(peers, word, dst);
    if (remote == nullptr)
        rdma_signal(peers, word, signal, SignalOp::kSet, dst);
    else if (signal_path)
        ptx::st_release_sys_u64(remote, signal);
    else
        ptx::st_relaxed_sys_u64(remote, signal);
}

// This call's format word at rank dst (relaxed: on either path it proves nothing about data).
__device__ __forceinline__ void send_format(const PeersTable* peers, const LowLatencyLayout& lay, int dst,
                                            uint32_t format, int epoch, int force_puts, const Shrink& s) {
    if (masked(s, dst)) return;
    uint64_t* word = lay.formats + peers->rank;
    const uint64_t signal = epoch_signal(epoch, format);
    uint64_t* remote = force_puts ? nullptr : on_peer(peers, word, dst);
    if (remote != nullptr)
        ptx::st_relaxed_sys_u64(remote, signal);
    else
        rdma_signal(peers, word, signal, SignalOp::kSet, dst);
}

// The flagged path's send half: block t stages token t (at most one a block), every block waits for the acks,
// then warp w < K of block t sends the token to its w-th rank while warps kLowLatencyMaxTopk.. of every block
// send the counts and format words, all at once: nothing waits for a store to land.
__device__ __forceinline__ void send_flagged_tokens(const PeersTable* peers, const LowLatencyLayout& lay,
                                                    const int4* x, const int* topk_experts, int4* staged,
                                                    int num_tokens, int num_topk, int hidden, int num_experts,
                                                    int max_tokens, int flags, uint32_t format, int epoch,
                                                    int32_t* call_word, const Shrink& s, uint64_t* timeline, int warp,
                                                    int lane) {
    __shared__ uint32_t token_masks[kFlaggedTokens];
    __shared__ int token_slots[kLowLatencyMaxTopk];
    __shared__ int4 headers[kLowLatencyMaxTopk][kLowLatencyHeaderInt4];
    const int num_ranks = lay.num_ranks, num_local = num_experts / num_ranks;
    const int x_int4 = hidden / 8, t = static_cast<int>(blockIdx.x);
    const bool fp8 = flags & kFlagFp8;
    const int payload_int4 = fp8 ? (hidden + hidden / kFp8BlockChannels * 4 + 15) / 16 : x_int4;
    if (static_cast<int>(threadIdx.x) < num_tokens)
        token_masks[threadIdx.x] = token_ranks(topk_experts, static_cast<int>(threadIdx.x), num_topk, num_local);
    if (t < num_tokens) {
        stage_token(x + static_cast<int64_t>(t) * x_int4, staged, x_int4, hidden, fp8, flags, warp, kLowLatencyWarps,
                    lane);
        if (warp < num_topk) {
            const int slot = message_slot(topk_experts, t, warp, num_topk, lane);
            if (lane == 0) token_slots[warp] = slot;
        }
    }
    wait_for_acks(peers, lay, epoch, "ll_dispatch: peer read this buffer set's previous call (ack)", s);
    timeline_mark(timeline, kAtAcks);
    if (warp < kLowLatencyMaxTopk) {
        if (t < num_tokens && warp < num_topk)
            send_flagged(peers, lay, topk_experts, token_masks, token_slots, staged, payload_int4, t, warp, num_topk,
                         num_local, max_tokens, message_meta(hidden, flags), epoch, call_word, headers[warp], s,
                         lane);
        return;
    }
    constexpr int kCountWarps = kLowLatencyWarps - kLowLatencyMaxTopk;
    for (int j = static_cast<int>(blockIdx.x) + (warp - kLowLatencyMaxTopk) * static_cast<int>(gridDim.x);
         j < num_experts + num_ranks; j += kCountWarps * static_cast<int>(gridDim.x)) {
        if (j < num_experts) {
            send_count(peers, lay, topk_experts, num_tokens * num_topk, j, num_local, max_tokens, epoch, 0, nullptr,
                       false, s, lane);
        } else {
            const int dst = j - num_experts;
            const int messages = messages_before(token_masks, num_tokens, dst, lane);
            if (lane == 0) send_format(peers, lay, dst, format | static_cast<uint32_t>(messages), epoch, 0, s);
        }
    }
}

// The signal path's send half (docs/design.md): block b takes tokens b, b + grid, ...; warps 0..K-1 send each to
// its ranks, and the counts follow the data, released, so a count's arrival proves every message it counts landed.
__device__ __forceinline__ void send_signalled_tokens(const PeersTable* peers, const LowLatencyLayout& lay,
                                                      const int4* x, const int* topk_experts, int4* staged,
                                                      int num_tokens, int num_topk, int hidden, int num_experts,
                                                      int max_tokens, int flags, int epoch, int force_puts,
                                                      int32_t* expert_sent, int32_t* call_word, const Shrink& s,
                                                      uint64_t* timeline, int warp, int lane) {
    const int num_ranks = lay.num_ranks, num_local = num_experts / num_ranks, x_int4 = hidden / 8;
    const bool fp8 = flags & kFlagFp8, puts = needs_puts(peers, force_puts);
    const int payload_int4 = fp8 ? (hidden + hidden / kFp8BlockChannels * 4 + 15) / 16 : x_int4;
    const int meta = message_meta(hidden, flags);
    // Warps 0..K-1 send; the others stage the next token meanwhile (its payload and its K slots), into the
    // other of two buffers, so one __syncthreads a token suffices (it also tells the senders the next token
    // is staged). Every warp stages the first token, before the block waits for the acks: staging touches no
    // peer. K <= 16, so at least K warps stage.
    __shared__ int token_slots[2][kLowLatencyMaxTopk];
    int i_token = 0;
    for (int t = static_cast<int>(blockIdx.x); t < num_tokens; t += static_cast<int>(gridDim.x), ++i_token) {
        const int first_stager = i_token == 0 ? 0 : num_topk;
        if (warp >= first_stager)
            stage_token(x + static_cast<int64_t>(t) * x_int4, staged + (i_token & 1) * x_int4, x_int4, hidden,
                        fp8, flags, warp - first_stager, kLowLatencyWarps - first_stager, lane);
        const int slot_k = warp - first_stager;
        if (slot_k >= 0 && slot_k < num_topk) {
            const int slot = message_slot(topk_experts, t, slot_k, num_topk, lane);
            if (lane == 0) token_slots[i_token & 1][slot_k] = slot;
        }
        if (i_token == 0) {
            wait_for_acks(peers, lay, epoch, "ll_dispatch: peer read this buffer set's previous call (ack)", s);
            timeline_mark(timeline, kAtAcks);
        }
        const int4* payload = staged + (i_token & 1) * x_int4;
        __syncthreads();
        if (puts) {  // NVSHMEM puts read global memory: the block copies the payload to the staging row
            int4* staging = reinterpret_cast<int4*>(lay.staging + t * lay.msg_bytes);
            for (int i = static_cast<int>(threadIdx.x); i < payload_int4; i += kLowLatencyThreads)
                staging[i] = payload[i];
            ptx::fence_acq_rel_gpu();
            __syncthreads();
        }
        if (warp < num_topk)
            send_to_rank(peers, lay, topk_experts, token_slots[i_token & 1], payload, payload_int4, t, warp,
                         num_topk, num_local, max_tokens, meta, epoch, force_puts, call_word, s, lane);
    }
    if (i_token == 0) {  // a block without tokens still writes counts into the peers' set
        wait_for_acks(peers, lay, epoch, "ll_dispatch: peer read this buffer set's previous call (ack)", s);
        timeline_mark(timeline, kAtAcks);
    }
    // Each sending warp releases its messages once, after its last token: every lane's stores (a put path
    // quiets first), one gpu-scope fence, then a bump of each expert's counter for every (token, k) of the
    // ranks it sent to, sent or dropped (warp w took each token's w-th rank: each (token, k) is one warp's).
    // The count-sender's acquire of the counter and its system-scope release of the count carry the stores
    // to the receiver (causality is transitive), so no sending warp pays a system fence.
    if (warp < num_topk) {
        if (puts) rdma_quiet();
        __syncwarp();
        ptx::fence_acq_rel_gpu();  // each lane's bumps below come after every store of the warp
        for (int t = static_cast<int>(blockIdx.x); t < num_tokens; t += static_cast<int>(gridDim.x)) {
            const int* experts = topk_experts + t * num_topk;
            const int dst = nth_rank(experts, num_topk, num_local, warp, lane);
            const int expert = lane < num_topk ? experts[lane] : -1;
            if (dst >= 0 && expert >= 0 && expert / num_local == dst) atomicAdd(expert_sent + expert, 1);
        }
    }
    timeline_mark(timeline, kAtSent);

    // The count of each expert, after its data, and this call's format word at each rank: a warp a word, spread
    // over the blocks.
    const int num_slots = num_tokens * num_topk;
    for (int j = static_cast<int>(blockIdx.x) + warp * static_cast<int>(gridDim.x); j < num_experts + num_ranks;
         j += kLowLatencyWarps * static_cast<int>(gridDim.x)) {
        if (j < num_experts)
            send_count(peers, lay, topk_experts, num_slots, j, num_local, max_tokens, epoch, force_puts, expert_sent,
                       true, s, lane);
        else if (lane == 0)
            send_format(peers, lay, j - num_experts, 0u, epoch, force_puts, s);
    }
}

// Payload int4 i of a received message into `row`: below data_int4 recv_x's row, past it the FP8 scales (int4 i
// holds scales 4 (i - data_int4) .. + 3) for recv_scales' row, as floats or UE8M0 bytes.
__device__ __forceinline__ void store_payload(const int4& v, int i, int64_t row, int data_int4, int4* recv_x,
                                              void* recv_scales, int num_scales, bool ue8m0) {
    if (i < data_int4) {
        ptx::st_global_L1_no_allocate_v4(recv_x + row * data_int4 + i, v);
        return;
    }
    const int word = i - data_int4;
    if (ue8m0) {
        const uint32_t packed = static_cast<uint32_t>(ue8m0_of(__int_as_float(v.x))) |
                                static_cast<uint32_t>(ue8m0_of(__int_as_float(v.y))) << 8 |
                                static_cast<uint32_t>(ue8m0_of(__int_as_float(v.z))) << 16 |
                                static_cast<uint32_t>(ue8m0_of(__int_as_float(v.w))) << 24;
        reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(recv_scales) + row * num_scales)[word] = packed;
    } else {
        reinterpret_cast<int4*>(static_cast<float*>(recv_scales) + row * num_scales)[word] = v;
    }
}

// FP8 scale c of a message into `row`, one float (scales that do not fill whole int4: hidden % 512 != 0).
__device__ __forceinline__ void store_scale(float scale, int c, int64_t row, void* recv_scales, int num_scales,
                                            bool ue8m0) {
    if (ue8m0)
        static_cast<uint8_t*>(recv_scales)[row * num_scales + c] = ue8m0_of(scale);
    else
        static_cast<float*>(recv_scales)[row * num_scales + c] = scale;
}

// One received message's payload into the rows of its entries (entry j's row is lane j's `my_row`, j < num_rows):
// payload int4 below data_int4 go to recv_x's row, the rest are the FP8 scales (num_scales floats) for
// recv_scales' row, as floats or UE8M0 bytes. Each batch's loads are all issued before its stores, and a batch is
// loaded once for every row it goes to, so a 7168-channel FP8 message costs two round trips to memory.
__device__ __forceinline__ void receive_message(const int4* payload, int payload_int4, int data_int4, int4* recv_x,
                                                void* recv_scales, int64_t my_row, int num_rows, int num_scales,
                                                bool ue8m0, int lane) {
    constexpr int kInFlight = 8;  // 32 registers of 64 (1024 threads a block)
    const bool vector_scales = num_scales % 4 == 0;  // scales fill whole int4 (hidden % 512 == 0)
    const int loaded = vector_scales ? payload_int4 : data_int4;
    for (int base = 0; base < loaded; base += 32 * kInFlight) {
        int4 v[kInFlight];
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) {
            const int i = base + lane + 32 * j;
            if (i < loaded) v[j] = ptx::ld_volatile_global_v4(payload + i);
        }
        for (int r = 0; r < num_rows; ++r) {
            const int64_t row = __shfl_sync(0xffffffffu, my_row, r);
            int4* x_row = recv_x + row * data_int4;
#pragma unroll
            for (int j = 0; j < kInFlight; ++j) {
                const int i = base + lane + 32 * j;
                if (i < data_int4) {
                    ptx::st_global_L1_no_allocate_v4(x_row + i, v[j]);
                } else if (i < loaded) {
                    const int word = i - data_int4;  // scales 4 * word .. 4 * word + 3
                    if (ue8m0) {
                        const uint32_t packed = static_cast<uint32_t>(ue8m0_of(__int_as_float(v[j].x))) |
                                                static_cast<uint32_t>(ue8m0_of(__int_as_float(v[j].y))) << 8 |
                                                static_cast<uint32_t>(ue8m0_of(__int_as_float(v[j].z))) << 16 |
                                                static_cast<uint32_t>(ue8m0_of(__int_as_float(v[j].w))) << 24;
                        reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(recv_scales) + row * num_scales)[word] =
                            packed;
                    } else {
                        reinterpret_cast<int4*>(static_cast<float*>(recv_scales) + row * num_scales)[word] = v[j];
                    }
                }
            }
        }
    }
    if (!vector_scales) {
        const auto* scales = reinterpret_cast<const float*>(payload + data_int4);
        for (int r = 0; r < num_rows; ++r) {
            const int64_t row = __shfl_sync(0xffffffffu, my_row, r);
            for (int c = lane; c < num_scales; c += 32) {
                const float scale = ld_volatile_f32(scales + c);
                if (ue8m0)
                    static_cast<uint8_t*>(recv_scales)[row * num_scales + c] = ue8m0_of(scale);
                else
                    static_cast<float*>(recv_scales)[row * num_scales + c] = scale;
            }
        }
    }
}

// The last of sources 0..n-1 whose items begin at or before item q (begin: [n + 1] ascending prefix): a source
// without items shares its begin with the next, which is the one holding q.
__device__ __forceinline__ int last_at_or_before(const int* begin, int n, int q) {
    int found = 0;
    for (int lo = 1, hi = n - 1; lo <= hi;) {
        const int mid = (lo + hi) / 2;
        if (begin[mid] <= q)
            found = mid, lo = mid + 1;
        else
            hi = mid - 1;
    }
    return found;
}

// A message's header (lane j holds its int4 j) names its rows: lane k < n gets the row of entry k, and its
// src_info and top-k slot are written. Returns n, or 0 for a message to skip: a flagged one without entries (each
// was dropped; on the signal path such a message is never sent), or one from a peer called with other sizes
// (or a corrupt header), whose entries could point anywhere: reported.
__device__ __forceinline__ int message_rows(const int4& head, int src, bool flagged, int64_t& row,
                                            int* recv_src_info, int* recv_topk_slot, const int* pair_begin,
                                            int32_t* call_word, int num_local, int num_ranks, int max_tokens,
                                            int meta, int lane) {
    const int token = __shfl_sync(0xffffffffu, head.x, 0), seen_meta = __shfl_sync(0xffffffffu, head.y, 0);
    const int n = __shfl_sync(0xffffffffu, head.z, 0);
    if (flagged && n == 0) return 0;
    // Entry j: half j % 2 of header int4 1 + j / 2.
    const int holder = min(1 + lane / 2, 31);
    const int hx = __shfl_sync(0xffffffffu, head.x, holder), hy = __shfl_sync(0xffffffffu, head.y, holder);
    const int hz = __shfl_sync(0xffffffffu, head.z, holder), hw = __shfl_sync(0xffffffffu, head.w, holder);
    const int e = lane % 2 ? hz : hx, packed = lane % 2 ? hw : hy;
    const int slot = packed >> 4;
    const bool sane = lane >= n || (e >= 0 && e < num_local && slot >= 0 && slot < max_tokens);
    if (!__all_sync(0xffffffffu, sane) || seen_meta != meta || n < 1 || n > kLowLatencyMaxTopk) {
        if (lane == 0) report_status(call_word, kLowLatencyMetaMismatch);
        return 0;
    }
    row = 0;
    if (lane < n) {
        row = e * static_cast<int64_t>(num_ranks) * max_tokens + pair_begin[e * num_ranks + src] + slot;
        recv_src_info[row] = token;
        recv_topk_slot[row] = packed & 15;
    }
    return n;
}

// Flagged message `msg` from src, by the whole block: warp 0 polls its header and names its rows in shared
// memory, then each thread polls one int4 of the payload and stores it into every row: one round trip (a
// 7168-channel message is 462 FP8 or 896 bf16 int4), and few registers (nothing unrolled).
__device__ __forceinline__ void receive_flagged(const PeersTable* peers, const int4* msg, int src, int epoch,
                                                int4* recv_x, void* recv_scales, int* recv_src_info,
                                                int* recv_topk_slot, const int* pair_begin, int32_t* call_word,
                                                int num_local, int num_ranks, int max_tokens, int meta,
                                                int payload_int4, int data_int4, int num_scales, bool ue8m0,
                                                const Shrink& s) {
    __shared__ int64_t rows[kLowLatencyMaxTopk];
    __shared__ int num_rows;
    if (threadIdx.x < 32) {
        const int lane = static_cast<int>(threadIdx.x);
        int4 head = make_int4(0, 0, 0, 0);
        if (lane < kLowLatencyHeaderInt4)
            head = flagged_data(peers, s, msg + 2 * lane, ld_flagged(msg + 2 * lane), epoch,
                                "ll_dispatch: flagged message header from peer", src);
        int64_t row = 0;
        const int n = message_rows(head, src, true, row, recv_src_info, recv_topk_slot, pair_begin, call_word,
                                   num_local, num_ranks, max_tokens, meta, lane);
        if (lane < n) rows[lane] = row;
        if (lane == 0) num_rows = n;
    }
    __syncthreads();
    const int n = num_rows;
    const int4* payload = msg + 2 * kLowLatencyHeaderInt4;
    const bool vector_scales = num_scales % 4 == 0;
    const int loaded = n == 0 ? 0 : vector_scales ? payload_int4 : data_int4;
    for (int i = static_cast<int>(threadIdx.x); i < loaded; i += kLowLatencyThreads) {
        const int4 v = flagged_data(peers, s, payload + 2 * i, ld_flagged(payload + 2 * i), epoch,
                                    "ll_dispatch: flagged message from peer", src);
        for (int r = 0; r < n; ++r) store_payload(v, i, rows[r], data_int4, recv_x, recv_scales, num_scales, ue8m0);
    }
    for (int c = static_cast<int>(threadIdx.x); n > 0 && !vector_scales && c < num_scales; c += kLowLatencyThreads) {
        const int i = data_int4 + c / 4;  // scale c is word c % 4 of that int4
        const int4 w = flagged_data(peers, s, payload + 2 * i, ld_flagged(payload + 2 * i), epoch,
                                    "ll_dispatch: flagged message from peer", src);
        const float scale = __int_as_float(c % 4 == 0 ? w.x : c % 4 == 1 ? w.y : c % 4 == 2 ? w.z : w.w);
        for (int r = 0; r < n; ++r) store_scale(scale, c, rows[r], recv_scales, num_scales, ue8m0);
    }
    __syncthreads();  // before the next message takes the shared rows
}

__global__ void __launch_bounds__(kLowLatencyThreads, 1)
ll_dispatch(const PeersTable* peers, const int4* x, const int64_t* topk_idx, int num_tokens, int num_topk,
            int hidden, int num_experts, int max_tokens, int set, int phases, int flags, int force_puts,
            LowLatencySync* sync, int* host_status, int4* recv_x, void* recv_scales,
            int* recv_src_info, int* recv_topk_slot, int64_t* layout_range, int* recv_count,
            int* cumulative_stats, uint64_t* timeline, int64_t* wait_stats) {
    const int num_ranks = peers->num_ranks, num_local = num_experts / num_ranks;
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    const int epoch = ptx::ld_volatile_s32(&sync->epoch[set]) + 1;
    const LowLatencyLayout lay(peers->sym_base, set, num_ranks, num_experts, max_tokens, hidden);
    const bool fp8 = flags & kFlagFp8;
    const int meta = message_meta(hidden, flags);
    const int num_scales = hidden / kFp8BlockChannels;
    const int x_int4 = hidden / 8;  // a bf16 row
    const int payload_int4 = fp8 ? (hidden + num_scales * 4 + 15) / 16 : x_int4;
    // Dynamic shared memory: two tokens' payloads (bf16 size each, one staged while one is sent), then topk_idx
    // as int32 (-1 for no expert or an id out of range), which every slot and count below scans, then the
    // receive half's count and first row of every (local expert, source) pair, each source's format and the
    // first of its work items (and their total).
    extern __shared__ int4 staged[];
    int* topk_experts = reinterpret_cast<int*>(staged + 2 * x_int4);
    int* pair_count = topk_experts + num_tokens * num_topk;
    int* pair_begin = pair_count + num_local * num_ranks;
    int* src_format = pair_begin + num_local * num_ranks;
    int* flagged_begin = src_format + num_ranks;  // [R + 1]: each source's first flagged message, and the total
    int* slots_begin = flagged_begin + num_ranks + 1;  // [R + 1]: the same for signal-path message slots
    int32_t* expert_sent = expert_sent_counters(sync);
    int32_t* call_word = &sync->call[set];
    const Shrink s = shrink_of(sync, num_experts, call_word);
    if (!layout_fits(peers, lay, call_word)) phases = 0;
    if (phases != 0) send_deferred_acks(peers, sync, num_experts, max_tokens, hidden, force_puts, s);
    timeline_start(timeline, kAtStart);

    if (phases & kPhaseSend) {
        const int num_slots = num_tokens * num_topk;
        bool invalid = false;
        for (int j = static_cast<int>(threadIdx.x); j < num_slots; j += kLowLatencyThreads) {
            const int64_t e = __ldg(topk_idx + j);
            invalid |= e < -1 || e >= num_experts;
            topk_experts[j] = e >= 0 && e < num_experts ? static_cast<int>(e) : -1;
        }
        if (__syncthreads_or(invalid) && blockIdx.x == 0 && threadIdx.x == 0)
            report_status(call_word, kLowLatencyInvalidIds);
        const uint32_t format = call_format(num_tokens, num_topk, num_ranks, needs_puts(peers, force_puts));
        if (format & kFormatFlaggedDispatch)
            send_flagged_tokens(peers, lay, x, topk_experts, staged, num_tokens, num_topk, hidden, num_experts,
                                max_tokens, flags, format, epoch, call_word, s, timeline, warp, lane);
        else
            send_signalled_tokens(peers, lay, x, topk_experts, staged, num_tokens, num_topk, hidden, num_experts,
                                  max_tokens, flags, epoch, force_puts, expert_sent, call_word, s, timeline, warp,
                                  lane);
        timeline_mark(timeline, kAtCounted);
    }

    if (phases & kPhaseRecv) {
        // Every block waits for the count of every (local expert, source) and every source's format word: a
        // message may hold rows of any of my experts, each placed after the rows of the sources before its own.
        // On the signal path the arrival of any count of a source proves that every message it sent me landed
        // (its count-senders waited for all of them); on the flagged path its messages prove themselves.
        // A thread a word (one warp polling several words a lane was slower: each poll is a round trip).
        const int num_pairs = num_local * num_ranks;
        for (int j = static_cast<int>(threadIdx.x); j < num_pairs + num_ranks; j += kLowLatencyThreads) {
            const bool is_count = j < num_pairs;
            const int src = is_count ? j % num_ranks : j - num_pairs;
            const uint64_t* word = is_count ? lay.counts + j : lay.formats + src;
            uint64_t seen_word = 0, arrived = 0;
            const uint64_t since = wait_stats_since();
            wait_peer(peers, s, WaitSite{is_count ? "ll_dispatch: count of local expert (channel) from peer"
                                                  : "ll_dispatch: format word from peer",
                                         src, is_count ? j / num_ranks : -1, epoch},
                      [&](int64_t& seen) {
                          seen_word = ptx::ld_acquire_sys_u64(word);
                          seen = signal_epoch(seen_word);
                          wait_stats_arrived(arrived, seen != epoch);
                          return seen != epoch;
                      });
            // every block waits for every count: block 0's waits are the ones counted (as DeepEP, a (local
            // expert, source) pair's once)
            if (is_count && blockIdx.x == 0) add_wait_stats(wait_stats, src, since, arrived);
            const int value = static_cast<int>(static_cast<uint32_t>(seen_word));
            if (is_count)
                pair_count[j] = -value - 1;
            else
                src_format[src] = value;
        }
        if constexpr (kShrink) {
            // Nothing from a masked source, by one mask for the whole grid (grid_sync): no count (its rows would
            // move every later source's), and a format of no flagged messages and no message slots, whatever
            // arrived from it (a source may be masked after some of its words landed).
            grid_sync(peers, s);
            for (int j = static_cast<int>(threadIdx.x); j < num_pairs + num_ranks; j += kLowLatencyThreads) {
                const bool is_count = j < num_pairs;
                const int src = is_count ? j % num_ranks : j - num_pairs;
                if (!masked(s, src)) continue;
                if (is_count)
                    pair_count[j] = 0;
                else
                    src_format[src] = static_cast<int>(kFormatFlaggedDispatch);
            }
        }
        __syncthreads();
        for (int e = static_cast<int>(threadIdx.x); e < num_local; e += kLowLatencyThreads) {
            int begin = 0;
            for (int src = 0; src < num_ranks; ++src) {
                const int pair = e * num_ranks + src, n = pair_count[pair];
                pair_begin[pair] = begin;
                if (blockIdx.x == 0)
                    layout_range[pair] = (static_cast<int64_t>(begin) << 32) | static_cast<uint32_t>(n);
                begin += n;
            }
            if (blockIdx.x == 0) {
                recv_count[e] = begin;
                if (cumulative_stats != nullptr) atomicAdd(cumulative_stats + e, begin);
            }
        }
        if (threadIdx.x == 0) {  // a flagged source's messages, or every message slot of a signal-path source
            flagged_begin[0] = slots_begin[0] = 0;
            for (int src = 0; src < num_ranks; ++src) {
                const uint32_t format = static_cast<uint32_t>(src_format[src]);
                const bool flagged = format & kFormatFlaggedDispatch;
                flagged_begin[src + 1] = flagged_begin[src] + (flagged ? format & kFormatMessagesMask : 0);
                slots_begin[src + 1] = slots_begin[src] + (flagged ? 0 : max_tokens);
            }
        }
        __syncthreads();
        timeline_mark(timeline, kAtCounts);
        const int data_int4 = fp8 ? hidden / 16 : x_int4;
        const bool ue8m0 = flags & kFlagUe8m0;
        // A block a flagged message.
        for (int m = static_cast<int>(blockIdx.x); m < flagged_begin[num_ranks]; m += static_cast<int>(gridDim.x)) {
            const int src = last_at_or_before(flagged_begin, num_ranks, m);
            receive_flagged(peers, lay.flagged_msg(src, m - flagged_begin[src]), src, epoch, recv_x, recv_scales,
                            recv_src_info, recv_topk_slot, pair_begin, call_word, num_local, num_ranks, max_tokens,
                            meta, payload_int4, data_int4, fp8 ? num_scales : 0, ue8m0, s);
        }
        // A warp a signal-path message slot, consecutive slots in different blocks (what an SM copies does not grow
        // with its warps, so the messages spread over the SMs): the header says whether this call wrote it (its
        // epoch) and which rows take its payload.
        const int num_warps = static_cast<int>(gridDim.x) * kLowLatencyWarps;
        for (int q = warp * static_cast<int>(gridDim.x) + static_cast<int>(blockIdx.x); q < slots_begin[num_ranks];
             q += num_warps) {
            const int src = last_at_or_before(slots_begin, num_ranks, q);
            const int4* msg = lay.dispatch_slot(src, q - slots_begin[src]);
            const int4 head = lane < kLowLatencyHeaderInt4 ? ptx::ld_volatile_global_v4(msg + lane)
                                                           : make_int4(0, 0, 0, 0);
            if (__shfl_sync(0xffffffffu, head.w, 0) != epoch) continue;  // not a message of this call
            int64_t row = 0;
            const int n = message_rows(head, src, false, row, recv_src_info, recv_topk_slot, pair_begin, call_word,
                                       num_local, num_ranks, max_tokens, meta, lane);
            if (n > 0)
                receive_message(msg + kLowLatencyHeaderInt4, payload_int4, data_int4, recv_x, recv_scales, row, n,
                                fp8 ? num_scales : 0, ue8m0, lane);
        }
        timeline_mark(timeline, kAtReceived);
    }
    finish_call(peers, lay, sync, set, (phases & kPhaseRecv) != 0, true, epoch, force_puts, s, host_status,
                timeline);
}

// ------------------------------------------------------------------------------------------ LogFMT-10 (combine)

// DeepEP's LogFMT-10 (docs/layouts.md, "LogFMT combine"), per 128 channels of a row: amax and amin of |x|,
// log_amax = log2(amax), log_amin = max(log2(amin), log_amax - 32) (log_amax - 32 where amin is 0). A group with
// log_amax < 0 and log_amin < log_amax travels as a 9-bit magnitude index on the log scale between the two and a
// sign bit a value (index 0 is zero, index e > 0 is 2^((e - 1) * step + log_amin)); any other group as bf16.
constexpr int kLogfmtChannels = 128;
constexpr int kLogfmtGroupInt4 = kLogfmtChannels / 8;   // a lane's 8 channels, 16 lanes a group
constexpr int kLogfmtGroupBytes = 2 * kLogfmtChannels;  // a group's place in a combine slot (its bf16 size)
constexpr int kLogfmtHighBytes = kLogfmtChannels;       // a cast group: 128 low bytes, then 2 bits a value
constexpr int kLogfmtMaxIndex = (1 << 9) - 1;
constexpr float kLogfmtMinClip = 32.0f;

struct LogfmtRange {
    float log_amin, step;
    bool cast;
};

// The sender's amax/amin are bf16 values and a group word carries them exactly, so both sides compute the same
// floats here.
__device__ __forceinline__ LogfmtRange logfmt_range(float amax, float amin) {
    const float log_amax = ptx::lg2_approx_f32(amax);
    const float log_amin = amin == 0.0f ? log_amax - kLogfmtMinClip
                                        : fmaxf(ptx::lg2_approx_f32(amin), log_amax - kLogfmtMinClip);
    return {log_amin, (log_amax - log_amin) / static_cast<float>(kLogfmtMaxIndex - 1),
            log_amax < 0.0f && log_amin < log_amax};
}

// One warp sends a row of y to combine slot `dst` and its group words to `meta` (both on the home rank): a
// half-warp a group, a lane 8 channels. Of a cast group only its 160 bytes are written (the low 8 bits of its 128
// indices, then 2 bits a value: index bit 8, sign), at the start of its 256-byte place; a bf16 group fills it. A
// group word is bf16 amax | bf16 amin << 16 of a cast group (never 0: amax > 0), 0 of a bf16 one. The stores are
// plain: the caller's bar.sync and system-scope fence order them before the expert's flag, as the bf16 rows.
__device__ __forceinline__ void send_logfmt_row(int4* dst, uint32_t* meta, const int4* src, int row_int4, int lane,
                                                int slice, int slices) {
    for (int base = 32 * slice; base < row_int4; base += 32 * slices) {
        const int i = base + lane;
        // row_int4 is a multiple of 16: a half-warp is wholly in the row or wholly past it (then its shuffles stay
        // among its own lanes, and it stores nothing).
        const int4 raw = i < row_int4 ? ptx::ld_global_nc_L1_no_allocate_v4(src + i) : make_int4(0, 0, 0, 0);
        float v[8];
        unpack_bf16x8(raw, v);
        float amax = 0.0f, amin = __int_as_float(0x7f800000);  // +inf
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            amax = fmaxf(amax, fabsf(v[c]));
            amin = fminf(amin, fabsf(v[c]));
        }
#pragma unroll
        for (int m = kLogfmtGroupInt4 / 2; m > 0; m /= 2) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
            amin = fminf(amin, __shfl_xor_sync(0xffffffffu, amin, m));
        }
        if (i >= row_int4) continue;
        const LogfmtRange r = logfmt_range(amax, amin);
        const int group = i / kLogfmtGroupInt4, part = i % kLogfmtGroupInt4;
        char* place = reinterpret_cast<char*>(dst) + static_cast<int64_t>(group) * kLogfmtGroupBytes;
        if (r.cast) {
            // DeepEP's rounding: an index rounds up where |x| passes the mean of the two values it lies between.
            const float step_inv = 1.0f / r.step;
            const float fused = 2.0f - ptx::lg2_approx_f32((1.0f + ptx::ex2_approx_f32(r.step)) * 0.5f) * step_inv -
                                r.log_amin * step_inv;
            uint32_t low[2] = {0u, 0u}, high = 0u;
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                const uint32_t index = min(__float2uint_rd(fmaxf(ptx::lg2_approx_f32(fabsf(v[c])) * step_inv + fused,
                                                                 0.0f)),
                                           static_cast<uint32_t>(kLogfmtMaxIndex));
                low[c / 4] |= (index & 0xffu) << (8 * (c % 4));
                high |= ((index >> 8) | ((__float_as_uint(v[c]) >> 31) << 1)) << (2 * c);
            }
            *reinterpret_cast<uint2*>(place + 8 * part) = make_uint2(low[0], low[1]);
            *reinterpret_cast<uint16_t*>(place + kLogfmtHighBytes + 2 * part) = static_cast<uint16_t>(high);
        } else {
            ptx::st_global_L1_no_allocate_v4(reinterpret_cast<int4*>(place) + part, raw);
        }
        if (part == 0)
            meta[group] = r.cast ? (__float_as_uint(amax) >> 16) | (__float_as_uint(amin) & 0xffff0000u) : 0u;
    }
}

// What a receiving thread reads of int4 `i` of a combine slot, by its group word: the bf16 int4 of a bf16 group;
// of a cast group its 8 low index bytes (x, y) and its 16 bits of high bits (z).
__device__ __forceinline__ int4 load_logfmt_part(const int4* slot, int i, uint32_t meta) {
    if (meta == 0u) return ptx::ld_volatile_global_v4(slot + i);
    const int part = i % kLogfmtGroupInt4;
    const char* place = reinterpret_cast<const char*>(slot + (i - part));
    const uint64_t low = ptx::ld_volatile_u64(reinterpret_cast<const uint64_t*>(place + 8 * part));
    const uint32_t high = static_cast<uint32_t>(
        ptx::ld_volatile_s32(reinterpret_cast<const int*>(place + kLogfmtHighBytes + 4 * (part / 2))));
    return make_int4(static_cast<int>(low), static_cast<int>(low >> 32),
                     static_cast<int>((high >> (16 * (part % 2))) & 0xffffu), 0);
}

// The 8 floats of what load_logfmt_part read (decoded in float32, as DeepEP's receiver).
__device__ __forceinline__ void decode_logfmt_part(const int4& raw, uint32_t meta, float* v) {
    if (meta == 0u) {
        unpack_bf16x8(raw, v);
        return;
    }
    const LogfmtRange r = logfmt_range(__uint_as_float(meta << 16), __uint_as_float(meta & 0xffff0000u));
    const uint32_t high = static_cast<uint32_t>(raw.z);
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        const uint32_t low = (static_cast<uint32_t>(c < 4 ? raw.x : raw.y) >> (8 * (c % 4))) & 0xffu;
        const uint32_t bits = high >> (2 * c);
        const uint32_t index = low | ((bits & 1u) << 8);
        const float magnitude =
            index == 0u ? 0.0f : ptx::ex2_approx_f32(static_cast<float>(index - 1u) * r.step + r.log_amin);
        v[c] = (bits & 2u) ? -magnitude : magnitude;
    }
}

// ---------------------------------------------------------------------------------------------------- combine

// Both combines, bf16 (kLogfmt false: ll_combine) and LogFMT-10 (ll_combine_logfmt): the same halves, the rows
// encoded on the way out and decoded on the way in.
template <bool kLogfmt>
__device__ __forceinline__ void combine(const PeersTable* peers, const int4* y, const int* src_info,
                                        const int* topk_slot, const int64_t* layout_range, const int64_t* topk_idx,
                                        const float* topk_weights, int4* out, int num_tokens, int num_topk,
                                        int hidden, int num_experts, int max_tokens, int set, int phases,
                                        int force_puts, LowLatencySync* sync, int* host_status, uint64_t* timeline,
                                        int64_t* wait_stats) {
    const int me = peers->rank, num_ranks = peers->num_ranks, num_local = num_experts / num_ranks;
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    const int epoch = ptx::ld_volatile_s32(&sync->epoch[set]) + 1;
    const LowLatencyLayout lay(peers->sym_base, set, num_ranks, num_experts, max_tokens, hidden);
    const int row_int4 = hidden / 8;
    int32_t* call_word = &sync->call[set];
    const Shrink s = shrink_of(sync, num_experts, call_word);
    if (!layout_fits(peers, lay, call_word)) phases = 0;
    if (phases != 0) send_deferred_acks(peers, sync, num_experts, max_tokens, hidden, force_puts, s);
    timeline_start(timeline, kAtStart);

    if (phases & kPhaseSend) {
        wait_for_acks(peers, lay, epoch, "ll_combine: peer read this buffer set's previous call (ack)", s);
        timeline_mark(timeline, kAtAcks);
        const int num_pairs = num_local * num_ranks;
        const int w = warps_per_pair(num_pairs);
        const int global_warp = static_cast<int>(blockIdx.x) * kLowLatencyWarps + warp;
        const int sub = global_warp % w, group_in_block = warp / w;
        const int64_t rows_per_expert = static_cast<int64_t>(num_ranks) * max_tokens;
        for (int pair = global_warp / w; pair < num_pairs; pair += static_cast<int>(gridDim.x) * kLowLatencyWarps / w) {
            const int e = pair / num_ranks, home = pair % num_ranks;
            const int64_t packed = __ldg(layout_range + pair);
            const int begin = static_cast<int>(packed >> 32), n = static_cast<int>(packed & 0xffffffff);
            const bool direct = !force_puts && peers->sym_peer[home] != nullptr;
            // Nothing to a masked home; each warp of the group reads the mask for itself, so all of them still
            // reach the group's barrier below.
            const bool gone = masked(s, home);
            if constexpr (kLogfmt) {  // the host runs it only where every peer has an NVLink pointer
                // Encoding is arithmetic a value, so a pair of fewer rows than warps splits each row's 32-int4
                // steps among its warps (the same bits: every step encodes its own two groups).
                const int slices = n > 0 ? max(1, min(w / n, (row_int4 + 31) / 32)) : 1;
                for (int item = sub; !gone && item < n * slices; item += w) {
                    const int64_t row = e * rows_per_expert + begin + item / slices;
                    const int token = __ldg(src_info + row), k = __ldg(topk_slot + row);
                    send_logfmt_row(on_peer(peers, lay.combine_slot(token, k), home),
                                    on_peer(peers, lay.combine_meta(token, k), home), y + row * row_int4, row_int4,
                                    lane, item % slices, slices);
                }
            }
            // bf16 over NVLink: a pair of fewer rows than warps splits each row among its warps too (a warp keeps
            // its slice: row_slices divides the group); puts stay whole rows, one message each. (LogFMT's own
            // split above ran 1 us slower at 8 tokens on 2 x H200 in this form.)
            const int slices = !kLogfmt && direct ? row_slices(w, n, row_int4) : 1, slice = sub % slices;
            for (int i = sub / slices; !kLogfmt && !gone && i < n; i += w / slices) {
                const int64_t row = e * rows_per_expert + begin + i;
                const int4* src = y + row * row_int4;
                int4* mine = lay.combine_slot(__ldg(src_info + row), __ldg(topk_slot + row));
                if (direct)
                    warp_copy_slice(on_peer(peers, mine, home), src, row_int4, lane, slice, slices);
                else
                    rdma_put_warp(peers, mine, src, static_cast<size_t>(row_int4) * 16, home, lane);
            }
            if (!direct) rdma_quiet();
            // Every row of the pair is out (bar.sync orders the group's stores before the release below).
            if (w > 1)
                ptx::bar_sync(1 + group_in_block, w * 32);
            else
                __syncwarp();
            if (sub == 0 && lane == 0 && !gone) {
                uint64_t* word = lay.flags + static_cast<int64_t>(me) * num_local + e;
                const uint64_t signal = epoch_signal(epoch, 1u);
                if (direct) {
                    // One system-scope fence (the bar.sync put the group's rows before it), then a relaxed store:
                    // a release store after it would fence again, and the peer's address is loaded before both.
                    uint64_t* remote = on_peer(peers, word, home);
                    ptx::fence_acq_rel_sys();
                    ptx::st_relaxed_sys_u64(remote, signal);
                } else {
                    rdma_signal(peers, word, signal, SignalOp::kSet, home);
                }
            }
        }
        timeline_mark(timeline, kAtSent);
    }

    if (phases & kPhaseRecv) {
        // A block waits only for the flags its own tokens' experts raise (a thread a (token, k)), all at once: a
        // block without tokens waits for nothing, and no flag is polled by all 128 blocks. A flag no token here
        // needs may land after this call's acks: its peer's next flag on the set comes after it (same word, same
        // writer) and carries the next epoch.
        const int block_slots = (num_tokens - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                                static_cast<int>(gridDim.x) * num_topk;
        for (int j = static_cast<int>(threadIdx.x); j < block_slots; j += kLowLatencyThreads) {
            const int t = static_cast<int>(blockIdx.x) + j / num_topk * static_cast<int>(gridDim.x);
            const int64_t expert = __ldg(topk_idx + static_cast<int64_t>(t) * num_topk + j % num_topk);
            if (expert < 0 || expert >= num_experts) continue;
            const uint64_t* word = lay.flags + expert;
            const uint64_t since = wait_stats_since();
            uint64_t arrived = 0;
            wait_peer(peers, s, WaitSite{"ll_combine: rows of expert (channel) from its rank",
                                         static_cast<int>(expert) / num_local, static_cast<int>(expert), epoch},
                      [&](int64_t& seen) {
                          seen = signal_epoch(ptx::ld_acquire_sys_u64(word));
                          wait_stats_arrived(arrived, seen != epoch);
                          return seen != epoch;
                      });
            add_wait_stats(wait_stats, static_cast<int>(expert) / num_local, since, arrived);  // a (token, k)'s wait
        }
        // Shrink build: the terms of a masked owner are skipped (zero), by one mask for the whole grid.
        if constexpr (kShrink) grid_sync(peers, s);
        __syncthreads();
        timeline_mark(timeline, kAtCounted);
        __shared__ int slot_valid[kLowLatencyMaxTopk];
        __shared__ float slot_weight[kLowLatencyMaxTopk];
        for (int t = static_cast<int>(blockIdx.x); t < num_tokens; t += static_cast<int>(gridDim.x)) {
            if (static_cast<int>(threadIdx.x) < num_topk) {
                const int64_t j = static_cast<int64_t>(t) * num_topk + threadIdx.x;
                const int64_t expert = __ldg(topk_idx + j);
                slot_valid[threadIdx.x] = expert >= 0 && expert < num_experts &&
                                          !masked(s, static_cast<int>(expert) / num_local);
                slot_weight[threadIdx.x] = __ldg(topk_weights + j);
                if (expert < -1 || expert >= num_experts) report_status(call_word, kLowLatencyInvalidIds);
            }
            __syncthreads();
            for (int i = static_cast<int>(threadIdx.x); i < row_int4; i += kLowLatencyThreads) {
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                // kInFlight slots' loads issued together, then summed in k order (bit-exact with the reference).
                constexpr int kInFlight = 4;
                for (int k0 = 0; k0 < num_topk; k0 += kInFlight) {
                    int4 raw[kInFlight];
                    uint32_t meta[kInFlight];
                    if constexpr (kLogfmt) {  // the group words first: they say where and how each part lies
#pragma unroll
                        for (int j = 0; j < kInFlight; ++j)
                            if (k0 + j < num_topk && slot_valid[k0 + j])
                                meta[j] = static_cast<uint32_t>(ptx::ld_volatile_s32(reinterpret_cast<const int*>(
                                    lay.combine_meta(t, k0 + j) + i / kLogfmtGroupInt4)));
                    }
#pragma unroll
                    for (int j = 0; j < kInFlight; ++j)
                        if (k0 + j < num_topk && slot_valid[k0 + j]) {
                            if constexpr (kLogfmt)
                                raw[j] = load_logfmt_part(lay.combine_slot(t, k0 + j), i, meta[j]);
                            else
                                raw[j] = ptx::ld_volatile_global_v4(lay.combine_slot(t, k0 + j) + i);
                        }
#pragma unroll
                    for (int j = 0; j < kInFlight; ++j) {
                        if (k0 + j >= num_topk || !slot_valid[k0 + j]) continue;
                        float v[8];
                        if constexpr (kLogfmt)
                            decode_logfmt_part(raw[j], meta[j], v);
                        else
                            unpack_bf16x8(raw[j], v);
#pragma unroll
                        for (int c = 0; c < 8; ++c) acc[c] = __fadd_rn(acc[c], __fmul_rn(v[c], slot_weight[k0 + j]));
                    }
                }
                out[static_cast<int64_t>(t) * row_int4 + i] = pack_bf16x8(acc);
            }
            __syncthreads();
        }
        timeline_mark(timeline, kAtReceived);
    }
    finish_call(peers, lay, sync, set, (phases & kPhaseRecv) != 0, false, epoch, force_puts, s, host_status,
                timeline);
}

__global__ void __launch_bounds__(kLowLatencyThreads, 1)
ll_combine(const PeersTable* peers, const int4* y, const int* src_info, const int* topk_slot,
           const int64_t* layout_range, const int64_t* topk_idx, const float* topk_weights, int4* out,
           int num_tokens, int num_topk, int hidden, int num_experts, int max_tokens, int set, int phases,
           int force_puts, LowLatencySync* sync, int* host_status, uint64_t* timeline, int64_t* wait_stats) {
    combine<false>(peers, y, src_info, topk_slot, layout_range, topk_idx, topk_weights, out, num_tokens, num_topk,
                   hidden, num_experts, max_tokens, set, phases, force_puts, sync, host_status, timeline, wait_stats);
}

// The LogFMT-10 combine: launched only on the build without a put path (LowLatencySpec), hidden % 128 == 0.
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
ll_combine_logfmt(const PeersTable* peers, const int4* y, const int* src_info, const int* topk_slot,
                  const int64_t* layout_range, const int64_t* topk_idx, const float* topk_weights, int4* out,
                  int num_tokens, int num_topk, int hidden, int num_experts, int max_tokens, int set, int phases,
                  int force_puts, LowLatencySync* sync, int* host_status, uint64_t* timeline,
                  int64_t* wait_stats) {
    combine<true>(peers, y, src_info, topk_slot, layout_range, topk_idx, topk_weights, out, num_tokens, num_topk,
                  hidden, num_experts, max_tokens, set, phases, force_puts, sync, host_status, timeline, wait_stats);
}

// ------------------------------------------------------------------------------------------ shrink: clean

#if defined(EPJIT_LL_SHRINK)
// clean_low_latency_buffer's barrier in shrink mode, in place of the host group's (which a dead rank would hang):
// each live rank writes `round` into its clean word at every live rank, then waits for every live rank's word to
// reach it; a rank that does not in time is masked. The host runs it, zeroes its two sets, and runs it again with
// the next round, so no live rank writes into a set before every live rank has zeroed its own. The words lie after
// the sets, which the clean zeroes, so the rounds only grow (the host counts them: every live rank cleans as often).
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
ll_clean_barrier(const PeersTable* peers, LowLatencySync* sync, int num_experts, int max_tokens, int hidden,
                 int round, int force_puts) {
    const int num_ranks = peers->num_ranks;
    const LowLatencyLayout lay(peers->sym_base, 0, num_ranks, num_experts, max_tokens, hidden);
    if (2 * lay.set_bytes + ll_align(8 * static_cast<int64_t>(num_ranks)) > peers->sym_bytes) return;  // (sized)
    const Shrink s = shrink_of(sync, num_experts, nullptr);
    uint64_t* words = clean_words(lay, peers->sym_base);
    uint64_t* mine = words + peers->rank;
    const uint64_t value = static_cast<uint64_t>(round);
    for (int pe = static_cast<int>(threadIdx.x); pe < num_ranks; pe += static_cast<int>(blockDim.x)) {
        if (masked(s, pe)) continue;
        uint64_t* remote = force_puts ? nullptr : on_peer(peers, mine, pe);
        if (remote != nullptr)
            ptx::st_release_sys_u64(remote, value);
        else
            rdma_signal(peers, mine, value, SignalOp::kSet, pe);
    }
    for (int pe = static_cast<int>(threadIdx.x); pe < num_ranks; pe += static_cast<int>(blockDim.x)) {
        const uint64_t* word = words + pe;
        wait_peer(peers, s, WaitSite{"ll_clean_barrier: peer's clean round", pe, -1, round}, [&](int64_t& seen) {
            seen = static_cast<int64_t>(ptx::ld_acquire_sys_u64(word));
            return seen < round;
        });
    }
}
#endif

}  // namespace epjit
