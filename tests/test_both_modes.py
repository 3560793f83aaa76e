"""One Buffer for both modes across NVLink nodes, on the CPU: where each mode's region lies in the symmetric heap
(normal mode's from the start, low-latency mode's the last get_low_latency_size_hint bytes, disjoint on every
rank), the PeersTable that moves low-latency mode's base (PeerMemory.tail_region, over a stand-in for CuPy), the
resources each front gets, and the size checks that name num_rdma_bytes and each mode's bytes."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

import epjit.front as front
from epjit import memory
from epjit.config import get_combine_config, get_dispatch_config, rdma_size_hint
from epjit.errors import ArgumentError
from epjit.front import Resources, both_modes, checked_sizes, fronts
from epjit.kernels.low_latency import LowLatencyPutsSpec, LowLatencySpec, low_latency_size_hint
from epjit.memory import PEERS_TABLE_BYTES, PEERS_TABLE_OFFSETS, IpcHeap, PeerMemory
from epjit.ops.low_latency import kernels_for

from .test_ipc_heap import FakeGroup, runtime  # noqa: F401 (runtime: the fixture)

OFF = PEERS_TABLE_OFFSETS


def _table(sym) -> np.ndarray:
    """The fields of a PeersTable that PeerMemory.create writes for the symmetric region."""
    host = np.zeros(PEERS_TABLE_BYTES, dtype=np.uint8)
    host[OFF["sym_bytes"]:OFF["sym_bytes"] + 8].view(np.int64)[:] = sym.num_bytes
    host[OFF["sym_base"]:OFF["sym_base"] + 8].view(np.uint64)[:] = sym.base
    host[OFF["sym_peer"]:OFF["sym_peer"] + 8 * len(sym.peer_ptrs)].view(np.uint64)[:] = sym.peer_ptrs
    host[OFF["timeout_ns"]:OFF["timeout_ns"] + 8].view(np.uint64)[:] = 123
    return host


def _fields(table: np.ndarray, ranks: int) -> tuple[int, int, list[int], int]:
    return (int(table[OFF["sym_bytes"]:OFF["sym_bytes"] + 8].view(np.int64)[0]),
            int(table[OFF["sym_base"]:OFF["sym_base"] + 8].view(np.uint64)[0]),
            [int(p) for p in table[OFF["sym_peer"]:OFF["sym_peer"] + 8 * ranks].view(np.uint64)],
            int(table[OFF["timeout_ns"]:OFF["timeout_ns"] + 8].view(np.uint64)[0]))


@pytest.fixture
def cupy_tables(runtime, monkeypatch):  # noqa: F811 (the fixture, by name)
    cupy = sys.modules["cupy"]
    monkeypatch.setattr(cupy, "asnumpy", lambda a: np.array(a), raising=False)
    monkeypatch.setattr(cupy, "asarray", lambda a: np.array(a), raising=False)
    return runtime


def test_the_low_latency_region_is_the_heaps_tail_through_a_table_of_its_own(cupy_tables):
    group = FakeGroup(4, 2)
    heap = IpcHeap(group, 10_000)
    mem = PeerMemory(group, None, heap, SimpleNamespace(close=lambda: None), _table(heap), {})
    region = mem.tail_region(4096)
    offset = heap.num_bytes - 4096
    assert isinstance(region.sym, IpcHeap) and region.owner is mem and region.wait_record is mem.wait_record
    assert (region.sym.base, region.sym.num_bytes) == (heap.base + offset, 4096)
    assert region.sym.peer_ptrs == [p + offset for p in heap.peer_ptrs]
    assert _fields(region.table, 4) == (4096, heap.base + offset, region.sym.peer_ptrs, 123)
    assert _fields(mem.table, 4) == (heap.num_bytes, heap.base, heap.peer_ptrs, 123)  # the whole heap's unchanged
    assert type(kernels_for(False, region.sym)) is type(kernels_for(False, heap)) is LowLatencySpec
    region.close()
    assert region.table is None and len(cupy_tables.allocated) == 1  # the owner's memory stays
    for bad in (0, 100, heap.num_bytes + 256):
        with pytest.raises(ValueError, match="tail_region"):
            mem.tail_region(bad)
    heap.close()
    assert cupy_tables.allocated == {}


def test_peers_reached_by_puts_stay_so_in_the_region(cupy_tables):
    """NVSHMEM's heap across nodes: a peer of another node has no pointer (0), in the region too, so low-latency
    mode keeps its put build, and the puts' symmetric addresses move with sym_base."""

    class Heap(memory.SymmetricHeap):
        def __init__(self) -> None:  # no NVSHMEM: what a region copies
            self.base, self.num_bytes, self.peer_ptrs = 1 << 40, 1 << 20, [1 << 40, 0]

    heap = Heap()
    mem = PeerMemory(FakeGroup(2, 1), None, heap, SimpleNamespace(close=lambda: None), _table(heap), {})
    region = mem.tail_region(1 << 16)
    assert isinstance(region.sym, memory.SymmetricHeap) and region.sym.peer_ptrs == [(1 << 40) + (15 << 16), 0]
    assert type(kernels_for(False, region.sym)) is LowLatencyPutsSpec


class Recorded:
    def __init__(self, res, *args):
        self.res, self.args = res, args

    def close(self) -> None:
        pass


def _resources(num_nvl_ranks: int, num_nvl_bytes: int = 1 << 20) -> Resources:
    mem = SimpleNamespace(tail_region=lambda n: ("region", n))
    return Resources(FakeGroup(4, num_nvl_ranks), mem, None, None, None, None, 1, num_nvl_bytes, 1 << 30,
                     128, 7168, 256)


@pytest.mark.parametrize("num_nvl_ranks", [1, 2])
def test_a_buffer_of_both_modes_across_nodes_gives_each_mode_its_region(monkeypatch, num_nvl_ranks):
    for name in ("InternodeFront", "IntranodeFront", "LowLatencyFront"):
        monkeypatch.setattr(front, name, type(name, (Recorded,), {}))
    need = low_latency_size_hint(128, 7168, 4, 256)
    normal, low_latency = fronts(_resources(num_nvl_ranks), True)
    assert type(normal).__name__ == "InternodeFront" and normal.args == (False,)
    assert (normal.res.low_latency_heap_bytes, normal.res.num_rdma_bytes, normal.res.mem.tail_region(1)) == (
        need, 1 << 30, ("region", 1))  # the whole heap's memory and table: the internode kernels' offsets as ever
    assert (low_latency.res.mem, low_latency.res.num_rdma_bytes) == (("region", need), need)
    assert both_modes(_resources(num_nvl_ranks))[1].mem == ("region", need)
    # one mode, or both inside one node: nothing moves
    for res, mode in ((_resources(num_nvl_ranks), False), (_resources(num_nvl_ranks, 0), True), (_resources(4), True)):
        made = [f for f in fronts(res, mode) if isinstance(f, Recorded)]
        assert all(f.res is res and f.res.low_latency_heap_bytes == 0 for f in made)


@pytest.mark.parametrize("ranks, num_nvl_ranks", [(2, 1), (4, 2), (4, 1), (16, 8)])
def test_the_sum_of_the_hints_holds_both_modes_and_their_regions_are_disjoint(ranks, num_nvl_ranks):
    group = SimpleNamespace(size=ranks, num_nvl_ranks=num_nvl_ranks, check_same=lambda what, value: None)
    m, hidden, experts = 128, 7168, 256
    normal = rdma_size_hint(ranks, hidden, 8, experts, num_nvl_ranks=num_nvl_ranks)
    ll = low_latency_size_hint(m, hidden, ranks, experts)
    total = normal + ll
    assert checked_sizes(group, 1 << 30, total, True, m, hidden, experts) == total
    heap = memory._round_up(total)
    assert heap - ll >= total - ll == normal  # low latency's region begins where normal mode's may end, or after
    for config in (get_dispatch_config(ranks, num_nvl_ranks=num_nvl_ranks),
                   get_combine_config(ranks, num_nvl_ranks=num_nvl_ranks)):
        assert config.internode_bytes(ranks, num_nvl_ranks, hidden, 8, 4096)[1] <= total - ll
    with pytest.raises(ArgumentError, match=rf"num_rdma_bytes=1024 is below the \d+ bytes a Buffer serving both "
                                            rf"modes .* then low-latency mode's {ll} "):
        checked_sizes(group, 1 << 30, 1024, True, m, hidden, experts)
    with pytest.raises(ArgumentError, match="num_nvl_bytes=1 is below"):
        checked_sizes(group, 1, total, True, m, hidden, experts)
    # low latency alone, or normal mode alone, as before
    assert checked_sizes(group, 0, 0, True, m, hidden, experts) == ll
    assert checked_sizes(group, 1 << 30, normal, False, 0, 0, 0) == normal
