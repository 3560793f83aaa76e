"""CPU tier of normal mode across NVLink nodes: the host mirrors of cuda_src/internode.cuh, the size hints (under
DeepEP's for the same config), the Config rules and defaults for every topology, the sizes a Buffer refuses, the
internode host record's refusals, and the warp-role specs."""

from __future__ import annotations

import re

import numpy as np
import pytest

import epjit
from epjit.config import check_internode_need, check_normal_sizes, internode_config, rdma_size_hint
from epjit.errors import ArgumentError
from epjit.kernels import internode as k
from epjit.kernels import intranode as intranode_kernels
from epjit.kernels.internode import InternodeSpec, config_problems, heap_fixed_bytes, internode_spec
from epjit.ops import notify as ops
from epjit.ops.internode import HANDLE_INTS, config_tag, forwarded_at

from .test_jit import CUDA_SRC

HEADER = (CUDA_SRC / "internode.cuh").read_text()
SOURCE = (CUDA_SRC / "internode.cu").read_text()


def _constant(name: str) -> int:
    match = re.search(rf"constexpr (?:int|int64_t) {name} = ([^;]+);", HEADER)
    assert match, name
    return int(eval(match.group(1), {}, {"kMaxNodes": k.MAX_NODES}))  # noqa: S307 - our own header


def test_layout_constants_mirror_the_header():
    assert _constant("kMaxNodes") == k.MAX_NODES
    assert _constant("kMaxInternodeChannels") == k.MAX_INTERNODE_CHANNELS
    assert _constant("kChunkFlags") == k.CHUNK_FLAGS
    assert _constant("kInternodeMetaInts") == k.META_INTS == intranode_kernels.META_INTS
    assert f"sizeof(RdmaRing) == {k.RDMA_RING_BYTES}" in HEADER and f"sizeof(NvlRing) == {k.NVL_RING_BYTES}" in HEADER
    # RdmaRing: kChunkFlags flags and four words; NvlRing: two words and kMaxNodes tails and heads.
    assert k.RDMA_RING_BYTES == 8 * (k.CHUNK_FLAGS + 4) and k.NVL_RING_BYTES == 8 * (2 + 2 * k.MAX_NODES)
    assert "kHeapEpochOffset = 2 * kMaxNodes * 8;" in HEADER and "kHeapRingsOffset = kHeapEpochOffset + 128;" in HEADER
    assert k.HEAP_RINGS_OFFSET == 2 * k.MAX_NODES * 8 + 128


def test_message_and_notify_sizes_mirror_the_header():
    assert "align_to(16 + 2 * static_cast<int64_t>(hidden) + 8 * static_cast<int64_t>(num_topk), 16)" in HEADER
    assert "kInternodeMetaInts + num_ranks + num_nodes + expert_cap / num_nodes, 4" in HEADER
    assert "10 * num_nodes + num_ranks + expert_cap / num_ranks, 4" in HEADER
    assert k.slot_bytes(7168, 8) == 16 + 2 * 7168 + 64 and k.slot_bytes(7, 1) == 48
    # the FP8 combine's RDMA slot: header, e4m3 [H], scales [H / 128], weights [K]; about half the bf16 slot
    assert "align_to(16 + static_cast<int64_t>(hidden) + static_cast<int64_t>(hidden) / 32 +\n" \
           "                        4 * static_cast<int64_t>(num_topk), 16)" in HEADER
    assert k.fp8_combine_slot_bytes(7168, 8) == 16 + 7168 + 7168 // 32 + 32 and k.fp8_combine_slot_bytes(128, 1) == 160
    assert k.fp8_combine_slot_bytes(7168, 8) / k.slot_bytes(7168, 8) < 0.52
    assert k.notify_rdma_ints(16, 2, 4096) == 2076  # 8 + 16 + 2 + 2048, to a multiple of 4
    assert k.notify_nvl_ints(16, 2, 4096) == 20 + 16 + 256


@pytest.mark.parametrize("ranks, nodes", [(2, 2), (4, 2), (16, 2), (16, 4), (64, 8), (32, 32)])
def test_fixed_parts_are_the_headers_offsets(ranks, nodes):
    """InternodeHeap / InternodeNvl's constructors, step by step (a ring region after the fixed part)."""
    cap, align = 4096, lambda n: (n + 127) // 128 * 128
    area = 2 * nodes * k.notify_rdma_ints(ranks, nodes, cap) * 4
    rings_end = align(k.HEAP_RINGS_OFFSET + k.MAX_INTERNODE_CHANNELS * nodes * k.RDMA_RING_BYTES)
    assert k.heap_fixed_bytes(ranks, nodes, cap) == align(rings_end + 2 * area)
    v = ranks // nodes
    nvl = align(align(k.MAX_INTERNODE_CHANNELS * v * k.NVL_RING_BYTES) + 2 * v * k.notify_nvl_ints(ranks, nodes,
                                                                                                  cap) * 4)
    assert k.nvl_fixed_bytes(ranks, nodes, cap) == nvl
    slot = k.slot_bytes(4096, 8)
    assert k.internode_rdma_bytes(ranks, nodes, cap, 12, 128, 4096, 8) == \
        k.heap_fixed_bytes(ranks, nodes, cap) + 2 * 12 * nodes * 128 * slot
    rings = 12 * v * 288 * slot if v > 1 else 0  # one rank a node: no NVLink ring
    assert k.internode_nvl_bytes(ranks, nodes, cap, 12, 288, 4096, 8) == nvl + rings


@pytest.mark.parametrize("nodes", [2, 4, 8, 16, 32])
@pytest.mark.parametrize("nvl_ranks", [1, 2, 4, 8])
def test_rdma_hint_is_under_deepeps_for_the_same_config(nodes, nvl_ranks):
    ranks = nodes * nvl_ranks
    for hidden in (1024, 2048, 4096, 7168):
        for topk in (1, 8, 32):
            for sms, send, recv in ((24, 8, 128), (24, 6, 128), (8, 6, 64), (48, 16, 256), (20, 28, 128)):
                config = epjit.Config(sms, 8, 4096, send, recv)
                ours = rdma_size_hint(ranks, hidden, topk, 256, config, nvl_ranks)
                assert ours <= k.deepep_rdma_size_hint(sms // 2, nodes, recv, hidden), (hidden, topk, config)
    # The plan's figure: 7168 hidden, top-8, 2 nodes of 2, the defaults: 84.6 MiB against DeepEP's 96.1 MiB.
    if (nodes, nvl_ranks) == (2, 2):
        assert round(epjit.Buffer.get_rdma_size_hint(4, 7168, 8, 256, num_nvl_ranks=2) / 2**20, 1) == 84.6
        assert round(k.deepep_rdma_size_hint(12, 2, 128, 7168) / 2**20, 1) == 96.1


def test_one_node_hints_are_intranodes():
    assert epjit.Buffer.get_rdma_size_hint(8, 7168) == 0 == epjit.Buffer.get_rdma_size_hint(8, 7168, num_nvl_ranks=8)
    assert epjit.Buffer.get_normal_size_hint(8, 7168, num_nvl_ranks=8) == epjit.Buffer.get_normal_size_hint(8, 7168)
    with pytest.raises(ArgumentError, match="does not divide"):
        epjit.Buffer.get_rdma_size_hint(8, 7168, num_nvl_ranks=3)


@pytest.mark.parametrize("nodes", [2, 3, 4, 8, 16, 32])
@pytest.mark.parametrize("nvl_ranks", [1, 2, 3, 4, 8])
def test_defaults_fit_every_topology(nodes, nvl_ranks):
    ranks = nodes * nvl_ranks
    for get in (epjit.config.get_dispatch_config, epjit.config.get_combine_config):
        config = get(ranks, num_nvl_ranks=nvl_ranks)
        assert config == internode_config(ranks, nvl_ranks)
        spec = config.internode_spec(ranks, nvl_ranks)  # raises if a rule fails
        warps = spec.num_threads // 32
        peers = nvl_ranks - 1
        assert spec.dispatch_send_warps + peers * spec.dispatch_recv_warps <= warps
        assert nvl_ranks * spec.forward_warps + 1 <= warps
        assert peers * spec.combine_send_warps + 2 <= warps and spec.combine_forward_groups <= 15


def test_config_rules_name_what_fails():
    spec = internode_spec(2, 2)
    assert config_problems(24, 8, 288, 8, 128, 2, spec) == []
    assert "must be even" in config_problems(23, 8, 288, 8, 128, 2, spec)[0]
    assert "chunks must be in" in config_problems(24, 8, 288, 8, 40, 2, spec)[0]  # 5 chunks: no room for a window
    assert "chunks must be in" in config_problems(24, 8, 288, 1, 128, 2, spec)[0]  # 128 chunks: more than 64 flags
    assert ">= 33" in config_problems(24, 8, 32, 8, 128, 2, spec)[0]
    assert "combine sub-ring" in config_problems(24, 8, 100, 8, 128, 2, spec)[0]
    assert config_problems(24, 8, 100, 8, 128, 2, internode_spec(2, 1)) == []  # one rank a node: no NVLink ring
    with pytest.raises(ArgumentError, match="tune the intranode kernels"):
        epjit.Config(24, 8, 288, 8, 128, combine_send_warps=3).internode_spec(4, 2)
    with pytest.raises(ArgumentError, match="cannot run across 2 nodes of 2: num_sms=23"):
        epjit.Config(23, 8, 288, 8, 128).internode_spec(4, 2)


def test_specs_refuse_roles_that_do_not_fit():
    with pytest.raises(ValueError, match="2 to 32 nodes"):
        InternodeSpec(1, 2, 768, 18, 6, 11, 4, 1)
    with pytest.raises(ValueError, match="senders"):
        InternodeSpec(2, 8, 768, 12, 2, 2, 1, 2)  # 12 + 7 x 2 > 24 warps
    with pytest.raises(ValueError, match="forwarders"):
        InternodeSpec(2, 4, 768, 14, 3, 6, 2, 2)  # 4 x 6 + 1 > 24
    with pytest.raises(ValueError, match="combine_forward_groups"):
        InternodeSpec(2, 2, 768, 18, 6, 11, 4, 3)  # more groups than nodes


def test_buffer_sizes_refused_before_any_collective():
    check_normal_sizes(16, 8, 1 << 30, 1 << 30, 256)
    fixed = heap_fixed_bytes(16, 2, 4096)
    check_normal_sizes(16, 8, 1 << 30, fixed + (1 << 20), 256, 1 << 20)  # both modes: normal's region, then 1 MiB
    with pytest.raises(ArgumentError, match=rf"num_rdma_bytes={fixed + (1 << 20) - 1} is below the "
                                            rf"{fixed + (1 << 20)} bytes a Buffer serving both modes .* at least "
                                            rf"{fixed} bytes .* then low-latency mode's {1 << 20} .* their sum"):
        check_normal_sizes(16, 8, 1 << 30, fixed + (1 << 20) - 1, 256, 1 << 20)
    with pytest.raises(ArgumentError, match="num_nvl_bytes=1 is below"):
        check_normal_sizes(16, 8, 1, 1 << 30, 256)
    with pytest.raises(ArgumentError, match="num_rdma_bytes=0 is below"):
        check_normal_sizes(16, 8, 1 << 30, 0, 256)
    config = internode_config(16, 8)
    with pytest.raises(ArgumentError, match="needs .* bytes of symmetric heap"):
        check_internode_need(config, 16, 8, 7168, 8, 256, 256, (1 << 34, 1 << 20), "dispatch")
    need = config.internode_bytes(16, 8, 7168, 8, 4096)[1]
    check_internode_need(config, 16, 8, 7168, 8, 256, 256, (1 << 34, need + 4096), "dispatch", 4096)
    with pytest.raises(ArgumentError, match=rf"needs {need} bytes of symmetric heap .* has num_rdma_bytes="
                                            rf"{need + 4095}, of which low-latency mode's region takes the last 4096"):
        check_internode_need(config, 16, 8, 7168, 8, 256, 256, (1 << 34, need + 4095), "dispatch", 4096)
    with pytest.raises(ArgumentError, match="num_experts=8192 is more than this Buffer's notify areas hold"):
        check_internode_need(config, 16, 8, 7168, 8, 8192, 256, (1 << 34, 1 << 34), "dispatch")
    check_internode_need(config, 16, 8, 7168, 8, 8192, 8192, (1 << 34, 1 << 34), "dispatch")


def test_config_tag_tells_configs_apart():
    a = epjit.Config(24, 8, 288, 8, 128)
    assert config_tag(a) == config_tag(epjit.Config(24, 8, 288, 8, 128))
    assert len({config_tag(c) for c in (a, epjit.Config(22, 8, 288, 8, 128), epjit.Config(24, 8, 320, 8, 128),
                                        epjit.Config(24, 8, 288, 6, 128), epjit.Config(24, 8, 288, 8, 96))}) == 5
    assert 0 <= config_tag(epjit.Config(128, 1, 1 << 20, 1 << 10, 1 << 16)) < 1 << 30


def _record(num_ranks: int, status: int, rows: list[int], forwarded: list[int], capacity: list[tuple[int, int]],
            flags: int = 0) -> np.ndarray:
    r, m = num_ranks, k.META_INTS
    ints = np.zeros(2 + (m + 2) * r + 16, np.int32)
    ints[1] = status
    for i in range(r):
        ints[2 + m * i:2 + m * (i + 1)] = [7168, 256, 8, flags, capacity[i][0], capacity[i][1], 100, 5]
    ints[2 + m * r:2 + (m + 1) * r] = rows
    ints[forwarded_at(r):forwarded_at(r) + r] = forwarded
    return ints


def test_internode_records_name_forwarded_tokens_and_the_config():
    assert forwarded_at(4) == 2 + 9 * 4 and ops.expert_counts_at(4, True) == 2 + 10 * 4
    ints = _record(2, ops.STATUS_OVER_CAPACITY, [10, 10], [30, 5], [(10, 20), (10, 20)])
    error = ops.refusal(ints, 2, 0, 0, forwarded=True)
    assert "tokens forwarded: rank 0: 30 for 20" in str(error) and "rows received" not in str(error)
    worst = _record(2, ops.STATUS_WORST_TOO_SMALL, [10, 10], [30, 5], [(8, 16), (8, 16)], ops.FLAG_WORST_TOKENS)
    message = str(ops.refusal(worst, 2, 0, 8, forwarded=True))
    assert "rows received for num_worst_tokens: rank 0: 10 for 8" in message
    assert "tokens forwarded for num_worst_tokens: rank 0: 30 for 16" in message
    mismatch = _record(2, ops.STATUS_META_MISMATCH, [0, 0], [0, 0], [(1, 1), (1, 1)])
    mismatch[2 + k.META_INTS + 7] = 6
    assert "config differs across ranks: rank 0: 5, rank 1: 6" in str(ops.refusal(mismatch, 2, 0, 0, forwarded=True))


def test_handle_arrays_are_named_once_and_every_kernel_argument_is_one():
    assert len(set(HANDLE_INTS)) == len(HANDLE_INTS)
    dispatch = {name for name, _ in InternodeSpec.KERNELS["internode_dispatch"]}
    combine = {name for name, _ in InternodeSpec.KERNELS["internode_combine"]}
    arrays = set(HANDLE_INTS) - {"status", "saved_counts"}
    assert arrays <= dispatch | {"recv_src_idx"} and "call_status" in dispatch and "dispatch_status" in combine
    assert {"recv_channel_offset", "recv_channel_count", "send_rdma_head", "recv_rdma_channel",
            "send_nvl_head"} <= combine


def test_every_internode_wait_names_its_leg():
    """A stalled peer's error says whether the RDMA or the NVLink leg waited (or a coordinator, on its own block)."""
    sites = re.findall(r'WaitSite\{"([^"]+)"', SOURCE)
    assert len(sites) >= 12
    for site in sites:
        assert "RDMA" in site or "NVLink" in site or "coordinator" in site, site
