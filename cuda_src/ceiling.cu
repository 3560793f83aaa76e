// The copy ceilings the normal-mode kernels are judged against (`python -m epjit.bench --modes ceiling`): warps
// copy 16-byte words from local memory into the NVLink buffers of the ranks in `dst_mask` with warp_copy's loads,
// stores and bytes in flight (this rank's own bit: a local copy). Blocks split evenly among the destinations, so
// a run with B blocks and D destinations says what B/D SMs reach towards one rank while the others run too. With
// `rotate` every block writes to each destination in turn instead, starting with the rank after this one: while
// all ranks keep step, each GPU writes to one peer and is written by one (NCCL's p2p schedule), the same bytes.
// With `pull` the bytes flow the other way: each block reads its destination's region of this rank's bytes out of
// that peer's buffer into this rank's own buffer (remote loads, local stores: how NCCL's P2P read mode moves them).
#include "copy.cuh"
#include "peers.cuh"

namespace epjit {

__global__ void copy_ceiling(const PeersTable* peers, int dst_mask, int rotate, int pull, const int4* src,
                             int64_t n_int4) {
    const int num_dsts = __popc(dst_mask);
    const int blocks_per_dst = rotate ? static_cast<int>(gridDim.x) : static_cast<int>(gridDim.x) / num_dsts;
    const int first = rotate ? 0 : static_cast<int>(blockIdx.x) / blocks_per_dst;
    if (first >= num_dsts) return;
    const int me = peers->nvl_rank, num_ranks = peers->num_nvl_ranks;
    constexpr int kPiece = 32 * 8;  // int4 one warp copies at a time: one warp_copy batch (4 KiB)
    const int warps = static_cast<int>(blockDim.x) / 32;
    const int64_t stride = static_cast<int64_t>(blocks_per_dst) * warps;
    const int lane = static_cast<int>(threadIdx.x % 32);
    for (int step = 1; step <= num_ranks; ++step) {
        // rotate: the destinations in turn from the next rank; else the block's one destination, once
        const int rank = rotate ? (me + step) % num_ranks : __fns(static_cast<unsigned>(dst_mask), 0, first + 1);
        if (rotate && !(dst_mask >> rank & 1)) continue;
        // Every source writes its own region of a destination's payload: bytes from different ranks never overlap.
        int4* remote = nvl_ptr<int4>(peers, rank, kNvlHeaderBytes + me * n_int4 * 16);
        int4* dst = pull ? nvl_ptr<int4>(peers, me, kNvlHeaderBytes + rank * n_int4 * 16) : remote;
        const int4* from = pull ? remote : src;
        for (int64_t p = (blockIdx.x % blocks_per_dst) * warps + threadIdx.x / 32; p * kPiece < n_int4;
             p += stride) {
            const int64_t left = n_int4 - p * kPiece;
            warp_copy(dst + p * kPiece, from + p * kPiece, static_cast<int>(left < kPiece ? left : kPiece), lane);
        }
        if (!rotate) break;
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
