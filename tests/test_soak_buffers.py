"""CPU tier of scripts/soak_buffers.py's bookkeeping: which memory maps it judges (those backed by a file, a device or
shared memory, where a leaked mapping shows) and which it only reports (anonymous maps, which move with the
allocators), and that --explain's helpers find retained objects and growing allocation sites. The soak itself runs
in the GPU tier (test_gpu_reliability.py)."""

from __future__ import annotations

import importlib.util
import sys
import tracemalloc
import types
import weakref
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def soak():
    # The script imports CuPy and torch at the top for its GPU half; the bookkeeping tested here needs neither.
    stubs = {name: types.ModuleType(name) for name in ("cupy", "torch") if importlib.util.find_spec(name) is None}
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("soak_buffers", ROOT / "scripts" / "soak_buffers.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


MAPS = {
    "7f0000000000-7f0000100000 rw-s 00000000 00:05 1234                       /dev/nvidiactl": True,
    "7f0000100000-7f0000200000 rw-s 00000000 00:1a 77                         /dev/shm/epjit-7 (deleted)": True,
    "7f0000200000-7f0000300000 r-xp 00000000 08:01 99                         /usr/lib/libcuda.so.1": True,
    "558c74bcc000-558c75178000 rw-p 00000000 00:00 0                          [heap]": False,
    "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]": False,
    "7f87a0800000-7f87a0900000 rw-p 00000000 00:00 0 ": False,
}


def test_only_maps_backed_by_something_are_judged(soak):
    assert {line: soak._is_file_map(line) for line in MAPS} == MAPS
    assert "file_maps" in soak.JUDGED
    assert not set(soak.REPORTED) & set(soak.JUDGED)
    assert set(soak.REPORTED) == {"anonymous_maps", "resident_bytes"}


def test_map_change_names_what_came_and_went(soak):
    before = list(MAPS)[:3]
    after = [*list(MAPS)[1:3], list(MAPS)[5]]
    assert soak._map_change(before, after) == ["+1024 KiB rw-p [anonymous]", "-1024 KiB rw-s /dev/nvidiactl"]


class _Retained:
    pass


def test_object_growth_finds_dead_weak_references_kept_in_a_dict(soak):
    start = soak._live_objects()
    targets = [_Retained() for _ in range(50)]
    kept = {1000 + i: weakref.ref(t) for i, t in enumerate(targets)}
    del targets  # the weak references are dead now, and the dict still holds them
    lines = soak._object_growth(start)
    assert lines[0] == "+50 live weakref.ReferenceType", lines
    assert any(line.startswith("largest holder: builtins.dict of 50") for line in lines), lines
    assert any("point at: 50 builtins.NoneType" in line for line in lines), lines
    assert len(kept) == 50


def test_python_growth_names_the_line_that_allocated(soak):
    tracemalloc.start(4)
    try:
        start = tracemalloc.take_snapshot()
        kept = [bytes(2000) for _ in range(100)]
        lines = soak._python_growth(start)
    finally:
        tracemalloc.stop()
    assert any(line.startswith("+") and "test_soak_buffers.py" in line for line in lines), lines
    assert len(kept) == 100


def test_soak_reports_the_changes_between_its_snapshots(soak, monkeypatch):
    """soak() around a stand-in cycle that keeps a 1 MiB anonymous map per cycle: the judged figures stay, the
    anonymous maps are counted but not judged, and the ones that came are listed (as new maps, or as a neighbour that
    grew: the kernel merges them). How many anonymous maps came is the allocators' business (tracemalloc, Python's
    arenas and malloc add their own: 9 on a fresh 2-core machine), so no count is asserted."""
    import mmap

    kept: list[mmap.mmap] = []

    def cycle(group, n):
        # private and anonymous, like an allocator's arena (a shared one shows as "/dev/zero (deleted)": a file)
        kept.append(mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
        kept[-1][0] = 1  # touch it

    class Group:
        rank = 0

        def barrier(self):
            pass

    pools = types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setattr(soak, "cupy", types.SimpleNamespace(
        get_default_memory_pool=lambda: pools, get_default_pinned_memory_pool=lambda: pools,
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(memGetInfo=lambda: (1 << 30, 1 << 31)))))
    monkeypatch.setattr(soak, "torch", types.SimpleNamespace(cuda=types.SimpleNamespace(
        synchronize=lambda: None, empty_cache=lambda: None)))
    monkeypatch.setitem(soak.KINDS, "stand-in", cycle)
    found = soak.soak(Group(), "stand-in", cycles=3, warmup=1, explain=True)
    assert found["cycles"] == 3 and len(kept) == 4
    assert found["change"]["gpu_free_bytes"] == 0 and found["change"]["file_maps"] == 0
    assert "anonymous_maps" in soak.REPORTED and "anonymous_maps" not in soak.JUDGED
    assert isinstance(found["change"]["anonymous_maps"], int)
    assert any(line.startswith("+") and "[anonymous]" in line for line in found["maps_changed"]), found
    assert any("mmap.mmap" in line for line in found["python_growth"]), found["python_growth"]
