"""EPJIT_PROFILE=1: where each call's time goes, for tuning (off: every method is a no-op and costs nothing).

Host timestamps and stream events mark the phases of a normal-mode call; kernels launched with a timeline write
per-block stamps (cuda_src/timeline.cuh) that :meth:`Profile.report` and :meth:`Profile.blocks` turn into
microseconds.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..kernels.foundation import TIMELINE_SLOTS, TIMELINE_SM_SLOT, TIMELINE_TAG_SLOT


def _cupy() -> Any:
    import cupy

    return cupy


class Profile:
    """Host timestamps and stream events of the last call, when EPJIT_PROFILE=1 (off: every method is a no-op)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.marks: list[tuple[str, float, Any]] = []
        self._events: list[Any] = []  # reused call after call (creating an event costs microseconds)
        self._used = 0
        # per kernel launched: its name, the point names of its enum and its per-block stamps (timeline.cuh)
        self.timelines: list[tuple[str, tuple[str, ...], Any]] = []

    def start(self) -> None:
        if self.enabled:
            self.marks = [("start", time.perf_counter(), None)]
            self._used = 0
            self.timelines = []

    def timeline(self, name: str, num_blocks: int, points: tuple[str, ...]) -> int:
        """The address of zeroed stamps for one kernel launch of num_blocks blocks, or 0 (no stamps) when off."""
        if not self.enabled:
            return 0
        stamps = _cupy().zeros(num_blocks * TIMELINE_SLOTS, dtype=np.uint64)
        self.timelines.append((name, points, stamps))
        return stamps.data.ptr

    def mark(self, name: str, stream: Any = None) -> None:
        if self.enabled:
            t = time.perf_counter()
            event = None
            if stream is not None:
                if self._used == len(self._events):
                    self._events.append(_cupy().cuda.Event())
                event = self._events[self._used]
                self._used += 1
                event.record(stream)
            self.marks.append((name, t, event))

    def report(self) -> dict[str, float]:
        """Microseconds: host time from the call's start to each mark, and GPU time between recorded events."""
        out: dict[str, float] = {}
        t0 = self.marks[0][1] if self.marks else 0.0
        last_event = None
        for name, t, event in self.marks[1:]:  # low-latency calls keep no marks, only timelines
            out[f"host:{name}"] = round((t - t0) * 1e6, 1)
            if event is not None:
                event.synchronize()
                if last_event is not None:
                    out[f"gpu:{name}"] = round(_cupy().cuda.get_elapsed_time(last_event, event) * 1e3, 1)
                last_event = event
        # Each kernel's points in microseconds from its first block's start: earliest, median and latest block (a
        # block that never reached a point is left out).
        for name, points, timeline in self.timelines:
            stamps, t0 = self._stamps(timeline)
            for i, point in enumerate(points):
                reached = stamps[:, i][stamps[:, i] > 0]
                if len(reached):
                    out[f"{name}:{point}:min"] = round(float(reached.min() - t0) / 1e3, 1)
                    out[f"{name}:{point}:med"] = round(float(np.median(reached) - t0) / 1e3, 1)
                    out[f"{name}:{point}:max"] = round(float(reached.max() - t0) / 1e3, 1)
        return out

    @staticmethod
    def _stamps(timeline: Any) -> tuple[np.ndarray, int]:
        """A kernel's stamps, one row a block, and its first block's start (ns)."""
        stamps = timeline.get().reshape(-1, TIMELINE_SLOTS).astype(np.int64)
        return stamps, int(stamps[:, 0][stamps[:, 0] > 0].min(initial=np.iinfo(np.int64).max))

    def blocks(self) -> dict[str, list[tuple[int, ...]]]:
        """Per kernel, one row a block: its SM, its tag (the channel it served; -1: none), then its points in
        microseconds from the kernel's first block's start (-1: not reached). Which blocks are late, and whether
        they share a TPC or GPC, is in here."""
        out: dict[str, list[tuple[int, ...]]] = {}
        for name, points, timeline in self.timelines:
            stamps, t0 = self._stamps(timeline)
            tagged = len(points) <= TIMELINE_TAG_SLOT  # else the tag slot holds a point (timeline.cuh)
            out[name] = [(int(row[TIMELINE_SM_SLOT]) - 1, int(row[TIMELINE_TAG_SLOT]) - 1 if tagged else -1,
                          *(round((int(v) - t0) / 1e3) if v > 0 else -1 for v in row[:len(points)]))
                         for row in stamps if row[0] > 0]  # blocks that never started work (spares) left out
        return out
