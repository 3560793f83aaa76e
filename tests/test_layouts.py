"""The PeersTable and WaitRecord layouts packed in Python must match cuda_src/peers.cuh number for number."""

from __future__ import annotations

import re

from epjit import memory
from epjit.kernels import cuda_sources

CUDA_SRC = cuda_sources()

HEADER = (CUDA_SRC / "peers.cuh").read_text()


def _constexpr(name: str) -> int:
    m = re.search(rf"constexpr\s+\w+\s+{name}\s*=\s*(\d+)\s*;", HEADER)
    assert m, name
    return int(m.group(1))


def test_constants_match_header():
    assert memory.MAX_NVL_RANKS == _constexpr("kMaxNvlRanks")
    assert memory.MAX_RANKS == _constexpr("kMaxRanks")
    assert memory.NVL_HEADER_BYTES == _constexpr("kNvlHeaderBytes")
    # The intranode rank script reads the channel barrier rows there (it imports torch and CuPy: read as text).
    script = (CUDA_SRC.parent / "tests" / "ranks" / "intranode.py")
    if script.is_file():  # a checkout, not an installed wheel
        rows_at = re.search(r"^CHANNEL_ROWS_AT = (\d+)", script.read_text(), re.M)
        assert rows_at and int(rows_at.group(1)) == _constexpr("kNvlChannelBarrierOffset")


_C_SIZES = {"int32_t": 4, "int64_t": 8, "uint64_t": 8}


def _struct_offsets(name: str) -> tuple[dict[str, int], int]:
    """Field offsets of a struct of naturally aligned scalars, pointers and arrays of them, as C lays it out."""
    body = re.search(rf"struct {name} \{{(.*?)\}};", HEADER, re.S).group(1)
    offsets, offset = {}, 0
    for ctype, field, count in re.findall(r"^\s*([\w*]+(?:\s*\*)?)\s+(\w+)(?:\[(\w+)\])?;", body, re.M):
        size = 8 if ctype.endswith("*") else _C_SIZES[ctype]
        offset = (offset + size - 1) // size * size
        offsets[field] = offset
        n = 1 if not count else (int(count) if count.isdigit() else _constexpr(count))
        offset += size * n
    return offsets, (offset + 7) // 8 * 8


def test_peers_table_offsets_match_the_struct():
    offsets, size = _struct_offsets("PeersTable")
    assert {k: v for k, v in offsets.items() if k != "pad"} == memory.PEERS_TABLE_OFFSETS
    asserted = int(re.search(r"sizeof\(PeersTable\)\s*==\s*(\d+)", HEADER).group(1))
    assert size == asserted == memory.PEERS_TABLE_BYTES
    o = memory.PEERS_TABLE_OFFSETS
    assert o["sym_peer"] + 8 * memory.MAX_RANKS == memory.PEERS_TABLE_BYTES
    assert o["nvl"] + 8 * memory.MAX_NVL_RANKS == o["sym_peer"]


def test_wait_record_dtype_matches_struct():
    body = re.search(r"struct WaitRecord \{(.*?)\};", HEADER, re.S).group(1)
    fields = re.findall(r"^\s*(\w+)\s+(\w+)(\[\d+\])?;", body, re.M)
    assert [f[1] for f in fields] == list(memory.WAIT_RECORD_DTYPE.names)
    sizes = {"int32_t": 4, "int64_t": 8}
    offset = 0
    for ctype, name, array in fields:
        assert memory.WAIT_RECORD_DTYPE.fields[name][1] == offset, name
        offset += int(array[1:-1]) if array else sizes[ctype]
    assert offset == memory.WAIT_RECORD_DTYPE.itemsize == memory.WAIT_RECORD_BYTES


def test_layout_allocation_holds_per_node_counts_among_the_counts():
    """get_dispatch_layout's one allocation: per-node counts only on a group of several NVLink nodes, placed before
    invalid_ids and is_token_in_rank, so the memset of the counts (multi-block layouts) zeroes them too."""
    import numpy as np

    from epjit.ops.layout import DispatchLayout, MadeLayout

    one = MadeLayout.offsets(100, 8, 64)
    two = MadeLayout.offsets(100, 8, 64, num_nodes=2)
    assert one[2] == one[5] and two[2] == two[5] + 256  # 2 nodes: 8 bytes, one aligned part
    assert all(o % 256 == 0 for o in two) and two[3] > two[2] > two[5] > two[1]
    owner = np.zeros(two[4], np.uint8)
    owner[two[5]:two[5] + 8].view(np.int32)[:] = [70, 41]
    made = MadeLayout(owner, "cupy", "cupy", 100, 8, 64, 0, two[1], two[2], two[3], num_nodes=2)
    assert DispatchLayout(made=made).num_tokens_per_rdma_rank.tolist() == [70, 41]
    single = MadeLayout(np.zeros(one[4], np.uint8), "cupy", "cupy", 100, 8, 64, 0, one[1], one[2], one[3])
    assert DispatchLayout(made=single).num_tokens_per_rdma_rank is None
    # Assigning any array keeps the others the caller could see, the per-node counts included.
    layout = DispatchLayout(made=made)
    layout.num_tokens_per_expert = np.zeros(64, np.int32)
    assert layout.made is None and layout.num_tokens_per_rdma_rank.tolist() == [70, 41]
