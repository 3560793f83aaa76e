"""The symmetric region on CUDA IPC memory (epjit.memory.IpcHeap), on the CPU with a stand-in for CuPy's runtime:
which Buffers get it (one NVLink node, puts not forced, NVSHMEM not asked for; virtual nodes on one host with
EPJIT_RDMA_BY_STORES), the pointers it gives the kernels (every rank's, past the header, at the same offsets), that
NVSHMEM never starts for it, that it refuses a group across hosts, that closing it gives back the allocation and
every mapping, and that a Buffer's peer memory lands on the rank's GPU whatever device is current."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

from epjit import memory
from epjit.errors import SetupError
from epjit.kernels.low_latency import LowLatencyPutsSpec, LowLatencySpec, LowLatencyStoresSpec
from epjit.memory import NVL_HEADER_BYTES, IpcHeap, PeerMemory, symmetric_memory
from epjit.ops.low_latency import kernels_for, needs_puts


class FakeRuntime:
    """What an IPC region asks of cupy.cuda.runtime: allocations, handles, mappings, each counted."""

    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self) -> None:
        self.allocated: dict[int, int] = {}  # base -> bytes
        self.mapped: set[int] = set()
        self.next = 1 << 40

    def malloc(self, num_bytes: int) -> int:
        self.next += 1 << 32
        self.allocated[self.next] = num_bytes
        return self.next

    def free(self, base: int) -> None:
        del self.allocated[base]

    def memset(self, base: int, value: int, num_bytes: int) -> None:
        assert value == 0 and num_bytes <= self.allocated[base]

    def deviceSynchronize(self) -> None:  # noqa: N802 (CUDA's name)
        pass

    def ipcGetMemHandle(self, base: int) -> bytes:  # noqa: N802
        return base.to_bytes(64, "little")

    def ipcOpenMemHandle(self, handle: bytes, flags: int) -> int:  # noqa: N802
        ptr = (1 << 46) + int.from_bytes(handle, "little")  # where the peer's allocation lands in this process
        self.mapped.add(ptr)
        return ptr

    def ipcCloseMemHandle(self, ptr: int) -> None:  # noqa: N802
        self.mapped.remove(ptr)


class FakeGroup:
    """Rank 1 of ``size`` ranks in NVLink nodes of ``num_nvl_ranks`` over ``num_hosts`` hosts; every peer's handle
    names its own base."""

    def __init__(self, size: int = 4, num_nvl_ranks: int = 4, num_hosts: int = 1) -> None:
        self.rank, self.size, self.device = 1, size, 0
        self.hosts = [f"host{r * num_hosts // size}" for r in range(size)]
        self.num_nvl_ranks, self.nvl_node, self.nvl_rank = num_nvl_ranks, 1 // num_nvl_ranks, 1 % num_nvl_ranks
        self.barriers = 0

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        mine = int.from_bytes(data, "little")
        return [(mine + (r - self.rank) * 0x1000).to_bytes(64, "little") for r in range(self.size)]

    def barrier(self) -> None:
        self.barriers += 1


class FakeDevice:
    """cupy.cuda.Device: binding a GPU current (use, or for a block) does nothing here."""

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal

    def use(self) -> None:
        pass

    def __enter__(self) -> FakeDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeRuntime]:
    rt = FakeRuntime()
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=rt, Device=FakeDevice)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    # NVSHMEM must not be touched: importing it fails here
    monkeypatch.setitem(sys.modules, "nvshmem", None)
    monkeypatch.setattr(memory, "_live", {"mapped_host_bytes": 0, "ipc_mappings": 0, "nvl_buffer_bytes": 0,
                                          "heap_bytes": 0})
    yield rt


def test_one_node_buffers_get_ipc_memory_unless_puts_or_nvshmem_are_asked_for():
    assert symmetric_memory(FakeGroup(4, 4)) == "ipc"
    assert symmetric_memory(FakeGroup(4, 2)) == "nvshmem"  # two nodes: puts to the other
    assert symmetric_memory(FakeGroup(4, 1)) == "nvshmem"
    assert symmetric_memory(FakeGroup(4, 4), force_puts=True) == "nvshmem"
    assert symmetric_memory(FakeGroup(4, 4), one_node_nvshmem=True) == "nvshmem"


def test_virtual_nodes_get_ipc_memory_with_rdma_by_stores_and_only_on_one_host():
    assert symmetric_memory(FakeGroup(4, 2), rdma_by_stores=True) == "ipc"
    assert symmetric_memory(FakeGroup(4, 1), rdma_by_stores=True) == "ipc"
    assert symmetric_memory(FakeGroup(4, 4), one_node_nvshmem=True, rdma_by_stores=True) == "ipc"
    with pytest.raises(SetupError, match="EPJIT_RDMA_BY_STORES=1 .*one host, and this group spans 2"):
        symmetric_memory(FakeGroup(4, 2, num_hosts=2), rdma_by_stores=True)
    assert symmetric_memory(FakeGroup(4, 4), force_puts=True, rdma_by_stores=True) == "ipc"  # puts as stores


@pytest.mark.parametrize("num_nvl_ranks", [4, 2, 1])
def test_every_peer_by_pointer_past_the_header_and_no_nvshmem(runtime, num_nvl_ranks):
    """One NVLink node, or virtual nodes on one host: every rank of the group mapped, by rank."""
    group = FakeGroup(4, num_nvl_ranks)
    heap = IpcHeap(group, 1000)
    (own,) = runtime.allocated
    assert heap.base == own + NVL_HEADER_BYTES
    assert heap.num_bytes == memory._round_up(1000) >= 1000
    assert runtime.allocated[own] == NVL_HEADER_BYTES + heap.num_bytes
    assert heap.peer_ptrs[group.rank] == heap.base
    assert heap.peer_ptrs == [(1 << 46) + own + (r - 1) * 0x1000 + NVL_HEADER_BYTES if r != 1 else heap.base
                              for r in range(4)]
    assert heap.has_direct_peers and not needs_puts(False, heap) and needs_puts(True, heap)
    assert type(kernels_for(False, heap)) is LowLatencySpec and type(kernels_for(True, heap)) is LowLatencyStoresSpec
    assert memory.live_resources()["ipc_mappings"] == 3
    assert memory.live_resources()["nvshmem_initialised"] == 0 and memory.live_resources()["heap_bytes"] == 0
    heap.close()
    assert runtime.allocated == {} and runtime.mapped == set()
    assert memory.live_resources()["ipc_mappings"] == 0 and memory.live_resources()["nvl_buffer_bytes"] == 0
    assert group.barriers == 2  # after the handles were opened, and before freeing: no peer still writes


def test_a_group_across_hosts_is_refused_before_anything_is_allocated(runtime):
    with pytest.raises(SetupError, match="one host, and this group spans 2.*NVSHMEM's heap"):
        IpcHeap(FakeGroup(4, 2, num_hosts=2), 1000)
    assert runtime.allocated == {}


def test_peer_memory_names_the_symmetric_kinds():
    with pytest.raises(ValueError, match="symmetric='ucx'"):
        PeerMemory.create(FakeGroup(), 0, 1 << 20, symmetric="ucx")


def test_the_low_latency_build_follows_the_heap_and_forced_puts():
    """NVSHMEM's heap: the plain build where every peer has a pointer, the NVSHMEM build where one has none or puts
    are forced; IPC memory never needs NVSHMEM (forced puts run as stores)."""

    class Heap(memory.SymmetricHeap):
        def __init__(self, ptrs: list[int]) -> None:  # no NVSHMEM: only what the choice reads
            self.peer_ptrs = ptrs

    assert type(kernels_for(False, Heap([1, 2]))) is LowLatencySpec
    assert type(kernels_for(False, Heap([1, 0]))) is LowLatencyPutsSpec
    assert type(kernels_for(True, Heap([1, 2]))) is LowLatencyPutsSpec
    assert type(kernels_for(False, None)) is LowLatencyPutsSpec
    assert LowLatencyPutsSpec.USES_NVSHMEM and not LowLatencyStoresSpec.USES_NVSHMEM
    assert LowLatencyStoresSpec.KERNELS == LowLatencySpec.KERNELS


def test_peer_memory_allocates_on_the_ranks_gpu_whatever_device_is_current(runtime, monkeypatch):
    """JAX's client (and any other library) may leave another GPU current after epjit.init() bound the rank's: every
    allocation of PeerMemory.create (NVLink buffer, IPC heap, peers table) still lands on the group's GPU."""
    current = {"device": 1}  # another GPU is current when the Buffer is made
    on_device: list[tuple[str, int]] = []

    class Device:
        def __init__(self, ordinal: int) -> None:
            self.ordinal, self.previous = ordinal, None

        def use(self) -> None:
            current["device"] = self.ordinal

        def __enter__(self) -> Device:
            self.previous, current["device"] = current["device"], self.ordinal
            return self

        def __exit__(self, *exc: object) -> None:
            current["device"] = self.previous

    malloc = runtime.malloc

    def recording_malloc(num_bytes: int) -> int:
        on_device.append(("malloc", current["device"]))
        return malloc(num_bytes)

    def asarray(host: object) -> object:
        on_device.append(("table", current["device"]))
        return types.SimpleNamespace(data=types.SimpleNamespace(ptr=1 << 30))

    monkeypatch.setattr(runtime, "malloc", recording_malloc)
    cupy = sys.modules["cupy"]
    cupy.cuda.Device = Device
    cupy.asarray = asarray

    class Record:  # the wait record's pinned host memory is not the GPU's
        device_ptr = 0

        def close(self) -> None:
            pass

    monkeypatch.setattr(memory, "WaitRecord", Record)
    group = FakeGroup(4, 4)  # its GPU: 0
    mem = PeerMemory.create(group, 1 << 20, 1 << 20, symmetric="ipc")
    assert on_device == [("malloc", 0), ("malloc", 0), ("table", 0)], on_device
    assert current["device"] == 0  # left bound: the Buffer's later allocations follow it
    del mem
