// What a normal-mode notify decides (intranode.cu and internode.cu alike): status bits every rank computes
// identically from every rank's meta and counts, and the call flags and meta bits they come from. Dispatch (and
// every combine of its handle) does nothing if any bit is set, on every rank. epjit/ops/intranode.py mirrors them.
#pragma once

namespace epjit {

constexpr int kStatusMetaMismatch = 1;   // hidden / num_experts / num_topk / flags differ across ranks
constexpr int kStatusWorstTooSmall = 2;  // some rank would receive more rows than num_worst_tokens
constexpr int kStatusLayoutTooBig = 4;   // some rank's layout does not fit its buffers
constexpr int kStatusInvalidIds = 8;     // some rank's topk_idx has entries outside [-1, num_experts)
constexpr int kStatusOverCapacity = 16;  // some rank would receive more rows than the outputs it allocated early
constexpr int kMetaLayoutTooBig = 1 << 30;
constexpr int kMetaInvalidIds = 1 << 29;
constexpr int kFlagWorstTokens = 8;  // call flag: the receive capacity is num_worst_tokens (too small: an error)
// Call flag: captured in a CUDA graph. host_out is then the graph's record, which the host reads whenever it next
// checks, not after this call: notify writes it only when it refuses the call, so a refusal stays until read.
constexpr int kFlagCaptured = 16;
// Per-rank meta bits and flags, not meant to agree across ranks.
constexpr int kOwnMetaBits = kMetaLayoutTooBig | kMetaInvalidIds | kFlagWorstTokens | kFlagCaptured;

}  // namespace epjit
