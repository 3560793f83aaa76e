"""EPJIT_PROFILE=1: where each call's time goes, for tuning (off: every method is a no-op and costs nothing).

Host timestamps and stream events mark the phases of a normal-mode call; kernels launched with a timeline write
per-block stamps (cuda_src/timeline.cuh) that :meth:`Profile.report` and :meth:`Profile.blocks` turn into
microseconds. Kernels whose blocks split into roles (the internode ones) write a row a (channel, role) instead, which
:meth:`Profile.roles` also sums up role by role (:func:`summarise_roles`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels.foundation import (
    TIMELINE_ROLE_TAG_STRIDE,
    TIMELINE_SLOTS,
    TIMELINE_SM_SLOT,
    TIMELINE_TAG_SLOT,
    TimelineRole,
)


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
        # per kernel launched with a row a (channel, role): its name, its roles and its stamps
        self.role_timelines: list[tuple[str, tuple[TimelineRole, ...], Any]] = []

    def start(self) -> None:
        if self.enabled:
            self.marks = [("start", time.perf_counter(), None)]
            self._used = 0
            self.timelines = []
            self.role_timelines = []

    def timeline(self, name: str, num_blocks: int, points: tuple[str, ...]) -> int:
        """The address of zeroed stamps for one kernel launch of num_blocks blocks, or 0 (no stamps) when off."""
        if not self.enabled:
            return 0
        stamps = _cupy().zeros(num_blocks * TIMELINE_SLOTS, dtype=np.uint64)
        self.timelines.append((name, points, stamps))
        return stamps.data.ptr

    def role_timeline(self, name: str, num_channels: int, roles: tuple[TimelineRole, ...]) -> int:
        """The address of zeroed stamps for one launch whose channels each stamp a row a role (row channel x
        len(roles) + role), or 0 (no stamps) when off."""
        if not self.enabled:
            return 0
        stamps = _cupy().zeros(num_channels * len(roles) * TIMELINE_SLOTS, dtype=np.uint64)
        self.role_timelines.append((name, roles, stamps))
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
                _spread(out, f"{name}:{point}", stamps[:, i][stamps[:, i] > 0] - t0)
        # Kernels with a row a (channel, role): each role's points over its channels, the same way; a sum of waits
        # (_ns) a waiter of the role, over the channels that started the role.
        for name, roles, timeline in self.role_timelines:
            rows, t0 = _role_rows(timeline.get(), roles)
            for r, role in enumerate(roles):
                started = rows[:, r][rows[:, r, 0] > 0]
                for i, point in enumerate(role.points):
                    values = started[:, i]
                    _spread(out, f"{name}:{role.name}:{point}", values / max(role.waiters, 1)
                            if point.endswith("_ns") else values[values > 0] - t0)
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
        for name, roles, timeline in self.role_timelines:
            rows, t0 = _role_rows(timeline.get(), roles)
            for r, role in enumerate(roles):
                out[f"{name}:{role.name}"] = [
                    (int(row[TIMELINE_SM_SLOT]) - 1, (int(row[TIMELINE_TAG_SLOT]) - 1) % TIMELINE_ROLE_TAG_STRIDE,
                     *(_us(v, t0, point, role.waiters) for point, v in zip(role.points, row, strict=False)))
                    for row in rows[:, r] if row[0] > 0]
        return out

    def roles(self) -> list[RoleSummary]:
        """Each role of each kernel launched with a row a (channel, role), summed up over its channels."""
        out: list[RoleSummary] = []
        for name, roles, timeline in self.role_timelines:
            out += summarise_roles(name, roles, timeline.get())
        return out


def _spread(out: dict[str, float], key: str, ns: np.ndarray) -> None:
    """The earliest, median and latest of some nanoseconds, in microseconds (none: no keys)."""
    if len(ns):
        out[f"{key}:min"] = round(float(ns.min()) / 1e3, 1)
        out[f"{key}:med"] = round(float(np.median(ns)) / 1e3, 1)
        out[f"{key}:max"] = round(float(ns.max()) / 1e3, 1)


def _role_rows(stamps: Any, roles: tuple[TimelineRole, ...]) -> tuple[np.ndarray, int]:
    """A launch's stamps as int64 [channel][role][slot] (ns), and the earliest start (slot 0) of any row."""
    rows = np.asarray(stamps).reshape(-1, len(roles), TIMELINE_SLOTS).astype(np.int64)
    starts = rows[..., 0]
    return rows, int(starts[starts > 0].min(initial=np.iinfo(np.int64).max))


def _us(value: int, t0: int, point: str, waiters: int) -> int:
    """A role row's slot in microseconds: a moment from t0 (-1: not reached), or a sum of waits a waiter."""
    if point.endswith("_ns"):
        return round(int(value) / max(waiters, 1) / 1e3)
    return round((int(value) - t0) / 1e3) if value > 0 else -1


@dataclass(frozen=True)
class RoleSummary:
    """One role of a kernel over its channels, microseconds (moments from the launch's first start): when its first
    channel started, its first and last marks (first_*, last_*), when its last channel was done; a channel's active
    time (done - start: median and largest), its waits a waiter (median over the channels: starved for what it
    consumes, blocked for room where it produces; -1: the role has none), and busy = active - starved - blocked."""

    kernel: str
    role: str
    channels: int
    waiters: int
    start: float
    first: float
    last: float
    done: float
    active: float
    active_max: float
    starved: float
    blocked: float

    @property
    def span(self) -> float:
        """From the role's first start to its last channel done: the time its bytes moved in."""
        return self.done - self.start

    @property
    def busy(self) -> float:
        return self.active - max(self.starved, 0.0) - max(self.blocked, 0.0)


def summarise_roles(kernel: str, roles: tuple[TimelineRole, ...], stamps: np.ndarray) -> list[RoleSummary]:
    """The roles of one launch from its stamps (uint64 [channels x roles x TIMELINE_SLOTS], any shape that reshapes
    to it): one summary a role that some channel started (a role the launch does not have, e.g. NVLink receivers
    with one rank a node, has no rows)."""
    rows, t0 = _role_rows(stamps, roles)
    started = [(role, rows[:, r][rows[:, r, 0] > 0]) for r, role in enumerate(roles)]
    return [_summarise_role(kernel, role, role_rows, t0) for role, role_rows in started if len(role_rows)]


def _summarise_role(kernel: str, role: TimelineRole, rows: np.ndarray, t0: int) -> RoleSummary:
    """One role from the rows of its channels that started ([channels][slot] ns) and its launch's first start."""
    at = {point: rows[:, i] for i, point in enumerate(role.points)}

    def moment(values: np.ndarray, pick: Any) -> float:
        reached = values[values > 0]
        return round(float(pick(reached) - t0) / 1e3, 1) if len(reached) else -1.0

    def waited(point: str) -> float:
        return round(float(np.median(at[point])) / max(role.waiters, 1) / 1e3, 1) if point in at else -1.0

    first = next((at[p] for p in role.points if p.startswith("first_")), at["start"])
    last = next((at[p] for p in role.points if p.startswith("last_")), at["done"])
    done = at["done"]
    active = (done - at["start"])[done > 0] / 1e3
    median, largest = (round(float(np.median(active)), 1), round(float(active.max()), 1)) if len(active) else (-1, -1)
    return RoleSummary(kernel, role.name, len(rows), role.waiters, moment(at["start"], np.min), moment(first, np.min),
                       moment(last, np.max), moment(done, np.max), median, largest, waited("starved_ns"),
                       waited("blocked_ns"))
