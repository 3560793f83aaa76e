"""Peer memory: the NVLink buffer shared by CUDA IPC, the NVSHMEM symmetric heap, and the one device-side
``PeersTable`` through which kernels see both (layout in cuda_src/peers.cuh).

Collective resources are closed explicitly (``close()`` or ``with``), never in ``__del__``: closing is a
collective (a peer may still be reading our memory until everyone has arrived).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .env import settings
from .errors import EpjitError, EpjitTimeoutError, SetupError, with_rank

if TYPE_CHECKING:
    from .group import Group

log = logging.getLogger("epjit.memory")

# Mirrors of cuda_src/peers.cuh (tests/test_layouts.py checks every number against the header).
MAX_NVL_RANKS = 8
MAX_RANKS = 1024
NVL_HEADER_BYTES = 8192
WAIT_RECORD_BYTES = 128
PEERS_TABLE_BYTES = 8320
PEERS_TABLE_OFFSETS = {
    "rank": 0, "num_ranks": 4, "nvl_rank": 8, "num_nvl_ranks": 12, "nvl_bytes": 16, "sym_bytes": 24,
    "timeout_ns": 32, "wait_record": 40, "sym_base": 48, "wait_claim": 56, "nvl": 64, "sym_peer": 128,
}
WAIT_RECORD_DTYPE = np.dtype({
    "names": ["status", "rank", "peer", "channel", "expected", "observed", "elapsed_ns", "site"],
    "formats": ["<i4", "<i4", "<i4", "<i4", "<i8", "<i8", "<i8", "S88"],
    "offsets": [0, 4, 8, 12, 16, 24, 32, 40],
    "itemsize": WAIT_RECORD_BYTES,
})

_ALIGN = 256

# What this process holds now, by kind: the soak script (scripts/soak_buffers.py) reads it to prove that closing
# every Buffer gives everything back.
_live: dict[str, int] = {"mapped_host_bytes": 0, "ipc_mappings": 0, "nvl_buffer_bytes": 0, "heap_bytes": 0}


def live_resources() -> dict[str, int]:
    """Pinned host bytes mapped for kernels, peer buffers mapped through CUDA IPC, this rank's own NVLink buffer
    bytes and NVSHMEM heap bytes that epjit holds now, and whether NVSHMEM is initialised (1 or 0)."""
    return {**_live, "nvshmem_initialised": int(_nvshmem_state["initialised"])}


def _round_up(n: int, align: int = _ALIGN) -> int:
    return (n + align - 1) // align * align


class MappedHostArray:
    """Pinned host memory mapped into the device: kernels write it, the host reads it with no copy (after a
    stream synchronisation), and it stays readable even after a kernel trap has lost the CUDA context."""

    def __init__(self, num_bytes: int) -> None:
        import cupy

        rt = cupy.cuda.runtime
        self.num_bytes = int(num_bytes)
        self._host = rt.hostAlloc(self.num_bytes, rt.hostAllocMapped)
        from cuda.bindings import runtime as cudart

        err, device_ptr = cudart.cudaHostGetDevicePointer(self._host, 0)
        if err != cudart.cudaError_t.cudaSuccess:
            rt.freeHost(self._host)
            raise SetupError(with_rank(f"cudaHostGetDevicePointer failed: {err}"))
        self.device_ptr = int(device_ptr)
        buffer = (np.ctypeslib.ctypes.c_uint8 * self.num_bytes).from_address(self._host)
        self.bytes = np.ctypeslib.as_array(buffer)
        self.bytes[:] = 0
        self.ints = self.bytes[: self.num_bytes // 4 * 4].view(np.int32)  # the usual reading, made once
        _live["mapped_host_bytes"] += self.num_bytes

    def view(self, dtype: Any) -> np.ndarray:
        return self.bytes.view(dtype)

    def parts(self, num_bytes: int) -> list[MappedHostPart]:
        """The array cut into whole pieces of num_bytes, each read and written like an array of its own; this
        array keeps the memory (closing a piece does nothing), so many small records cost one allocation."""
        return [MappedHostPart(self, offset, num_bytes)
                for offset in range(0, self.num_bytes - num_bytes + 1, num_bytes)]

    def close(self) -> None:
        if self._host:
            import cupy

            cupy.cuda.runtime.freeHost(self._host)
            self._host = 0
            _live["mapped_host_bytes"] -= self.num_bytes


class MappedHostPart(MappedHostArray):
    """num_bytes of a MappedHostArray from offset: the same reading, device pointer and lifetime as the whole."""

    def __init__(self, whole: MappedHostArray, offset: int, num_bytes: int) -> None:
        self.num_bytes = int(num_bytes)
        self._host = 0  # nothing of its own to free
        self.device_ptr = whole.device_ptr + offset
        self.bytes = whole.bytes[offset:offset + self.num_bytes]
        self.ints = self.bytes[: self.num_bytes // 4 * 4].view(np.int32)


class WaitRecord(MappedHostArray):
    """Where a timed-out kernel spin-wait leaves what it waited for (cuda_src/wait.cuh)."""

    def __init__(self) -> None:
        super().__init__(WAIT_RECORD_BYTES)
        self._view = self.bytes

    def read(self) -> dict[str, Any] | None:
        if int(self._view.view(WAIT_RECORD_DTYPE)[0]["status"]) == 0:
            return None
        return self.decode(self._view)

    @staticmethod
    def decode(raw: np.ndarray) -> dict[str, Any]:
        """The fields of one record (WAIT_RECORD_BYTES of uint8), the site as text."""
        rec = raw.view(WAIT_RECORD_DTYPE)[0]
        return {k: (rec[k].decode(errors="replace") if k == "site" else int(rec[k])) for k in WAIT_RECORD_DTYPE.names}

    def error(self) -> EpjitTimeoutError | None:
        rec = self.read()
        if rec is None:
            return None
        where = f"peer rank {rec['peer']}" if rec["peer"] >= 0 else "no particular peer"
        channel = f", channel {rec['channel']}" if rec["channel"] >= 0 else ""
        return EpjitTimeoutError(
            f"rank {rec['rank']} timed out after {rec['elapsed_ns'] / 1e9:.1f} s in {rec['site']} "
            f"(waiting for {where}{channel}; expected {rec['expected']}, last saw {rec['observed']}). "
            "The CUDA context of this process is lost: let the launcher end every rank and restart. "
            "EPJIT_TIMEOUT_S sets the limit."
        )


class NvlBuffer:
    """A device buffer per rank, mapped into every rank of the same NVLink node through CUDA IPC handles
    (``whole_group``: into every rank of the group, which must be on one host; ``peer_ptrs`` is then by rank).

    Layout: ``kNvlHeaderBytes`` of control words (barrier signals first), then ``num_bytes`` of payload.
    """

    def __init__(self, group: Group, num_bytes: int, whole_group: bool = False) -> None:
        import cupy

        rt = cupy.cuda.runtime
        self.group = group
        self.num_bytes = int(num_bytes)
        self.total_bytes = NVL_HEADER_BYTES + _round_up(self.num_bytes)
        # Its own cudaMalloc, not a pool sub-allocation: an IPC handle maps a whole allocation.
        self.base = rt.malloc(self.total_bytes)
        _live["nvl_buffer_bytes"] += self.total_bytes
        self.peer_ptrs: list[int] = []
        self._opened: list[int] = []
        try:
            # All of it: the header's barrier signals, and the ring counters the internode kernels keep in the
            # payload from the Buffer's creation on (they are never cleared by a kernel).
            rt.memset(self.base, 0, self.total_bytes)
            rt.deviceSynchronize()
            handle = bytes(rt.ipcGetMemHandle(self.base))
            handles = group.allgather_bytes(handle)
            first, count = (0, group.size) if whole_group else (group.nvl_node * group.num_nvl_ranks,
                                                                 group.num_nvl_ranks)
            for rank in range(first, first + count):
                if rank == group.rank:
                    self.peer_ptrs.append(self.base)
                    continue
                ptr = rt.ipcOpenMemHandle(handles[rank], rt.cudaIpcMemLazyEnablePeerAccess)
                self._opened.append(ptr)
                _live["ipc_mappings"] += 1
                self.peer_ptrs.append(ptr)
            # Nobody may write into a peer's header before that peer has cleared it.
            group.barrier()
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        import cupy

        rt = cupy.cuda.runtime
        for ptr in self._opened:
            rt.ipcCloseMemHandle(ptr)
            _live["ipc_mappings"] -= 1
        self._opened.clear()
        if self.base:
            rt.free(self.base)
            self.base = 0
            _live["nvl_buffer_bytes"] -= self.total_bytes

    def close(self) -> None:
        """Collective: waits until no peer can still touch our memory, unmaps the peers', frees ours."""
        if not self.base:
            return
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
        self.group.barrier()
        self._release()


def symmetric_memory(group: Group, force_puts: bool = False, one_node_nvshmem: bool = False,
                     rdma_by_stores: bool = False) -> str:
    """Where a Buffer's symmetric region belongs: "ipc" inside one NVLink node, where every peer is reached by
    pointer and NVSHMEM need not start (no init, no library needed), and on one host with EPJIT_RDMA_BY_STORES
    (puts become NVLink stores: forced ones too); "nvshmem" across nodes (puts), when puts are forced
    (EPJIT_LL_FORCE_PUTS) or when EPJIT_ONE_NODE_NVSHMEM asks for NVSHMEM's heap anyway. SetupError where
    EPJIT_RDMA_BY_STORES cannot hold (a group across hosts)."""
    if rdma_by_stores:
        hosts = len(set(group.hosts))
        if hosts > 1:
            raise SetupError(with_rank(f"EPJIT_RDMA_BY_STORES=1 maps every rank's memory into every other through "
                                       f"CUDA IPC, which reaches one host, and this group spans {hosts}: unset it"))
        return "ipc"
    return "nvshmem" if group.num_nvl_ranks < group.size or force_puts or one_node_nvshmem else "ipc"


class IpcHeap:
    """The symmetric region of a group on one host, on CUDA IPC memory instead of NVSHMEM's heap: every rank
    allocates the same size and maps every peer's, so an offset means the same place on every rank and every peer
    has a load/store pointer. Kernels that reach all their peers by pointer (the low-latency build without
    NVSHMEM's device library, the internode build with the RDMA leg as stores) need nothing more, and NVSHMEM
    never starts. Zeroed, like the heap. One NVLink node, or (virtual nodes) every rank of the group on one host."""

    has_direct_peers = True

    def __init__(self, group: Group, num_bytes: int) -> None:
        hosts = len(set(group.hosts))
        if hosts > 1:
            raise SetupError(with_rank(f"CUDA IPC reaches one host, and this group spans {hosts}: its symmetric "
                                       "memory must be NVSHMEM's heap"))
        self.num_bytes = _round_up(int(num_bytes))
        # Its header (barrier signals) stays unused. peer_ptrs by rank: the whole group, on one host.
        self._buffer = NvlBuffer(group, self.num_bytes, whole_group=True)
        self.base = self._buffer.base + NVL_HEADER_BYTES
        self.peer_ptrs = [ptr + NVL_HEADER_BYTES for ptr in self._buffer.peer_ptrs]

    def close(self) -> None:
        """Collective, like NvlBuffer.close."""
        self._buffer.close()


# NVSHMEM is initialised by the first heap of a group and finalised when that group closes, not when its last
# heap does: an init/finalize pair costs ~1.7 s and keeps ~2 MiB of device memory that NVSHMEM never gives back
# (measured on an H100), which a process making low-latency Buffers one after another would pay every time.
_nvshmem_state: dict[str, Any] = {"initialised": False, "users": 0, "group": None, "heap_limit": 0}
_before_finalize: list[Callable[[], None]] = []
MIN_NVSHMEM = (3, 8)  # the host library must match the device library the kernels link, which needs 3.8


def before_nvshmem_finalize(hook: Callable[[], None]) -> None:
    """Run ``hook`` before NVSHMEM is finalised (once registered, at every finalise): whoever loads modules linked
    with NVSHMEM's device library registers their unloading here, which must happen first."""
    if hook not in _before_finalize:
        _before_finalize.append(hook)


def _nvshmem_init(group: Group, heap_bytes: int) -> None:
    """Initialise NVSHMEM for ``group`` unless it already is: unique id from rank 0, broadcast over the group, uid
    bootstrap. Every rank of the group makes the same decisions (a heap is made collectively)."""
    state = _nvshmem_state
    if state["initialised"]:
        if state["group"] is not group:
            raise SetupError(with_rank(f"NVSHMEM is initialised for another group ({state['group']!r}): close "
                                       "that group's Buffers, then the group, before making a Buffer with a "
                                       "symmetric heap on this one"))
        if state["users"] or heap_bytes <= state["heap_limit"] or "NVSHMEM_SYMMETRIC_SIZE" in os.environ:
            return  # (a heap that does not fit says so at nvshmem_malloc)
        _nvshmem_finalize()  # no heap left and a larger one asked for: reserve again, larger
    # NVLink multicast (NVLS) objects can take a shared host's GPUs down; epjit never needs them.
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    # The symmetric heap is reserved at init: make it large enough for what is asked, unless the user chose.
    size = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    chosen = max(1 << 30, _round_up(heap_bytes, 1 << 29) + (1 << 29))
    try:
        import nvshmem.core as nvshmem_core
        from cuda.core import Device
        from nvshmem import bindings as nvshmem_bindings
    except ImportError as e:
        missing = f"NVSHMEM needs nvshmem4py and cuda-core: pip install 'epjit[cuda13]' ({e})"
        raise SetupError(with_rank(missing)) from None
    version = nvshmem_core.get_version().libnvshmem_version
    if tuple(int(p) for p in version.split(".")[:2]) < MIN_NVSHMEM:
        raise SetupError(with_rank(f"the loaded libnvshmem_host is NVSHMEM {version}, but epjit needs >= "
                                   f"{MIN_NVSHMEM[0]}.{MIN_NVSHMEM[1]}: pip install 'nvidia-nvshmem-cu13>=3.8'"))
    uid = nvshmem_core.get_unique_id(empty=group.rank != 0)
    uid_bytes = uid._data.view(np.uint8)  # the id is a small struct; it travels as raw bytes
    raw = group.bcast_bytes(uid_bytes.tobytes() if group.rank == 0 else None, root=0)
    uid_bytes[:] = np.frombuffer(raw, dtype=np.uint8)
    device = Device(group.device)
    device.set_current()
    if size is None:
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(chosen)  # read by init; taken out again below
    try:
        nvshmem_core.init(device=device, uid=uid, rank=group.rank, nranks=group.size, initializer_method="uid")
    finally:
        if size is None:
            del os.environ["NVSHMEM_SYMMETRIC_SIZE"]
    if nvshmem_bindings.my_pe() != group.rank or nvshmem_bindings.n_pes() != group.size:
        raise SetupError(with_rank(f"NVSHMEM says PE {nvshmem_bindings.my_pe()} of {nvshmem_bindings.n_pes()}, "
                                   f"the group says rank {group.rank} of {group.size}"))
    # A size the user chose (NVSHMEM's own syntax, "2G" say) is never re-reserved: only epjit's own is compared.
    state.update(initialised=True, group=group, heap_limit=chosen if size is None else 0)
    group.on_close(lambda: _finalize_with(group))


def _finalize_with(group: Group) -> None:
    """The group that initialised NVSHMEM is closing: finalise it, unless heaps are still open (a Buffer not
    closed) or a collective of the group failed (a peer gone would never reach finalize's barrier)."""
    if _nvshmem_state["group"] is group and group.broken is None:
        _nvshmem_finalize()


def _nvshmem_finalize() -> None:
    if not _nvshmem_state["initialised"] or _nvshmem_state["users"] > 0:
        return
    import nvshmem.core as nvshmem_core

    for hook in _before_finalize:  # modules must be cumodule-finalised before NVSHMEM goes
        hook()
    nvshmem_core.finalize()
    _nvshmem_state.update(initialised=False, group=None, heap_limit=0)


class SymmetricHeap:
    """One NVSHMEM symmetric allocation of ``num_bytes`` (zeroed), with its peer pointers."""

    def __init__(self, group: Group, num_bytes: int) -> None:
        import cupy

        self.group = group
        self.num_bytes = _round_up(int(num_bytes))
        _nvshmem_init(group, self.num_bytes)
        from nvshmem import bindings as nvshmem_bindings

        self.base = 0
        try:
            self.base = int(nvshmem_bindings.malloc(self.num_bytes))  # collective
            if self.base == 0:
                raise SetupError(with_rank(f"nvshmem_malloc({self.num_bytes}) returned NULL: raise "
                                           "NVSHMEM_SYMMETRIC_SIZE or ask for fewer num_rdma_bytes"))
            _nvshmem_state["users"] += 1
            _live["heap_bytes"] += self.num_bytes
            cupy.cuda.runtime.memset(self.base, 0, self.num_bytes)
            cupy.cuda.runtime.deviceSynchronize()
            # nvshmem_ptr gives a load/store pointer where the PE is reachable over NVLink (P2P), else NULL. A PE
            # of another NVLink node (num_nvl_ranks) gets none even where NVSHMEM would give one (virtual nodes on
            # one host): the kernels then reach it through NVSHMEM puts, the path a cluster's other nodes take.
            node = group.nvl_node
            self.peer_ptrs = [int(nvshmem_bindings.ptr(self.base, pe)) if pe // group.num_nvl_ranks == node else 0
                              for pe in range(group.size)]
            nvshmem_bindings.barrier_all()
        except BaseException:
            self.close()
            raise

    @property
    def has_direct_peers(self) -> bool:
        return all(p != 0 for p in self.peer_ptrs)

    def close(self) -> None:
        """Collective: frees the allocation (NVSHMEM stays initialised until the group closes)."""
        if not _nvshmem_state["initialised"]:
            return
        import cupy
        from nvshmem import bindings as nvshmem_bindings

        cupy.cuda.runtime.deviceSynchronize()
        if self.base:
            nvshmem_bindings.free(self.base)  # collective
            self.base = 0
            _live["heap_bytes"] -= self.num_bytes
            _nvshmem_state["users"] -= 1


@dataclass
class PeerMemory:
    """What a Buffer owns: the NVLink buffer, the symmetric heap (either may be absent), the device PeersTable
    that points kernels at both, and the wait record that turns a kernel timeout into a Python exception."""

    group: Group
    nvl: NvlBuffer | None
    sym: SymmetricHeap | IpcHeap | None
    wait_record: WaitRecord
    table: Any  # cupy uint8 array of PEERS_TABLE_BYTES in device memory
    setup_seconds: dict[str, float]  # set-up seconds: nvl, symmetric (NVSHMEM init + heap, or IPC), table
    owner: PeerMemory | None = None  # a region of that PeerMemory (tail_region), which owns the memory

    @classmethod
    def create(cls, group: Group, num_nvl_bytes: int, num_rdma_bytes: int, timeout_s: float | None = None,
               symmetric: str = "nvshmem") -> PeerMemory:
        """``symmetric``: where the ``num_rdma_bytes`` region lives, "nvshmem" (its heap: puts and signals work)
        or "ipc" (CUDA IPC memory, one host only: pointers only, NVSHMEM never starts)."""
        if symmetric not in ("nvshmem", "ipc"):
            raise ValueError(f"symmetric={symmetric!r}: expected 'nvshmem' or 'ipc'")
        if group.device is None:
            raise SetupError(with_rank("peer memory needs a GPU, and epjit.init() bound none on this rank"))
        if group.num_nvl_ranks > MAX_NVL_RANKS:
            raise SetupError(with_rank(f"num_nvl_ranks={group.num_nvl_ranks} > {MAX_NVL_RANKS} supported"))
        if group.size > MAX_RANKS:
            raise SetupError(with_rank(f"{group.size} ranks > {MAX_RANKS} supported"))
        import cupy

        # The rank's GPU the calling thread's current device again, since every allocation below goes to the
        # current device: what ran since epjit.init() bound it may have made another current (JAX's client makes a
        # context on every GPU it sees).
        cupy.cuda.Device(group.device).use()
        t0 = time.perf_counter()
        nvl = sym = record = None
        try:
            record = WaitRecord()
            nvl = NvlBuffer(group, num_nvl_bytes) if num_nvl_bytes > 0 else None
            t1 = time.perf_counter()
            heap = IpcHeap if symmetric == "ipc" else SymmetricHeap
            sym = heap(group, num_rdma_bytes) if num_rdma_bytes > 0 else None
            t2 = time.perf_counter()
            host = np.zeros(PEERS_TABLE_BYTES, dtype=np.uint8)
            o = PEERS_TABLE_OFFSETS
            timeout = settings().timeout_s if timeout_s is None else float(timeout_s)
            host[o["rank"]:o["rank"] + 16].view(np.int32)[:] = [group.rank, group.size, group.nvl_rank,
                                                                 group.num_nvl_ranks]
            host[o["nvl_bytes"]:o["nvl_bytes"] + 16].view(np.int64)[:] = [
                nvl.num_bytes if nvl else 0, sym.num_bytes if sym else 0]
            host[o["timeout_ns"]:o["timeout_ns"] + 24].view(np.uint64)[:] = [
                int(timeout * 1e9), record.device_ptr, sym.base if sym else 0]
            if nvl is not None:
                host[o["nvl"]:o["nvl"] + 8 * len(nvl.peer_ptrs)].view(np.uint64)[:] = nvl.peer_ptrs
            if sym is not None:
                host[o["sym_peer"]:o["sym_peer"] + 8 * group.size].view(np.uint64)[:] = sym.peer_ptrs
            table = cupy.asarray(host)
            cupy.cuda.runtime.deviceSynchronize()
        except BaseException:
            for part in (sym, nvl, record):
                if part is not None:
                    part.close()
            raise
        t3 = time.perf_counter()
        return cls(group, nvl, sym, record, table,
                   {"nvl": round(t1 - t0, 3), "symmetric": round(t2 - t1, 3), "table": round(t3 - t2, 3)})

    @property
    def table_ptr(self) -> int:
        return int(self.table.data.ptr)

    def tail_region(self, num_bytes: int) -> PeerMemory:
        """The last ``num_bytes`` (a multiple of 256) of the symmetric region as a PeerMemory of its own: the same
        NVLink buffer and wait record, a symmetric region that begins that far in on every rank, and a PeersTable
        that says so. Kernels address the heap from sym_base and sym_peer only, so they run unchanged in it: a
        Buffer serving both modes across nodes gives it to low-latency mode. Closing it frees its table only."""
        sym = self.sym
        if sym is None or num_bytes % _ALIGN or not 0 < num_bytes <= sym.num_bytes:
            raise ValueError(f"tail_region({num_bytes}) of a symmetric region of "
                             f"{None if sym is None else sym.num_bytes} bytes")
        import cupy

        offset = sym.num_bytes - num_bytes  # a multiple of 256, as both sizes are
        region = copy.copy(sym)  # the same kind (IpcHeap or SymmetricHeap): the kernels are chosen by it
        region.base, region.num_bytes = sym.base + offset, num_bytes
        region.peer_ptrs = [ptr + offset if ptr else 0 for ptr in sym.peer_ptrs]  # 0: reached by puts, not moved
        host = cupy.asnumpy(self.table)
        o = PEERS_TABLE_OFFSETS
        host[o["sym_bytes"]:o["sym_bytes"] + 8].view(np.int64)[:] = num_bytes
        host[o["sym_base"]:o["sym_base"] + 8].view(np.uint64)[:] = region.base
        host[o["sym_peer"]:o["sym_peer"] + 8 * len(region.peer_ptrs)].view(np.uint64)[:] = region.peer_ptrs
        with cupy.cuda.Device(self.group.device):  # (called later than create: another device may be current)
            table = cupy.asarray(host)
            cupy.cuda.runtime.deviceSynchronize()
        return PeerMemory(self.group, self.nvl, region, self.wait_record, table, {}, owner=self)

    def nvl_payload_ptr(self, nvl_rank: int | None = None) -> int:
        """Device address of the payload of nvl rank's buffer (default: mine), as mapped in this process."""
        if self.nvl is None:
            raise EpjitError(with_rank("this PeerMemory has no NVLink buffer (num_nvl_bytes=0)"))
        return self.nvl.peer_ptrs[self.group.nvl_rank if nvl_rank is None else nvl_rank] + NVL_HEADER_BYTES

    def synchronize(self, stream: Any = None) -> None:
        """Wait for ``stream`` (default: the device); a kernel timeout becomes EpjitTimeoutError."""
        import cupy

        try:
            if stream is None:
                cupy.cuda.runtime.deviceSynchronize()
            else:
                stream.synchronize()
        except cupy.cuda.runtime.CUDARuntimeError as e:
            self.raise_for(e)

    def raise_for(self, error: BaseException) -> None:
        timeout = self.wait_record.error()
        if timeout is not None:
            raise timeout from error
        raise EpjitError(with_rank(f"CUDA error while waiting for epjit kernels: {error}")) from error

    def close(self) -> None:
        """Collective. Closes the symmetric region (NVSHMEM's heap or IPC memory), the IPC mappings and the wait
        record."""
        if self.table is None:
            return
        if self.owner is not None:  # a region: the owner closes the memory
            self.table = None
            return
        try:
            if self.sym is not None:
                self.sym.close()
            if self.nvl is not None:
                self.nvl.close()
        finally:
            self.table = None
            self.wait_record.close()
