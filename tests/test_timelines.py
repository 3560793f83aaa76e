"""EPJIT_PROFILE's point names on the host must follow the kernels' enums (cuda_src/timeline.cuh stamps
timeline[block][point], or timeline[channel x roles + role][point] for the internode kernels; Buffer.profile() names
the slots with these tuples), the internode kernels' rows sum up role by role, and only their profile build stamps."""

from __future__ import annotations

import re

import numpy as np
import pytest

from epjit.jit import KernelSpec
from epjit.jit.compiler import compile_options
from epjit.kernels import (
    by_stores,
    check_specs,
    cuda_sources,
    internode,
    internode_combine_fp8_spec,
    internode_spec,
    intranode,
    jit_config,
    low_latency,
    profile_spec,
)
from epjit.kernels.foundation import (
    TIMELINE_ROLE_TAG_STRIDE,
    TIMELINE_SLOTS,
    TIMELINE_SM_SLOT,
    TIMELINE_TAG_SLOT,
    TimelineRole,
)
from epjit.ops.internode import Internode
from epjit.ops.profile import Profile, summarise_roles

CUDA_SRC = cuda_sources()


def _enum(source: str, name: str) -> list[tuple[str, int]]:
    body = re.search(rf"enum {name} \{{(.*?)\}};", (CUDA_SRC / source).read_text(), re.S)
    assert body, (source, name)
    return [(m.group(1), int(m.group(2))) for m in re.finditer(r"(k\w+) = (\d+),", body.group(1))]


def _snake(enumerator: str, prefix: str) -> str:
    words = re.findall(r"[A-Z][a-z]*", enumerator[len(prefix):])
    return "_".join(w.lower() for w in words)


@pytest.mark.parametrize(("source", "enum", "prefix", "points"), [
    ("intranode.cu", "IntranodePoint", "kNormalAt", intranode.TIMELINE_POINTS),
    ("intranode.cu", "NotifyPoint", "kNotifyAt", intranode.NOTIFY_TIMELINE_POINTS),
    ("low_latency.cu", "TimelinePoint", "kAt", low_latency.TIMELINE_POINTS),
    ("internode.cu", "InternodeNotifyPoint", "kInternodeNotifyAt", internode.NOTIFY_TIMELINE_POINTS),
    ("internode.cu", "DispatchRole", "kDispatchRole", tuple(internode.DISPATCH_ROLE_POINTS)),
    ("internode.cu", "CombineRole", "kCombineRole", tuple(internode.COMBINE_ROLE_POINTS)),
    ("internode.cu", "RdmaSenderPoint", "kRdmaSender", internode.DISPATCH_ROLE_POINTS["rdma_sender"]),
    ("internode.cu", "NvlReceiverPoint", "kNvlReceiver", internode.DISPATCH_ROLE_POINTS["nvl_receiver"]),
    ("internode.cu", "ForwarderPoint", "kForwarder", internode.DISPATCH_ROLE_POINTS["forwarder"]),
    ("internode.cu", "NvlSenderPoint", "kNvlSender", internode.COMBINE_ROLE_POINTS["nvl_sender"]),
    ("internode.cu", "CombineForwarderPoint", "kCombineForwarder", internode.COMBINE_ROLE_POINTS["forwarder"]),
    ("internode.cu", "ReaderPoint", "kReader", internode.COMBINE_ROLE_POINTS["reader"]),
])
def test_point_names_follow_the_enum(source, enum, prefix, points):
    entries = _enum(source, enum)
    assert [value for _, value in entries] == list(range(len(entries)))  # slots in order, none skipped
    assert [_snake(name, prefix) for name, _ in entries] == list(points)
    assert len(points) <= TIMELINE_SLOTS


def test_slot_count_matches_the_header():
    header = (CUDA_SRC / "timeline.cuh").read_text()
    assert f"constexpr int kTimelineSlots = {TIMELINE_SLOTS};" in header
    # The SM and tag slots the host reads (Buffer.profile_blocks) are the ones timeline_start writes.
    assert TIMELINE_SM_SLOT == TIMELINE_SLOTS - 1 and "kTimelineSmSlot = kTimelineSlots - 1;" in header
    assert TIMELINE_TAG_SLOT == TIMELINE_SLOTS - 2 and "kTimelineTagSlot = kTimelineSlots - 2;" in header
    rows = (CUDA_SRC / "role_timeline.cuh").read_text()
    assert f"constexpr int kTimelineRoleTagStride = {TIMELINE_ROLE_TAG_STRIDE};" in rows


def test_internode_rows_a_channel():
    """Dispatch and combine stamp kInternodeRoles rows a channel, each role's points in the row's point slots, and
    every channel fits a tag."""
    source = (CUDA_SRC / "internode.cu").read_text()
    roles = int(re.search(r"constexpr int kInternodeRoles = (\d+);", source).group(1))
    assert len(internode.DISPATCH_ROLE_POINTS) == len(internode.COMBINE_ROLE_POINTS) == roles
    for points in (*internode.DISPATCH_ROLE_POINTS.values(), *internode.COMBINE_ROLE_POINTS.values()):
        assert points[0] == "start" and "done" in points and len(points) <= TIMELINE_TAG_SLOT
    assert internode.MAX_INTERNODE_CHANNELS < TIMELINE_ROLE_TAG_STRIDE


def test_internode_roles_count_their_waiters():
    """The waiters a row's waits are summed over (internode.cu's stamp_wait sites), from the spec's warp roles."""
    spec = internode_spec(2, 2)  # 24 warps: 18 senders, 6 receivers a peer, 11 forwarders a rank; combine 4, 2 groups
    assert [(r.name, r.waiters) for r in internode.timeline_roles(spec, "internode_dispatch")] == [
        ("rdma_sender", 18), ("nvl_receiver", 1), ("forwarder", 2)]
    combine = [(r.name, r.waiters) for r in internode.timeline_roles(spec, "internode_combine")]
    assert combine == [("nvl_sender", 1), ("forwarder", 24), ("reader", 19)]
    fp8 = internode.timeline_roles(internode_combine_fp8_spec(spec), "internode_combine_fp8")
    assert [(r.name, r.waiters) for r in fp8] == combine
    one_a_node = internode.timeline_roles(internode_spec(4, 1), "internode_combine")
    assert [(r.name, r.waiters) for r in one_a_node] == [("nvl_sender", 0), ("forwarder", 24), ("reader", 23)]


ROLES = (TimelineRole("sender", ("start", "first_put", "last_put", "done", "blocked_ns"), 2),
         TimelineRole("receiver", ("start", "first_tail", "last_tail", "done", "starved_ns"), 1),
         TimelineRole("forwarder", ("start", "first_chunk", "last_forwarded", "done", "starved_ns", "blocked_ns"), 4))


def _stamps() -> np.ndarray:
    """Two channels of ROLES (ns from 1 000 000); the receivers never started (no rows, as with one rank a node)."""
    t = np.zeros((2, len(ROLES), TIMELINE_SLOTS), dtype=np.uint64)
    t0 = 1_000_000
    for c, late in enumerate((0, 10_000)):
        t[c, 0, :5] = [t0 + late, t0 + 2_000 + late, t0 + 50_000 + late, t0 + 60_000 + late, 8_000 * (c + 1)]
        t[c, 2, :6] = [t0 + 1_000 + late, t0 + 20_000 + late, t0 + 70_000 + late, t0 + 71_000 + late,
                       40_000 * (c + 1), 4_000]
        for r in (0, 2):
            t[c, r, TIMELINE_SM_SLOT] = 10 * c + r + 1
            t[c, r, TIMELINE_TAG_SLOT] = r * TIMELINE_ROLE_TAG_STRIDE + c + 1
    return t


def test_summarise_roles_from_stamps():
    sender, forwarder = summarise_roles("dispatch", ROLES, _stamps())
    assert (sender.role, sender.channels, sender.waiters) == ("sender", 2, 2)
    assert (sender.start, sender.first, sender.last, sender.done) == (0.0, 2.0, 60.0, 70.0)
    assert (sender.active, sender.active_max, sender.span) == (60.0, 60.0, 70.0)
    assert (sender.starved, sender.blocked) == (-1.0, 6.0)  # median of 8 and 16 µs over 2 waiters
    assert sender.busy == 54.0
    assert (forwarder.first, forwarder.last, forwarder.done) == (20.0, 80.0, 81.0)
    assert (forwarder.starved, forwarder.blocked, forwarder.busy) == (15.0, 1.0, 54.0)


class _Stamps:
    """What Profile keeps of a launch's stamps (a CuPy array's .get())."""

    def __init__(self, stamps: np.ndarray) -> None:
        self.stamps = stamps

    def get(self) -> np.ndarray:
        return self.stamps.reshape(-1)


def test_profile_reports_roles():
    profile = Profile(True)
    profile.role_timelines = [("dispatch", ROLES, _Stamps(_stamps()))]
    report = profile.report()
    assert (report["dispatch:sender:done:min"], report["dispatch:sender:done:max"]) == (60.0, 70.0)
    assert report["dispatch:forwarder:starved_ns:med"] == 15.0  # a waiter's, over the channels
    assert not any(key.startswith("dispatch:receiver") for key in report)
    blocks = profile.blocks()
    assert blocks["dispatch:sender"] == [(0, 0, 0, 2, 50, 60, 4), (10, 1, 10, 12, 60, 70, 8)]
    assert blocks["dispatch:receiver"] == []
    assert [row[:2] for row in blocks["dispatch:forwarder"]] == [(2, 0), (12, 1)]
    assert [s.role for s in profile.roles()] == ["sender", "forwarder"]


def _internode_builds() -> list[KernelSpec]:
    spec = internode_spec(2, 2)
    family = [internode.InternodeNotifySpec(2, 2), spec, internode_combine_fp8_spec(spec)]
    return family + [by_stores(s) for s in family]


@pytest.mark.parametrize("build", _internode_builds(), ids=lambda s: s.family.split(".")[0] + type(s).__name__)
def test_profile_build_is_the_same_kernels_with_the_define(build):
    """profile_spec: the same kernels at the same instantiation and RDMA leg, built with EPJIT_INTERNODE_PROFILE (a
    module of its own); the production build never has the define."""
    profiled = profile_spec(build)
    assert isinstance(profiled, type(build)) and type(profiled) is not type(build)
    assert profiled.template_args() == build.template_args() and profiled.KERNELS == build.KERNELS
    assert profiled.DEFINES == (*build.DEFINES, internode.PROFILE) and internode.PROFILE not in build.DEFINES
    assert profiled.USES_NVSHMEM == build.USES_NVSHMEM and profiled.family != build.family
    assert profile_spec(profiled) is profiled
    assert profiled in check_specs()  # `python -m epjit.jit --check` builds it


def test_ops_load_the_profile_build_only_when_profiling():
    """Across nodes a Buffer made with EPJIT_PROFILE=1 runs the profile build, any other the production one."""
    spec = internode_spec(2, 2)
    for by_ipc in (False, True):
        for enabled in (False, True):
            ops = Internode.__new__(Internode)  # (no GPU: _build reads these two alone)
            ops.by_stores, ops.profile = by_ipc, Profile(enabled)
            production = by_stores(spec) if by_ipc else spec
            assert ops._build(spec) == (profile_spec(production) if enabled else production)
            assert (internode.PROFILE in ops._build(spec).DEFINES) == enabled


def _ptx(spec: KernelSpec) -> tuple[str, dict[str, str]]:
    """NVRTC's PTX of a spec's module (no GPU needed) and each kernel's lowered name."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")
    options = [o for o in compile_options(spec, "sm_90", jit_config()) if not o.startswith("-arch")]
    err, prog = nvrtc.nvrtcCreateProgram(f'#include "{spec.SOURCE}"\n'.encode(), b"profile_check.cu", 0, [], [])
    try:
        for expression in spec.name_expressions().values():
            nvrtc.nvrtcAddNameExpression(prog, expression.encode())
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options) + 1, [o.encode() for o in [*options, "-arch=compute_90"]])
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, spec.family
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        ptx = bytearray(size)
        nvrtc.nvrtcGetPTX(prog, ptx)
        names = {k: nvrtc.nvrtcGetLoweredName(prog, e.encode())[1].decode() for k, e in spec.name_expressions().items()}
        return ptx.rstrip(b"\0").decode(), names
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@pytest.mark.parametrize("build", _internode_builds()[3:], ids=lambda s: s.family.split(".")[0])
def test_production_build_has_no_stamps(build):
    """The production kernels take the timeline and never read it (no stamp, no timed wait: the code they were
    without them); the profile build reads it. Each kernel's timeline is its last parameter."""
    for spec, stamps in ((build, False), (profile_spec(build), True)):
        ptx, lowered = _ptx(spec)
        for kernel, params in spec.KERNELS.items():
            assert params[-1] == internode.TIMELINE
            read = re.search(rf"\[{re.escape(lowered[kernel])}_param_{len(params) - 1}\]", ptx) is not None
            assert read == stamps, (spec.family, kernel)
