// Normal-mode dispatch and combine across NVLink nodes (DeepEP's internode path, with epjit's synchronisation; why
// this shape: docs/design.md, "Internode"; the layouts and the ring positions: internode.cuh).
//
//   notify    block 0: my counts and meta to every rail peer over RDMA (one put with signal each), wait for theirs,
//             fold them, hand each node peer its share over NVLink, barrier of the node, then the verdict (every
//             rank sees every rank's meta, rows and forwarded tokens, so all refuse together), the prefix sums and
//             the host record. Blocks 1..R and R+1..R+N: my tokens of each channel for each rank and each node.
//   dispatch  two blocks a channel (claimed slot s: channel s / 2). The sending block: every sender warp stages
//             the tokens of its own chunks of each node's stream (a meta message first) and puts each chunk with
//             its flag once staged (my own node: the flag set in place); receiver groups drain the NVLink rings of
//             my node peers' forwarders into recv_x. The forwarding block: a group a node peer j takes the messages
//             with bit j from every node's ring into the NVLink ring (c, me -> j) in j's buffer (j = me: into
//             recv_x); a coordinator warp returns the slowest group's progress to the writers as heads.
//   combine   the same rings backwards. The sending block: NVLink senders return the rows each node peer forwarded
//             to me, in the sub-ring of the rows' home node; readers at home sum the nodes' partials; a coordinator
//             returns heads. The forwarding block: a group a home node sums, for each token it forwarded, the rows
//             of its node in float32 and puts the bf16 partial into the RDMA ring back home, each warp its chunks.
//             internode_combine_fp8 (Buffer.combine(..., use_fp8=True)): the same, but the forwarder quantises its
//             float32 partial to e4m3 with a float32 scale a 128 channels (no bf16 rounding between) and puts that
//             (RDMA slots of fp8_combine_slot_bytes: about half the bytes), and the readers sum the dequantised
//             partials in float32; the NVLink leg carries bf16 rows as before.
//
// Memory ordering. RDMA (rdma.cuh): staging stores by a warp -> __syncwarp -> fence -> that warp's put with signal,
// which NVSHMEM delivers after the data (the build with stores: the warp's stores, then a release of the signal);
// the reader's ld.acquire.sys of the chunk flag -> its group's barrier -> the slots. Heads are signal ADDs sent once
// the reads returned. NVLink: data stores -> the group's barrier -> st.release.sys of the tail; ld.acquire.sys of
// the tail -> barrier -> the slots; heads relaxed after the reads returned (as intranode).
#include "bf16.cuh"
#include "barrier.cuh"
#include "channels.cuh"
#include "copy.cuh"
#include "fp8.cuh"
#include "internode.cuh"
#include "placement.cuh"
#include "ptx.cuh"
#include "rdma.cuh"
#include "status.cuh"
#include "wait.cuh"
#if defined(EPJIT_INTERNODE_PROFILE)  // the profile build alone stamps (see RoleStamps)
#include "role_timeline.cuh"
#endif

namespace epjit {

constexpr uint32_t kFullMask = 0xffffffffu;

// EPJIT_PROFILE (role_timeline.cuh; epjit/kernels/internode.py mirrors these enums). Notify stamps a row a block,
// dispatch and combine a row a (channel, role): timeline[channel * kInternodeRoles + role][point], tagged with both.
// A role's moments are its first warp's (first_*) or its last's (last_*, done); a slot ending in Ns sums the
// nanoseconds its waiters spun: starved, waiting for what it consumes; blocked, for room where it produces.
// Only the profile build stamps (EPJIT_INTERNODE_PROFILE; a Buffer made with EPJIT_PROFILE=1 loads it): the
// production build's stamps and wait timings are empty functions, it ignores its timeline argument and declares no
// constant or global of its own for them, so its kernels are the code they were without stamps (their SASS,
// registers and spills).
enum InternodeNotifyPoint {
    kInternodeNotifyAtStart = 0,   // the block began
    kInternodeNotifyAtSent = 1,    // block 0: my counts put to every rail peer
    kInternodeNotifyAtRail = 2,    // block 0: every rail peer's counts arrived (the RDMA leg)
    kInternodeNotifyAtFolded = 3,  // block 0: the folds written into every node peer's buffer
    kInternodeNotifyAtNode = 4,    // block 0: every node peer's fold arrived (the NVLink barrier passed)
    kInternodeNotifyAtEnd = 5,     // the block's work done (block 0: the host record written)
};
enum DispatchRole {
    kDispatchRoleRdmaSender = 0,   // the sending block's sender warps: stage my tokens, put them to each node
    kDispatchRoleNvlReceiver = 1,  // the sending block's receiver groups: node peers' NVLink rings into recv_x
    kDispatchRoleForwarder = 2,    // the forwarding block's groups: RDMA rings into the node's NVLink rings
};
enum RdmaSenderPoint {
    kRdmaSenderStart = 0,      // the block began
    kRdmaSenderFirstPut = 1,   // a warp put its first chunk (or set its flag: my own node)
    kRdmaSenderLastPut = 2,    // the last chunk put
    kRdmaSenderDone = 3,       // the last sender warp finished
    kRdmaSenderBlockedNs = 4,  // waits for RDMA ring room (and for the last call's ring to drain), a warp each
};
enum NvlReceiverPoint {
    kNvlReceiverStart = 0,      // the block began
    kNvlReceiverFirstTail = 1,  // a group saw its ring's first messages
    kNvlReceiverLastTail = 2,   // a group saw its ring's final tail
    kNvlReceiverDone = 3,       // the last group stored its rows
    kNvlReceiverStarvedNs = 4,  // waits for a tail (the node peer's forwarder), a group leader each
};
enum ForwarderPoint {
    kForwarderStart = 0,          // the block began
    kForwarderFirstChunk = 1,     // a group found its first landed RDMA chunk
    kForwarderLastForwarded = 2,  // the last batch forwarded (its NVLink tail published)
    kForwarderDone = 3,           // the last group found every stream done
    kForwarderStarvedNs = 4,      // waits for RDMA chunk flags, a group leader each
    kForwarderBlockedNs = 5,      // waits for NVLink ring room (and combine's region to drain), a group leader each
};
enum CombineRole {
    kCombineRoleNvlSender = 0,  // the sending block's NVLink senders: my rows back to the node peer that forwarded them
    kCombineRoleForwarder = 1,  // the forwarding block's groups: a node's rows summed in float32, put home
    kCombineRoleReader = 2,     // the sending block's readers: the nodes' partials summed in float32 into out_x
};
enum NvlSenderPoint {
    kNvlSenderStart = 0,       // the block began
    kNvlSenderFirstChunk = 1,  // a group published its first chunk's tail
    kNvlSenderLastChunk = 2,   // the last chunk's tail published
    kNvlSenderDone = 3,        // the last group finished
    kNvlSenderBlockedNs = 4,   // waits for sub-ring room (and dispatch's region to drain), a group leader each
};
enum CombineForwarderPoint {
    kCombineForwarderStart = 0,      // the block began
    kCombineForwarderFirstPut = 1,   // a warp put its first chunk of partials
    kCombineForwarderLastPut = 2,    // the last chunk put
    kCombineForwarderDone = 3,       // the last warp finished
    kCombineForwarderStarvedNs = 4,  // waits for node peers' rows (NVLink sub-ring tails), a warp each
    kCombineForwarderBlockedNs = 5,  // waits for RDMA ring room (and the last call's ring to drain), a warp each
};
enum ReaderPoint {
    kReaderStart = 0,       // the block began
    kReaderFirstToken = 1,  // a reader summed its first token
    kReaderLastToken = 2,   // the last token summed
    kReaderDone = 3,        // the last reader finished
    kReaderStarvedNs = 4,   // waits for RDMA chunk flags (the partials), a warp each
};

#if defined(EPJIT_INTERNODE_PROFILE)
// (An enum, not a constexpr variable: NVRTC emits each namespace-scope constant as a global, which moves the
// production build's constant bank.)
enum : bool { kInternodeProfile = true };
constexpr int kInternodeRoles = 3;  // rows a channel, in dispatch and in combine

// A role's row of this channel, timeline[channel * kInternodeRoles + role] (the production build's RoleStamps is an
// empty base of InternodeCall whose stamps are empty, so the call's layout and code stay as they were).
struct RoleStamps {
    uint64_t* timeline;  // EPJIT_PROFILE's rows (nullptr: no stamps, each stamp one branch)
    int stamp_channel;

    __device__ RoleStamps(uint64_t* timeline_, int channel_) : timeline(timeline_), stamp_channel(channel_) {}
    __device__ bool timed() const { return timeline != nullptr; }
    __device__ int row(int role) const { return stamp_channel * kInternodeRoles + role; }
    __device__ void stamp_start(int role) const {
        timeline_row_start(timeline, row(role), 0, role, stamp_channel);
    }
    __device__ void stamp_first(int role, int point) const { timeline_row_first(timeline, row(role), point); }
    __device__ void stamp_latest(int role, int point) const { timeline_row_latest(timeline, row(role), point); }
    __device__ void stamp_wait(int role, int slot_, uint64_t ns) const {
        timeline_row_add(timeline, row(role), slot_, ns);
    }
    __device__ void stamp_warp_wait(int role, int slot_, uint64_t ns, int lane) const {
        timeline_row_add_warp(timeline, row(role), slot_, ns, lane);
    }
};

// A wait of a dispatch or combine role: timeout_while, timed (its nanoseconds go to a role's row, stamp_wait).
template <typename KeepWaiting>
__device__ __forceinline__ uint64_t profiled_wait(const PeersTable* peers, const WaitSite& site,
                                                  KeepWaiting&& keep_waiting) {
    return timeout_while<true>(peers, site, keep_waiting);
}

// Notify's stamps, a row a block (each under `if constexpr (kInternodeProfile)`: even an empty call before a return
// changes the production build's code).
__device__ __forceinline__ void notify_stamp(uint64_t* timeline, int point) {
    if (point == kInternodeNotifyAtStart) timeline_start(timeline, point);
    else timeline_mark(timeline, point);
}
#else
enum : bool { kInternodeProfile = false };

struct RoleStamps {
    __device__ RoleStamps(uint64_t*, int) {}
    __device__ static constexpr bool timed() { return false; }
    __device__ void stamp_start(int) const {}
    __device__ void stamp_first(int, int) const {}
    __device__ void stamp_latest(int, int) const {}
    __device__ void stamp_wait(int, int, uint64_t) const {}
    __device__ void stamp_warp_wait(int, int, uint64_t, int) const {}
};

template <typename KeepWaiting>
__device__ __forceinline__ uint64_t profiled_wait(const PeersTable* peers, const WaitSite& site,
                                                  KeepWaiting&& keep_waiting) {
    timeout_while(peers, site, keep_waiting);
    return 0;
}

__device__ __forceinline__ void notify_stamp(uint64_t*, int) {}
#endif

// What every role of a dispatch or combine launch needs to find its rings (and, in the profile build, its rows).
struct InternodeCall : RoleStamps {
    const PeersTable* peers;
    int rank, nvl_rank, node, num_nodes, num_nvl_ranks, channel, num_channels, expert_cap;
    int hidden, num_topk;
    InternodeHeap heap;
    RdmaChunks chunks;
    int nvl_slots;
    int64_t slot;  // an NVLink slot (and an RDMA one but in the FP8 combine: heap.slot)

    // fp8_combine: the RDMA rings in the FP8 combine's slots (fp8_combine_slot_bytes).
    __device__ InternodeCall(const PeersTable* peers_, int num_nodes_, int num_nvl_ranks_, int channel_,
                             int num_channels_, int expert_cap_, int hidden_, int num_topk_, int rdma_slots,
                             int rdma_chunk, int nvl_slots_, uint64_t* timeline_, bool fp8_combine = false)
        : RoleStamps(timeline_, channel_), peers(peers_), rank(peers_->rank), nvl_rank(peers_->nvl_rank),
          node(peers_->rank / num_nvl_ranks_), num_nodes(num_nodes_), num_nvl_ranks(num_nvl_ranks_), channel(channel_),
          num_channels(num_channels_), expert_cap(expert_cap_), hidden(hidden_), num_topk(num_topk_),
          heap(peers_->sym_base, num_nodes_ * num_nvl_ranks_, num_nodes_, expert_cap_, num_channels_, rdma_slots,
               fp8_combine ? fp8_combine_slot_bytes(hidden_, num_topk_) : slot_bytes(hidden_, num_topk_)),
          chunks{rdma_chunk, rdma_slots / rdma_chunk}, nvl_slots(nvl_slots_), slot(slot_bytes(hidden_, num_topk_)) {}

    // The NVLink buffer of node peer j (mine: j = nvl_rank).
    __device__ InternodeNvl nvl(int j) const {
        return InternodeNvl(nvl_ptr(peers, j, kNvlHeaderBytes), num_nodes * num_nvl_ranks, num_nodes, expert_cap,
                            num_channels, nvl_slots, slot);
    }
    __device__ int rail_peer(int node_) const { return node_ * num_nvl_ranks + nvl_rank; }
    __device__ RdmaRing& ring(int node_) const { return heap.ring(channel, node_); }
    // Where I stage position p of the ring me -> node_ (my own node's ring is written in place).
    __device__ char* staging_slot(int node_, int64_t p) const {
        return node_ == node ? heap.recv_slot(channel, node, chunks.slot(p))
                             : heap.send_slot(channel, node_, chunks.slot(p));
    }
    __device__ char* received_slot(int node_, int64_t p) const {
        return heap.recv_slot(channel, node_, chunks.slot(p));
    }
    // Wait until the rail peer on node_ has read my ring to it up to `need` (its head_seen): room for a chunk, or
    // the whole ring drained before a call lays it out again. The nanoseconds waited (0 but in the profile build).
    __device__ uint64_t wait_ring_head(int node_, int64_t need, const char* what) const {
        const RdmaRing& r = ring(node_);
        return profiled_wait(peers, WaitSite{what, rail_peer(node_), channel, need}, [&](int64_t& seen) {
            seen = static_cast<int64_t>(ptx::ld_acquire_sys_u64(&r.head_seen));
            return seen < need;
        });
    }
};

__device__ __forceinline__ int4* msg_x(char* slot) { return reinterpret_cast<int4*>(slot + 16); }
__device__ __forceinline__ float* msg_scales(char* slot, int hidden) {
    return reinterpret_cast<float*>(slot + 16 + hidden);
}
__device__ __forceinline__ int* msg_topk_idx(char* slot, int hidden) {
    return reinterpret_cast<int*>(slot + 16 + 2 * static_cast<int64_t>(hidden));
}
__device__ __forceinline__ float* msg_topk_weights(char* slot, int hidden, int num_topk) {
    return reinterpret_cast<float*>(slot + 16 + 2 * static_cast<int64_t>(hidden) + 4 * num_topk);
}
// Where a combine message holds its weights: a bf16 slot's topk_idx place, an FP8 RDMA slot's after the scales.
template <bool kFp8>
__device__ __forceinline__ float* msg_combine_weights(char* slot, int hidden) {
    if constexpr (kFp8) return reinterpret_cast<float*>(slot + 16 + hidden + hidden / 32);
    else return reinterpret_cast<float*>(msg_topk_idx(slot, hidden));
}

// Bit j: token t goes to rank j of node m (one load of the V bools).
template <int kNumNvlRanks>
__device__ __forceinline__ uint32_t node_mask(const bool* is_token_in_rank, int64_t t, int num_ranks, int m) {
    const bool* row = is_token_in_rank + t * num_ranks + static_cast<int64_t>(m) * kNumNvlRanks;
    uint64_t word = 0;  // one aligned load where V is a power of two (the row starts at a multiple of V bytes)
    if constexpr (kNumNvlRanks == 8) word = *reinterpret_cast<const uint64_t*>(row);
    else if constexpr (kNumNvlRanks == 4) word = *reinterpret_cast<const uint32_t*>(row);
    else if constexpr (kNumNvlRanks == 2) word = *reinterpret_cast<const uint16_t*>(row);
    else
#pragma unroll
        for (int j = 0; j < kNumNvlRanks; ++j) word |= static_cast<uint64_t>(row[j] ? 1 : 0) << (8 * j);
    uint32_t mask = 0;
#pragma unroll
    for (int j = 0; j < kNumNvlRanks; ++j) mask |= static_cast<uint32_t>((word >> (8 * j)) & 1u) << j;
    return mask;
}

// Signal `delta` more positions read to the writer of ring node_ -> me (its head_seen). My own node: in place.
__device__ __forceinline__ void send_head(const InternodeCall& call, int node_, uint64_t delta) {
    uint64_t* word = &call.ring(call.node).head_seen;  // (the writer's ring words for my node: same offset)
    if (node_ == call.node)
        ptx::red_add_release_sys_u64(word, delta);
    else
        rdma_signal(call.peers, word, delta, SignalOp::kAdd, call.rail_peer(node_));
}

// Put positions [from, to) of the ring me -> node_ (one chunk, or its start) from staging to node_'s receive half,
// with the signal that sets the chunk's flag to `to`. The whole warp calls it.
__device__ __forceinline__ void put_chunk(const InternodeCall& call, int node_, int64_t from, int64_t to, int lane) {
    uint64_t* flag = &call.ring(call.node).flag[call.chunks.flag(from)];
    if (node_ == call.node) {  // written in place: the flag alone, after the writes the caller's barrier ordered
        __syncwarp();
        if (lane == 0) ptx::st_release_sys_u64(flag, static_cast<uint64_t>(to));
        return;
    }
    const int64_t s = call.chunks.slot(from);
    rdma_put_signal_warp(call.peers, call.heap.recv_slot(call.channel, call.node, s),
                         call.heap.send_slot(call.channel, node_, s), static_cast<size_t>((to - from) * call.heap.slot),
                         flag, static_cast<uint64_t>(to), SignalOp::kSet, call.rail_peer(node_), lane);
}

// A received token message (RDMA or NVLink slot, peer-written: volatile loads) into row `row` of dispatch's outputs,
// its top-k ids made local to this rank (-1 elsewhere, weight 0 there).
struct ReceivedRow {
    int4* recv_x;
    float* recv_x_scales;
    int* recv_src_idx;
    int64_t* recv_topk_idx;
    float* recv_topk_weights;
    int x_int4, num_scales, num_topk, hidden;
    int64_t lo, hi;  // my experts

    __device__ void store(char* slot, int src_token, int64_t row, int lane) const {
        warp_copy_peer_written(recv_x + row * x_int4, msg_x(slot), x_int4, lane);
        if (lane == 0) recv_src_idx[row] = src_token;
        if (recv_topk_idx != nullptr && lane < num_topk) {
            const int e = ptx::ld_volatile_s32(msg_topk_idx(slot, hidden) + lane);
            const bool mine = e >= lo && e < hi;
            recv_topk_idx[row * num_topk + lane] = mine ? e - lo : -1;
            if (recv_topk_weights != nullptr)
                recv_topk_weights[row * num_topk + lane] =
                    mine ? ld_volatile_f32(msg_topk_weights(slot, hidden, num_topk) + lane) : 0.0f;
        }
        for (int s = lane; s < num_scales; s += 32)
            recv_x_scales[row * num_scales + s] = ld_volatile_f32(msg_scales(slot, hidden) + s);
    }
};

// ------------------------------------------------------------------------------------------------------- notify

// Host-mapped ints notify fills (the call's record), read by the host once [0] is no longer -1 (written last):
//   [0] rows this rank receives   [1] status bits   [2, 2 + 8R) every rank's meta   [2 + 8R, 2 + 9R) rows each rank
//   receives   [2 + 9R, 2 + 10R) tokens each rank forwards   [2 + 10R, + L) rows per local expert, aligned
// Outputs: channel_prefix_matrix [R][C] and rdma_channel_prefix [N][C] (my tokens of channels 0..c for each rank,
// each node), recv_rank_prefix [R + 1] (rows before each source's, then my total), fwd_node_prefix [N] (tokens I
// forward from the nodes before each), saved_counts [R + N + E] (this call's counts, for a replay of its handle).
template <int kNumNodes, int kNumNvlRanks>
__global__ void internode_notify(const PeersTable* peers, const int* num_tokens_per_rank,
                                 const int* num_tokens_per_rdma_rank, const int* num_tokens_per_expert,
                                 const bool* is_token_in_rank, int num_tokens, int num_channels, int hidden,
                                 int num_topk, int num_experts, int expert_cap, int flags, int expert_alignment,
                                 int recv_capacity, int fwd_capacity, int config_tag, int layout_fits,
                                 const int* invalid_ids, int* saved_counts, int* channel_prefix_matrix,
                                 int* rdma_channel_prefix, int* recv_rank_prefix, int* fwd_node_prefix, int* host_out,
                                 int* call_status, uint64_t* timeline) {
    constexpr int N = kNumNodes, V = kNumNvlRanks, R = N * V;
    // Dispatch, launched programmatically behind this kernel, may start and claim its channels meanwhile.
    ptx::griddepcontrol_launch_dependents();
    if constexpr (kInternodeProfile) notify_stamp(timeline, kInternodeNotifyAtStart);
    if (blockIdx.x > 0) {
        const int b = static_cast<int>(blockIdx.x) - 1;
        if (b < R)
            channel_prefix_block(is_token_in_rank, num_tokens, R, b, 1, num_channels,
                                 channel_prefix_matrix + b * num_channels);
        else
            channel_prefix_block(is_token_in_rank, num_tokens, R, (b - R) * V, V, num_channels,
                                 rdma_channel_prefix + (b - R) * num_channels);
        if constexpr (kInternodeProfile) notify_stamp(timeline, kInternodeNotifyAtEnd);
        return;
    }
    const int t = static_cast<int>(threadIdx.x), num_threads = static_cast<int>(blockDim.x);
    const int i = peers->nvl_rank, node = peers->rank / V;
    const int per_node = num_experts / N, per_rank = num_experts / R;
    const InternodeHeap heap(peers->sym_base, R, N, expert_cap, 0, 0, 0);
    const uint64_t epoch = *heap.epoch + 1;  // the same on every rank: every rank makes the same calls
    const int area = static_cast<int>(epoch & 1);
    // A rail peer is at most one notify ahead (each waits for every rail peer's message), and a node peer too (the
    // barrier below), so two areas alternate safely, and a refused call needs no second barrier.

    // 1. My message to each rail peer: meta, counts to each rank and node, counts to each expert of its node.
    const int msg_ints = kInternodeMetaInts + R + N + per_node;
    const bool invalid = invalid_ids != nullptr && *invalid_ids != 0;
    const int meta[kInternodeMetaInts] = {
        hidden, num_experts, num_topk,
        flags | (layout_fits ? 0 : kMetaLayoutTooBig) | (invalid ? kMetaInvalidIds : 0),
        recv_capacity, fwd_capacity, num_tokens, config_tag};
    for (int m = 0; m < N; ++m) {
        int32_t* msg = heap.staging_area(area, m);
        for (int k = t; k < msg_ints; k += num_threads)
            msg[k] = k < kInternodeMetaInts ? meta[k]
                     : k < kInternodeMetaInts + R ? num_tokens_per_rank[k - kInternodeMetaInts]
                     : k < kInternodeMetaInts + R + N ? num_tokens_per_rdma_rank[k - kInternodeMetaInts - R]
                     : num_tokens_per_expert[m * per_node + k - kInternodeMetaInts - R - N];
    }
    if (saved_counts != nullptr) {  // what a replay of this call's handle exchanges again
        for (int k = t; k < R; k += num_threads) saved_counts[k] = num_tokens_per_rank[k];
        for (int k = t; k < N; k += num_threads) saved_counts[R + k] = num_tokens_per_rdma_rank[k];
        for (int k = t; k < num_experts; k += num_threads) saved_counts[R + N + k] = num_tokens_per_expert[k];
    }
    ptx::fence_acq_rel_sys();  // the puts below read the staging from another thread (or the NIC)
    __syncthreads();
    const int warp = t / 32, lane = t % 32;
    const int64_t msg_bytes = align_to(4LL * msg_ints, 16);
    for (int m = warp; m < N; m += num_threads / 32) {
        uint64_t* signal = heap.signals + area * kMaxNodes + node;
        if (m == node) {
            int32_t* mine = heap.notify_area(area, node);
            for (int k = lane; k < msg_ints; k += 32) mine[k] = heap.staging_area(area, node)[k];
            __syncwarp();
            if (lane == 0) ptx::st_release_sys_u64(signal, epoch);
        } else {
            rdma_put_signal_warp(peers, heap.notify_area(area, node), heap.staging_area(area, m),
                                 static_cast<size_t>(msg_bytes), signal, epoch, SignalOp::kSet, m * V + i, lane);
        }
    }
    if constexpr (kInternodeProfile) notify_stamp(timeline, kInternodeNotifyAtSent);
    // 2. The rail's messages.
    if (t < N) {
        const uint64_t* signal = heap.signals + area * kMaxNodes + t;
        timeout_while(peers, WaitSite{"internode_notify: counts from a rail peer (RDMA leg)", t * V + i, -1,
                                      static_cast<int64_t>(epoch)},
                      [&](int64_t& seen) {
                          seen = static_cast<int64_t>(ptx::ld_acquire_sys_u64(signal));
                          return seen != static_cast<int64_t>(epoch);
                      });
    }
    __syncthreads();
    if constexpr (kInternodeProfile) notify_stamp(timeline, kInternodeNotifyAtRail);
    // 3. Fold for node peer j: the rail's metas, rows for every rank, forwarded tokens of every node's rank i,
    //    what each rail peer sends j, and j's experts' counts; into area (area, i) of j's NVLink buffer.
    auto rail = [&](int n, int k) { return ptx::ld_volatile_s32(heap.notify_area(area, n) + k); };
    const int folded = 10 * N + R + per_rank;
    for (int j = 0; j < V; ++j) {
        const InternodeNvl peer(nvl_ptr(peers, j, kNvlHeaderBytes), R, N, expert_cap, 0, 0, 0);
        int32_t* out = peer.notify_area(area, i);
        for (int k = t; k < folded; k += num_threads) {
            int v = 0;
            if (k < 8 * N) {
                v = rail(k / 8, k % 8);
            } else if (k < 8 * N + R) {
                for (int n = 0; n < N; ++n) v += rail(n, kInternodeMetaInts + k - 8 * N);
            } else if (k < 9 * N + R) {
                for (int n = 0; n < N; ++n) v += rail(n, kInternodeMetaInts + R + k - 8 * N - R);
            } else if (k < 10 * N + R) {
                v = rail(k - 9 * N - R, kInternodeMetaInts + node * V + j);
            } else {
                for (int n = 0; n < N; ++n) v += rail(n, kInternodeMetaInts + R + N + j * per_rank + k - 10 * N - R);
            }
            out[k] = v;
        }
    }
    if (t == 0) {  // tokens I forward, from the nodes before each
        int sum = 0;
        for (int n = 0; n < N; ++n) {
            fwd_node_prefix[n] = sum;
            sum += rail(n, kInternodeMetaInts + R + node);
        }
    }
    if constexpr (kInternodeProfile) notify_stamp(timeline, kInternodeNotifyAtFolded);
    // 4. Every node peer's fold (nvl_barrier_block fences the writes above and acquires the peers').
    nvl_barrier_block<V>(peers, "internode_notify: node peers' counts (NVLink leg)");
    if constexpr (kInternodeProfile) notify_stamp(timeline, kInternodeNotifyAtNode);
    const InternodeNvl mine(nvl_ptr(peers, i, kNvlHeaderBytes), R, N, expert_cap, 0, 0, 0);
    auto fold = [&](int j, int k) { return ptx::ld_volatile_s32(mine.notify_area(area, j) + k); };
    auto meta_of = [&](int s, int k) { return fold(s % V, 8 * (s / V) + k); };
    __shared__ int status;
    if (t == 0) status = 0;
    __syncthreads();
    for (int s = t; s < R; s += num_threads) {
        bool same = meta_of(s, 7) == config_tag;
        for (int k = 0; k < 4; ++k) {
            const int mask = k == 3 ? ~kOwnMetaBits : ~0;
            same = same && (meta_of(s, k) & mask) == (meta[k] & mask);
        }
        const int bits = meta_of(s, 3);
        int rows = 0;
        for (int j = 0; j < V; ++j) rows += fold(j, 8 * N + s);
        const int forwarded = fold(s % V, 8 * N + R + s / V);
        const bool worst = bits & kFlagWorstTokens;
        int problem = (same ? 0 : kStatusMetaMismatch) | (bits & kMetaLayoutTooBig ? kStatusLayoutTooBig : 0) |
                      (bits & kMetaInvalidIds ? kStatusInvalidIds : 0);
        if (rows > meta_of(s, 4) || forwarded > meta_of(s, 5))
            problem |= worst ? kStatusWorstTooSmall : kStatusOverCapacity;
        if (problem) atomicOr(&status, problem);
        const bool report = !(flags & kFlagCaptured);
        if (report) {
            for (int k = 0; k < kInternodeMetaInts; ++k) host_out[2 + s * kInternodeMetaInts + k] = meta_of(s, k);
            host_out[2 + kInternodeMetaInts * R + s] = rows;
            host_out[2 + (kInternodeMetaInts + 1) * R + s] = forwarded;
        }
    }
    if (t == 0) {  // rows before each source (ranks in order), then my total
        int sum = 0;
        for (int s = 0; s < R; ++s) {
            recv_rank_prefix[s] = sum;
            sum += fold(s % V, 9 * N + R + s / V);
        }
        recv_rank_prefix[R] = sum;
    }
    for (int l = t; l < per_rank; l += num_threads) {
        int sum = 0;
        for (int j = 0; j < V; ++j) sum += fold(j, 10 * N + R + l);
        host_out[2 + (kInternodeMetaInts + 2) * R + l] = (sum + expert_alignment - 1) / expert_alignment *
                                                         expert_alignment;
    }
    __syncthreads();
    if (status != 0 && (flags & kFlagCaptured)) {  // a captured call's record is written only when it refuses
        for (int s = t; s < R; s += num_threads) {
            for (int k = 0; k < kInternodeMetaInts; ++k) host_out[2 + s * kInternodeMetaInts + k] = meta_of(s, k);
            int rows = 0;
            for (int j = 0; j < V; ++j) rows += fold(j, 8 * N + s);
            host_out[2 + kInternodeMetaInts * R + s] = rows;
            host_out[2 + (kInternodeMetaInts + 1) * R + s] = fold(s % V, 8 * N + R + s / V);
        }
        __syncthreads();
    }
    if (t == 0) {
        *call_status = status;
        *heap.epoch = epoch;
        if (!(flags & kFlagCaptured) || status != 0) {
            host_out[1] = status;
            // Last, with a system-scope release: the host spins on this word, and seeing it proves the rest landed.
            ptx::st_release_sys_s32(host_out, recv_rank_prefix[R]);
        }
    }
    if constexpr (kInternodeProfile) notify_stamp(timeline, kInternodeNotifyAtEnd);
}

// ------------------------------------------------------------------------------------------------------- dispatch

// One token message staged at a slot: header, x (and FP8 scales), global top-k ids and weights. The whole warp.
__device__ __forceinline__ void stage_token(char* slot, int t, uint32_t mask, const int4* x, const float* x_scales,
                                            const int64_t* topk_idx, const float* topk_weights, int x_int4,
                                            int num_scales, int hidden, int num_topk, int lane) {
    if (lane == 0) *reinterpret_cast<int4*>(slot) = make_int4(t, static_cast<int>(mask), kMsgToken, 0);
    warp_copy(msg_x(slot), x + static_cast<int64_t>(t) * x_int4, x_int4, lane);
    for (int s = lane; s < num_scales; s += 32)
        msg_scales(slot, hidden)[s] = x_scales[static_cast<int64_t>(t) * num_scales + s];
    if (topk_idx != nullptr && lane < num_topk) {
        msg_topk_idx(slot, hidden)[lane] = static_cast<int>(topk_idx[static_cast<int64_t>(t) * num_topk + lane]);
        msg_topk_weights(slot, hidden, num_topk)[lane] =
            topk_weights != nullptr ? topk_weights[static_cast<int64_t>(t) * num_topk + lane] : 0.0f;
    }
}

// A stream's meta message (its first): the stream's tokens, my tokens for node m in earlier channels, and for each
// rank of the node where its tokens start and how many this channel carries. The whole warp.
template <int kNumNvlRanks>
__device__ __forceinline__ void stage_meta(char* slot, int m, int channel, int num_channels,
                                           const int* channel_prefix_matrix, const int* rdma_channel_prefix,
                                           int lane) {
    const int* rdma_prefix = rdma_channel_prefix + m * num_channels;
    const int before = channel > 0 ? rdma_prefix[channel - 1] : 0;
    if (lane == 0) *reinterpret_cast<int4*>(slot) = make_int4(rdma_prefix[channel] - before, before, kMsgMeta, 0);
    if (lane < kNumNvlRanks) {
        const int* prefix = channel_prefix_matrix + (m * kNumNvlRanks + lane) * num_channels;
        const int start = channel > 0 ? prefix[channel - 1] : 0;
        reinterpret_cast<int*>(slot + 16)[lane] = start;
        reinterpret_cast<int*>(slot + 16)[kNumNvlRanks + lane] = prefix[channel] - start;
    }
}

// The senders of a sending block, each warp on its own. Every warp walks the channel's tokens 32 at a time and
// computes, by ballots, the position each token takes in each node's stream (after the stream's meta message);
// chunk q of a stream belongs to warp q % kSendWarps, which stages its messages (the first once the ring has room)
// and puts the chunk, with its flag, as soon as it staged the chunk's last message. So the puts spread over every
// sending warp (on one host NVSHMEM's peer-to-peer put is the calling warp's own copy: one warp putting every chunk
// was the channel's bottleneck), and no warp waits for another. Warp 0 writes the receipts (send_rdma_head: k, or
// -k-1 with k the index the next token for that node takes: combine's readers find their rows by them).
// No deadlock: a chunk's room needs chunks ending a window and more before it (Config: Q S >= 32 + 2 S), which
// every warp past that window has put, so the warp furthest behind can always go on.
template <int kNumNodes, int kNumNvlRanks, int kSendWarps>
__device__ void dispatch_senders(const InternodeCall& call, const int4* x, const float* x_scales,
                                 const int64_t* topk_idx, const float* topk_weights, const bool* is_token_in_rank,
                                 const int* channel_prefix_matrix, const int* rdma_channel_prefix,
                                 int* send_rdma_head, int num_tokens, int num_scales, int warp, int lane) {
    constexpr int N = kNumNodes, V = kNumNvlRanks, R = N * V;
    const int c = call.channel, C = call.num_channels, hidden = call.hidden, K = call.num_topk;
    const int64_t S = call.chunks.size;
    const int x_int4 = num_scales > 0 ? hidden / 16 : hidden / 8;
    int64_t base = 0, end = 0;  // lane m: node m's stream: its meta message's position, its end
    uint64_t drained = 0;        // (EPJIT_PROFILE: how long lane m waited for the drain)
    if (lane < N) {
        const RdmaRing& ring = call.ring(lane);
        const int64_t last_end = static_cast<int64_t>(ring.tail);
        base = call.chunks.start(last_end);
        const int* prefix = rdma_channel_prefix + lane * C;
        end = base + 1 + prefix[c] - (c > 0 ? prefix[c - 1] : 0);
        // A ring is written only once its reader has read everything before (its layout may have changed since).
        drained = call.wait_ring_head(lane, last_end, "internode_dispatch sender: the RDMA ring to drain");
    }
    __syncwarp();
    call.stamp_warp_wait(kDispatchRoleRdmaSender, kRdmaSenderBlockedNs, drained, lane);
    auto chunk_done = [&](int m, int64_t p, int64_t stream_base, int64_t stream_end) {
        if (p % S == S - 1 || p + 1 == stream_end) {
            __syncwarp();
            ptx::fence_acq_rel_gpu();  // the chunk's slots before the put (or flag) that carries them
            put_chunk(call, m, max(p / S * S, stream_base), p + 1, lane);
            if (call.timed() && lane == 0) {
                call.stamp_first(kDispatchRoleRdmaSender, kRdmaSenderFirstPut);
                call.stamp_latest(kDispatchRoleRdmaSender, kRdmaSenderLastPut);
            }
        }
    };
#pragma unroll
    for (int m = 0; m < N; ++m) {  // the streams' first chunks: the meta message (the drained ring has room)
        const int64_t base_m = __shfl_sync(kFullMask, base, m), end_m = __shfl_sync(kFullMask, end, m);
        if (base_m / S % kSendWarps != warp) continue;
        stage_meta<V>(call.staging_slot(m, base_m), m, c, C, channel_prefix_matrix, rdma_channel_prefix, lane);
        chunk_done(m, base_m, base_m, end_m);
    }
    int64_t tail = base + 1;
    int begin, stop;
    channel_range(num_tokens, C, c, begin, stop);
    for (int t0 = begin; t0 < stop; t0 += 32) {
        const int token = t0 + lane;
        uint32_t ballot[N];
#pragma unroll
        for (int m = 0; m < N; ++m)
            ballot[m] = __ballot_sync(kFullMask, token < stop && node_mask<V>(is_token_in_rank, token, R, m) != 0);
#pragma unroll
        for (int m = 0; m < N; ++m) {
            const int64_t tail_m = __shfl_sync(kFullMask, tail, m), base_m = __shfl_sync(kFullMask, base, m);
            const int64_t end_m = __shfl_sync(kFullMask, end, m);
            if (warp == 0 && token < stop) {
                const int k = static_cast<int>(tail_m - base_m - 1) + __popc(ballot[m] & ((1u << lane) - 1));
                send_rdma_head[static_cast<int64_t>(token) * N + m] = ballot[m] >> lane & 1 ? k : -k - 1;
            }
            for (uint32_t w = ballot[m]; w != 0; w &= w - 1) {
                const int l = __ffs(static_cast<int>(w)) - 1;
                const int64_t p = tail_m + __popc(ballot[m] & ((1u << l) - 1));
                if (p / S % kSendWarps != warp) continue;
                if (p % S == 0 && lane == 0) {  // the first message of my chunk: room for the whole chunk
                    const int64_t need = call.chunks.head_needed(p);
                    const uint64_t waited =
                        call.wait_ring_head(m, need, "internode_dispatch sender: RDMA ring room (head)");
                    call.stamp_wait(kDispatchRoleRdmaSender, kRdmaSenderBlockedNs, waited);
                }
                __syncwarp();
                stage_token(call.staging_slot(m, p), t0 + l, node_mask<V>(is_token_in_rank, t0 + l, R, m), x,
                            x_scales, topk_idx, topk_weights, x_int4, num_scales, hidden, K, lane);
                chunk_done(m, p, base_m, end_m);
            }
        }
#pragma unroll
        for (int m = 0; m < N; ++m)
            if (lane == m) tail += __popc(ballot[m]);
    }
    if (warp == 0 && lane < N) call.ring(lane).tail = static_cast<uint64_t>(call.chunks.start(end));
    if (call.timed() && lane == 0) call.stamp_latest(kDispatchRoleRdmaSender, kRdmaSenderDone);
}

// A receiving group of a sending block: ring (c, peer -> me) of my NVLink buffer, written by node peer `peer`'s
// forwarder, into recv_x. A meta message gives a source node's start and count (recv_channel_offset / count for
// combine); a token its row. Done when every node's meta and all the tokens they announce have come.
template <int kNumNodes, int kNumNvlRanks, int kRecvWarps>
__device__ void dispatch_receivers(const InternodeCall& call, const ReceivedRow& out, const int* recv_rank_prefix,
                                   int* recv_channel_offset, int* recv_channel_count, int group, int warp_in_group,
                                   int lane) {
    constexpr int N = kNumNodes, V = kNumNvlRanks;
    const int peer = (call.nvl_rank + 1 + group) % V, c = call.channel, C = call.num_channels;
    const int group_thread = warp_in_group * 32 + lane, barrier = 2 + group;
    const InternodeNvl mine = call.nvl(call.nvl_rank);
    NvlRing& words = mine.ring_words(c, peer);
    __shared__ int64_t s_tail[V];
    __shared__ int s_expected[V], s_metas[V];
    if (group_thread == 0) s_expected[group] = 0, s_metas[group] = 0;
    int64_t head = static_cast<int64_t>(words.dispatch_head);
    const int64_t start = head;
    ptx::bar_sync(barrier, kRecvWarps * 32);
    // The next tail (the group's leader waits for it and hands it to the group), or -1 once the ring is done.
    auto next_tail = [&]() {
        if (group_thread == 0) {
            int64_t tail = -1;
            if (s_metas[group] < N || head - start < s_expected[group]) {
                const uint64_t waited =
                    profiled_wait(call.peers, WaitSite{"internode_dispatch receiver: NVLink ring tail (forwarder)",
                                                       call.node * V + peer, c, head + 1},
                                  [&](int64_t& seen) {
                                      seen = tail = static_cast<int64_t>(ptx::ld_acquire_sys_u64(&words.dispatch_tail));
                                      return tail <= head;
                                  });
                if (call.timed()) {
                    call.stamp_wait(kDispatchRoleNvlReceiver, kNvlReceiverStarvedNs, waited);
                    if (head == start) call.stamp_first(kDispatchRoleNvlReceiver, kNvlReceiverFirstTail);
                    call.stamp_latest(kDispatchRoleNvlReceiver, kNvlReceiverLastTail);
                }
            }
            s_tail[group] = tail;
        }
        ptx::bar_sync(barrier, kRecvWarps * 32);
        return s_tail[group];
    };
    for (int64_t tail = next_tail(); tail >= 0; tail = next_tail()) {
        for (int64_t p = head + warp_in_group; p < tail; p += kRecvWarps) {
            char* slot = mine.slot_at(c, peer, p % call.nvl_slots);
            const int4 header = ptx::ld_volatile_global_v4(reinterpret_cast<const int4*>(slot));
            const int source = header.y * V + peer;
            if (header.z == kMsgMeta) {
                if (lane == 0) {
                    recv_channel_offset[source * C + c] = recv_rank_prefix[source] + header.x;
                    recv_channel_count[source * C + c] = header.w;
                    atomicAdd(&s_expected[group], header.w + 1);
                    atomicAdd(&s_metas[group], 1);
                }
            } else {
                out.store(slot, header.x, recv_rank_prefix[source] + header.w, lane);
            }
        }
        // The group's reads returned (their values are stored): a relaxed head is enough, as in intranode.
        ptx::bar_sync(barrier, kRecvWarps * 32);
        head = tail;
        if (group_thread == 0) ptx::st_relaxed_sys_u64(&words.dispatch_head, static_cast<uint64_t>(head));
    }
    if (call.timed() && group_thread == 0) call.stamp_latest(kDispatchRoleNvlReceiver, kNvlReceiverDone);
}

// What a forwarding group knows of each source node's stream this call (shared memory, written by its leader).
struct ForwardStream {
    int64_t pos;     // next position to take
    int64_t end;     // the stream's end (-1 until its meta is read)
    int64_t fwd0;    // forwarded-token index of position p: fwd0 + p
    int count;       // tokens of the stream taken for my destination so far
    int start;       // where they start among the source's tokens for my destination
};

// The leader of forwarding group j: the next batch (up to 32 messages of one source node's stream, round robin over
// the nodes with a landed chunk), handling stream metas on the way. Returns the node (-1: every stream done).
template <int kNumNodes, int kNumNvlRanks>
__device__ int next_forward_batch(const InternodeCall& call, ForwardStream* streams, volatile int64_t* stream_end,
                                  int& round_robin, int64_t& from, int64_t& to, int j, NvlRing* words,
                                  const InternodeNvl& dest, int64_t& nvl_tail, const int* fwd_node_prefix,
                                  const int* recv_rank_prefix, int* recv_channel_offset, int* recv_channel_count,
                                  int* recv_rdma_channel) {
    constexpr int N = kNumNodes, V = kNumNvlRanks;
    const int c = call.channel, C = call.num_channels;
    int found = -1, waiting = -1;
    auto scan = [&]() {
        for (int a = 0; a < N && found < 0; ++a) {
            const int n = (round_robin + a) % N;
            ForwardStream& s = streams[n];
            if (s.end >= 0 && s.pos >= s.end) continue;
            if (waiting < 0) waiting = n;
            const int64_t landed = static_cast<int64_t>(
                ptx::ld_acquire_sys_u64(&call.ring(n).flag[call.chunks.flag(s.pos)]));
            if (landed <= s.pos) continue;
            if (s.end < 0) {  // the stream's meta message
                char* slot = call.received_slot(n, s.pos);
                const int4 header = ptx::ld_volatile_global_v4(reinterpret_cast<const int4*>(slot));
                const int start = ptx::ld_volatile_s32(reinterpret_cast<int*>(slot + 16) + j);
                const int count = ptx::ld_volatile_s32(reinterpret_cast<int*>(slot + 16) + V + j);
                s.end = s.pos + 1 + header.x;
                s.fwd0 = fwd_node_prefix[n] + header.y - (s.pos + 1);
                s.start = start;
                if (j == 0) {
                    recv_rdma_channel[(n * C + c) * 2] = fwd_node_prefix[n] + header.y;
                    recv_rdma_channel[(n * C + c) * 2 + 1] = header.x;
                    stream_end[n] = s.end;
                }
                if (j == call.nvl_rank) {
                    const int source = n * V + j;
                    recv_channel_offset[source * C + c] = recv_rank_prefix[source] + start;
                    recv_channel_count[source * C + c] = count;
                } else {  // the receiver learns the node's start and count from a meta message of its own
                    const int64_t need = nvl_tail + 1 - call.nvl_slots;
                    const uint64_t waited =
                        profiled_wait(call.peers, WaitSite{"internode_dispatch forwarder: NVLink ring room (head)",
                                                           call.node * V + j, c, need},
                                      [&](int64_t& seen) {
                                          seen = static_cast<int64_t>(ptx::ld_acquire_sys_u64(&words->dispatch_head));
                                          return seen < need;
                                      });
                    call.stamp_wait(kDispatchRoleForwarder, kForwarderBlockedNs, waited);
                    char* out = dest.slot_at(c, call.nvl_rank, nvl_tail % call.nvl_slots);
                    *reinterpret_cast<int4*>(out) = make_int4(start, n, kMsgMeta, count);
                    ++nvl_tail;
                    ptx::st_release_sys_u64(&words->dispatch_tail, static_cast<uint64_t>(nvl_tail));
                }
                ++s.pos;
                if (s.pos >= landed) continue;
            }
            // Chunks that landed after this one extend the batch (each flag proves its own chunk).
            int64_t avail = landed;
            while (avail < s.end && avail < s.pos + 32) {
                const int64_t next = static_cast<int64_t>(
                    ptx::ld_acquire_sys_u64(&call.ring(n).flag[call.chunks.flag(avail)]));
                if (next <= avail) break;
                avail = next;
            }
            found = n;
            from = s.pos;
            to = min(min(avail, s.pos + 32), s.end);
            round_robin = n + 1;
        }
    };
    scan();
    while (found < 0 && waiting >= 0) {
        const int peer = call.rail_peer(waiting);
        const uint64_t waited = profiled_wait(call.peers, WaitSite{"internode_dispatch forwarder: RDMA chunk flag",
                                                                   peer, c, streams[waiting].pos + 1},
                                              [&](int64_t& seen) {
                                                  waiting = -1;
                                                  scan();
                                                  seen = waiting >= 0 ? streams[waiting].pos : -1;
                                                  return found < 0 && waiting >= 0;
                                              });
        call.stamp_wait(kDispatchRoleForwarder, kForwarderStarvedNs, waited);
    }
    return found;
}

// Forwarding group j of a forwarding block: the messages with bit j from every node's ring, in ring order, into
// the NVLink ring (c, me -> j) in j's buffer, each restamped with its position among its source's tokens for j
// (j = me: straight into recv_x). send_nvl_head[k][j]: where forwarded token k went in that ring (or -i-1, i the
// next one's): combine's receipts. progress[j][n]: what the group has taken from node n's ring.
template <int kNumNodes, int kNumNvlRanks, int kForwardWarps>
__device__ void dispatch_forwarders(const InternodeCall& call, ForwardStream (*streams)[kNumNodes],
                                    volatile int64_t (*progress)[kNumNodes], volatile int64_t* stream_end,
                                    const ReceivedRow& out, const int* fwd_node_prefix, const int* recv_rank_prefix,
                                    int* recv_channel_offset, int* recv_channel_count, int* recv_rdma_channel,
                                    int* send_nvl_head, int j, int warp_in_group, int lane) {
    constexpr int N = kNumNodes, V = kNumNvlRanks;
    const int c = call.channel, group_thread = warp_in_group * 32 + lane, barrier = 1 + j;
    const bool direct = j == call.nvl_rank;
    const InternodeNvl dest = call.nvl(j);
    NvlRing* words = &dest.ring_words(c, call.nvl_rank);
    __shared__ int s_node[V];
    __shared__ int64_t s_from[V], s_to[V], s_nvl_tail[V];
    int64_t nvl_tail = 0;
    int round_robin = 0;
    if (group_thread == 0 && !direct) {
        nvl_tail = static_cast<int64_t>(ptx::ld_volatile_u64(&words->dispatch_tail));  // mine alone to write
        for (int n = 0; n < N; ++n) {  // combine's sub-rings there drained before dispatch reuses the region
            const uint64_t waited = profiled_wait(
                call.peers, WaitSite{"internode_dispatch forwarder: the NVLink region to drain (combine)",
                                     call.node * V + j, c, n},
                [&](int64_t& seen) {
                    seen = static_cast<int64_t>(ptx::ld_acquire_sys_u64(&words->combine_head[n]));
                    return seen != static_cast<int64_t>(ptx::ld_acquire_sys_u64(&words->combine_tail[n]));
                });
            call.stamp_wait(kDispatchRoleForwarder, kForwarderBlockedNs, waited);
        }
        s_nvl_tail[j] = nvl_tail;
    }
    ptx::bar_sync(barrier, kForwardWarps * 32);
    // The next batch's source node (its leader picks it and hands it to the group), or -1 once every stream is done.
    auto next_batch = [&]() {
        if (group_thread == 0) {
            int64_t from = 0, to = 0;
            s_node[j] = next_forward_batch<N, V>(call, streams[j], stream_end, round_robin, from, to, j, words, dest,
                                                 nvl_tail, fwd_node_prefix, recv_rank_prefix, recv_channel_offset,
                                                 recv_channel_count, recv_rdma_channel);
            s_from[j] = from, s_to[j] = to, s_nvl_tail[j] = nvl_tail;
        }
        ptx::bar_sync(barrier, kForwardWarps * 32);
        return s_node[j];
    };
    for (int n = next_batch(); n >= 0; n = next_batch()) {
        const int64_t from = s_from[j], to = s_to[j], tail0 = s_nvl_tail[j];
        if (call.timed() && group_thread == 0) call.stamp_first(kDispatchRoleForwarder, kForwarderFirstChunk);
        ForwardStream& s = streams[j][n];
        const int64_t p = from + lane;
        uint32_t bit = 0;
        if (p < to) bit = ptx::ld_volatile_s32(reinterpret_cast<int*>(call.received_slot(n, p)) + 1) >> j & 1u;
        const uint32_t selected = __ballot_sync(kFullMask, bit != 0);
        const int taken = s.count, count = __popc(selected);
        if (warp_in_group == 0 && p < to) {
            const int idx = taken + __popc(selected & ((1u << lane) - 1));
            send_nvl_head[(s.fwd0 + p) * V + j] = bit ? idx : -idx - 1;
        }
        if (group_thread == 0 && !direct && count > 0) {
            const int64_t need = tail0 + count - call.nvl_slots;
            const uint64_t waited =
                profiled_wait(call.peers, WaitSite{"internode_dispatch forwarder: NVLink ring room (head)",
                                                   call.node * V + j, c, need},
                              [&](int64_t& seen) {
                                  seen = static_cast<int64_t>(ptx::ld_acquire_sys_u64(&words->dispatch_head));
                                  return seen < need;
                              });
            call.stamp_wait(kDispatchRoleForwarder, kForwarderBlockedNs, waited);
        }
        ptx::bar_sync(barrier, kForwardWarps * 32);
        int k = 0;
        for (uint32_t w = selected; w != 0; w &= w - 1, ++k) {
            if (k % kForwardWarps != warp_in_group) continue;
            char* slot = call.received_slot(n, from + __ffs(static_cast<int>(w)) - 1);
            const int src_token = ptx::ld_volatile_s32(reinterpret_cast<int*>(slot));
            const int position = s.start + taken + k;
            if (direct) {
                out.store(slot, src_token, recv_rank_prefix[n * V + j] + position, lane);
                continue;
            }
            char* to_slot = dest.slot_at(c, call.nvl_rank, (tail0 + k) % call.nvl_slots);
            if (lane == 0) *reinterpret_cast<int4*>(to_slot) = make_int4(src_token, n, kMsgToken, position);
            warp_copy_peer_written(msg_x(to_slot), msg_x(slot), out.x_int4 + (out.num_scales * 4 + 15) / 16, lane);
            for (int q = lane; q < 2 * out.num_topk; q += 32)  // ids, then weights
                msg_topk_idx(to_slot, call.hidden)[q] = ptx::ld_volatile_s32(msg_topk_idx(slot, call.hidden) + q);
        }
        ptx::bar_sync(barrier, kForwardWarps * 32);
        if (group_thread == 0) {
            s.count = taken + count;
            s.pos = to;
            if (!direct && count > 0) {
                nvl_tail = tail0 + count;
                ptx::st_release_sys_u64(&words->dispatch_tail, static_cast<uint64_t>(nvl_tail));
            }
            progress[j][n] = to;
            if (call.timed()) call.stamp_latest(kDispatchRoleForwarder, kForwarderLastForwarded);
        }
    }
    if (call.timed() && group_thread == 0) call.stamp_latest(kDispatchRoleForwarder, kForwarderDone);
}

// The coordinator of a forwarding block: for each node's ring, the slowest group's progress goes back to the
// writer as its head (signal ADDs); at the end the head jumps to the chunk-aligned end, where both ends start next.
template <int kNumNodes, int kNumNvlRanks>
__device__ void dispatch_head_coordinator(const InternodeCall& call, volatile int64_t (*progress)[kNumNodes],
                                          volatile int* retired, volatile int64_t* stream_end, int lane) {
    constexpr int N = kNumNodes, V = kNumNvlRanks;
    int64_t reported = lane < N ? static_cast<int64_t>(call.ring(lane).head) : 0;
    bool done = false;
    timeout_while(call.peers, WaitSite{"internode_dispatch head coordinator: forwarders to finish", -1, call.channel,
                                       0},
                  [&](int64_t& seen) {
                      bool all = true;
                      for (int j = 0; j < V; ++j) all = all && retired[j];
                      if (lane < N) {
                          int64_t low = all ? call.chunks.start(stream_end[lane]) : progress[0][lane];
                          for (int j = 1; j < V && !all; ++j) low = min(low, progress[j][lane]);
                          if (low > reported) {
                              send_head(call, lane, static_cast<uint64_t>(low - reported));
                              reported = low;
                          }
                      }
                      done = all;
                      seen = reported;
                      return !done;
                  });
    if (lane < N) call.ring(lane).head = static_cast<uint64_t>(reported);
}

template <int kNumNodes, int kNumNvlRanks, int kNumThreads, int kDispatchSendWarps, int kDispatchRecvWarps,
          int kForwardWarps, int kCombineSendWarps, int kCombineForwardGroups>
__global__ void __launch_bounds__(kNumThreads, 1)
internode_dispatch(const PeersTable* peers, ChannelClaims* claims, const int4* x, const float* x_scales,
                   const int64_t* topk_idx, const float* topk_weights, const bool* is_token_in_rank,
                   const int* channel_prefix_matrix, const int* rdma_channel_prefix, const int* recv_rank_prefix,
                   const int* fwd_node_prefix, const int* call_status, int4* recv_x, float* recv_x_scales,
                   int* recv_src_idx, int64_t* recv_topk_idx, float* recv_topk_weights, int* recv_channel_offset,
                   int* recv_channel_count, int* send_rdma_head, int* recv_rdma_channel, int* send_nvl_head,
                   int num_tokens, int hidden, int num_scales, int num_topk, int num_experts, int expert_cap,
                   int num_channels, int rdma_slots, int rdma_chunk, int nvl_slots, int num_worst_tokens,
                   uint64_t* timeline) {
    constexpr int N = kNumNodes, V = kNumNvlRanks, kNumWarps = kNumThreads / 32;
    static_assert(kDispatchSendWarps + (V - 1) * kDispatchRecvWarps <= kNumWarps, "sending block roles");
    static_assert(V * kForwardWarps + 1 <= kNumWarps, "forwarding block roles");
    const int claimed = claim_channel(claims, peers, 2 * num_channels);  // every block claims, even to stop
    if (claimed < 0) return;
    // Launched programmatically behind notify: what notify wrote is read only past this point.
    ptx::griddepcontrol_wait();
    if (*call_status != 0) return;  // refused: on every rank, before anything moves
    const InternodeCall call(peers, N, V, claimed / 2, num_channels, expert_cap, hidden, num_topk, rdma_slots,
                             rdma_chunk, nvl_slots, timeline);
    if (call.timed() && threadIdx.x == 0) {  // the block's roles begin
        if (claimed % 2 == 1) call.stamp_start(kDispatchRoleForwarder);
        else call.stamp_start(kDispatchRoleRdmaSender);
        if (claimed % 2 == 0 && V > 1) call.stamp_start(kDispatchRoleNvlReceiver);
    }
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    const int64_t lo = static_cast<int64_t>(peers->rank) * (num_experts / (N * V));
    const ReceivedRow out{recv_x, recv_x_scales, recv_src_idx, recv_topk_idx, recv_topk_weights,
                          num_scales > 0 ? hidden / 16 : hidden / 8, num_scales, num_topk, hidden, lo,
                          lo + num_experts / (N * V)};
    if (claimed % 2 == 0) {
        if (warp < kDispatchSendWarps) {
            dispatch_senders<N, V, kDispatchSendWarps>(call, x, x_scales, topk_idx, topk_weights, is_token_in_rank,
                                                       channel_prefix_matrix, rdma_channel_prefix, send_rdma_head,
                                                       num_tokens, num_scales, warp, lane);
        } else if (warp < kDispatchSendWarps + (V - 1) * kDispatchRecvWarps) {
            const int w = warp - kDispatchSendWarps;
            dispatch_receivers<N, V, kDispatchRecvWarps>(call, out, recv_rank_prefix, recv_channel_offset,
                                                         recv_channel_count, w / kDispatchRecvWarps,
                                                         w % kDispatchRecvWarps, lane);
        }
        // Worst-token mode: rows past what arrived are padding, with no expert and no weight.
        for (int64_t row = recv_rank_prefix[N * V] + static_cast<int64_t>(call.channel) * kNumThreads + threadIdx.x;
             row < num_worst_tokens; row += static_cast<int64_t>(num_channels) * kNumThreads) {
            recv_src_idx[row] = -1;
            for (int k = 0; k < num_topk && recv_topk_idx != nullptr; ++k) {
                recv_topk_idx[row * num_topk + k] = -1;
                if (recv_topk_weights != nullptr) recv_topk_weights[row * num_topk + k] = 0.0f;
            }
        }
        return;
    }
    __shared__ ForwardStream streams[V][N];
    __shared__ volatile int64_t progress[V][N];
    __shared__ volatile int64_t stream_end[N];
    __shared__ volatile int retired[V];
    for (int k = static_cast<int>(threadIdx.x); k < V * N; k += kNumThreads) {
        const int n = k % N;
        const int64_t base = call.chunks.start(static_cast<int64_t>(call.ring(n).head));
        streams[k / N][n] = ForwardStream{base, -1, 0, 0, 0};
        progress[k / N][n] = base;
        if (k < N) stream_end[k] = -1;
        if (k < V) retired[k] = 0;
    }
    __syncthreads();
    if (warp < V * kForwardWarps) {
        const int j = warp / kForwardWarps;
        dispatch_forwarders<N, V, kForwardWarps>(call, streams, progress, stream_end, out, fwd_node_prefix,
                                                 recv_rank_prefix, recv_channel_offset, recv_channel_count,
                                                 recv_rdma_channel, send_nvl_head, j, warp % kForwardWarps, lane);
        if (warp % kForwardWarps == 0 && lane == 0) retired[j] = 1;
    } else if (warp == V * kForwardWarps) {
        dispatch_head_coordinator<N, V>(call, progress, retired, stream_end, lane);
    }
}

// ------------------------------------------------------------------------------------------------------- combine

// An NVLink sending group: the rows my dispatch received through node peer `peer` (sources (n, peer)), in received
// order, node by node, into sub-ring n of region (c, me) in peer's buffer, chunk by chunk.
template <int kNumNodes, int kNumNvlRanks, int kSendWarps>
__device__ void combine_nvl_senders(const InternodeCall& call, const int4* y, const float* y_topk_weights,
                                    const int* recv_channel_offset, const int* recv_channel_count, int nvl_chunk,
                                    int group, int warp_in_group, int lane) {
    constexpr int N = kNumNodes, V = kNumNvlRanks;
    const int peer = (call.nvl_rank + 1 + group) % V, c = call.channel, C = call.num_channels;
    const int group_thread = warp_in_group * 32 + lane, barrier = 1 + group, row_int4 = call.hidden / 8;
    const int sub_slots = call.nvl_slots / N;
    const InternodeNvl dest = call.nvl(peer);
    NvlRing& words = dest.ring_words(c, call.nvl_rank);
    if (group_thread == 0) {  // the region's dispatch ring read to its end before its sub-rings are written
        const int64_t dispatched = static_cast<int64_t>(ptx::ld_volatile_u64(&words.dispatch_tail));
        const uint64_t waited =
            profiled_wait(call.peers, WaitSite{"internode_combine NVLink sender: the region to drain (dispatch)",
                                               call.node * V + peer, c, dispatched},
                          [&](int64_t& seen) {
                              seen = static_cast<int64_t>(ptx::ld_acquire_sys_u64(&words.dispatch_head));
                              return seen != dispatched;
                          });
        call.stamp_wait(kCombineRoleNvlSender, kNvlSenderBlockedNs, waited);
    }
    ptx::bar_sync(barrier, kSendWarps * 32);
    for (int n = 0; n < N; ++n) {
        const int source = n * V + peer;
        const int first = recv_channel_offset[source * C + c], count = recv_channel_count[source * C + c];
        int64_t tail = static_cast<int64_t>(ptx::ld_volatile_u64(&words.combine_tail[n]));  // mine alone
        for (int done = 0; done < count;) {
            const int rows = min(nvl_chunk, count - done);
            if (group_thread == 0) {
                const int64_t need = tail + rows - sub_slots;
                const uint64_t waited =
                    profiled_wait(call.peers, WaitSite{"internode_combine NVLink sender: sub-ring room (head)",
                                                       call.node * V + peer, c, need},
                                  [&](int64_t& seen) {
                                      seen = static_cast<int64_t>(ptx::ld_acquire_sys_u64(&words.combine_head[n]));
                                      return seen < need;
                                  });
                call.stamp_wait(kCombineRoleNvlSender, kNvlSenderBlockedNs, waited);
            }
            ptx::bar_sync(barrier, kSendWarps * 32);
            for (int k = warp_in_group; k < rows; k += kSendWarps) {
                char* slot = dest.slot_at(c, call.nvl_rank, n * sub_slots + (tail + k) % sub_slots);
                const int64_t row = first + done + k;
                warp_copy<false>(msg_x(slot), y + row * row_int4, row_int4, lane);
                if (y_topk_weights != nullptr && lane < call.num_topk)
                    msg_topk_idx(slot, call.hidden)[lane] =
                        __float_as_int(y_topk_weights[row * call.num_topk + lane]);  // the weights' place
            }
            ptx::bar_sync(barrier, kSendWarps * 32);
            done += rows;
            tail += rows;
            if (group_thread == 0) {
                ptx::st_release_sys_u64(&words.combine_tail[n], static_cast<uint64_t>(tail));
                if (call.timed()) {
                    call.stamp_first(kCombineRoleNvlSender, kNvlSenderFirstChunk);
                    call.stamp_latest(kCombineRoleNvlSender, kNvlSenderLastChunk);
                }
            }
        }
    }
    if (call.timed() && group_thread == 0) call.stamp_latest(kCombineRoleNvlSender, kNvlSenderDone);
}

// A reader's sum of token t's bf16 partials (internode_combine): lane m < N holds e (t's index in node m's stream,
// or < 0: none) and base (where that stream starts in the ring m -> me).
template <int kNumNodes>
__device__ __forceinline__ void sum_partials_bf16(const InternodeCall& call, int e, int64_t base, const int4* bias0,
                                                  const int4* bias1, int4* out_x, int t, int lane) {
    constexpr int N = kNumNodes;
    constexpr int kBatch = N < 8 ? N : 8;                  // nodes whose columns are loaded before any add
    constexpr int kUnroll = 8 / kBatch > 0 ? 8 / kBatch : 1;  // columns a lane loads at once
    const int row_int4 = call.hidden / 8;
    for (int i0 = lane; i0 < row_int4; i0 += 32 * kUnroll) {
        float acc[kUnroll][8];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[u][q] = 0.0f;
            const int i = i0 + 32 * u;
            if (i < row_int4 && bias0 != nullptr) add_bf16x8(acc[u], bias0[static_cast<int64_t>(t) * row_int4 + i]);
            if (i < row_int4 && bias1 != nullptr) add_bf16x8(acc[u], bias1[static_cast<int64_t>(t) * row_int4 + i]);
        }
#pragma unroll
        for (int m0 = 0; m0 < N; m0 += kBatch) {
            int4 v[kUnroll][kBatch];
            const int4* rows[kBatch];
#pragma unroll
            for (int b = 0; b < kBatch; ++b) {
                const int m = m0 + b;
                const int em = __shfl_sync(kFullMask, e, m < N ? m : 0);
                const int64_t bm = __shfl_sync(kFullMask, base, m < N ? m : 0);
                rows[b] = m < N && em >= 0 ? msg_x(call.received_slot(m, bm + em)) : nullptr;
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
#pragma unroll
                for (int b = 0; b < kBatch; ++b)
                    if (i0 + 32 * u < row_int4 && rows[b] != nullptr)
                        v[u][b] = ptx::ld_volatile_global_v4(rows[b] + i0 + 32 * u);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
#pragma unroll
                for (int b = 0; b < kBatch; ++b)
                    if (i0 + 32 * u < row_int4 && rows[b] != nullptr) add_bf16x8(acc[u], v[u][b]);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i0 + 32 * u < row_int4)
                ptx::st_global_L1_no_allocate_v4(out_x + static_cast<int64_t>(t) * row_int4 + i0 + 32 * u,
                                                 pack_bf16x8(acc[u]));
    }
}

// The same sum of FP8 partials (internode_combine_fp8): node m's slot holds e4m3 [H] at 16 and a float32 scale a
// 128 channels after them; each lane adds its 8 channels' dequantised values (add_fp8x8: float32 products) in
// float32 after the biases, the nodes ascending, as the bf16 sum does. The same bounds on every lane (shuffles).
template <int kNumNodes>
__device__ __forceinline__ void sum_partials_fp8(const InternodeCall& call, int e, int64_t base, const int4* bias0,
                                                 const int4* bias1, int4* out_x, int t, int lane) {
    constexpr int N = kNumNodes;
    constexpr int kBatch = N < 8 ? N : 8;
    constexpr int kUnroll = 8 / kBatch > 0 ? 8 / kBatch : 1;
    const int row_int4 = call.hidden / 8;
    for (int i0 = 0; i0 < row_int4; i0 += 32 * kUnroll) {
        float acc[kUnroll][8];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[u][q] = 0.0f;
            const int i = i0 + 32 * u + lane;
            if (i < row_int4 && bias0 != nullptr) add_bf16x8(acc[u], bias0[static_cast<int64_t>(t) * row_int4 + i]);
            if (i < row_int4 && bias1 != nullptr) add_bf16x8(acc[u], bias1[static_cast<int64_t>(t) * row_int4 + i]);
        }
#pragma unroll
        for (int m0 = 0; m0 < N; m0 += kBatch) {
            uint2 q[kUnroll][kBatch];
            float scale[kUnroll][kBatch];
            char* slots[kBatch];
#pragma unroll
            for (int b = 0; b < kBatch; ++b) {
                const int m = m0 + b;
                const int em = __shfl_sync(kFullMask, e, m < N ? m : 0);
                const int64_t bm = __shfl_sync(kFullMask, base, m < N ? m : 0);
                slots[b] = m < N && em >= 0 ? call.received_slot(m, bm + em) : nullptr;
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
#pragma unroll
                for (int b = 0; b < kBatch; ++b) {
                    const int i = i0 + 32 * u + lane;
                    if (i < row_int4 && slots[b] != nullptr) {
                        q[u][b] = ptx::ld_volatile_global_v2(reinterpret_cast<const uint2*>(msg_x(slots[b])) + i);
                        scale[u][b] = ld_volatile_f32(msg_scales(slots[b], call.hidden) + i / 16);
                    }
                }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
#pragma unroll
                for (int b = 0; b < kBatch; ++b)
                    if (i0 + 32 * u + lane < row_int4 && slots[b] != nullptr) add_fp8x8(acc[u], q[u][b], scale[u][b]);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = i0 + 32 * u + lane;
            if (i < row_int4)
                ptx::st_global_L1_no_allocate_v4(out_x + static_cast<int64_t>(t) * row_int4 + i, pack_bf16x8(acc[u]));
        }
    }
}

// A reader at home: token t's partials from every node it went to (chunk flags prove them), summed in float32 as
// bias 0, bias 1, then the nodes ascending, rounded to bf16 once (the reference's internode formula); kFp8: the
// partials are FP8 (internode_combine_fp8).
template <int kNumNodes, int kNumReaders, bool kFp8>
__device__ void combine_readers(const InternodeCall& call, volatile int (*progress)[kNumNodes], volatile int* retired,
                                const int* send_rdma_head, const int4* bias0, const int4* bias1, int4* out_x,
                                float* out_topk_weights, int num_tokens, int reader, int lane) {
    constexpr int N = kNumNodes;
    const int c = call.channel, K = call.num_topk;
    const int64_t base = lane < N ? call.chunks.start(static_cast<int64_t>(call.ring(lane).head)) : 0;
    int begin, end;
    channel_range(num_tokens, call.num_channels, c, begin, end);
    for (int t = begin + reader; t < end; t += kNumReaders) {
        const int e = lane < N ? send_rdma_head[static_cast<int64_t>(t) * N + lane] : -1;
        uint64_t waited = 0;
        if (lane < N && e >= 0) {
            const int64_t pos = base + e;
            const uint64_t* flag = &call.ring(lane).flag[call.chunks.flag(pos)];
            waited = profiled_wait(call.peers, WaitSite{"internode_combine reader: RDMA chunk flag",
                                                        call.rail_peer(lane), c, pos + 1},
                                   [&](int64_t& seen) {
                                       seen = static_cast<int64_t>(ptx::ld_acquire_sys_u64(flag));
                                       return seen <= pos;
                                   });
        }
        __syncwarp();
        call.stamp_warp_wait(kCombineRoleReader, kReaderStarvedNs, waited, lane);
        if constexpr (kFp8)
            sum_partials_fp8<N>(call, e, base, bias0, bias1, out_x, t, lane);
        else
            sum_partials_bf16<N>(call, e, base, bias0, bias1, out_x, t, lane);
        if (out_topk_weights != nullptr) {
            float w = 0.0f;
            for (int m = 0; m < N; ++m) {
                const int em = __shfl_sync(kFullMask, e, m);
                const int64_t bm = __shfl_sync(kFullMask, base, m);
                if (em >= 0 && lane < K)
                    w += ld_volatile_f32(msg_combine_weights<kFp8>(call.received_slot(m, bm + em), call.hidden) +
                                         lane);
            }
            if (lane < K) out_topk_weights[static_cast<int64_t>(t) * K + lane] = w;
        }
        __syncwarp();
        if (lane < N) progress[reader][lane] = e >= 0 ? e + 1 : -e - 1;
        if (call.timed() && lane == 0) {
            if (t == begin + reader) call.stamp_first(kCombineRoleReader, kReaderFirstToken);
            if (t + kNumReaders >= end) call.stamp_latest(kCombineRoleReader, kReaderLastToken);
        }
    }
    __syncwarp();
    if (lane == 0) retired[reader] = 1;
    if (call.timed() && lane == 0) call.stamp_latest(kCombineRoleReader, kReaderDone);
}

// The coordinator of a combine sending block: the slowest active reader's position in each node's ring goes back
// to that node's forwarder as its head; at the end the head jumps to the chunk-aligned end.
template <int kNumNodes, int kNumReaders>
__device__ void combine_head_coordinator(const InternodeCall& call, volatile int (*progress)[kNumNodes],
                                         volatile int* retired, const int* rdma_channel_prefix, int lane) {
    constexpr int N = kNumNodes;
    const int c = call.channel, C = call.num_channels;
    int64_t reported = 0, base = 0, final_head = 0;
    if (lane < N) {
        reported = static_cast<int64_t>(call.ring(lane).head);
        base = call.chunks.start(reported);
        const int* prefix = rdma_channel_prefix + lane * C;
        final_head = call.chunks.start(base + prefix[c] - (c > 0 ? prefix[c - 1] : 0));
    }
    timeout_while(call.peers, WaitSite{"internode_combine head coordinator: readers to finish", -1, c, 0},
                  [&](int64_t& seen) {
                      bool all = true;
                      int low = 0x7fffffff;
                      for (int r = 0; r < kNumReaders; ++r) {
                          if (retired[r]) continue;
                          all = false;
                          if (lane < N) low = min(low, progress[r][lane]);
                      }
                      if (lane < N) {
                          const int64_t head = all ? final_head : base + low;
                          if (head > reported) {
                              send_head(call, lane, static_cast<uint64_t>(head - reported));
                              reported = head;
                          }
                      }
                      seen = reported;
                      return !all;
                  });
    if (lane < N) call.ring(lane).head = static_cast<uint64_t>(final_head);
}

// The FP8 partial (internode_combine_fp8) of the rows `rows` (nullptr: none from that rank), into slot `out`: each
// lane sums its 8 channels of every row in float32, the ranks ascending (as the bf16 partial), then its 16-lane block
// of 128 channels takes the scale amax / 448 and the lane stores its 8 e4m3 (as the reference's
// per_token_cast_to_fp8 of the float32 partial); the scales follow the H e4m3 bytes. The same bounds on every lane
// (block128_scale shuffles); hidden % 128 == 0, so a 16-lane block is wholly in the row or wholly out.
template <int kNumNvlRanks>
__device__ __forceinline__ void quantize_partial(const int4* const* rows, char* out, int hidden, int lane) {
    const int row_int4 = hidden / 8;
    uint2* q = reinterpret_cast<uint2*>(msg_x(out));
    float* scales = msg_scales(out, hidden);
    constexpr int kUnroll = kNumNvlRanks < 8 ? 8 / kNumNvlRanks : 1;  // columns a lane loads at once (the bf16 sum's)
    for (int i0 = 0; i0 < row_int4; i0 += 32 * kUnroll) {
        int4 v[kUnroll][kNumNvlRanks];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
            for (int j = 0; j < kNumNvlRanks; ++j)
                if (i0 + 32 * u + lane < row_int4 && rows[j] != nullptr)
                    v[u][j] = ptx::ld_volatile_global_v4(rows[j] + i0 + 32 * u + lane);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = i0 + 32 * u + lane;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
            for (int j = 0; j < kNumNvlRanks; ++j)
                if (i < row_int4 && rows[j] != nullptr) add_bf16x8(acc, v[u][j]);
            const float scale = block128_scale(acc);  // every lane
            if (i < row_int4) {
                q[i] = quantize_x8(acc, __fdiv_rn(1.0f, scale));
                if (i % 16 == 0) scales[i / 16] = scale;
            }
        }
    }
}

// One forwarded token's partial: its rows from my node (mine from y, the others' from sub-ring n of their regions in
// my buffer, where send_nvl_head's receipts say) summed in float32 by rank, rounded to bf16 (kFp8: quantised to
// e4m3 with a float32 scale a 128 channels, no bf16 rounding between), and their weights' sum, into staging slot
// `out`. The whole warp; lane j < V holds the receipt of rank j and where its sub-ring starts.
template <int kNumNodes, int kNumNvlRanks, bool kFp8>
__device__ void forward_partial(const InternodeCall& call, int n, char* out, const int4* y, const float* y_topk_weights,
                                int own_rows, int receipt, int64_t nvl_base, int lane) {
    constexpr int N = kNumNodes, V = kNumNvlRanks;
    const int c = call.channel, me = call.nvl_rank, K = call.num_topk;
    const int row_int4 = call.hidden / 8, sub_slots = call.nvl_slots / N;
    const InternodeNvl mine = call.nvl(me);
    uint64_t waited = 0;
    if (lane < V && lane != me && receipt >= 0) {
        const uint64_t* tail = &mine.ring_words(c, lane).combine_tail[n];
        const int64_t need = nvl_base + receipt + 1;
        waited = profiled_wait(call.peers, WaitSite{"internode_combine forwarder: NVLink sub-ring tail",
                                                    call.node * V + lane, c, need},
                               [&](int64_t& seen) {
                                   seen = static_cast<int64_t>(ptx::ld_acquire_sys_u64(tail));
                                   return seen < need;
                               });
    }
    __syncwarp();
    call.stamp_warp_wait(kCombineRoleForwarder, kCombineForwarderStarvedNs, waited, lane);
    const int4* rows[V];
    const float* weights[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int r = __shfl_sync(kFullMask, receipt, j);
        const int64_t b = __shfl_sync(kFullMask, nvl_base, j);
        if (r < 0) {
            rows[j] = nullptr, weights[j] = nullptr;
        } else if (j == me) {
            rows[j] = y + static_cast<int64_t>(own_rows + r) * row_int4;
            weights[j] = y_topk_weights != nullptr ? y_topk_weights + static_cast<int64_t>(own_rows + r) * K : nullptr;
        } else {
            char* slot = mine.slot_at(c, j, n * sub_slots + (b + r) % sub_slots);
            rows[j] = msg_x(slot);
            weights[j] = reinterpret_cast<const float*>(msg_topk_idx(slot, call.hidden));
        }
    }
    if constexpr (kFp8) {
        quantize_partial<V>(rows, out, call.hidden, lane);
    } else {
        // 8 / V columns a lane at once (about 8 loads in flight; V on nodes of 8 or more): one at a time
        // kept only V loads in flight and waited a load's latency for each (2 x 1: 961 -> 748 us at 4096 tokens).
        // Each column's sum is still the ranks ascending.
        constexpr int kUnroll = V < 8 ? 8 / V : 1;
        for (int i0 = lane; i0 < row_int4; i0 += 32 * kUnroll) {
            int4 v[kUnroll][V];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
#pragma unroll
                for (int j = 0; j < V; ++j)
                    if (i0 + 32 * u < row_int4 && rows[j] != nullptr)
                        v[u][j] = ptx::ld_volatile_global_v4(rows[j] + i0 + 32 * u);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
                for (int j = 0; j < V; ++j)
                    if (i0 + 32 * u < row_int4 && rows[j] != nullptr) add_bf16x8(acc, v[u][j]);
                if (i0 + 32 * u < row_int4) msg_x(out)[i0 + 32 * u] = pack_bf16x8(acc);
            }
        }
    }
    if (y_topk_weights != nullptr && lane < K) {
        float w = 0.0f;
#pragma unroll
        for (int j = 0; j < V; ++j)
            if (weights[j] != nullptr) w += ld_volatile_f32(weights[j] + lane);
        msg_combine_weights<kFp8>(out, call.hidden)[lane] = w;
    }
}

// Forwarding group for home node n: each token this rank forwarded from n on this channel, in RDMA order, as a
// partial (forward_partial) into the ring back to n. Chunk q of the stream belongs to warp q % warps of the group,
// which fills it and puts it (puts spread over the group's warps, as dispatch's senders do); after each round of
// `warps` chunks the group meets, and the sub-rings' heads move past what the round consumed. kFp8: FP8 partials.
template <int kNumNodes, int kNumNvlRanks, bool kFp8>
__device__ void combine_forward_node(const InternodeCall& call, int n, const int4* y, const float* y_topk_weights,
                                     const int* recv_channel_offset, const int* recv_rdma_channel,
                                     const int* send_nvl_head, int warps, int barrier, int warp_in_group, int lane) {
    constexpr int V = kNumNvlRanks;
    const int c = call.channel, C = call.num_channels, me = call.nvl_rank;
    const int64_t S = call.chunks.size;
    const int first = recv_rdma_channel[(n * C + c) * 2], count = recv_rdma_channel[(n * C + c) * 2 + 1];
    const int own_rows = recv_channel_offset[(n * V + me) * C + c];
    const InternodeNvl mine = call.nvl(me);
    RdmaRing& ring = call.ring(n);
    const int64_t last_end = static_cast<int64_t>(ring.tail), base = call.chunks.start(last_end);
    // lane j: where sub-ring n of j's region in my buffer starts this call (mine alone to move)
    const int64_t nvl_base = lane < V ? static_cast<int64_t>(mine.ring_words(c, lane).combine_head[n]) : 0;
    if (warp_in_group == 0 && lane == 0) {
        const uint64_t waited =
            call.wait_ring_head(n, last_end, "internode_combine forwarder: the RDMA ring to drain");
        call.stamp_wait(kCombineRoleForwarder, kCombineForwarderBlockedNs, waited);
    }
    ptx::bar_sync(barrier, warps * 32);
    for (int64_t round = 0; round * warps * S < count; ++round) {
        const int64_t k0 = (round * warps + warp_in_group) * S, k1 = min(k0 + S, static_cast<int64_t>(count));
        if (k0 < count) {
            if (lane == 0) {
                const int64_t need = call.chunks.head_needed(base + k0);
                const uint64_t waited =
                    call.wait_ring_head(n, need, "internode_combine forwarder: RDMA ring room (head)");
                call.stamp_wait(kCombineRoleForwarder, kCombineForwarderBlockedNs, waited);
            }
            __syncwarp();
            for (int64_t k = k0; k < k1; ++k) {
                const int receipt = lane < V ? send_nvl_head[(first + k) * V + lane] : -1;
                forward_partial<kNumNodes, V, kFp8>(call, n, call.staging_slot(n, base + k), y, y_topk_weights,
                                                    own_rows, receipt, nvl_base, lane);
            }
            __syncwarp();
            ptx::fence_acq_rel_gpu();  // the chunk's slots before the put (or flag) that carries them
            put_chunk(call, n, base + k0, base + k1, lane);
            if (call.timed() && lane == 0) {
                call.stamp_first(kCombineRoleForwarder, kCombineForwarderFirstPut);
                call.stamp_latest(kCombineRoleForwarder, kCombineForwarderLastPut);
            }
        }
        ptx::bar_sync(barrier, warps * 32);
        if (warp_in_group == 0) {  // the sub-rings' heads: what the round's last token consumed of each
            const int64_t last = min((round + 1) * warps * S, static_cast<int64_t>(count)) - 1;
            const int receipt = lane < V ? send_nvl_head[(first + last) * V + lane] : 0;
            if (lane < V && lane != me) {
                const int64_t consumed = receipt >= 0 ? receipt + 1 : -receipt - 1;
                ptx::st_relaxed_sys_u64(&mine.ring_words(c, lane).combine_head[n],
                                        static_cast<uint64_t>(nvl_base + consumed));
            }
        }
    }
    if (warp_in_group == 0 && lane == 0) ring.tail = static_cast<uint64_t>(call.chunks.start(base + count));
}

// Both combines: bf16 (kFp8 false: internode_combine) and FP8 partials on the RDMA leg (internode_combine_fp8).
template <int kNumNodes, int kNumNvlRanks, int kNumThreads, int kCombineSendWarps, int kCombineForwardGroups,
          bool kFp8>
__device__ __forceinline__ void combine(const PeersTable* peers, ChannelClaims* claims, const int4* y,
                                        const float* y_topk_weights, const int4* bias0, const int4* bias1,
                                        const int* rdma_channel_prefix, const int* recv_channel_offset,
                                        const int* recv_channel_count, const int* send_rdma_head,
                                        const int* recv_rdma_channel, const int* send_nvl_head,
                                        const int* dispatch_status, int4* out_x, float* out_topk_weights,
                                        int num_tokens, int hidden, int num_topk, int expert_cap, int num_channels,
                                        int rdma_slots, int rdma_chunk, int nvl_slots, int nvl_chunk,
                                        uint64_t* timeline) {
    constexpr int N = kNumNodes, V = kNumNvlRanks, kNumWarps = kNumThreads / 32;
    constexpr int kSenders = (V - 1) * kCombineSendWarps, kReaders = kNumWarps - kSenders - 1;
    constexpr int kGroupWarps = kNumWarps / kCombineForwardGroups;
    static_assert(kReaders >= 1 && kCombineForwardGroups <= 15 && kGroupWarps >= 1, "combine roles");
    // The handle's dispatch was refused: its receipts were never written; every block of every rank returns.
    if (*dispatch_status != 0) return;
    const int claimed = claim_channel(claims, peers, 2 * num_channels);
    if (claimed < 0) return;
    const InternodeCall call(peers, N, V, claimed / 2, num_channels, expert_cap, hidden, num_topk, rdma_slots,
                             rdma_chunk, nvl_slots, timeline, kFp8);
    if (call.timed() && threadIdx.x == 0) {  // the block's roles begin
        if (claimed % 2 == 1) call.stamp_start(kCombineRoleForwarder);
        else call.stamp_start(kCombineRoleReader);
        if (claimed % 2 == 0 && V > 1) call.stamp_start(kCombineRoleNvlSender);
    }
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    if (claimed % 2 == 0) {
        __shared__ volatile int progress[kReaders][N];
        __shared__ volatile int retired[kReaders];
        for (int k = static_cast<int>(threadIdx.x); k < kReaders * N; k += kNumThreads) progress[k / N][k % N] = 0;
        if (threadIdx.x < kReaders) retired[threadIdx.x] = 0;
        __syncthreads();
        if (warp < kSenders) {
            combine_nvl_senders<N, V, kCombineSendWarps>(call, y, y_topk_weights, recv_channel_offset,
                                                         recv_channel_count, nvl_chunk, warp / kCombineSendWarps,
                                                         warp % kCombineSendWarps, lane);
        } else if (warp == kSenders) {
            combine_head_coordinator<N, kReaders>(call, progress, retired, rdma_channel_prefix, lane);
        } else {
            combine_readers<N, kReaders, kFp8>(call, progress, retired, send_rdma_head, bias0, bias1, out_x,
                                               out_topk_weights, num_tokens, warp - kSenders - 1, lane);
        }
        return;
    }
    const int group = warp / kGroupWarps;
    if (group >= kCombineForwardGroups) return;
    // Home nodes in increasing order, as every NVLink sender sends them: a group never waits for a sub-ring whose
    // sender waits for another sub-ring of the same group.
    for (int n = group; n < N; n += kCombineForwardGroups)
        combine_forward_node<N, V, kFp8>(call, n, y, y_topk_weights, recv_channel_offset, recv_rdma_channel,
                                         send_nvl_head, kGroupWarps, 1 + group, warp % kGroupWarps, lane);
    if (call.timed() && lane == 0) call.stamp_latest(kCombineRoleForwarder, kCombineForwarderDone);
}

template <int kNumNodes, int kNumNvlRanks, int kNumThreads, int kDispatchSendWarps, int kDispatchRecvWarps,
          int kForwardWarps, int kCombineSendWarps, int kCombineForwardGroups>
__global__ void __launch_bounds__(kNumThreads, 1)
internode_combine(const PeersTable* peers, ChannelClaims* claims, const int4* y, const float* y_topk_weights,
                  const int4* bias0, const int4* bias1, const int* rdma_channel_prefix, const int* recv_channel_offset,
                  const int* recv_channel_count, const int* send_rdma_head, const int* recv_rdma_channel,
                  const int* send_nvl_head, const int* dispatch_status, int4* out_x, float* out_topk_weights,
                  int num_tokens, int hidden, int num_topk, int expert_cap, int num_channels, int rdma_slots,
                  int rdma_chunk, int nvl_slots, int nvl_chunk, uint64_t* timeline) {
    combine<kNumNodes, kNumNvlRanks, kNumThreads, kCombineSendWarps, kCombineForwardGroups, false>(
        peers, claims, y, y_topk_weights, bias0, bias1, rdma_channel_prefix, recv_channel_offset, recv_channel_count,
        send_rdma_head, recv_rdma_channel, send_nvl_head, dispatch_status, out_x, out_topk_weights, num_tokens, hidden,
        num_topk, expert_cap, num_channels, rdma_slots, rdma_chunk, nvl_slots, nvl_chunk, timeline);
}

// The FP8 combine (Buffer.combine(..., use_fp8=True) across nodes): a build of its own (InternodeCombineFp8Spec),
// launched only with hidden % 128 == 0, on the bf16 combine's rings, receipts and roles; its RDMA slots are
// fp8_combine_slot_bytes.
template <int kNumNodes, int kNumNvlRanks, int kNumThreads, int kCombineSendWarps, int kCombineForwardGroups>
__global__ void __launch_bounds__(kNumThreads, 1)
internode_combine_fp8(const PeersTable* peers, ChannelClaims* claims, const int4* y, const float* y_topk_weights,
                      const int4* bias0, const int4* bias1, const int* rdma_channel_prefix,
                      const int* recv_channel_offset, const int* recv_channel_count, const int* send_rdma_head,
                      const int* recv_rdma_channel, const int* send_nvl_head, const int* dispatch_status, int4* out_x,
                      float* out_topk_weights, int num_tokens, int hidden, int num_topk, int expert_cap,
                      int num_channels, int rdma_slots, int rdma_chunk, int nvl_slots, int nvl_chunk,
                      uint64_t* timeline) {
    combine<kNumNodes, kNumNvlRanks, kNumThreads, kCombineSendWarps, kCombineForwardGroups, true>(
        peers, claims, y, y_topk_weights, bias0, bias1, rdma_channel_prefix, recv_channel_offset, recv_channel_count,
        send_rdma_head, recv_rdma_channel, send_nvl_head, dispatch_status, out_x, out_topk_weights, num_tokens, hidden,
        num_topk, expert_cap, num_channels, rdma_slots, rdma_chunk, nvl_slots, nvl_chunk, timeline);
}

}  // namespace epjit
