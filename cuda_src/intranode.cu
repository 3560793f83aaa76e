// Normal-mode dispatch and combine inside one NVLink node (DeepEP's intranode kernels; why this shape: docs/design.md;
// the buffer layout: intranode.cuh and docs/layouts.md).
//
//   notify     block 0: write my counts into every peer's buffer and zero my queues' dispatch words, barrier,
//              then build rank_prefix_matrix and what the host needs; blocks 1..R build channel_prefix_matrix
//              (tokens of each channel bound for each destination, prefix-summed over channels).
//   (both)     one block a channel, claimed at the start so that no two working blocks share a TPC
//              (placement.cuh: the host launches more blocks than channels, the spare ones return at once).
//   dispatch   one block a channel, its warps in groups (DispatchRoles): for each other rank a sending group
//              pushes the channel's tokens for that rank through ring (channel, me) in its buffer, chunk by chunk,
//              publishing the tail, and a draining group copies ring (channel, that rank) of my buffer into recv_x
//              at the rows rank_prefix_matrix and the channel's start offset give, publishing the head; one more
//              group copies my own tokens from x (or, phased, one sending group serves the other ranks in turn).
//              send_head[t][r] records the ring index token t took towards r (or, as -(i)-1, the index the next
//              token towards r will take): combine's receipts.
//   combine    after a barrier of the channel's blocks on every rank (each zeroes the channel's combine words in
//              its buffer first), the same rings in the other direction (CombineRoles): sending groups return
//              each received row to its source in received order, so it lands at the index send_head recorded;
//              reader warps sum, for each token of the channel, the rows its receipts point at; a coordinator
//              warp moves each ring's head to the slowest reader.
//
// Why every block does every job: an SM copies no faster locally than over NVLink, and a few SMs already fill the
// link to one peer (the benchmark's copy ceilings: docs/performance.md), so the SMs are the budget, and dispatch
// spends them on R - 1 rings out, R - 1 rings in and the own copy. Blocks specialised as senders or receivers
// (DeepEP's layout) leave one kind idle while the other finishes; one block a channel doing all three keeps the
// bytes per SM equal whatever the rank count.
//
// Memory ordering (every pair): sender data stores -> bar.sync of the rank group -> st.release.sys of the tail by
// one thread; receiver ld.acquire.sys of the tail -> bar.sync -> data loads. Receiver loads -> bar.sync ->
// st.release.sys of the head; sender ld.acquire.sys of the head before it overwrites a slot.
#include "barrier.cuh"
#include "bf16.cuh"
#include "copy.cuh"
#include "fp8.cuh"
#include "intranode.cuh"
#include "placement.cuh"
#include "status.cuh"
#include "ptx.cuh"
#include "timeline.cuh"
#include "wait.cuh"

namespace epjit {

// EPJIT_PROFILE (timeline.cuh): the points dispatch and combine blocks stamp (epjit/kernels/intranode.py mirrors
// them). Points several warp groups reach are stamped by each; the latest counts.
enum IntranodePoint {
    kNormalAtStart = 0,      // the block began
    kNormalAtOwnCopied = 1,  // dispatch: the own-copy group has copied this rank's tokens from x
    kNormalAtFirstTail = 2,  // dispatch: a draining group saw its ring's first tail; combine: a reader's first token
    kNormalAtSent = 3,       // the sending groups published their final tails
    kNormalAtReceived = 4,   // dispatch: every ring drained; combine: every token reduced
    kNormalAtLastTail = 5,   // dispatch: a draining group saw its ring's final tail; combine: a reader's last token
                             // had all its rows (what is left after it is copying or reducing what arrived)
};
enum NotifyPoint {
    kNotifyAtStart = 0,     // the block began
    kNotifyAtWritten = 1,   // block 0: counts and meta written into every peer's buffer
    kNotifyAtBarrier = 2,   // block 0: every peer's too (the barrier passed)
    kNotifyAtChecked = 3,   // block 0: metas compared, rank_prefix_matrix and capacities checked
    kNotifyAtPulled = 4,    // block 0: the per-expert counts read from the peers and the host's fields written
    kNotifyAtEnd = 5,       // the block's results written (block 0: the host's counts published)
};

// Whether tokens t .. t + 31 go to rank `dst` (bit i: token t + i; 0 past `end`), one load a warp: the token
// loops walk this mask instead of loading each token's flag in turn, a dependent memory round trip a token.
__device__ __forceinline__ uint32_t selected_window(const bool* is_token_in_rank, int t, int end, int dst,
                                                    int num_ranks, int lane) {
    const int token = t + lane;
    return __ballot_sync(0xffffffffu,
                         token < end && is_token_in_rank[static_cast<int64_t>(token) * num_ranks + dst]);
}

// A wait on peer site.peer. In the shrink build (kShrink), timeout_while_unmasked: false, at once, for a masked
// peer, and false once it is masked meanwhile or after the shrink timeout (the wait masks it then); the caller stops
// using that peer for the call. Otherwise timeout_while (a trap after EPJIT_TIMEOUT_S), and always true, so the
// callers' shrink branches compile away and the other builds are the code they were.
template <typename KeepWaiting>
__device__ __forceinline__ bool wait_on_peer(const PeersTable* peers, const WaitSite& site,
                                             KeepWaiting&& keep_waiting) {
    if constexpr (kShrink) {
        bool masked_now;
        return timeout_while_unmasked(peers, normal_shrink_mask(peers), site, masked_now, keep_waiting);
    } else {
        timeout_while(peers, site, keep_waiting);
        return true;
    }
}

// Shrink mode: whether nvl rank r takes no part in the rest of this call: masked in the call's mask (notify's, the
// same on every live rank) or in this rank's mask since (a wait timed out on it, or the host masked it).
__device__ __forceinline__ bool peer_gone(const PeersTable* peers, int call_mask, int r) {
    return (call_mask >> r & 1) || ptx::ld_volatile_s32(normal_shrink_mask(peers).mask + peers->rank - peers->nvl_rank + r) != 0;
}

// A sender's flow control: before a chunk, wait until the ring (channel, me) at the receiver has room for a whole
// chunk, i.e. at most num_slots - chunk of its slots are still unread. `head` caches the receiver's head, which
// lives across NVLink: it is read again only when the cached value says the ring may be full. One lane waits;
// __syncwarp hands the answer to the warp. The acquire pairs with the receiver's st.release.sys of the head, which
// comes after its reads of those slots.
// Returns false on lane 0 where the receiver was masked instead (shrink mode: wait_on_peer).
__device__ __forceinline__ bool wait_for_ring_room(const PeersTable* peers, const char* site, const int32_t* head_ptr,
                                                   int tail, int& head, int num_slots, int chunk, int peer_rank,
                                                   int channel, int lane) {
    bool room = true;
    if (lane == 0 && tail - head > num_slots - chunk) {
        room = wait_on_peer(peers, WaitSite{site, peer_rank, channel, tail - num_slots + chunk}, [&](int64_t& seen) {
            seen = head = ptx::ld_acquire_sys_s32(head_ptr);
            return tail - head > num_slots - chunk;
        });
    }
    __syncwarp();
    return room;
}

// The warp groups of a dispatch block (named barrier group + 1): sending groups, a draining group for each other
// rank, then the own copy with the warps left. How many warps each role gets is the host's choice, a template
// parameter (epjit/kernels/intranode.py: intranode_spec, which also sizes the chunks by it). Senders set the pace (a
// drain copies what has arrived; more sending warps, not fewer round trips a row, sped them up), so by default they
// get what the own copy (W / 2R) and the drains (W / (2R - 1) a peer) leave: 10 / 8 / 6 on 2 ranks, 4 / 3 / 3 a peer
// on 4 (with equal groups the own copy finished well before the senders: docs/history.md).
//
// kPhased: one sending group of all the sending warps, serving the peers one at a time: me + 1, then me + 2, ...
// While the ranks keep step, each GPU is then written by one peer at a time (NCCL's p2p schedule: on 4 ranks the
// `rotate` copy pattern reached well above every peer at once, `peers`, with the same SMs; docs/performance.md).
// A channel's share for one peer fits its ring (~150 tokens of 256 slots
// at 4096 tokens x 24 channels), so a phase rarely waits for the drain.
template <int kNumRanks, int kNumWarps, int kSendWarpsAPeer, int kDrainWarpsAPeer, bool kPhased>
struct DispatchRoles {
    enum Role { kSend, kDrain, kOwn };
    static constexpr int kPeers = kNumRanks - 1;
    static constexpr int kSendWarps = kSendWarpsAPeer, kDrainWarps = kDrainWarpsAPeer;
    static constexpr int kSendGroups = kPeers == 0 ? 0 : kPhased ? 1 : kPeers;
    static constexpr int kSendGroupWarps = kPhased ? kPeers * kSendWarps : kSendWarps;
    static constexpr int kPeersPerSendGroup = kPhased ? kPeers : 1;
    static constexpr int kGroups = kSendGroups + kPeers + 1;  // senders, a drain group a peer, the own copy
    static constexpr int kOwnWarps = kNumWarps - kPeers * (kSendWarps + kDrainWarps);
    static_assert(kOwnWarps >= 1 && (kPeers == 0 ? kSendWarps == 0 && kDrainWarps == 0
                                                 : kSendWarps >= 1 && kDrainWarps >= 1),
                  "every role needs a warp (the host's IntranodeSpec refuses such a split first)");
    static_assert(kGroups <= 15, "named barriers 1..15 name the groups");
    Role role;
    int group;          // named barrier group + 1
    int peer;           // the nvl rank served (mine for the own copy; a phased sending group's first peer)
    int warp_in_group;

    __device__ DispatchRoles(int warp, int me) {
        constexpr int kSendEnd = kPeers * kSendWarps, kDrainEnd = kSendEnd + kPeers * kDrainWarps;
        if (warp < kSendEnd) {
            group = warp / kSendGroupWarps, warp_in_group = warp % kSendGroupWarps;
            role = kSend, peer = (me + 1 + group) % kNumRanks;
        } else if (warp < kDrainEnd) {
            const int d = (warp - kSendEnd) / kDrainWarps;
            group = kSendGroups + d, warp_in_group = (warp - kSendEnd) % kDrainWarps;
            role = kDrain, peer = (me + 1 + d) % kNumRanks;
        } else {
            group = kGroups - 1, warp_in_group = warp - kDrainEnd, role = kOwn, peer = me;
        }
    }
    // The nvl rank a sending group serves in its phase-th turn (always roles.peer unless kPhased).
    __device__ int send_peer(int me, int phase) const { return kPhased ? (me + 1 + phase) % kNumRanks : peer; }
    __device__ int warps() const { return role == kSend ? kSendGroupWarps : role == kDrain ? kDrainWarps : kOwnWarps; }
    __device__ void sync() const { ptx::bar_sync(group + 1, warps() * 32); }
};

// The warps of a combine block: sending groups first (one per other rank, kSendPerPeer warps each, named barrier
// group + 1), then the coordinator, then the readers. A reader reads R rows and writes one for every row a sender
// copies, so readers get the larger share: by default send warps ~ 2(R-1) / (2(R-1) + R + 1) of the block (copies
// count a read and a write), except on 2 ranks: the formula gives 9 of 24 warps, but 7 are faster (measured:
// docs/history.md): NVLink, not their warps, limits the senders there, and the two warps they give up serve the
// readers (epjit/kernels/intranode.py).
template <int kNumRanks, int kNumWarps, int kSendWarpsAPeer>
struct CombineRoles {
    enum Role { kSend, kCoordinator, kRead };
    static constexpr int kSendPerPeer = kSendWarpsAPeer;
    static constexpr int kSendWarps = kSendPerPeer * (kNumRanks - 1);
    static constexpr int kNumReaders = kNumWarps - kSendWarps - 1;
    static_assert(kNumRanks == 1 ? kSendPerPeer == 0 : kSendPerPeer >= 1, "a sending warp for each other rank");
    static_assert(kNumReaders >= 1, "too few warps for the readers");
    Role role;
    int group;          // sending group (named barrier group + 1)
    int peer;           // the nvl rank a sending group serves
    int warp_in_group;  // in the sending group, or the reader index

    __device__ CombineRoles(int warp, int me) {
        if (warp < kSendWarps) {
            role = kSend, group = warp / kSendPerPeer, warp_in_group = warp % kSendPerPeer;
            peer = (me + 1 + group) % kNumRanks;
        } else {
            role = warp == kSendWarps ? kCoordinator : kRead, group = -1, peer = me;
            warp_in_group = warp - kSendWarps - 1;
        }
    }
    __device__ void sync() const { ptx::bar_sync(group + 1, kSendPerPeer * 32); }
};

// Shrink mode: every rank's notify decides the call's mask, the ranks that take no part in this call, the same on
// every live rank: the ranks this rank has masked after the barrier (masked before the call, or by a barrier wait that
// timed out), and those any live peer had masked as its call began (its meta[5], written before its arrival at the
// barrier, which this rank acquired). The ranks masked only by a peer are masked here too. A rank that finds itself
// masked by a peer goes on alone (its mask: every other rank). Returns the mask as bits (bit r: nvl rank r).
template <int kNumRanks>
__device__ __noinline__ int agree_call_mask(const PeersTable* peers, const int32_t* meta) {
    const int me = peers->nvl_rank, rank0 = peers->rank - me;
    const PeerMask m = normal_shrink_mask(peers);
    int mine = 0;
    for (int r = 0; r < kNumRanks; ++r)
        if (r != me && ptx::ld_volatile_s32(m.mask + rank0 + r) != 0) mine |= 1 << r;
    int call = mine;
    for (int r = 0; r < kNumRanks; ++r)
        if (r != me && !(mine >> r & 1)) call |= ptx::ld_volatile_s32(meta + r * kMetaInts + 5);
    if (call >> me & 1) call = (1 << kNumRanks) - 1;
    call &= ~(1 << me);
    for (int r = 0; r < kNumRanks; ++r)
        if ((call >> r & 1) && !(mine >> r & 1)) atomicExch(m.mask + rank0 + r, 1);  // no record: no wait of mine
    return call;
}

// This rank's mask as bits (shrink mode; me excluded), as a call begins.
template <int kNumRanks>
__device__ __forceinline__ int mask_bits(const PeersTable* peers) {
    const PeerMask m = normal_shrink_mask(peers);
    const int me = peers->nvl_rank;
    int bits = 0;
    for (int r = 0; r < kNumRanks; ++r)
        if (r != me && ptx::ld_volatile_s32(m.mask + peers->rank - me + r) != 0) bits |= 1 << r;
    return bits;
}

// Host-mapped ints notify fills (host_out, the call's own record), read by the host once [0] is no longer -1
// (written last):
//   [0] rows this rank receives   [1] status bits   [2, 2+M*R) every rank's meta (M = kMetaInts)   [2+M*R,
//   2+(M+1)*R) rows each rank receives   [2+(M+1)*R, +L) rows per local expert, rounded up to expert_alignment
// call_status: the status bits again, in the handle's device ints: the dispatch and every combine of the handle
// do nothing unless they are 0; shrink mode: call_status[1] is the call's mask (agree_call_mask), which dispatch and
// every combine of the handle leave out.
//
// recv_capacity: the rows of output this rank allocated before the counts were known (num_worst_tokens, a
// handle's rows, or the host's estimate). Every rank learns every rank's capacity through the meta,
// so all agree to stop when one would overflow: kStatusWorstTooSmall for num_worst_tokens (an error), else
// kStatusOverCapacity (the host repeats the call with outputs of the exact size).
template <int kNumRanks>
__global__ void intranode_notify(const PeersTable* peers, const int* num_tokens_per_rank,
                                 const int* num_tokens_per_expert, const bool* is_token_in_rank, int num_tokens,
                                 int num_channels, int num_slots, int hidden, int num_topk, int num_scales,
                                 int num_experts, int flags, int expert_alignment, int recv_capacity, int cached,
                                 const int* invalid_ids, int* rank_prefix_matrix, int* channel_prefix_matrix,
                                 int* host_out, int* call_status, uint64_t* timeline) {
    const int me = peers->nvl_rank;
    const int t = static_cast<int>(threadIdx.x);
    const int num_local_experts = num_experts / kNumRanks;
    // Dispatch, launched programmatically behind this kernel, may take its SMs and claim its channels meanwhile;
    // it reads nothing of ours before griddepcontrol_wait, which waits for this grid to end.
    ptx::griddepcontrol_launch_dependents();
    timeline_start(timeline, kNotifyAtStart);
    if (blockIdx.x > 0) {
        if (cached) return;  // a cached handle brings its channel_prefix_matrix
        const int dst = static_cast<int>(blockIdx.x) - 1;
        channel_prefix_block(is_token_in_rank, num_tokens, kNumRanks, dst, 1, num_channels,
                             channel_prefix_matrix + dst * num_channels);
        timeline_mark(timeline, kNotifyAtEnd);
        return;
    }

    IntranodeLayout mine(nvl_ptr(peers, me, kNvlHeaderBytes), kNumRanks, num_channels, num_slots, hidden, num_topk,
                         num_scales, num_local_experts);
    const bool fits = mine.end <= peers->nvl_bytes;
    // Zero my queues' dispatch control words (start, finish, head, tail): their previous writers (the last
    // dispatch's senders and my drains) finished before any rank could pass the barrier below. Combine's words are
    // combine's own: it zeroes them channel by channel before its channel barrier.
    for (int i = t; i < 4 * num_channels * kNumRanks; i += blockDim.x) mine.dispatch_ctrl[i] = 0;
    // Shrink mode: the ranks this rank masked before the call get no counts or meta and are not waited for.
    // (Shrink mode's shared words are declared in its branches only: an unused __shared__ is still allocated, and
    // the other builds would no longer be the code they were.)
    int masked_before = 0;
    if constexpr (kShrink) {
        __shared__ int s_masked_before;
        if (t == 0) s_masked_before = mask_bits<kNumRanks>(peers);
        __syncthreads();
        masked_before = s_masked_before;
    }
    if (t < kNumRanks && !(masked_before >> t & 1)) {
        // Counts and meta sit before the rings, at offsets that depend only on R and C: safe to write even when
        // this call's rings do not fit (every buffer holds at least that much; the Buffer checks it). The meta
        // says so then, and every rank stops.
        IntranodeLayout peer(nvl_ptr(peers, t, kNvlHeaderBytes), kNumRanks, num_channels, num_slots, hidden,
                             num_topk, num_scales, num_local_experts);
        if (!cached)
            for (int i = 0; i < kNumRanks; ++i) peer.counts[me * kNumRanks + i] = num_tokens_per_rank[i];
        int32_t* meta = peer.meta + me * kMetaInts;
        meta[0] = hidden;
        meta[1] = num_experts;
        meta[2] = num_topk;
        meta[4] = recv_capacity;
        const bool invalid = invalid_ids != nullptr && *invalid_ids != 0;
        meta[3] = flags | (fits ? 0 : kMetaLayoutTooBig) | (invalid ? kMetaInvalidIds : 0);
        if constexpr (kShrink) meta[5] = masked_before;
    }
    // My per-expert counts (tokens I send to each rank's local experts) into my own buffer, read by the peers after
    // the barrier. Not into theirs: the counts sit after the rings, at an offset that moves with this call's top-k,
    // scales and slots, where a peer still in its previous combine may be reading ring slots (that combine's rows
    // from me are all sent, so my own combine could end first); only the fixed areas before the rings (counts,
    // meta) are written into peers before the barrier.
    if (!cached && fits)
        for (int i = t; i < kNumRanks * num_local_experts; i += blockDim.x)
            mine.expert_counts[i] = num_tokens_per_expert[i];
    timeline_mark(timeline, kNotifyAtWritten);
    // Pairs the count writes above with every peer's reads below (nvl_barrier_block fences and releases).
    if constexpr (kShrink)
        nvl_barrier_block_live<kNumRanks>(peers, normal_shrink_mask(peers), "intranode_notify: peer's counts and meta",
                                          0);
    else
        nvl_barrier_block<kNumRanks>(peers, "intranode_notify: peer's counts and meta");
    timeline_mark(timeline, kNotifyAtBarrier);

    __shared__ int status;
    if (t == 0) status = 0;
    // Shrink mode: a rank of the call's mask is left out of every check and count below (its meta and counts may
    // be an earlier call's): nothing arrives from it.
    int call_mask = 0;
    if constexpr (kShrink) {
        __shared__ int s_call_mask;
        if (t == 0) s_call_mask = agree_call_mask<kNumRanks>(peers, mine.meta);
        __syncthreads();
        call_mask = s_call_mask;
    }
    __syncthreads();
    if (t < kNumRanks) {
        const int32_t* theirs = mine.meta + t * kMetaInts;
        const int32_t* own = mine.meta + me * kMetaInts;
        bool same = true;
        for (int j = 0; j < kMetaCompared; ++j) {
            const int mask = j == 3 ? ~kOwnMetaBits : ~0;  // the own bits live in the flags word only
            same = same && (theirs[j] & mask) == (own[j] & mask);
        }
        if (!(call_mask >> t & 1)) {
            if (theirs[3] & kMetaLayoutTooBig) atomicOr(&status, kStatusLayoutTooBig);
            if (theirs[3] & kMetaInvalidIds) atomicOr(&status, kStatusInvalidIds);
            if (!same) atomicOr(&status, kStatusMetaMismatch);
        }
        if (!cached) {
            // Column t of the counts matrix, prefix-summed over source ranks (DeepEP's rank_prefix_matrix).
            int sum = 0;
            for (int i = 0; i < kNumRanks; ++i) {
                if (!(call_mask >> i & 1)) sum += mine.counts[i * kNumRanks + t];
                rank_prefix_matrix[i * kNumRanks + t] = sum;
            }
        }
    }
    __syncthreads();
    if (t < kNumRanks && !(call_mask >> t & 1)) {
        const int total = rank_prefix_matrix[(kNumRanks - 1) * kNumRanks + t];
        const int32_t* theirs = mine.meta + t * kMetaInts;
        if (total > theirs[4])
            atomicOr(&status, theirs[3] & kFlagWorstTokens ? kStatusWorstTooSmall : kStatusOverCapacity);
    }
    __syncthreads();
    timeline_mark(timeline, kNotifyAtChecked);
    // Where every rank's rings fit and every rank called alike, every peer's buffer has this call's layout (else
    // every rank stops, and the counts are not read); after the barrier every peer is in this notify, past its
    // previous combine, with its counts written.
    if (!cached && !(status & (kStatusLayoutTooBig | kStatusMetaMismatch)))
        for (int l = t; l < num_local_experts; l += blockDim.x) {
            int sum = 0;
            for (int i = 0; i < kNumRanks; ++i) {
                if (call_mask >> i & 1) continue;
                const IntranodeLayout theirs(nvl_ptr(peers, i, kNvlHeaderBytes), kNumRanks, num_channels, num_slots,
                                             hidden, num_topk, num_scales, num_local_experts);
                sum += ptx::ld_volatile_s32(theirs.expert_counts + me * num_local_experts + l);
            }
            host_out[2 + (kMetaInts + 1) * kNumRanks + l] =
                (sum + expert_alignment - 1) / expert_alignment * expert_alignment;
        }
    __syncthreads();
    const bool report = !(flags & kFlagCaptured) || status != 0;
    if (report && t < kNumRanks) {  // every rank's meta and received rows: what the host's messages name
        for (int j = 0; j < kMetaInts; ++j) host_out[2 + t * kMetaInts + j] = mine.meta[t * kMetaInts + j];
        host_out[2 + kMetaInts * kNumRanks + t] = rank_prefix_matrix[(kNumRanks - 1) * kNumRanks + t];
    }
    __syncthreads();
    timeline_mark(timeline, kNotifyAtPulled);
    // A refused call's dispatch ends at once, so a faster peer can start its next notify, and write that call's
    // counts and meta into this buffer, while this rank still reads this call's: the rank could then decide
    // differently from its peers (see the retry after kStatusOverCapacity) and never run the call they wait for.
    // So on refusal every rank waits here until all are past their reads (every rank computes the same status from
    // the same counts and meta). An accepted call needs no wait: a peer's next notify comes after this rank's
    // dispatch, which exchanges with it.
    if (status != 0) {
        if constexpr (kShrink)
            nvl_barrier_block_live<kNumRanks>(peers, normal_shrink_mask(peers),
                                              "intranode_notify: peers past a refused call's reads", call_mask);
        else
            nvl_barrier_block<kNumRanks>(peers, "intranode_notify: peers past a refused call's reads");
    }
    if (t == 0) {
        *call_status = status;
        if constexpr (kShrink) call_status[1] = call_mask;
        if (report) {
            host_out[1] = status;
            // Last, with a system-scope release: the host spins on this word (it starts at -1), and seeing it
            // proves every other host_out field landed (they were written before the __syncthreads above).
            ptx::st_release_sys_s32(host_out, rank_prefix_matrix[(kNumRanks - 1) * kNumRanks + me]);
        }
    }
    timeline_mark(timeline, kNotifyAtEnd);
}

// The small fields that travel with a token's row: source index, top-k ids made local to the destination (-1
// for other ranks' experts), their weights (0 there) and the FP8 scales. Each warp loads them into registers
// before it copies the row and stores them after, so their load latency hides behind the row's (loaded after the
// row, each token paid one more memory round trip). Lanes hold top-k entry `lane` and scales lane and lane + 32;
// scales past 64 (hidden > 8192) are copied directly.
struct TokenFields {
    static constexpr int kHeldScales = 64;
    int src;
    int expert;
    float weight, scale0, scale1;

    // From the caller's inputs, token t, for the rank owning experts [lo, hi).
    __device__ void load_inputs(int t, const int64_t* topk_idx, const float* topk_weights, const float* x_scales,
                                int num_topk, int num_scales, int64_t lo, int64_t hi, int lane) {
        src = t;
        expert = -1, weight = 0.0f;
        if (topk_idx != nullptr && lane < num_topk) {
            const int64_t e = topk_idx[static_cast<int64_t>(t) * num_topk + lane];
            if (e >= lo && e < hi) {
                expert = static_cast<int>(e - lo);
                if (topk_weights != nullptr) weight = topk_weights[static_cast<int64_t>(t) * num_topk + lane];
            }
        }
        const float* scales = x_scales + static_cast<int64_t>(t) * num_scales;
        scale0 = lane < num_scales ? scales[lane] : 0.0f;
        scale1 = lane + 32 < num_scales ? scales[lane + 32] : 0.0f;
    }

    // From ring slot `slot` of queue q, which a peer wrote during this kernel (volatile loads).
    __device__ void load_ring(const IntranodeLayout& ring, int q, int slot, int num_topk, int num_scales, int lane) {
        src = ptx::ld_volatile_s32(ring.src_slot(q, slot));
        if (lane < num_topk) {
            expert = ptx::ld_volatile_s32(ring.topk_idx_slot(q, slot) + lane);
            weight = ld_volatile_f32(ring.topk_weights_slot(q, slot) + lane);
        }
        const float* scales = ring.scales_slot(q, slot);
        if (lane < num_scales) scale0 = ld_volatile_f32(scales + lane);
        if (lane + 32 < num_scales) scale1 = ld_volatile_f32(scales + lane + 32);
    }

    // Into a ring slot (Expert = int) or a row of dispatch's outputs (Expert = int64_t); to_expert and to_weight
    // may be null.
    template <typename Expert>
    __device__ void store(int* to_src, Expert* to_expert, float* to_weight, float* to_scales, int num_topk,
                          int num_scales, int lane) const {
        if (lane == 0) *to_src = src;
        if (to_expert != nullptr && lane < num_topk) {
            to_expert[lane] = expert;
            if (to_weight != nullptr) to_weight[lane] = weight;
        }
        if (lane < num_scales) to_scales[lane] = scale0;
        if (lane + 32 < num_scales) to_scales[lane + 32] = scale1;
    }

    // Into row `row` of dispatch's outputs (recv_topk_idx and recv_topk_weights may be null). Returns the row's
    // scales, for the caller to copy those past kHeldScales.
    __device__ float* store_row(int64_t row, int* recv_src_idx, int64_t* recv_topk_idx, float* recv_topk_weights,
                                float* recv_x_scales, int num_topk, int num_scales, int lane) const {
        float* scales = recv_x_scales + row * num_scales;
        store(recv_src_idx + row, recv_topk_idx != nullptr ? recv_topk_idx + row * num_topk : nullptr,
              recv_topk_weights != nullptr ? recv_topk_weights + row * num_topk : nullptr, scales, num_topk,
              num_scales, lane);
        return scales;
    }
};

// Scales past the 64 TokenFields holds, from the caller's (read-only) x_scales.
__device__ __forceinline__ void copy_scales_past_held(float* to, const float* from, int num_scales, int lane) {
    for (int s = TokenFields::kHeldScales + lane; s < num_scales; s += 32) to[s] = from[s];
}

template <int kNumRanks, int kNumThreads, int kDispatchSendWarps, int kDispatchDrainWarps, int kCombineSendWarps,
          bool kDispatchPhased>
__global__ void __launch_bounds__(kNumThreads, 1)
intranode_dispatch(const PeersTable* peers, ChannelClaims* claims, const int4* x, const float* x_scales,
                   const int64_t* topk_idx, const float* topk_weights, const bool* is_token_in_rank,
                   const int* channel_prefix_matrix, const int* rank_prefix_matrix, const int* call_status,
                   int4* recv_x, float* recv_x_scales,
                   int* recv_src_idx, int64_t* recv_topk_idx, float* recv_topk_weights, int* recv_channel_offset,
                   int* send_head, int num_tokens, int hidden, int x_row_int4, int num_scales, int num_topk,
                   int num_experts, int num_channels, int num_slots, int num_max_send_tokens, int num_worst_tokens,
                   uint64_t* timeline) {
    constexpr int kNumWarps = kNumThreads / 32;
    const int channel = claim_channel(claims, peers, num_channels);  // every block claims, even to stop
    if (channel < 0) return;  // no channel for this block
    // Launched programmatically (buffer.py): the block may have started while notify still ran; from here on it
    // reads what notify wrote (the status, the prefix matrices, zeroed control words, the peers' barrier).
    ptx::griddepcontrol_wait();
    if (*call_status != 0) return;  // notify found a problem: every rank stops here, before any send
    timeline_start(timeline, kNormalAtStart, channel);
    // Shrink mode: the call's mask (notify's): nothing goes to or comes from those ranks. A group that loses its
    // peer later (masked by a wait, here or elsewhere) stops using it, the whole group at once (s_gone, read
    // between two of the group's barriers).
    int call_mask = 0;
    volatile int* s_gone = nullptr;
    if constexpr (kShrink) {  // (declared here only: an unused __shared__ is still allocated)
        __shared__ volatile int gone[kNumRanks];
        call_mask = call_status[1], s_gone = gone;
        if (threadIdx.x < kNumRanks) s_gone[threadIdx.x] = 0;
        __syncthreads();
    }

    using Roles = DispatchRoles<kNumRanks, kNumWarps, kDispatchSendWarps, kDispatchDrainWarps, kDispatchPhased>;
    const int me = peers->nvl_rank;
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    const Roles roles(warp, me);
    const int peer = roles.peer;
    const int warp_in_rank = roles.warp_in_group;
    const int group_thread = warp_in_rank * 32 + lane;
    const int num_local_experts = num_experts / kNumRanks;
    int begin, end;
    channel_range(num_tokens, num_channels, channel, begin, end);

    if (roles.role == Roles::kOwn) {
        constexpr int group_warps = Roles::kOwnWarps;
        const int64_t lo = static_cast<int64_t>(me) * num_local_experts, hi = lo + num_local_experts;
        // My own tokens go straight from x to recv_x: their rows follow the other ranks' as for any source.
        const int64_t row0 = (me > 0 ? rank_prefix_matrix[(me - 1) * kNumRanks + me] : 0) +
                             (channel > 0 ? channel_prefix_matrix[me * num_channels + channel - 1] : 0);
        if (group_thread == 0) recv_channel_offset[me * num_channels + channel] = static_cast<int>(row0);
        for (int t0 = begin, n = 0; t0 < end; t0 += 32) {
            const uint32_t window = selected_window(is_token_in_rank, t0, end, me, kNumRanks, lane);
            if (warp_in_rank == 0 && t0 + lane < end) {  // lane i: token t0 + i's receipt
                const int before = n + __popc(window & ((1u << lane) - 1));
                send_head[static_cast<int64_t>(t0 + lane) * kNumRanks + me] = window >> lane & 1 ? before : -before - 1;
            }
            for (uint32_t w = window; w != 0; w &= w - 1, ++n) {
                if (n % group_warps != warp_in_rank) continue;
                const int t = t0 + __ffs(static_cast<int>(w)) - 1;
                const int64_t row = row0 + n;
                TokenFields fields;
                fields.load_inputs(t, topk_idx, topk_weights, x_scales, num_topk, num_scales, lo, hi, lane);
                warp_copy(recv_x + row * x_row_int4, x + static_cast<int64_t>(t) * x_row_int4, x_row_int4, lane);
                float* scales = fields.store_row(row, recv_src_idx, recv_topk_idx, recv_topk_weights, recv_x_scales,
                                                 num_topk, num_scales, lane);
                copy_scales_past_held(scales, x_scales + static_cast<int64_t>(t) * num_scales, num_scales, lane);
            }
        }
        roles.sync();
        if (group_thread == 0) timeline_mark_latest(timeline, kNormalAtOwnCopied);
    }

    if (roles.role == Roles::kSend) {
        constexpr int group_warps = Roles::kSendGroupWarps > 0 ? Roles::kSendGroupWarps : 1;  // 1 rank: never sends
        if (group_thread < Roles::kPeersPerSendGroup &&
            !(call_mask >> roles.send_peer(me, group_thread) & 1)) {  // every peer this group serves learns its count
            const int to = roles.send_peer(me, group_thread);
            const IntranodeLayout dst(nvl_ptr(peers, to, kNvlHeaderBytes), kNumRanks, num_channels, 0, 0, 0, 0, 0);
            const int q = dst.queue(channel, me);
            const int start = channel > 0 ? channel_prefix_matrix[to * num_channels + channel - 1] : 0;
            const int finish = channel_prefix_matrix[to * num_channels + channel];
            // Relaxed: the receiver needs these values and nothing written before them (notify's barrier already
            // ordered the zeroed control words before this kernel), and each release would stall this thread on a
            // system-scope fence before the first chunk.
            ptx::st_relaxed_sys_s32(dst.start(q), -start - 1);
            ptx::st_relaxed_sys_s32(dst.finish(q), -finish - 1);
        }
        for (int phase = 0; phase < Roles::kPeersPerSendGroup; ++phase) {
            const int to = roles.send_peer(me, phase);
            const int to_rank = peers->rank - me + to;
            if (call_mask >> to & 1) {  // shrink mode: nothing goes to it, and its receipts say so
                for (int t = begin + group_thread; t < end; t += group_warps * 32)
                    send_head[static_cast<int64_t>(t) * kNumRanks + to] = -1;
                continue;
            }
            const int64_t lo = static_cast<int64_t>(to) * num_local_experts, hi = lo + num_local_experts;
            const IntranodeLayout dst(nvl_ptr(peers, to, kNvlHeaderBytes), kNumRanks, num_channels, num_slots, hidden,
                                      num_topk, num_scales, 0);
            const int q = dst.queue(channel, me);
            int tail = 0, head = 0;
            // Chunks start at one token a warp and double up to num_max_send_tokens: the receiver's first tail comes
            // early (a full first chunk left its drain group idle at the start), later tails come rarely (each is a
            // system-scope release that waits for the group's stores).
            int chunk_limit = min(group_warps, num_max_send_tokens);
            for (int t = begin; t < end; chunk_limit = min(2 * chunk_limit, num_max_send_tokens)) {
                const bool room = wait_for_ring_room(peers, "intranode_dispatch sender: ring space (head)",
                                                     dst.dispatch_head(q), tail, head, num_slots, num_max_send_tokens,
                                                     to_rank, channel, lane);
                if constexpr (kShrink) {  // masked since notify: the rest of its tokens stay here
                    if (!room || (group_thread == 0 && peer_gone(peers, 0, to))) s_gone[to] = 1;
                    roles.sync();
                    if (s_gone[to]) break;
                }
                uint32_t window = 0;
                for (int chunk = 0, k = 32; chunk < chunk_limit && t < end; ++t, ++k) {
                    if (k == 32) window = selected_window(is_token_in_rank, t, end, to, kNumRanks, lane), k = 0;
                    const bool selected = window >> k & 1;
                    if (group_thread == 0)
                        send_head[static_cast<int64_t>(t) * kNumRanks + to] = selected ? tail : -tail - 1;
                    if (!selected) continue;
                    const int slot = tail % num_slots;
                    if (chunk % group_warps == warp_in_rank) {
                        TokenFields fields;
                        fields.load_inputs(t, topk_idx, topk_weights, x_scales, num_topk, num_scales, lo, hi, lane);
                        warp_copy(dst.x_slot(q, slot), x + static_cast<int64_t>(t) * x_row_int4, x_row_int4, lane);
                        fields.store(dst.src_slot(q, slot),
                                     topk_idx != nullptr ? dst.topk_idx_slot(q, slot) : nullptr,
                                     dst.topk_weights_slot(q, slot), dst.scales_slot(q, slot), num_topk, num_scales,
                                     lane);
                        copy_scales_past_held(dst.scales_slot(q, slot),
                                              x_scales + static_cast<int64_t>(t) * num_scales, num_scales, lane);
                    }
                    ++tail;
                    ++chunk;
                }
                roles.sync();
                if (group_thread == 0) ptx::st_release_sys_s32(dst.dispatch_tail(q), tail);
            }
        }
        if (group_thread == 0) timeline_mark_latest(timeline, kNormalAtSent);
    }

    // Shrink mode: nothing arrives from a rank of the call's mask (notify counted none of its rows).
    if (roles.role == Roles::kDrain && (call_mask >> roles.peer & 1) && roles.warp_in_group == 0 && lane == 0) {
        const int peer = roles.peer;
        recv_channel_offset[peer * num_channels + channel] = peer > 0 ? rank_prefix_matrix[(peer - 1) * kNumRanks + me]
                                                                      : 0;
    }
    // Draining group: copy the ring that rank `peer` fills for this channel into recv_x.
    if (roles.role == Roles::kDrain && !(call_mask >> roles.peer & 1)) {
        constexpr int group_warps = Roles::kDrainWarps > 0 ? Roles::kDrainWarps : 1;
        const int peer_rank = peers->rank - me + peer;
        const IntranodeLayout mine(nvl_ptr(peers, me, kNvlHeaderBytes), kNumRanks, num_channels, num_slots, hidden,
                                   num_topk, num_scales, 0);
        const int q = mine.queue(channel, peer);
        __shared__ int s_start[kNumRanks], s_count[kNumRanks], s_tail[kNumRanks];
        if (group_thread == 0) {
            int start = 0, finish = 0;
            // (shrink mode, the peer masked meanwhile: nothing drained; its rows here stay as they were)
            if (wait_on_peer(peers, WaitSite{"intranode_dispatch receiver: channel start offset", peer_rank, channel, 0},
                             [&](int64_t& seen) {
                                 seen = start = ptx::ld_acquire_sys_s32(mine.start(q));
                                 return start == 0;
                             }))
                wait_on_peer(peers, WaitSite{"intranode_dispatch receiver: channel end offset", peer_rank, channel, 0},
                             [&](int64_t& seen) {
                                 seen = finish = ptx::ld_acquire_sys_s32(mine.finish(q));
                                 return finish == 0;
                             });
            if (kShrink && (start == 0 || finish == 0)) start = finish = -1;
            s_start[peer] = -start - 1;
            s_count[peer] = (-finish - 1) - (-start - 1);
        }
        roles.sync();
        const int count = s_count[peer];
        const int64_t row0 = (peer > 0 ? rank_prefix_matrix[(peer - 1) * kNumRanks + me] : 0) + s_start[peer];
        if (group_thread == 0) recv_channel_offset[peer * num_channels + channel] = static_cast<int>(row0);

        for (int head = 0; head < count;) {
            if (group_thread == 0) {
                int tail = head;
                if (!wait_on_peer(peers, WaitSite{"intranode_dispatch receiver: ring tail", peer_rank, channel,
                                                  head + 1},
                                  [&](int64_t& seen) {
                                      seen = tail = ptx::ld_acquire_sys_s32(mine.dispatch_tail(q));
                                      return tail == head;
                                  }))
                    tail = -1;  // shrink mode: masked meanwhile, the rest of its rows stay as they were
                s_tail[peer] = tail;
                if (head == 0) timeline_mark_latest(timeline, kNormalAtFirstTail);
                if (tail == count) timeline_mark_latest(timeline, kNormalAtLastTail);
            }
            roles.sync();
            const int tail = s_tail[peer];
            if (kShrink && tail < 0) break;
            for (int i = head + warp_in_rank; i < tail; i += group_warps) {
                const int slot = i % num_slots;
                const int64_t row = row0 + i;
                TokenFields fields;
                fields.load_ring(mine, q, slot, recv_topk_idx != nullptr ? num_topk : 0, num_scales, lane);
                warp_copy_peer_written(recv_x + row * x_row_int4, mine.x_slot(q, slot), x_row_int4, lane);
                float* scales = fields.store_row(row, recv_src_idx, recv_topk_idx, recv_topk_weights, recv_x_scales,
                                                 num_topk, num_scales, lane);
                for (int s = TokenFields::kHeldScales + lane; s < num_scales; s += 32)
                    scales[s] = ld_volatile_f32(mine.scales_slot(q, slot) + s);
            }
            // Every warp of the group has read slots [head, tail) before the sender may reuse them: their loads
            // returned (each value was stored into recv_x before the barrier), so a relaxed store is enough, as in
            // DeepEP; a release would stall the group on a system-scope fence a batch.
            roles.sync();
            head = tail;
            if (group_thread == 0) ptx::st_relaxed_sys_s32(mine.dispatch_head(q), head);
        }
        if (group_thread == 0) timeline_mark_latest(timeline, kNormalAtReceived);
    }

    // Worst-token mode: rows past what arrived are padding, with no expert and no weight.
    if (num_worst_tokens > 0) {
        const int total = rank_prefix_matrix[(kNumRanks - 1) * kNumRanks + me];
        for (int64_t row = total + static_cast<int64_t>(channel) * kNumThreads + threadIdx.x; row < num_worst_tokens;
             row += static_cast<int64_t>(num_channels) * kNumThreads) {
            recv_src_idx[row] = -1;
            for (int k = 0; k < num_topk && recv_topk_idx != nullptr; ++k) {
                recv_topk_idx[row * num_topk + k] = -1;
                if (recv_topk_weights != nullptr) recv_topk_weights[row * num_topk + k] = 0.0f;
            }
        }
    }
}

// Not inlined: the barrier's registers would otherwise stay reserved through the kernel (inlined, it made the
// kernel spill more).
template <int kNumRanks>
__device__ __noinline__ void combine_channel_barrier(const PeersTable* peers, int channel) {
    nvl_barrier_block<kNumRanks, false>(peers, "intranode_combine: the channel's block on peer to start (barrier)",
                                        channel_barrier_offset(channel), channel);
}

// combine_channel_barrier of shrink mode: the ranks of the dispatch's mask (`skip`) and those masked since are left
// out, and a peer that does not come within the shrink timeout is masked.
template <int kNumRanks>
__device__ __noinline__ void combine_channel_barrier_live(const PeersTable* peers, int channel, int skip) {
    nvl_barrier_block_live<kNumRanks, false>(peers, normal_shrink_mask(peers),
                                             "intranode_combine: the channel's block on peer to start (barrier)", skip,
                                             channel_barrier_offset(channel), channel);
}

// The reader's sum of token t's rows in bf16 (combine<kFp8 = false>), bias first, then the ranks in order.
template <int kNumRanks>
__device__ __forceinline__ void reduce_token_bf16(const int4* const* rows, const int4* bias0, const int4* bias1,
                                                  int4* out, int t, int row_int4, int lane) {
    // kUnroll int4 columns per lane at once, every rank's row loaded before any add: kUnroll x R loads in
    // flight per lane (one column at a time left each lane waiting a full memory latency per load pair).
    constexpr int kUnroll = kNumRanks >= 8 ? 1 : 8 / kNumRanks;
    for (int i0 = lane; i0 < row_int4; i0 += 32 * kUnroll) {
        int4 v[kUnroll][kNumRanks];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = i0 + 32 * u;
#pragma unroll
            for (int r = 0; r < kNumRanks; ++r)
                if (i < row_int4 && rows[r] != nullptr) v[u][r] = ptx::ld_volatile_global_v4(rows[r] + i);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = i0 + 32 * u;
            if (i >= row_int4) break;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (bias0 != nullptr) add_bf16x8(acc, bias0[static_cast<int64_t>(t) * row_int4 + i]);
            if (bias1 != nullptr) add_bf16x8(acc, bias1[static_cast<int64_t>(t) * row_int4 + i]);
#pragma unroll
            for (int r = 0; r < kNumRanks; ++r)
                if (rows[r] != nullptr) add_bf16x8(acc, v[u][r]);
            ptx::st_global_L1_no_allocate_v4(out + static_cast<int64_t>(t) * row_int4 + i, pack_bf16x8(acc));
        }
    }
}

// The reader's sum of token t's rows in FP8 (combine<kFp8 = true>): a ring slot holds the peer's row as hidden
// e4m3 bytes, then hidden / 128 float32 scales (warp_quantize_row); my own row, read from y, is quantised here
// the same way, so every row counts as its round trip whichever rank it comes from. Each lane sums its 8 channels
// in float32, bias first, then the ranks in order (add_fp8x8), as the bf16 sum does.
template <int kNumRanks>
__device__ __forceinline__ void reduce_token_fp8(const int4* const* rows, int me, const int4* bias0,
                                                 const int4* bias1, int4* out, int t, int row_int4, int lane) {
    constexpr int kUnroll = kNumRanks >= 8 ? 1 : 8 / kNumRanks;
    const int64_t row_bytes = static_cast<int64_t>(row_int4) * 8;
    for (int i0 = 0; i0 < row_int4; i0 += 32 * kUnroll) {  // the same bounds on every lane (block128_scale)
        uint2 q[kUnroll][kNumRanks];
        float scale[kUnroll][kNumRanks];
        int4 own[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = i0 + 32 * u + lane;
            own[u] = make_int4(0, 0, 0, 0);
#pragma unroll
            for (int r = 0; r < kNumRanks; ++r) {
                if (i >= row_int4 || rows[r] == nullptr) continue;
                if (r == me) {
                    own[u] = ptx::ld_volatile_global_v4(rows[r] + i);
                    continue;
                }
                const char* slot = reinterpret_cast<const char*>(rows[r]);
                q[u][r] = ptx::ld_volatile_global_v2(reinterpret_cast<const uint2*>(slot) + i);
                scale[u][r] = ld_volatile_f32(reinterpret_cast<const float*>(slot + row_bytes) + i / 16);
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = i0 + 32 * u + lane;
            const bool valid = i < row_int4;  // a whole block of 16 lanes or none (row_int4 % 16 == 0)
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (valid && bias0 != nullptr) add_bf16x8(acc, bias0[static_cast<int64_t>(t) * row_int4 + i]);
            if (valid && bias1 != nullptr) add_bf16x8(acc, bias1[static_cast<int64_t>(t) * row_int4 + i]);
#pragma unroll
            for (int r = 0; r < kNumRanks; ++r) {
                if (rows[r] == nullptr) continue;  // (the same on every lane)
                if (r == me) {
                    float f[8];
                    unpack_bf16x8(own[u], f);
                    float inverse;
                    const float s = bf16_block128_scale(f, inverse);  // every lane
                    if (valid) add_fp8x8(acc, quantize_x8(f, inverse), s);
                } else if (valid) {
                    add_fp8x8(acc, q[u][r], scale[u][r]);
                }
            }
            if (valid) ptx::st_global_L1_no_allocate_v4(out + static_cast<int64_t>(t) * row_int4 + i, pack_bf16x8_rn(acc));
        }
    }
}

// Both combines: bf16 (kFp8 false: intranode_combine, rows travel as they are) and FP8 (intranode_combine_fp8,
// rows travel quantised, scales in the slot after them: hidden + hidden / 32 bytes of the bf16 row's 2 * hidden).
template <int kNumRanks, int kNumThreads, int kCombineSendWarps, bool kFp8>
__device__ __forceinline__ void combine(const PeersTable* peers, ChannelClaims* claims, const int4* y,
                                        const float* y_topk_weights, const int4* bias0, const int4* bias1,
                                        const int* rank_prefix_matrix, const int* recv_channel_offset,
                                        const int* send_head, const int* dispatch_status, int4* out_x,
                                        float* out_topk_weights, int num_tokens, int hidden, int num_topk,
                                        int num_channels, int num_slots, int num_max_send_tokens,
                                        uint64_t* timeline) {
    constexpr int kNumWarps = kNumThreads / 32;
    // The handle's dispatch was refused (notify's status, the same on every rank): its receipts were never
    // written, so every block of every rank returns, before claiming a channel (the claims stay as they were).
    if (*dispatch_status != 0) return;
    const int channel = claim_channel(claims, peers, num_channels);
    if (channel < 0) return;
    timeline_start(timeline, kNormalAtStart, channel);
    using Roles = CombineRoles<kNumRanks, kNumWarps, kCombineSendWarps>;
    constexpr int kNumReaders = Roles::kNumReaders;
    const int me = peers->nvl_rank;
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    const int row_int4 = hidden / 8;
    const Roles roles(warp, me);
    // Shrink mode: the dispatch's mask (its notify's), and the sending groups whose peer was masked since (s_gone,
    // read between two of the group's barriers, so the whole group stops at once).
    int call_mask = 0;
    volatile int* s_gone = nullptr;
    if constexpr (kShrink) {  // (declared here only: an unused __shared__ is still allocated)
        __shared__ volatile int gone[kNumRanks];
        call_mask = dispatch_status[1], s_gone = gone;
        if (threadIdx.x < kNumRanks) s_gone[threadIdx.x] = 0;  // (the barrier's __syncthreads orders it)
    }
    __shared__ volatile int progress[kNumReaders][kNumRanks];  // next ring index reader i needs from rank r
    __shared__ volatile int retired[kNumReaders];
    for (int i = threadIdx.x; i < kNumReaders * kNumRanks; i += kNumThreads)
        progress[i / kNumRanks][i % kNumRanks] = 0;
    if (threadIdx.x < kNumReaders) retired[threadIdx.x] = 0;
    // Before any sender writes a peer's ring: the channel's block on every rank has zeroed the channel's combine
    // words in its buffer and has started, so it finished dispatch (kernels of one stream run in order) and reads
    // no ring of the channel any more. A barrier per channel, in this kernel, instead of a whole-GPU barrier in a
    // kernel of its own before it: no launch between them, and a channel waits only for its own blocks.
    // Thread r zeroes the words of queue (channel, r): rank r's sender and my coordinator use them; thread r's
    // release in the barrier is what rank r acquires, so it carries the zeros (no block-wide fence needed).
    if (static_cast<int>(threadIdx.x) < kNumRanks) {  // (the control words sit before the rings: no sizes needed)
        const IntranodeLayout words(nvl_ptr(peers, me, kNvlHeaderBytes), kNumRanks, num_channels, 0, 0, 0, 0, 0);
        const int q = words.queue(channel, static_cast<int>(threadIdx.x));
        *words.combine_head(q) = 0;
        *words.combine_tail(q) = 0;
    }
    if constexpr (kShrink)
        combine_channel_barrier_live<kNumRanks>(peers, channel, call_mask);
    else
        combine_channel_barrier<kNumRanks>(peers, channel);

    if (roles.role == Roles::kSend) {
        // Rows rank `peer` sent me on this channel, in the order they arrived: they go back in that order, so
        // the k-th lands at ring index k, which is what peer's send_head recorded. My own rows need no trip:
        // my readers take them from y.
        const int peer = roles.peer, warp_in_rank = roles.warp_in_group;
        const int group_thread = warp_in_rank * 32 + lane;
        const int peer_rank = peers->rank - me + peer;
        const IntranodeLayout dst(nvl_ptr(peers, peer, kNvlHeaderBytes), kNumRanks, num_channels, num_slots, hidden,
                                  num_topk, 0, 0);
        const int q = dst.queue(channel, me);
        const int first = recv_channel_offset[peer * num_channels + channel];
        const int last = channel + 1 < num_channels ? recv_channel_offset[peer * num_channels + channel + 1]
                                                    : rank_prefix_matrix[peer * kNumRanks + me];
        int tail = 0, head = 0;
        int chunk_limit = min(Roles::kSendPerPeer, num_max_send_tokens);  // doubling, as dispatch's senders do
        for (int row = first; row < last; chunk_limit = min(2 * chunk_limit, num_max_send_tokens)) {
            const bool room = wait_for_ring_room(peers, "intranode_combine sender: ring space (head)",
                                                 dst.combine_head(q), tail, head, num_slots, num_max_send_tokens,
                                                 peer_rank, channel, lane);
            if constexpr (kShrink) {  // in the dispatch's mask, or masked since: nothing (more) goes back to it
                if (!room || (group_thread == 0 && peer_gone(peers, call_mask, peer))) s_gone[peer] = 1;
                roles.sync();
                if (s_gone[peer]) break;
            }
            for (int chunk = 0; chunk < chunk_limit && row < last; ++chunk, ++row, ++tail) {
                if (chunk % Roles::kSendPerPeer != warp_in_rank) continue;
                const int slot = tail % num_slots;
                if constexpr (kFp8) {  // 4 words a lane in flight: more spill (the kernel is at 80 registers)
                    warp_quantize_row<4>(reinterpret_cast<char*>(dst.x_slot(q, slot)),
                                         y + static_cast<int64_t>(row) * row_int4, row_int4, lane);
                } else {
                    // Word-by-word remainder: the half batch spills this kernel's registers (80 at 768 threads).
                    warp_copy<false>(dst.x_slot(q, slot), y + static_cast<int64_t>(row) * row_int4, row_int4, lane);
                }
                if (y_topk_weights != nullptr && lane < num_topk)
                    dst.topk_weights_slot(q, slot)[lane] = y_topk_weights[static_cast<int64_t>(row) * num_topk + lane];
            }
            roles.sync();
            if (group_thread == 0) ptx::st_release_sys_s32(dst.combine_tail(q), tail);
        }
        if (group_thread == 0) timeline_mark_latest(timeline, kNormalAtSent);
        return;
    }

    // The coordinator moves the heads; reader i reduces tokens begin + i, step kNumReaders.
    const int my_first = recv_channel_offset[me * num_channels + channel];  // first row of my own in y
    const IntranodeLayout mine(nvl_ptr(peers, me, kNvlHeaderBytes), kNumRanks, num_channels, num_slots, hidden,
                               num_topk, 0, 0);
    int begin, end;
    channel_range(num_tokens, num_channels, channel, begin, end);

    if (roles.role == Roles::kCoordinator) {
        int last = 0;
        timeout_while(peers, WaitSite{"intranode_combine coordinator: readers to finish", -1, channel, 0},
                      [&](int64_t& seen) {
                          bool done = true;
                          int low = 0x7fffffff;
                          for (int w = 0; w < kNumReaders; ++w) {
                              if (retired[w]) continue;
                              done = false;
                              if (lane < kNumRanks) low = min(low, progress[w][lane]);
                          }
                          if (lane < kNumRanks && !done && low > last) {
                              last = low;
                              // Relaxed, as in DeepEP: the readers' loads of these slots have returned.
                              ptx::st_relaxed_sys_s32(mine.combine_head(mine.queue(channel, lane)), last);
                          }
                          seen = last;
                          return !done;
                      });
        return;
    }

    const int reader = roles.warp_in_group;
    for (int t = begin + reader; t < end; t += kNumReaders) {
        int expected = lane < kNumRanks ? send_head[static_cast<int64_t>(t) * kNumRanks + lane] : -1;
        if (kShrink && lane < kNumRanks && (call_mask >> lane & 1)) expected = -1;  // sent nothing: no term
        if (lane < kNumRanks && lane != me && expected >= 0) {  // my own rows are in y already
            // Shrink mode: a rank masked since (or now, by this wait) adds no term to this token and the later ones
            if (!wait_on_peer(peers, WaitSite{"intranode_combine reader: ring tail", peers->rank - me + lane, channel,
                                              expected + 1},
                              [&](int64_t& seen) {
                                  const int tail =
                                      ptx::ld_acquire_sys_s32(mine.combine_tail(mine.queue(channel, lane)));
                                  seen = tail;
                                  return tail <= expected;
                              }))
                expected = -1;
        }
        __syncwarp();
        if (lane == 0 && t + kNumReaders >= end) timeline_mark_latest(timeline, kNormalAtLastTail);
        // Where each rank's row for token t is: a ring slot for the others, y itself for my own.
        const int4* rows[kNumRanks];
#pragma unroll
        for (int r = 0; r < kNumRanks; ++r) {
            const int e = __shfl_sync(0xffffffffu, expected, r);
            rows[r] = e < 0 ? nullptr
                            : r == me ? y + static_cast<int64_t>(my_first + e) * row_int4
                                      : mine.x_slot(mine.queue(channel, r), e % num_slots);
        }
        if constexpr (kFp8)
            reduce_token_fp8<kNumRanks>(rows, me, bias0, bias1, out_x, t, row_int4, lane);
        else
            reduce_token_bf16<kNumRanks>(rows, bias0, bias1, out_x, t, row_int4, lane);
        if (out_topk_weights != nullptr) {  // the weights' places found again: held through the rows, they spilled
            float w = 0.0f;
#pragma unroll
            for (int r = 0; r < kNumRanks; ++r) {
                const int e = __shfl_sync(0xffffffffu, expected, r);
                if (e < 0 || lane >= num_topk) continue;
                if (r != me)
                    w += ld_volatile_f32(mine.topk_weights_slot(mine.queue(channel, r), e % num_slots) + lane);
                else if (y_topk_weights != nullptr)
                    w += ld_volatile_f32(y_topk_weights + static_cast<int64_t>(my_first + e) * num_topk + lane);
            }
            if (lane < num_topk) out_topk_weights[static_cast<int64_t>(t) * num_topk + lane] = w;
        }
        __syncwarp();
        if (lane < kNumRanks) progress[reader][lane] = expected >= 0 ? expected + 1 : -expected - 1;
        if (lane == 0 && t == begin + reader) timeline_mark_latest(timeline, kNormalAtFirstTail);
    }
    __syncwarp();
    if (lane == 0) {
        retired[reader] = 1;
        timeline_mark_latest(timeline, kNormalAtReceived);
    }
}

template <int kNumRanks, int kNumThreads, int kDispatchSendWarps, int kDispatchDrainWarps, int kCombineSendWarps,
          bool kDispatchPhased>
__global__ void __launch_bounds__(kNumThreads, 1)
intranode_combine(const PeersTable* peers, ChannelClaims* claims, const int4* y, const float* y_topk_weights,
                  const int4* bias0, const int4* bias1, const int* rank_prefix_matrix, const int* recv_channel_offset,
                  const int* send_head, const int* dispatch_status, int4* out_x, float* out_topk_weights,
                  int num_tokens, int hidden, int num_topk, int num_channels, int num_slots, int num_max_send_tokens,
                  uint64_t* timeline) {
    combine<kNumRanks, kNumThreads, kCombineSendWarps, false>(
        peers, claims, y, y_topk_weights, bias0, bias1, rank_prefix_matrix, recv_channel_offset, send_head,
        dispatch_status, out_x, out_topk_weights, num_tokens, hidden, num_topk, num_channels, num_slots,
        num_max_send_tokens, timeline);
}

// The FP8 combine (Buffer.combine(..., use_fp8=True)): a build of its own (IntranodeCombineFp8Spec), launched only
// with hidden % 128 == 0, on the rings, receipts and roles of the bf16 combine.
template <int kNumRanks, int kNumThreads, int kCombineSendWarps>
__global__ void __launch_bounds__(kNumThreads, 1)
intranode_combine_fp8(const PeersTable* peers, ChannelClaims* claims, const int4* y, const float* y_topk_weights,
                      const int4* bias0, const int4* bias1, const int* rank_prefix_matrix,
                      const int* recv_channel_offset, const int* send_head, const int* dispatch_status, int4* out_x,
                      float* out_topk_weights, int num_tokens, int hidden, int num_topk, int num_channels,
                      int num_slots, int num_max_send_tokens, uint64_t* timeline) {
    combine<kNumRanks, kNumThreads, kCombineSendWarps, true>(
        peers, claims, y, y_topk_weights, bias0, bias1, rank_prefix_matrix, recv_channel_offset, send_head,
        dispatch_status, out_x, out_topk_weights, num_tokens, hidden, num_topk, num_channels, num_slots,
        num_max_send_tokens, timeline);
}

}  // namespace epjit
