// The copy ceilings the normal-mode kernels are judged against (`python -m epjit.bench --modes ceiling`): warps
// copy 16-byte words from local memory into the NVLink buffers of the ranks in `dst_mask` with warp_copy's loads,
// stores and bytes in flight (this rank's own bit: a local copy). How the SMs share the destinations (schedule):
//   kSplit       blocks split evenly among the destinations, so a run with B blocks and D destinations says what
//                B/D SMs reach towards one rank while the others run too;
//   kRotate      every block writes to each destination in turn, starting with the rank after this one: while all
//                ranks keep step, each GPU writes to one peer and is written by one (NCCL's p2p schedule);
//   kInterleave  every warp writes to every destination, piece by piece in turn (how the normal-mode kernels'
//                blocks talk to all peers at once).
// With `pull` the bytes flow the other way: each block reads its destination's region of this rank's bytes out of
// that peer's buffer into this rank's own buffer (remote loads, local stores: how NCCL's P2P read mode moves them).
// With `skew` each rank starts its walk through a region at a different place (rank me at me / R of the way, then
// wrapping), so ranks writing into one GPU at once do not write the same offsets of regions 64 MiB apart: whether
// the senders keeping step on the receiver's addresses is what slows the split pattern.
#include "copy.cuh"
#include "peers.cuh"

namespace epjit {

enum CeilingSchedule { kSplit = 0, kRotate = 1, kInterleave = 2 };

__global__ void copy_ceiling(const PeersTable* peers, int dst_mask, int schedule, int pull, int skew,
                             const int4* src, int64_t n_int4) {
    const int num_dsts = __popc(dst_mask);
    const bool split = schedule == kSplit;
    const int blocks_per_dst = split ? static_cast<int>(gridDim.x) / num_dsts : static_cast<int>(gridDim.x);
    const int first = split ? static_cast<int>(blockIdx.x) / blocks_per_dst : 0;
    if (first >= num_dsts) return;
    const int me = peers->nvl_rank, num_ranks = peers->num_nvl_ranks;
    constexpr int kPiece = 32 * 8;  // int4 one warp copies at a time: one warp_copy batch (4 KiB)
    const int warps = static_cast<int>(blockDim.x) / 32;
    const int64_t num_pieces = (n_int4 + kPiece - 1) / kPiece;
    const int64_t shift = skew ? num_pieces * me / num_ranks : 0;
    const int lane = static_cast<int>(threadIdx.x % 32);
    // One piece of the region this rank owns in `rank`'s buffer (pushing) or of mine that `rank` fills (pulling).
    auto copy_piece = [&](int rank, int64_t p) {
        p = (p + shift) % num_pieces;
        int4* remote = nvl_ptr<int4>(peers, rank, kNvlHeaderBytes + me * n_int4 * 16);
        int4* dst = pull ? nvl_ptr<int4>(peers, me, kNvlHeaderBytes + rank * n_int4 * 16) : remote;
        const int4* from = pull ? remote : src;
        const int64_t left = n_int4 - p * kPiece;
        warp_copy(dst + p * kPiece, from + p * kPiece, static_cast<int>(left < kPiece ? left : kPiece), lane);
    };
    const int64_t stride = static_cast<int64_t>(blocks_per_dst) * warps;
    const int64_t p0 = (blockIdx.x % blocks_per_dst) * warps + threadIdx.x / 32;
    if (schedule == kInterleave) {
        // Pieces in the same order as one destination's, each copied to every destination before the next.
        for (int64_t p = p0; p < num_pieces; p += stride)
            for (int step = 1; step <= num_ranks; ++step) {
                const int rank = (me + step) % num_ranks;
                if (dst_mask >> rank & 1) copy_piece(rank, p);
            }
        return;
    }
    for (int step = 1; step <= num_ranks; ++step) {
        // rotate: the destinations in turn from the next rank; else the block's one destination, once
        const int rank = split ? __fns(static_cast<unsigned>(dst_mask), 0, first + 1) : (me + step) % num_ranks;
        if (!split && !(dst_mask >> rank & 1)) continue;
        // Every source writes its own region of a destination's payload: bytes from different ranks never overlap.
        for (int64_t p = p0; p < num_pieces; p += stride) copy_piece(rank, p);
        if (split) break;
    }
}

// The same copies through bulk (TMA) loads and stores: one thread a warp drives a BulkCopier of kStages stages of
// stage_bytes each (dynamic shared memory: warps x kStages x stage_bytes, then the mbarriers), copying pieces of
// stage_bytes.
constexpr int kCeilingStages = 8;
__global__ void copy_ceiling_bulk(const PeersTable* peers, int dst_mask, const char* src, int64_t n_bytes,
                                  int stage_bytes) {
    extern __shared__ __align__(128) char smem[];
    const int num_dsts = __popc(dst_mask);
    const int blocks_per_dst = static_cast<int>(gridDim.x) / num_dsts;
    const int d = static_cast<int>(blockIdx.x) / blocks_per_dst;
    if (d >= num_dsts || threadIdx.x % 32 != 0) return;
    const int rank = __fns(static_cast<unsigned>(dst_mask), 0, d + 1);
    char* dst = nvl_ptr<char>(peers, rank, kNvlHeaderBytes + peers->nvl_rank * n_bytes);
    const int warp = static_cast<int>(threadIdx.x) / 32, warps = static_cast<int>(blockDim.x) / 32;
    auto* bars = reinterpret_cast<uint64_t*>(smem + static_cast<int64_t>(warps) * kCeilingStages * stage_bytes);
    BulkCopier<kCeilingStages, 2> copier(smem + static_cast<int64_t>(warp) * kCeilingStages * stage_bytes,
                                         bars + warp * kCeilingStages, stage_bytes, peers);
    const int64_t stride = static_cast<int64_t>(blocks_per_dst) * warps * stage_bytes;
    for (int64_t off = ((blockIdx.x % blocks_per_dst) * warps + warp) * static_cast<int64_t>(stage_bytes);
         off < n_bytes; off += stride) {
        const int64_t left = n_bytes - off;
        copier.push(dst + off, src + off, static_cast<int>(left < stage_bytes ? left : stage_bytes));
    }
    copier.flush();
}

}  // namespace epjit
