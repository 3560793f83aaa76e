// Layout of the NVSHMEM symmetric heap in low-latency mode (docs/layouts.md), shared by the kernels of
// low_latency.cu. The host mirror is epjit/kernels/low_latency.py:low_latency_set_bytes.
//
// Two sets, used alternately by successive calls, so a caller may hold one call's results while issuing the next.
// Each set (R ranks, E experts, L = E/R local experts, M = num_max_dispatch_tokens_per_rank, H = hidden):
//
//   counts          uint64 [L][R src]           dispatch: (epoch << 32) | (uint32)-(n+1), n = rows src sent to l
//   flags           uint64 [E]                  combine: (epoch << 32) | 1, from the owner of expert g
//   acks            uint64 [R]                  epoch << 32: rank r has read everything this set brought it in
//                                               that call (after a dispatch, sent by r's next low-latency
//                                               kernel); a sender waits for it before the set's next call
//   dispatch slots  [R src][M] x msg            one message per (source token, destination rank): header + payload
//   combine slots   [M][kLowLatencyMaxTopk] x 2H   expert output for (token, k), at the token's home rank
//   staging         [M] x msg + [M][R] x header   what NVSHMEM puts read (only where no NVLink pointer)
//                   (a LogFMT combine keeps its group words here: uint32 [M][kLowLatencyMaxTopk][H/128])
//   formats         uint64 [R src]              dispatch: (epoch << 32) | format: whether src's messages here are
//                                               flagged, and how many it sent
//   flagged msgs    [R src][kFlaggedTokens] x 2 msg    small dispatches' messages, flagged (below)
//
// After the two sets, once (clean_words, 256-byte aligned):
//
//   clean words     uint64 [R src]              shrink mode's clean barrier: the round src reached (ll_clean_barrier)
//
// A small dispatch takes the flagged path: every 8 bytes of its messages travel as {4 data bytes, the call's
// epoch} (16-byte stores {a, epoch, b, epoch}; an 8-byte half lands whole), so a receiver polls the data itself
// and no sender orders its stores before a signal: no system-scope fence and no count hand-off on the way (each
// costs microseconds, most of a one-token call), for twice the bytes. The flagged region is written only flagged,
// so an epoch word there is always an epoch. A source decides by its own tokens and says so in its format word,
// which it sends with its counts at once (on that path they prove nothing about data).
//
// A message carries a token once to a rank, whatever number of that rank's experts chose it: header {source
// token, meta, entries, epoch} and one entry {local expert, slot << 4 | k} per (token, k) on that rank (its row
// is slot `slot` of (local expert, source), the k-th top-k choice), then FP8 bytes [H] + float scales [H/128], or
// bf16 [H]; its stride fits the larger (bf16). The receiver copies the payload into each entry's row: NVLink
// carries a token once per rank, not once per expert (at top-8 of 256 on 4 ranks, 2.2 experts a chosen rank).
// Signal words and message headers carry the epoch of the call that wrote them (each rank counts the calls on
// each set in device memory, identically), so no word ever needs cleaning between calls and a word left by an
// older call never passes for this one's. The acks stop a rank that runs ahead (receive hooks let a rank have two
// calls in flight) from overwriting a set a slower peer is still reading.
#pragma once

#include "peers.cuh"

namespace epjit {

constexpr int kLowLatencyMaxTopk = 16;
constexpr int kLowLatencyHeaderBytes = 144;  // int4 {token, meta, entries, epoch} + int2 entry[kLowLatencyMaxTopk]
constexpr int kLowLatencyHeaderInt4 = kLowLatencyHeaderBytes / 16;
static_assert(kLowLatencyHeaderBytes == 16 + 8 * kLowLatencyMaxTopk, "one int2 entry per top-k slot");

// The flagged path's limits: a source sends flagged messages when it has at most kFlaggedTokens tokens and at
// most kFlaggedMessages messages leave it (tokens x min(R - 1, K)): on 2 ranks 64 tokens, at top-8 on 4 ranks 53,
// on 8 ranks 22. Beyond, the doubled bytes cost more than the signal path saves: on 4 x H200 (FP8, 7168 wide) a
// 48-token dispatch (144 messages) took 27.3 us flagged against 29.3 on the signal path, a 64-token one (192) 30.1
// against 30.4, while at 24 and 32 tokens the flagged path saved 4-6 us (the ~5 us chain of fences and count
// hand-offs the signal path puts before a receiver may read). The region's stride is kFlaggedTokens whatever R, a
// compile-time constant: a stride from R (a smaller region on 4 and 8 ranks) cost every dispatch 1-2.5 us on
// 2 x H100, large calls included, for no reason its instruction counts showed.
constexpr int kFlaggedMessages = 160;
constexpr int kFlaggedTokens = 64;  // a source's messages to one rank, at most: one a token
constexpr int kFlaggedMaxRanks = 32;  // a token's destination ranks as one 32-bit mask
// A format word's low bits: the messages sent (flagged path), then what is flagged.
constexpr uint32_t kFormatMessagesMask = 0xffff;
constexpr uint32_t kFormatFlaggedDispatch = 1u << 16;
static_assert(kFlaggedTokens <= 64, "two ballots of a warp cover a flagged source's tokens");

__host__ __device__ constexpr int64_t ll_align(int64_t n) { return (n + 255) / 256 * 256; }

__host__ __device__ constexpr int64_t ll_msg_bytes(int hidden) {
    return (kLowLatencyHeaderBytes + 2 * static_cast<int64_t>(hidden) + 15) / 16 * 16;
}

struct LowLatencyLayout {
    uint64_t* counts;
    uint64_t* flags;
    uint64_t* acks;
    char* dispatch_slots;
    char* combine_slots;
    char* staging;
    char* staging_headers;
    uint64_t* formats;
    char* flagged_msgs;
    int64_t msg_bytes, combine_row_bytes, set_bytes;
    int num_ranks, max_tokens;

    __host__ __device__ LowLatencyLayout(void* sym_base, int set, int num_ranks_, int num_experts, int max_tokens_,
                                         int hidden)
        : msg_bytes(ll_msg_bytes(hidden)), combine_row_bytes(2 * static_cast<int64_t>(hidden)),
          num_ranks(num_ranks_), max_tokens(max_tokens_) {
        const int64_t R = num_ranks, E = num_experts, L = num_experts / num_ranks, M = max_tokens;
        int64_t off = 0;
        const int64_t counts_off = off;
        off += ll_align(L * R * 8);
        const int64_t flags_off = off;
        off += ll_align(E * 8);
        const int64_t acks_off = off;
        off += ll_align(R * 8);
        const int64_t dispatch_off = off;
        off += ll_align(R * M * msg_bytes);
        const int64_t combine_off = off;
        off += ll_align(M * kLowLatencyMaxTopk * combine_row_bytes);
        const int64_t staging_off = off;
        off += ll_align(M * msg_bytes);
        const int64_t headers_off = off;
        off += ll_align(M * R * kLowLatencyHeaderBytes);
        const int64_t formats_off = off;
        off += ll_align(R * 8);
        const int64_t flagged_msgs_off = off;
        off += ll_align(R * kFlaggedTokens * 2 * msg_bytes);
        set_bytes = off;
        char* base = static_cast<char*>(sym_base) + set * set_bytes;
        counts = reinterpret_cast<uint64_t*>(base + counts_off);
        flags = reinterpret_cast<uint64_t*>(base + flags_off);
        acks = reinterpret_cast<uint64_t*>(base + acks_off);
        dispatch_slots = base + dispatch_off;
        combine_slots = base + combine_off;
        staging = base + staging_off;
        staging_headers = base + headers_off;
        formats = reinterpret_cast<uint64_t*>(base + formats_off);
        flagged_msgs = base + flagged_msgs_off;
    }

    __device__ int4* dispatch_slot(int src, int token) const {
        return reinterpret_cast<int4*>(dispatch_slots + (static_cast<int64_t>(src) * max_tokens + token) * msg_bytes);
    }
    __device__ int4* staging_header(int token, int dst) const {
        return reinterpret_cast<int4*>(staging_headers +
                                       (static_cast<int64_t>(token) * num_ranks + dst) * kLowLatencyHeaderBytes);
    }
    // Flagged message i from src (i < kFlaggedTokens), 2 x msg_bytes: each data int4 as two flagged int4.
    __device__ int4* flagged_msg(int src, int i) const {
        const int64_t index = static_cast<int64_t>(src) * kFlaggedTokens + i;
        return reinterpret_cast<int4*>(flagged_msgs + index * 2 * msg_bytes);
    }
    __device__ int4* combine_slot(int token, int k) const {
        return reinterpret_cast<int4*>(
            combine_slots + (static_cast<int64_t>(token) * kLowLatencyMaxTopk + k) * combine_row_bytes);
    }
    // LogFMT combine (ll_combine_logfmt): slot (token, k)'s group words, a uint32 a 128 channels, where the staging
    // region is: only the put path stages, and a LogFMT combine runs only in the build without one (the host refuses
    // it elsewhere). [M][kLowLatencyMaxTopk][H/128] x 4 bytes fits in the staging region's M x msg_bytes (> 2H).
    __device__ uint32_t* combine_meta(int token, int k) const {
        return reinterpret_cast<uint32_t*>(staging) +
               (static_cast<int64_t>(token) * kLowLatencyMaxTopk + k) * (combine_row_bytes / 256);
    }
};

// Per-Buffer device words (plain device memory, zeroed at creation), per set: the epoch; the running call's
// word (its finished blocks in the low 16 bits, the last one advances the epoch; its status bits above, for the
// host); the epoch of a receive whose acks the next kernel sends. Then the dispatch's per-expert sent counters.
struct LowLatencySync {
    int32_t epoch[2];
    int32_t call[2];
    int32_t unacked[2];
    int32_t pad[2];
    // Followed by int32 expert_sent[num_experts] (dispatch: messages of the running call sent to each expert;
    // its count-sender zeroes it once the count is out, so every call starts from zero).
};

__device__ __forceinline__ int32_t* expert_sent_counters(LowLatencySync* sync) {
    return reinterpret_cast<int32_t*>(sync + 1);
}

// Shrink mode (the EPJIT_LL_SHRINK build, for a Buffer made with enable_shrink): after expert_sent, 8-byte aligned
// (epjit/kernels/low_latency.py: shrink_offset). Written by the host at creation but for the grid barrier and the mask.
struct LowLatencyShrink {
    int32_t arrived;      // grid barrier (grid_sync): the blocks that reached it
    int32_t generation;   // grid barrier: how often every block did
    WaitRecord* records;  // mapped host memory [R]: the wait that masked each rank (wait.cuh: PeerMask)
    uint64_t timeout_ns;  // how long a wait on a peer polls before it masks the peer
    // Followed by int32 mask[R]: nonzero = masked, neither sent to nor waited for (zero at creation).
};
static_assert(sizeof(LowLatencyShrink) == 24, "LowLatencyShrink layout is shared with epjit/ops/low_latency.py");

__device__ __forceinline__ LowLatencyShrink* shrink_state(LowLatencySync* sync, int num_experts) {
    return reinterpret_cast<LowLatencyShrink*>(reinterpret_cast<char*>(expert_sent_counters(sync)) +
                                               (4 * static_cast<int64_t>(num_experts) + 7) / 8 * 8);
}

// The shrink barrier's words: after the two sets (clean_low_latency_buffer zeroes the sets only, so the rounds
// survive it).
__device__ __forceinline__ uint64_t* clean_words(const LowLatencyLayout& lay, void* sym_base) {
    return reinterpret_cast<uint64_t*>(static_cast<char*>(sym_base) + 2 * lay.set_bytes);
}

}  // namespace epjit
