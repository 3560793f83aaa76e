"""EPJIT_PROFILE's point names on the host must follow the kernels' enums (cuda_src/timeline.cuh stamps
timeline[block][point]; Buffer.profile() names the slots with these tuples)."""

from __future__ import annotations

import re

import pytest

from epjit.kernels import cuda_sources, intranode, low_latency
from epjit.kernels.foundation import TIMELINE_SLOTS, TIMELINE_SM_SLOT, TIMELINE_TAG_SLOT

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
