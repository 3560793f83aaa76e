// The NVSHMEM put ceiling the internode kernels' RDMA leg is judged against (`python -m epjit.bench --put-ceiling`,
// several NVLink nodes only): every rank puts n_bytes to its rail peer on the next node (dst_pe: the rank with its
// own local index there) while its rail peer on the previous node (src_pe) puts as many to it, so every rank sends
// and receives at once, as the RDMA leg does. Each warp of the grid puts chunks of chunk_bytes in turn (chunk c by
// warp c mod warps) with nvshmemx_putmem_signal_nbi_warp, from this rank's send region to the same offset of the
// peer's receive region, each put adding 1 to the peer's signal after its data. Block 0's thread 0 then waits
// until its own signal reaches `expected`: the signal only grows (never reset), so the host passes the running
// total of the chunks its peer has put since the heap was made. Every warp quiets its puts before the grid ends.
//
// symmetric allocation:  [ signal: uint64 | pad | send: n_bytes | receive: n_bytes ]
//                        0                      kPutCeilingHeaderBytes (PUT_CEILING_HEADER_BYTES of the spec)
//
// On one host with virtual nodes NVSHMEM carries these puts over its peer-to-peer transport (the calling warp's
// copy over NVLink); on a cluster over the NIC (IBGDA or the proxy), which is what this ceiling is for.
#include "nvshmem.cuh"
#include "peers.cuh"
#include "ptx.cuh"
#include "wait.cuh"

namespace epjit {

constexpr int64_t kPutCeilingHeaderBytes = 128;

__global__ void put_ceiling(const PeersTable* peers, int dst_pe, int src_pe, int64_t n_bytes, int64_t chunk_bytes,
                            uint64_t expected) {
    const int warps = static_cast<int>(blockDim.x) / 32;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * warps;
    const int64_t warp = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / 32;
    const int64_t num_chunks = (n_bytes + chunk_bytes - 1) / chunk_bytes;
    auto* signal = sym_local<uint64_t>(peers, 0);
    const char* send = sym_local<const char>(peers, kPutCeilingHeaderBytes);
    char* recv = sym_local<char>(peers, kPutCeilingHeaderBytes + n_bytes);
    for (int64_t c = warp; c < num_chunks; c += num_warps) {
        const int64_t off = c * chunk_bytes;
        const int64_t bytes = n_bytes - off < chunk_bytes ? n_bytes - off : chunk_bytes;
        nvshmemx_putmem_signal_nbi_warp(recv + off, send + off, static_cast<size_t>(bytes), signal, 1,
                                        NVSHMEM_SIGNAL_ADD, dst_pe);
    }
    nvshmem_quiet();  // this warp's puts have completed at the peer (the send region may be reused)
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        timeout_while(peers, WaitSite{"put_ceiling: signal >= chunks put so far by rail peer", src_pe, -1,
                                      static_cast<int64_t>(expected)},
                      [&](int64_t& seen) {
                          seen = static_cast<int64_t>(ptx::ld_acquire_sys_u64(signal));
                          return static_cast<uint64_t>(seen) < expected;
                      });
    }
}

}  // namespace epjit
