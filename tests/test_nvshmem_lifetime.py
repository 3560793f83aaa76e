"""When epjit starts and finalises NVSHMEM, on the CPU with stand-ins for NVSHMEM, cuda.core and CuPy: a group's
first symmetric heap starts it, later heaps reuse it, closing the group finalises it (a start/stop pair keeps
device memory NVSHMEM never gives back, so a Buffer must not pay one), and peers of other NVLink nodes get no
pointer (the kernels then use puts, as across a cluster)."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from epjit import memory
from epjit.errors import SetupError


class FakeNvshmem:
    """What epjit calls of nvshmem.core and nvshmem.bindings, counting the starts and stops."""

    def __init__(self) -> None:
        self.inits: list[str | None] = []  # NVSHMEM_SYMMETRIC_SIZE as each init saw it
        self.finalizes = 0
        self.next_base = 1 << 32

    def modules(self) -> dict[str, types.ModuleType]:
        core = types.ModuleType("nvshmem.core")
        core.get_version = lambda: types.SimpleNamespace(libnvshmem_version="3.8.0")
        core.get_unique_id = lambda empty: types.SimpleNamespace(_data=np.zeros(8, dtype=np.uint8))
        core.init = lambda **kw: self.inits.append(os.environ.get("NVSHMEM_SYMMETRIC_SIZE"))
        core.finalize = self._finalize
        bindings = types.ModuleType("nvshmem.bindings")
        bindings.my_pe = lambda: 0
        bindings.n_pes = lambda: 4
        bindings.malloc = self._malloc
        bindings.free = lambda base: None
        bindings.ptr = lambda base, pe: base + pe
        bindings.barrier_all = lambda: None
        package = types.ModuleType("nvshmem")
        package.core, package.bindings = core, bindings
        cuda_core = types.ModuleType("cuda.core")
        cuda_core.Device = lambda ordinal: types.SimpleNamespace(set_current=lambda: None)
        runtime = types.SimpleNamespace(memset=lambda *a: None, deviceSynchronize=lambda: None)
        cupy = types.ModuleType("cupy")
        cupy.cuda = types.SimpleNamespace(runtime=runtime)
        return {"nvshmem": package, "nvshmem.core": core, "nvshmem.bindings": bindings, "cuda.core": cuda_core,
                "cupy": cupy}

    def _malloc(self, num_bytes: int) -> int:
        self.next_base += 1 << 30
        return self.next_base

    def _finalize(self) -> None:
        self.finalizes += 1


class FakeGroup:
    """Rank 0 of 4 ranks in NVLink nodes of 2: what a heap asks of its group."""

    def __init__(self) -> None:
        self.rank, self.size, self.device, self.num_nvl_ranks, self.nvl_node = 0, 4, 0, 2, 0
        self.broken: str | None = None
        self.hooks: list[Callable[[], None]] = []

    def bcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        return data or bytes(8)

    def on_close(self, hook: Callable[[], None]) -> None:
        self.hooks.append(hook)

    def close(self) -> None:
        for hook in self.hooks:
            hook()
        self.hooks = []


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvshmem]:
    nv = FakeNvshmem()
    for name, module in nv.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    monkeypatch.setattr(memory, "_nvshmem_state", {"initialised": False, "users": 0, "group": None,
                                                   "heap_limit": 0})
    monkeypatch.setattr(memory, "_before_finalize", [])
    yield nv


def test_heaps_one_after_another_start_nvshmem_once_and_the_group_finalises_it(fake):
    group = FakeGroup()
    for _ in range(3):
        memory.SymmetricHeap(group, 64 << 20).close()
    assert len(fake.inits) == 1 and fake.finalizes == 0
    assert fake.inits[0] == str(1 << 30)  # what epjit reserved (at least 1 GiB), set only for init
    assert "NVSHMEM_SYMMETRIC_SIZE" not in os.environ
    group.close()
    assert fake.finalizes == 1 and not memory._nvshmem_state["initialised"]


def test_a_larger_heap_with_none_open_reserves_again_and_an_open_one_keeps_nvshmem(fake):
    group = FakeGroup()
    small = memory.SymmetricHeap(group, 64 << 20)
    small.close()
    big = memory.SymmetricHeap(group, 3 << 30)  # more than the 1 GiB reserved, none open: start again
    assert len(fake.inits) == 2 and fake.finalizes == 1
    assert int(fake.inits[1]) >= (3 << 30) + (1 << 29)
    group.close()  # a heap still open: NVSHMEM stays (finalize would free it under its owner)
    assert fake.finalizes == 1 and memory._nvshmem_state["initialised"]
    big.close()


def test_a_second_group_is_refused_while_the_first_holds_nvshmem(fake):
    memory.SymmetricHeap(FakeGroup(), 1 << 20).close()
    with pytest.raises(SetupError, match="initialised for another group"):
        memory.SymmetricHeap(FakeGroup(), 1 << 20)


def test_a_broken_group_does_not_finalise(fake):
    group = FakeGroup()
    memory.SymmetricHeap(group, 1 << 20).close()
    group.broken = "rank 3 is gone"
    group.close()  # finalize's barrier would wait for the lost rank for ever
    assert fake.finalizes == 0


def test_peers_of_other_nodes_get_no_pointer(fake):
    heap = memory.SymmetricHeap(FakeGroup(), 1 << 20)
    assert [p != 0 for p in heap.peer_ptrs] == [True, True, False, False]  # node 0 is ranks 0 and 1
    assert not heap.has_direct_peers
    heap.close()
