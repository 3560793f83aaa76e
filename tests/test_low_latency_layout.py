"""Low-latency mode without a GPU: the host mirror of cuda_src/low_latency.cuh and the memory it reserves."""

from __future__ import annotations

import re

import pytest

from epjit.kernels import cuda_sources
from epjit.kernels import low_latency as ll
from epjit.ops import low_latency as ll_ops

CUDA_SRC = cuda_sources()
HEADER = (CUDA_SRC / "low_latency.cuh").read_text()
KERNELS = (CUDA_SRC / "low_latency.cu").read_text()


def _constexpr(text: str, name: str) -> int:
    m = re.search(rf"constexpr\s+\w+\s+{name}\s*=\s*(\d+)\s*;", text)
    assert m, name
    return int(m.group(1))


def test_constants_match_the_sources():
    assert ll.LOW_LATENCY_MAX_TOPK == _constexpr(HEADER, "kLowLatencyMaxTopk")
    assert ll.LOW_LATENCY_HEADER_BYTES == _constexpr(HEADER, "kLowLatencyHeaderBytes")
    assert ll.LOW_LATENCY_THREADS == _constexpr(KERNELS, "kLowLatencyThreads")
    assert ll.FLAGGED_MESSAGES == _constexpr(HEADER, "kFlaggedMessages")
    assert ll.FLAGGED_TOKENS == _constexpr(HEADER, "kFlaggedTokens")
    shift = re.search(r"constexpr uint32_t kFormatFlaggedDispatch = 1u << (\d+);", HEADER)
    assert shift and ll.FORMAT_FLAGGED_DISPATCH == 1 << int(shift.group(1))
    for py, c in [("PHASE_SEND", "kPhaseSend"), ("PHASE_RECV", "kPhaseRecv"), ("FLAG_FP8", "kFlagFp8"),
                  ("FLAG_ROUND_SCALE", "kFlagRoundScale"), ("FLAG_UE8M0", "kFlagUe8m0"),
                  ("STATUS_INVALID_IDS", "kLowLatencyInvalidIds"), ("STATUS_SLOT_OVERFLOW", "kLowLatencySlotOverflow"),
                  ("STATUS_META_MISMATCH", "kLowLatencyMetaMismatch"),
                  ("STATUS_LAYOUT_TOO_BIG", "kLowLatencyLayoutTooBig"), ("STATUS_RANK_MASKED", "kLowLatencyRankMasked"),
                  ("STATUS_BIT_COUNT", "kStatusBitCount")]:
        assert getattr(ll_ops, py) == _constexpr(KERNELS, c), py  # the family's public protocol constants
    fields = re.findall(r"int32_t (\w+)(?:\[(\d+)\])?;", re.search(r"struct LowLatencySync \{(.*?)\};", HEADER,
                                                                   re.S).group(1))
    assert sum(4 * int(n or 1) for _, n in fields) == ll.SYNC_BYTES
    shrink = re.search(r"static_assert\(sizeof\(LowLatencyShrink\) == (\d+)", HEADER)
    assert shrink and int(shrink.group(1)) == ll.SHRINK_BYTES
    assert "(4 * static_cast<int64_t>(num_experts) + 7) / 8 * 8" in HEADER  # shrink_offset's alignment
    assert [ll.shrink_offset(e) for e in (1, 2, 3, 256)] == [40, 40, 48, 1056]


def test_set_bytes_follow_the_header_regions():
    # The regions the constructor lays out, in order, each rounded to 256 bytes (the mirror's derivation).
    regions = re.findall(r"off \+= ll_align\((.*?)\);", HEADER)
    assert len(regions) == 9
    r, e, m, h = 4, 256, 128, 7168
    env = {"L": e // r, "R": r, "E": e, "M": m, "msg_bytes": ll.message_bytes(h), "combine_row_bytes": 2 * h,
           "kLowLatencyMaxTopk": ll.LOW_LATENCY_MAX_TOPK, "kLowLatencyHeaderBytes": ll.LOW_LATENCY_HEADER_BYTES,
           "kFlaggedTokens": ll.FLAGGED_TOKENS}
    total = sum((eval(expr, {}, env) + 255) // 256 * 256 for expr in regions)  # noqa: S307 (our own header)
    assert total == ll.low_latency_set_bytes(r, e, m, h)
    # After the two sets, shrink mode's clean words (uint64 [R]); the hint reserves them whether or not it is on.
    assert ll.clean_words_offset(r, e, m, h) == 2 * total
    assert ll.low_latency_size_hint(m, h, r, e) == 2 * total + 256


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_buffer_is_at_most_deepeps(ranks):
    # No more memory than DeepEP's buffer, at the benchmark's size: 128 tokens x 7168 x 256 experts.
    ours = ll.low_latency_size_hint(128, 7168, ranks, 256)
    deepep = ll.deepep_low_latency_size_hint(128, 7168, ranks, 256)
    assert ours <= deepep
    # Two sets of combine slots [128 tokens x 16 top-k x 14 KB] dominate; dispatch slots are one message a
    # (source, token), not one a (local expert, source, slot) as in DeepEP (which needs ~1.9 GB here). The flagged
    # region of small dispatches adds 64 doubled messages a source a set (~30 MB on 8 ranks).
    assert 60e6 < ours < 130e6


def test_message_stride_fits_both_payloads():
    for hidden in (128, 2048, 4096, 7168):
        fp8 = ll.LOW_LATENCY_HEADER_BYTES + hidden + hidden // 128 * 4
        bf16 = ll.LOW_LATENCY_HEADER_BYTES + 2 * hidden
        assert ll.message_bytes(hidden) >= max(fp8, bf16) and ll.message_bytes(hidden) % 16 == 0


def test_the_build_without_nvshmem_serves_only_where_every_peer_has_a_pointer():
    from epjit.memory import SymmetricHeap
    from epjit.ops.low_latency import needs_puts as low_latency_needs_puts

    def heap(*peer_ptrs: int) -> SymmetricHeap:  # nvshmem_ptr's answers, without NVSHMEM
        h = object.__new__(SymmetricHeap)
        h.peer_ptrs = list(peer_ptrs)
        return h

    assert not low_latency_needs_puts(False, heap(0x7F00_0000_0000, 0x7E00_0000_0000))
    assert low_latency_needs_puts(True, heap(0x7F00_0000_0000, 0x7E00_0000_0000))  # EPJIT_LL_FORCE_PUTS
    assert low_latency_needs_puts(False, heap(0x7F00_0000_0000, 0))  # a peer reachable only through NVSHMEM puts
    assert low_latency_needs_puts(False, None)  # no symmetric heap to tell


def test_the_puts_builds_are_the_same_kernels_with_nvshmem_or_stores():
    assert ll.LowLatencyPutsSpec.SOURCE == ll.LowLatencyStoresSpec.SOURCE == ll.LowLatencySpec.SOURCE
    assert ll.LowLatencyPutsSpec.DEFINES == ("EPJIT_LL_PUTS",) and not ll.LowLatencySpec.DEFINES
    assert ll.LowLatencyPutsSpec.USES_NVSHMEM and not ll.LowLatencySpec.USES_NVSHMEM
    assert ll.LowLatencyPutsSpec.KERNELS == ll.LowLatencySpec.KERNELS
    assert ll.LowLatencyStoresSpec.DEFINES == ("EPJIT_RDMA_BY_STORES",)
    assert not ll.LowLatencyStoresSpec.USES_NVSHMEM and ll.LowLatencyStoresSpec.KERNELS == ll.LowLatencySpec.KERNELS
    assert [s().family for s in (ll.LowLatencySpec, ll.LowLatencyPutsSpec, ll.LowLatencyStoresSpec)] == [
        "low_latency", "low_latency_puts", "low_latency_stores"]  # cache files and logs tell the builds apart
    # the plain build's put path traps, and the source reaches NVSHMEM only through rdma.cuh
    source = (CUDA_SRC / ll.LowLatencySpec.SOURCE).read_text()
    assert "#define EPJIT_RDMA_NONE" in source and "nvshmemx_" not in source and "nvshmem_quiet" not in source
