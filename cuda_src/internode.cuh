// Layouts of normal mode across NVLink nodes (internode.cu; why this shape: docs/design.md, "Internode"; the host
// mirror is epjit/kernels/internode.py, held to these numbers by a CPU test; docs/layouts.md draws them).
//
// Topology: V = num_nvl_ranks consecutive ranks form a node, N = R / V nodes; rank r is (node r / V, local r % V).
// Rails: (n, i) reaches over RDMA only (m, i) of every other node m: each RDMA ring joins two ranks of one rail.
//
// Positions. Every ring counts the messages it ever carried, from the Buffer's creation: a writer's tail and a
// reader's head only grow, across calls and across dispatch and combine (which use the same rings backwards), so no
// kernel clears a control word and no call needs a barrier past notify's. Each end keeps where its last stream
// ended (RdmaRing::tail / head, NvlRing's words) and starts the next one there.
//
// RDMA rings hold T slots as Q = T / S chunks of S slots (S = rdma_chunk_send): position p sits in chunk p / S, at
// slot (p / S % Q) * S + p % S, so a chunk is contiguous and travels in one put. A stream starts at a chunk
// boundary. The writer puts a chunk with a signal that SETs flag[p / S % kChunkFlags] (at the reader) to the
// position after the chunk: a flag proves its own chunk, whatever order puts land in (NVSHMEM orders two puts to
// one PE only under a fence). A stale flag holds at most where the last stream ended, so it never passes for a new
// chunk; and a writer reuses a flag only after the reader's head passed the chunk that last set it, because
// Q <= kChunkFlags and chunk q is written only once the head reached (q + 1 - Q) S. Heads travel back as signal
// ADDs into the writer's RdmaRing::head_seen (their order does not matter).
//
// Symmetric heap (InternodeHeap; every rank the same offsets):
//   signals    u64 [2][kMaxNodes]              notify: area a's message from node n has arrived (SET to the epoch)
//   epoch      u64 (+ pad)                     notify calls so far (the same on every rank)
//   rings      RdmaRing [kMaxInternodeChannels][N]   per (channel, peer node): flags of ring node -> me, and my
//                                               ends of both rings (control words: zeroed with the Buffer)
//   notify     int32 [2 areas][N][notify_ints] what rail peer (n, i) sent this call (8 meta, R counts to each rank,
//                                               N counts to each node, E / N counts to each expert of my node)
//   staging    the same, what I put to each rail peer
//   send       [C][N][T] slots of D bytes      ring me -> m staged here, then put to m's receive half
//   receive    [C][N][T] slots of D bytes      ring m -> me (m = my node: written in place by my own senders)
//
// NVLink buffer payload (InternodeNvl; ranks of my node write into it over NVLink):
//   words      NvlRing [kMaxInternodeChannels][V]   per (channel, writer j): the ring j -> me's counters
//   notify     int32 [2][V][nvl_notify_ints]  what node peer j folded from its rail (below)
//   rings      [C][V][Tn] slots of D bytes    region (c, j): dispatch: forwarder j -> my receivers, one ring of
//                                               Tn; combine: my rows' partners at j -> my forwarders, N sub-rings of
//                                               Tn / N (one a home node). A writer that switches modes first waits
//                                               until the other mode's counters there agree (drained).
//
// A message slot (D = slot_bytes(hidden, K) bytes, the same on both legs):
//   0         int4 header (kMsg* below)
//   16        x: bf16 [H], or e4m3 [H] then float scales [H / 128] at 16 + H
//   16 + 2H   int32 topk_idx [K] (global ids, -1: none), then float topk_weights [K]
//   combine:  bf16 row [H] at 16, float topk_weights [K] at 16 + 2H
// The FP8 combine (internode_combine_fp8) keeps these NVLink slots (bf16 rows) but lays its RDMA rings out in slots
// of D8 = fp8_combine_slot_bytes(hidden, K): the header's 16 bytes (unused), e4m3 [H] at 16, float scales [H / 128]
// at 16 + H, float topk_weights [K] at 16 + H + H / 32; a ring drains before its other mode writes it, so the two
// slot sizes never share a stream.
// RDMA token {t, mask (bit j: rank j of the node wants it), kMsgToken, 0}; RDMA meta, a stream's first message
// {tokens in the stream, my tokens for the node in earlier channels, kMsgMeta, 0} + int32 start[V], count[V] (my
// tokens for each rank of the node in earlier channels, in this one). NVLink token {t, source node, kMsgToken,
// position among the source's tokens for me}; NVLink meta {start, source node, kMsgMeta, count}.
#pragma once

#include "peers.cuh"

namespace epjit {

constexpr int kMaxNodes = 32;               // a lane a node in the coordinators
constexpr int kMaxInternodeChannels = 64;   // control words are reserved for this many channels (num_sms / 2)
constexpr int kChunkFlags = 64;             // flags a RDMA ring: at most this many chunks in a ring
constexpr int kInternodeMetaInts = 8;       // {hidden, E, K, flags, recv_capacity, fwd_capacity, tokens, config}
constexpr int kMsgToken = 0, kMsgMeta = 1;

__host__ __device__ constexpr int64_t align_to(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

// Control words of one RDMA ring pair (channel c, peer node m), in my heap.
struct RdmaRing {
    uint64_t flag[kChunkFlags];  // ring m -> me: the writer's chunk flags (position after the chunk)
    uint64_t head_seen;          // ring me -> m: what m has read of it (m's signal ADDs)
    uint64_t tail;               // ring me -> m: where my last stream ended (chunk-aligned)
    uint64_t head;               // ring m -> me: where I stopped reading (chunk-aligned)
    uint64_t pad;
};
static_assert(sizeof(RdmaRing) == 544, "RdmaRing layout is mirrored in epjit/kernels/internode.py");

// Counters of the NVLink ring region (channel c, writer j), in the reader's buffer: the writer moves the tails, the
// reader the heads.
struct NvlRing {
    uint64_t dispatch_tail;
    uint64_t dispatch_head;
    uint64_t combine_tail[kMaxNodes];  // sub-ring of home node n
    uint64_t combine_head[kMaxNodes];
};
static_assert(sizeof(NvlRing) == 528, "NvlRing layout is mirrored in epjit/kernels/internode.py");

__host__ __device__ constexpr int64_t slot_bytes(int hidden, int num_topk) {
    return align_to(16 + 2 * static_cast<int64_t>(hidden) + 8 * static_cast<int64_t>(num_topk), 16);
}
// A slot of the FP8 combine's RDMA rings: a partial as e4m3 and its scales a 128 channels (hidden % 128 == 0).
__host__ __device__ constexpr int64_t fp8_combine_slot_bytes(int hidden, int num_topk) {
    return align_to(16 + static_cast<int64_t>(hidden) + static_cast<int64_t>(hidden) / 32 +
                        4 * static_cast<int64_t>(num_topk), 16);
}
// int32 of one notify message over RDMA (to a rail peer) and over NVLink (to a node peer), for up to expert_cap
// experts: meta[8] counts[R] node_counts[N] experts[E/N]; metas[8N] rows[R] forwarded[N] counts[N] experts[E/R].
__host__ __device__ constexpr int notify_rdma_ints(int num_ranks, int num_nodes, int expert_cap) {
    return static_cast<int>(align_to(kInternodeMetaInts + num_ranks + num_nodes + expert_cap / num_nodes, 4));
}
__host__ __device__ constexpr int notify_nvl_ints(int num_ranks, int num_nodes, int expert_cap) {
    return static_cast<int>(align_to(10 * num_nodes + num_ranks + expert_cap / num_ranks, 4));
}

constexpr int64_t kHeapSignalsOffset = 0;
constexpr int64_t kHeapEpochOffset = 2 * kMaxNodes * 8;
constexpr int64_t kHeapRingsOffset = kHeapEpochOffset + 128;

struct InternodeHeap {
    uint64_t* signals;  // [2][kMaxNodes]
    uint64_t* epoch;
    RdmaRing* rings;    // [kMaxInternodeChannels][N]
    int32_t* notify;    // [2][N][notify_ints]
    int32_t* staging;   // [2][N][notify_ints]
    char* send;         // [C][N][T][D]
    char* recv;
    int64_t end;        // bytes used from the heap's start
    int num_nodes, notify_ints, num_slots;
    int64_t slot;       // D

    __host__ __device__ InternodeHeap(void* base_, int num_ranks, int num_nodes_, int expert_cap, int num_channels,
                                      int num_slots_, int64_t slot_)
        : num_nodes(num_nodes_), notify_ints(notify_rdma_ints(num_ranks, num_nodes_, expert_cap)),
          num_slots(num_slots_), slot(slot_) {
        char* base = static_cast<char*>(base_);
        signals = reinterpret_cast<uint64_t*>(base + kHeapSignalsOffset);
        epoch = reinterpret_cast<uint64_t*>(base + kHeapEpochOffset);
        rings = reinterpret_cast<RdmaRing*>(base + kHeapRingsOffset);
        int64_t off = align_to(kHeapRingsOffset + static_cast<int64_t>(kMaxInternodeChannels) * num_nodes *
                                                      static_cast<int64_t>(sizeof(RdmaRing)), 128);
        const int64_t area = 2LL * num_nodes * notify_ints * 4;
        notify = reinterpret_cast<int32_t*>(base + off), off += area;
        staging = reinterpret_cast<int32_t*>(base + off), off = align_to(off + area, 128);
        const int64_t ring_bytes = static_cast<int64_t>(num_channels) * num_nodes * num_slots * slot;
        send = base + off, off += ring_bytes;
        recv = base + off, off += ring_bytes;
        end = off;
    }

    __device__ RdmaRing& ring(int channel, int node) const { return rings[channel * num_nodes + node]; }
    __device__ int32_t* notify_area(int area, int node) const {
        return notify + (static_cast<int64_t>(area) * num_nodes + node) * notify_ints;
    }
    __device__ int32_t* staging_area(int area, int node) const {
        return staging + (static_cast<int64_t>(area) * num_nodes + node) * notify_ints;
    }
    __device__ char* send_slot(int channel, int node, int64_t s) const {
        return send + ((static_cast<int64_t>(channel) * num_nodes + node) * num_slots + s) * slot;
    }
    __device__ char* recv_slot(int channel, int node, int64_t s) const {
        return recv + ((static_cast<int64_t>(channel) * num_nodes + node) * num_slots + s) * slot;
    }
};

struct InternodeNvl {
    NvlRing* words;   // [kMaxInternodeChannels][V]
    int32_t* notify;  // [2][V][nvl_notify_ints]
    char* rings;      // [C][V][Tn][D]
    int64_t end;
    int num_nvl_ranks, notify_ints, num_slots;
    int64_t slot;

    __host__ __device__ InternodeNvl(void* payload, int num_ranks, int num_nodes, int expert_cap, int num_channels,
                                     int num_slots_, int64_t slot_)
        : num_nvl_ranks(num_ranks / num_nodes), notify_ints(notify_nvl_ints(num_ranks, num_nodes, expert_cap)),
          num_slots(num_slots_), slot(slot_) {
        char* base = static_cast<char*>(payload);
        words = reinterpret_cast<NvlRing*>(base);
        int64_t off = align_to(static_cast<int64_t>(kMaxInternodeChannels) * num_nvl_ranks *
                                   static_cast<int64_t>(sizeof(NvlRing)), 128);
        notify = reinterpret_cast<int32_t*>(base + off);
        off = align_to(off + 2LL * num_nvl_ranks * notify_ints * 4, 128);
        rings = base + off;
        end = off + static_cast<int64_t>(num_channels) * num_nvl_ranks * num_slots * slot;
    }

    __device__ NvlRing& ring_words(int channel, int writer) const { return words[channel * num_nvl_ranks + writer]; }
    __device__ int32_t* notify_area(int area, int writer) const {
        return notify + (static_cast<int64_t>(area) * num_nvl_ranks + writer) * notify_ints;
    }
    __device__ char* slot_at(int channel, int writer, int64_t s) const {
        return rings + ((static_cast<int64_t>(channel) * num_nvl_ranks + writer) * num_slots + s) * slot;
    }
};

// An RDMA ring's chunks (see the top of this file).
struct RdmaChunks {
    int64_t size;        // S: messages a chunk
    int64_t count;       // Q: chunks a ring
    __device__ int64_t slot(int64_t p) const { return (p / size % count) * size + p % size; }
    __device__ int flag(int64_t p) const { return static_cast<int>(p / size % kChunkFlags); }
    __device__ int64_t start(int64_t end_of_last_stream) const { return align_to(end_of_last_stream, size); }
    // The head a writer waits for before it fills the chunk holding position p.
    __device__ int64_t head_needed(int64_t p) const { return (p / size + 1 - count) * size; }
};

}  // namespace epjit
