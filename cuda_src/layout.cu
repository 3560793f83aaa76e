// get_dispatch_layout: from topk_idx [N, K] (int64, -1 = no expert) to the counts every dispatch needs.
//
//   num_tokens_per_rank [R]        tokens with at least one expert on rank r
//   num_tokens_per_rdma_rank [R/V] tokens with at least one expert on NVLink node n (V = ranks per node); only
//                                  written when num_nvl_ranks < num_ranks
//   num_tokens_per_expert [E]      top-k slots naming expert e (a repeated expert counts once per slot)
//   is_token_in_rank [N, R]        bool
//   invalid_ids [1]                top-k entries outside [-1, E): skipped here, reported by the next notify
//
// One thread per token; counts go to shared memory first (one atomic per token and target there) and to global
// memory once per block, so the result is exact and independent of scheduling. With several blocks they are added
// into global memory, which the host zeroes first; a single block (up to 256 tokens: every decode-sized batch)
// stores them whole, zeros included, so the host needs no memset: one fewer call on the path a small batch waits
// for. is_token_in_rank is never zeroed (every row is written whole).
#include "types.cuh"

namespace epjit {

__global__ void dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                                int num_ranks, int num_nvl_ranks, int* num_tokens_per_rank,
                                int* num_tokens_per_rdma_rank, int* num_tokens_per_expert, bool* is_token_in_rank,
                                int* invalid_ids) {
    extern __shared__ int shared_counts[];
    const int num_nodes = num_ranks / num_nvl_ranks;
    int* s_expert = shared_counts;
    int* s_rank = s_expert + num_experts;
    int* s_node = s_rank + num_ranks;
    int* s_invalid = s_node + num_nodes;
    for (int i = threadIdx.x; i < num_experts + num_ranks + num_nodes + 1; i += blockDim.x) shared_counts[i] = 0;
    __syncthreads();

    const int experts_per_rank = num_experts / num_ranks;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < num_tokens) {
        const int64_t* row = topk_idx + static_cast<int64_t>(t) * num_topk;
        bool* in_rank = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
        for (int r = 0; r < num_ranks; ++r) in_rank[r] = false;  // then the ranks found below, by this thread
        // A token's distinct ranks and nodes: top-k is small (<= 16), so a quadratic look-back is cheapest.
        for (int k = 0; k < num_topk; ++k) {
            const int64_t e = row[k];
            if (e < -1 || e >= num_experts) atomicAdd(s_invalid, 1);
            if (e < 0 || e >= num_experts) continue;
            atomicAdd(s_expert + e, 1);
            const int r = static_cast<int>(e) / experts_per_rank;
            bool seen_rank = false, seen_node = false;
            for (int j = 0; j < k; ++j) {
                if (row[j] < 0 || row[j] >= num_experts) continue;
                const int rj = static_cast<int>(row[j]) / experts_per_rank;
                seen_rank |= rj == r;
                seen_node |= rj / num_nvl_ranks == r / num_nvl_ranks;
            }
            if (!seen_rank) {
                in_rank[r] = true;
                atomicAdd(s_rank + r, 1);
            }
            if (!seen_node) atomicAdd(s_node + r / num_nvl_ranks, 1);
        }
    }
    __syncthreads();
    const bool whole = gridDim.x == 1;  // the only block: store every count; else add the nonzero ones
    auto publish = [whole](int* dst, int count) {
        if (whole)
            *dst = count;
        else if (count)
            atomicAdd(dst, count);
    };
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x) publish(num_tokens_per_expert + i, s_expert[i]);
    for (int i = threadIdx.x; i < num_ranks; i += blockDim.x) publish(num_tokens_per_rank + i, s_rank[i]);
    if (num_tokens_per_rdma_rank != nullptr)
        for (int i = threadIdx.x; i < num_nodes; i += blockDim.x) publish(num_tokens_per_rdma_rank + i, s_node[i]);
    if (threadIdx.x == 0) publish(invalid_ids, *s_invalid);
}

}  // namespace epjit
